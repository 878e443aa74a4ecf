package sandboxes

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/test/e2e"
)

func ContainerSpec() *sandboxv1.SandboxSpec {
	return &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 200, Pids: 100}}
}

func TestContainerSandboxEndToEnd(t *testing.T) {
	c := e2e.ContainerCluster(t)
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, ContainerSpec())
	if err != nil {
		t.Fatal(err)
	}
	// Its own hostname and network namespace, and the requested memory
	// limit (200 MiB) on its cgroup as it sees it.
	r := e2e.Shell(t, sb, "hostname; cat /sys/fs/cgroup/memory/memory.limit_in_bytes; ls /sys/class/net")
	if got, want := strings.Fields(string(r.Stdout)), []string{sb.ID, "209715200", "lo"}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("hostname, memory limit and interfaces inside: %q %q, want %q", r.Stdout, r.Stderr, want)
	}
	// A command that does not exist: exit code 127 and its stderr.
	r, err = sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"definitely-not-here"}})
	if err != nil || r.ExitCode != 127 || !strings.Contains(string(r.Stderr), "not found") {
		t.Fatalf("missing command: %+v %v", r, err)
	}
	r = e2e.Shell(t, sb, "nosuchcmd")
	if r.ExitCode != 127 || !strings.Contains(string(r.Stderr), "not found") {
		t.Fatalf("missing command in sh: %+v", r)
	}
	// Files round trip through the API.
	if _, err := sb.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: "/root/data/x.txt", Data: []byte("payload")})); err != nil {
		t.Fatal(err)
	}
	if got := e2e.Shell(t, sb, "cat /root/data/x.txt"); string(got.Stdout) != "payload" {
		t.Fatalf("file written through the API reads %q inside", got.Stdout)
	}
	// Endless output is capped.
	cap, err := sb.Process.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"yes"}, TimeoutMs: 500}, MaxOutputBytes: 1 << 16}))
	if err != nil || len(cap.Msg.Stdout) != 1<<16 || cap.Msg.StdoutDropped == 0 {
		t.Fatalf("yes: %d bytes kept, %d dropped, %v", len(cap.Msg.GetStdout()), cap.Msg.GetStdoutDropped(), err)
	}
	// Persistent session.
	sess, err := sb.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	sid := sess.Msg.Session.Id
	sb.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sid, Command: "cd /tmp && export K=v"}))
	sr, err := sb.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sid, Command: "echo $K $(pwd)"}))
	if err != nil || string(sr.Msg.Stdout) != "v /tmp\n" {
		t.Fatalf("session state: %q %v", sr.Msg.GetStdout(), err)
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	e2e.AssertNoLeaks(t, c)
}

func TestRestartReattachesAndStopAllLeavesNothing(t *testing.T) {
	c := e2e.ContainerCluster(t)
	ctx := e2e.Ctx(t)
	var ids []string
	for i := 0; i < 2; i++ {
		sb, err := c.Client.Create(ctx, ContainerSpec())
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.ID)
		e2e.Shell(t, sb, "echo before-restart > /root/mark; sleep 1000 >/dev/null 2>&1 &")
	}
	c.Restart(t)
	for _, id := range ids {
		r := e2e.Shell(t, c.Client.Sandbox(id), "cat /root/mark; ps | grep -v grep | grep -q \"sleep 1000\" && echo sleeper-alive")
		if string(r.Stdout) != "before-restart\nsleeper-alive\n" {
			t.Fatalf("%s after restart: %q %q", id, r.Stdout, r.Stderr)
		}
	}
	// Remove every sandbox, as `dsec stop --all` does.
	list, err := c.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if err != nil || len(list.Msg.Sandboxes) != 2 {
		t.Fatalf("list after restart: %v, %v", list, err)
	}
	for _, sb := range list.Msg.Sandboxes {
		if _, err := c.Client.Sandboxes.StopSandbox(ctx, connect.NewRequest(&sandboxv1.StopSandboxRequest{SandboxId: sb.Id})); err != nil {
			t.Fatal(err)
		}
	}
	e2e.AssertNoLeaks(t, c)
}

// A process that outgrows the sandbox's memory limit is killed by the
// kernel's OOM killer inside the sandbox's cgroup; the sandbox and its
// agent go on answering, and the host saw no OOM of its own.
func TestOutOfMemoryKillStaysInsideTheLimit(t *testing.T) {
	c := e2e.ContainerCluster(t)
	ctx := e2e.Ctx(t)
	spec := ContainerSpec()
	spec.Resources.MemoryMb = 64
	sb, err := c.Client.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	// A shell variable of 200 MB cannot fit in 64 MiB.
	r, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"sh", "-c", `x=$(head -c 200000000 /dev/zero | tr '\0' x); echo survived ${#x}`}})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(r.Stdout), "survived") || (r.Signal != 9 && r.ExitCode != 137) {
		t.Fatalf("the memory hog was not OOM-killed: exit %d signal %d, %q %q", r.ExitCode, r.Signal, r.Stdout, r.Stderr)
	}
	oom := e2e.Shell(t, sb, "cat /sys/fs/cgroup/memory/memory.oom_control")
	if !strings.Contains(string(oom.Stdout), "oom_kill ") || strings.Contains(string(oom.Stdout), "oom_kill 0") {
		t.Fatalf("the sandbox's cgroup recorded no OOM kill: %q", oom.Stdout)
	}
	if got := e2e.Shell(t, sb, "echo still here"); string(got.Stdout) != "still here\n" {
		t.Fatalf("after the OOM kill: %q", got.Stdout)
	}
}

package sandboxes

import (
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// A shell in a terminal ends with its exit status under gVisor, whose
// terminals do not answer a master read with EIO when the shell exits.
func TestGvisorPtyShellExits(t *testing.T) {
	c := e2e.GvisorCluster(t)
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	stream, err := sb.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{
		Args: []string{"/bin/sh"}, Pty: &agentv1.PtySize{Cols: 80, Rows: 24}, Tag: "term",
	}}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var out strings.Builder
	var exit *agentv1.ProcessEvent_Exited
	for stream.Receive() {
		switch e := stream.Msg().Event.Event.(type) {
		case *agentv1.ProcessEvent_Started_:
			sel := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Tag{Tag: "term"}}
			if _, err := sb.Process.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: sel, Data: []byte("echo in-$((6*7)); exit 3\n")})); err != nil {
				t.Fatal(err)
			}
		case *agentv1.ProcessEvent_Output_:
			out.Write(e.Output.Data)
		case *agentv1.ProcessEvent_Exited_:
			exit = e.Exited
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if exit == nil || exit.ExitCode != 3 || !strings.Contains(out.String(), "in-42") {
		t.Fatalf("exit %v, output %q", exit, out.String())
	}
}

// What Debian's runsc breaks in Debian images works: sudo (setuid is
// ignored; the agent's broker stands in: a NOPASSWD user becomes root, a
// user without a rule is refused, the exit status comes back) and
// coreutils' stat calls.
func TestGvisorDebianImageTools(t *testing.T) {
	c := e2e.GvisorPyCluster(t)
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/py:3.11"})
	if err != nil {
		t.Fatal(err)
	}
	run := func(user, cmd string) *agentv1.RunResponse {
		r, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"/bin/sh", "-c", cmd}, User: user, Cwd: "/tmp"})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := run("user", "sudo -n id -u; sudo sh -c 'echo $SUDO_USER; exit 4'"); string(r.Stdout) != "0\nuser\n" || r.ExitCode != 4 {
		t.Fatalf("sudo as user: %q %q exit %d", r.Stdout, r.Stderr, r.ExitCode)
	}
	if r := run("nobody", "sudo true"); r.ExitCode == 0 || !strings.Contains(string(r.Stderr), "nobody may not run commands as root") {
		t.Fatalf("sudo as nobody: %q exit %d", r.Stderr, r.ExitCode)
	}
	// coreutils pass AT_NO_AUTOMOUNT to statx, which this runsc rejects;
	// the preloaded compat library clears it.
	if r := run("user", "ls -l /etc/hostname >/dev/null && stat -c %U /etc/hostname && cp -a /etc/hostname /tmp/h && echo copied"); string(r.Stdout) != "root\ncopied\n" {
		t.Fatalf("coreutils: %q %q exit %d", r.Stdout, r.Stderr, r.ExitCode)
	}
}

// After a restart of every component, gVisor sandboxes are re-attached:
// a running one with its processes, a paused one still paused (frozen all
// along) until a call resumes it.
func TestGvisorRestartReattachesRunningAndPaused(t *testing.T) {
	c := e2e.GvisorCluster(t)
	ctx := e2e.Ctx(t)
	spec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest"}
	running, err := c.Client.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	paused, err := c.Client.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	e2e.Shell(t, running, "echo kept > /root/mark; sleep 1000 >/dev/null 2>&1 &")
	e2e.Shell(t, paused, testutil.PauseProbe("/tmp/probe"))
	before := waitProbe(t, paused, "/tmp/probe", 3)
	if _, err := c.Client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: paused.ID})); err != nil {
		t.Fatal(err)
	}
	pausedAt := time.Now()
	c.Restart(t)
	got, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: paused.ID}))
	if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("paused sandbox after restart: %v, %v", got, err)
	}
	if r := e2e.Shell(t, c.Client.Sandbox(running.ID), "cat /root/mark; ps | grep -v grep | grep -q 'sleep 1000' && echo alive"); string(r.Stdout) != "kept\nalive\n" {
		t.Fatalf("running sandbox after restart: %q %q", r.Stdout, r.Stderr)
	}
	time.Sleep(time.Until(pausedAt.Add(frozenFor)))
	now := waitProbe(t, c.Client.Sandbox(paused.ID), "/tmp/probe", before.Rounds)
	after := waitProbe(t, c.Client.Sandbox(paused.ID), "/tmp/probe", now.Rounds+1)
	if after.LongGap < frozenFor-300*time.Millisecond {
		t.Fatalf("the paused sandbox ran across the restart: longest gap %v", after.LongGap)
	}
}

package sandboxes

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/embed"
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

// TestWarmPoolOnCrun: an edge with a warm pool of two crun sandboxes of
// busybox; creates of that image and shape claim them: each is the
// create's (its environment, hostname and machine id of its own, its
// memory limit), and the pool starts new ones. A create of another
// shape starts its own. Drained, the pool leaves nothing.
func TestWarmPoolOnCrun(t *testing.T) {
	pool := ContainerSpec()
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Pools = []edge.Pool{{Spec: pool, Project: "root", Size: 2}}
	}, "container")
	waitPool := func(n int) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for c.Edge.PoolReady() != n {
			if time.Now().After(deadline) {
				t.Fatalf("the pool holds %d ready, want %d", c.Edge.PoolReady(), n)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	waitPool(2)
	pooled := c.Edge.PoolSandboxes()
	ctx := e2e.Ctx(t)
	var machineIDs []string
	for i := range 2 {
		spec := ContainerSpec()
		spec.Env = map[string]string{"MINE": fmt.Sprint("claim-", i)}
		sb, err := c.Client.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(pooled, sb.ID) {
			t.Fatalf("create %d made %s, not one of the pool's %v", i+1, sb.ID, pooled)
		}
		r := e2e.Shell(t, sb, "echo $MINE $DSEC_SANDBOX_ID; hostname; cat /etc/machine-id /sys/fs/cgroup/memory/memory.limit_in_bytes")
		got := strings.Fields(string(r.Stdout))
		if len(got) != 5 || got[0] != fmt.Sprint("claim-", i) || got[1] != sb.ID || got[2] != sb.ID || got[4] != "209715200" || slices.Contains(machineIDs, got[3]) {
			t.Fatalf("claimed sandbox %s: $MINE, $DSEC_SANDBOX_ID, hostname, machine id, memory limit = %q (machine ids so far %v)", sb.ID, got, machineIDs)
		}
		machineIDs = append(machineIDs, got[3])
	}
	waitPool(2) // refilled
	refilled := c.Edge.PoolSandboxes()
	other := ContainerSpec()
	other.Resources.MemoryMb = 256
	if sb, err := c.Client.Create(ctx, other); err != nil || slices.Contains(refilled, sb.ID) {
		t.Fatalf("a create of another shape: %v, or it claimed a pool sandbox (pool %v)", err, refilled)
	}

	// A pool of that shape set through the API (dsec pool set): it fills,
	// is listed beside the flag's, and serves its shape's creates; size 0
	// removes both.
	nodes, err := c.Client.SetPool(ctx, other.Image, other.Backend, other.Resources, false, 1)
	if err != nil || len(nodes) != 1 || nodes[0].Error != "" || len(nodes[0].Pools) != 2 {
		t.Fatalf("pool set: %v, %v", nodes, err)
	}
	waitPool(3)
	nodes, err = c.Client.ListPools(ctx)
	if err != nil || len(nodes) != 1 || len(nodes[0].Pools) != 2 {
		t.Fatalf("pool ls: %v, %v", nodes, err)
	}
	for _, pl := range nodes[0].Pools {
		if want := map[int64]string{200: "flag", 256: "api"}[pl.MemoryMb]; pl.Source != want || pl.Ready != pl.Size {
			t.Fatalf("pool ls: %v", pl)
		}
	}
	before := c.Edge.PoolSandboxes()
	if sb, err := c.Client.Create(ctx, other); err != nil || !slices.Contains(before, sb.ID) {
		t.Fatalf("a create of the API pool's shape: %v, or it did not claim one of %v", err, before)
	}
	team := c.Project(t, "root", "poolers", nil)
	if _, err := team.SetPool(ctx, other.Image, other.Backend, other.Resources, false, 4); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("a sub-project's admin set a pool: %v", err)
	}
	// The same through the CLI.
	bin := e2e.DsecBinary(t)
	run := func(args ...string) (string, string, int) {
		t.Helper()
		return e2e.RunCLI(t, bin, []string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key}, "", args...)
	}
	for _, spec := range []*sandboxv1.SandboxSpec{pool, other} {
		r := spec.Resources
		if out, errOut, code := run("pool", "set", spec.Image, "--size", "0", "--backend", spec.Backend, "--cpu", fmt.Sprint(r.CpuCores), "--memory", fmt.Sprint(r.MemoryMb), "--pids", fmt.Sprint(r.Pids)); code != 0 {
			t.Fatalf("dsec pool set --size 0: %q %q exit %d", out, errOut, code)
		}
	}
	waitPool(0)
	if out, errOut, code := run("pool", "ls"); code != 0 || !strings.Contains(out, "(no pools)") {
		t.Fatalf("dsec pool ls after removing both: %q %q exit %d", out, errOut, code)
	}
	if _, errOut, code := run("pool", "set", "root/no-such:1", "--size", "1"); code == 0 || !strings.Contains(errOut, "not_found") {
		t.Fatalf("dsec pool set of a missing image: %q exit %d", errOut, code)
	}
	for _, e := range c.Edges {
		e.DestroyAll(context.Background(), "root")
		e.DrainPools(context.Background())
	}
	e2e.AssertNoLeaks(t, c)
}

package sandboxes

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/test/e2e"
)

// longCall starts a command that would run a minute and returns a channel
// with its result.
func longCall(t *testing.T, sb *client.Sandbox) chan error {
	done := make(chan error, 1)
	go func() {
		_, err := sb.Run(e2e.Ctx(t), &agentv1.ProcessConfig{Args: []string{"sleep", "60"}})
		done <- err
	}()
	time.Sleep(300 * time.Millisecond) // let it reach the agent
	return done
}

// checkDead asserts what a dead sandbox must show: failed with a reason,
// soon; a call in flight and a new call end at once; the other sandbox
// answers.
func checkDead(t *testing.T, c *e2e.Cluster, sb, other *client.Sandbox, killed time.Time, inflight chan error, want string) {
	t.Helper()
	reason, took := e2e.WaitFailed(t, c, sb.ID, killed)
	t.Logf("reported failed after %v: %s", took.Round(time.Millisecond), reason)
	if !strings.Contains(reason, want) {
		t.Errorf("reason %q, want it to say %q", reason, want)
	}
	select {
	case err := <-inflight:
		if err == nil {
			t.Error("the call in flight succeeded")
		}
	case <-time.After(10 * time.Second):
		t.Error("the call in flight still hangs 10 s after the sandbox died")
	}
	start := time.Now()
	if _, err := sb.Shell(e2e.Ctx(t), "true"); connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), want) {
		t.Errorf("a new call: %v", err)
	} else if d := time.Since(start); d > 2*time.Second {
		t.Errorf("a new call took %v to fail", d)
	}
	if r := e2e.Shell(t, other, "echo alive"); string(r.Stdout) != "alive\n" {
		t.Errorf("the other sandbox: %q", r.Stdout)
	}
	if err := sb.Stop(e2e.Ctx(t)); err != nil {
		t.Errorf("stop a failed sandbox: %v", err)
	}
}

// pidsOf lists host processes whose command line mentions s.
func pidsOf(t *testing.T, s string) []int {
	out, _ := exec.Command("ps", "-eo", "pid=,args=").Output()
	var pids []int
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) > 1 && strings.Contains(line, s) {
			if pid, err := strconv.Atoi(f[0]); err == nil {
				pids = append(pids, pid)
			}
		}
	}
	return pids
}

// victimAndNeighbour creates two sandboxes of spec: the one a test ends,
// and one beside it that must go on answering.
func victimAndNeighbour(t *testing.T, c *e2e.Cluster, spec *sandboxv1.SandboxSpec) (victim, neighbour *client.Sandbox) {
	t.Helper()
	victim, err := c.Client.Create(e2e.Ctx(t), spec)
	if err != nil {
		t.Fatal(err)
	}
	neighbour, err = c.Client.Create(e2e.Ctx(t), spec)
	if err != nil {
		t.Fatal(err)
	}
	return victim, neighbour
}

// The host kills a container's agent: the sandbox is failed at once.
func TestContainerWhoseAgentIsKilledIsReportedFailed(t *testing.T) {
	c := e2e.ContainerCluster(t)
	sb, other := victimAndNeighbour(t, c, ContainerSpec())
	inflight := longCall(t, sb)
	out, err := exec.Command("crun", "--root", filepath.Join(c.Cfg.StateDir, "edge", "backends", "container", "crun"), "state", sb.ID).Output()
	if err != nil {
		t.Fatal(err)
	}
	var st struct{ Pid int }
	if err := json.Unmarshal(out, &st); err != nil || st.Pid == 0 {
		t.Fatalf("crun state: %s %v", out, err)
	}
	killed := time.Now()
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	checkDead(t, c, sb, other, killed, inflight, "ended")
}

// The host kills a gVisor sandbox's runsc processes: failed at once.
func TestGvisorWhoseRuntimeIsKilledIsReportedFailed(t *testing.T) {
	c := e2e.GvisorCluster(t)
	spec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest"}
	sb, other := victimAndNeighbour(t, c, spec)
	inflight := longCall(t, sb)
	pids := pidsOf(t, sb.ID)
	if len(pids) == 0 {
		t.Fatal("no runsc process of the sandbox found")
	}
	killed := time.Now()
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGKILL)
	}
	checkDead(t, c, sb, other, killed, inflight, "ended")
}

// Something on the node stops a gVisor sandbox's sentry with SIGSTOP:
// nothing in it answers, SIGCONT through runsc included; it is reported
// failed with the reason at the first unanswered health check.
func TestGvisorWhoseSentryIsStoppedIsReportedFailed(t *testing.T) {
	c := e2e.GvisorCluster(t)
	ctx := e2e.Ctx(t)
	spec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest"}
	sb, other := victimAndNeighbour(t, c, spec)
	var sentry []int
	for _, pid := range pidsOf(t, sb.ID) {
		if cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)); strings.HasPrefix(string(cmd), "runsc-sandbox") {
			sentry = append(sentry, pid)
		}
	}
	if len(sentry) != 1 {
		t.Fatalf("runsc-sandbox processes of the sandbox: %v, want one", sentry)
	}
	stopped := time.Now()
	if err := syscall.Kill(sentry[0], syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(sentry[0], syscall.SIGKILL) }) //nolint:errcheck // it may be gone
	msg, took := e2e.WaitFailed(t, c, sb.ID, stopped)
	t.Logf("reported failed %v after the SIGSTOP: %s", took.Round(time.Millisecond), msg)
	if !strings.Contains(msg, "stopped by a signal on the node") {
		t.Errorf("reason: %q, want it to say the runtime was stopped on the node", msg)
	}
	if r, err := other.Shell(ctx, "echo ok"); err != nil || string(r.Stdout) != "ok\n" {
		t.Errorf("its neighbour: %v %v", r, err)
	}
}

// A gVisor sandbox whose files outgrow its memory (files live in its memory;
// no process holds them, so the agent's memory watch kills none) is ended
// by the host's OOM killer at its limit and the sentry's reserve, and
// reported so, with that limit.
func TestGvisorOutOfMemoryIsReportedWithTheLimit(t *testing.T) {
	c := e2e.GvisorCluster(t)
	ctx := e2e.Ctx(t)
	spec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{MemoryMb: 128}}
	sb, err := c.Client.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	other, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	// Files in /tmp live in the sandbox's memory under gVisor.
	done := make(chan error, 1)
	go func() {
		_, err := sb.Run(e2e.Ctx(t), &agentv1.ProcessConfig{Args: []string{"sh", "-c", "dd if=/dev/zero of=/tmp/fill bs=1M count=1024"}})
		done <- err
	}()
	started := time.Now()
	checkDead(t, c, sb, other, started, done, "out of memory (limit 192 MiB)")
}

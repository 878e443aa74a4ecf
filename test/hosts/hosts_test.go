// Package hosts is the host test: it runs inside the Debian 13 virtual
// machine that `make test-hosts` boots (systemd as PID 1, cgroup v2 only),
// against the services deploy/quickstart.sh installed there, and checks
// what a user's host must do: limits enforced through cgroup v2, exec,
// files, pause, a gVisor fork that keeps a process's memory, network
// policy, a task pause that gives memory back, and sandboxes that outlive
// a restart of every unit. Elsewhere it skips: scripts/test-hosts.sh
// builds it with `go test -c` and runs it in the VM with DSEC_HOST_TEST=1.
package hosts

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/cgroups"
)

func setup(t *testing.T) *client.Client {
	t.Helper()
	if os.Getenv("DSEC_HOST_TEST") != "1" {
		t.Skip("the host test runs inside the Debian 13 VM: make test-hosts")
	}
	c, err := client.FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func create(t *testing.T, c *client.Client, spec *sandboxv1.SandboxSpec) *client.Sandbox {
	t.Helper()
	start := time.Now()
	sb, err := c.Create(ctxT(t, 3*time.Minute), spec)
	if err != nil {
		t.Fatalf("create %s: %v", spec.Backend, err)
	}
	t.Logf("created %s sandbox %s in %v", spec.Backend, sb.ID, time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := sb.Stop(ctx); err != nil && connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("stop %s: %v", sb.ID, err)
		}
	})
	return sb
}

func sh(t *testing.T, sb *client.Sandbox, cmd string, timeout time.Duration) *agentv1.RunResponse {
	t.Helper()
	r, err := sb.Run(ctxT(t, timeout+30*time.Second), &agentv1.ProcessConfig{Args: []string{"sh", "-c", cmd}, TimeoutMs: uint32(timeout.Milliseconds())})
	if err != nil {
		t.Fatalf("%q: %v", cmd, err)
	}
	return r
}

// cgroupFile reads a file of sandbox id's cgroup on this v2 host.
func cgroupFile(t *testing.T, id, name string) string {
	t.Helper()
	parent := os.Getenv("DSEC_CGROUP_PARENT")
	if parent == "" {
		parent = cgroups.DefaultParent
	}
	data, err := os.ReadFile(filepath.Join(cgroups.DefaultRoot, parent, id, name))
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(data))
}

func TestTheHostIsCgroupV2WithSystemd(t *testing.T) {
	setup(t)
	h, err := cgroups.Detect(cgroups.DefaultRoot, "")
	if err != nil || h.Version != cgroups.V2 {
		t.Fatalf("cgroups: %v %v; the host test needs a v2-only host", h, err)
	}
	if comm, _ := os.ReadFile("/proc/1/comm"); strings.TrimSpace(string(comm)) != "systemd" {
		t.Fatalf("PID 1 is %q, not systemd", comm)
	}
}

// TestContainerLimitsHoldOnCgroupV2: cpu.max, memory.max (no swap) and
// pids.max of the sandbox's cgroup are the spec's; a memory hog is killed
// with the OOM reason while the sandbox lives on; a fork bomb stops at
// the pids limit.
func TestContainerLimitsHoldOnCgroupV2(t *testing.T) {
	c := setup(t)
	sb := create(t, c, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest",
		Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 96, Pids: 64}})
	for file, want := range map[string]string{"cpu.max": "50000 100000", "memory.max": fmt.Sprint(96 << 20), "memory.swap.max": "0", "pids.max": "64"} {
		if got := cgroupFile(t, sb.ID, file); got != want {
			t.Errorf("%s = %q, want %q", file, got, want)
		}
	}
	if r := sh(t, sb, "echo hello > /root/f && cat /root/f", 10*time.Second); strings.TrimSpace(string(r.Stdout)) != "hello" {
		t.Fatalf("exec and files: %+v", r)
	}
	// dd's 200 MiB buffer, filled by one read, under a 96 MiB limit.
	r := sh(t, sb, "dd if=/dev/zero of=/dev/null bs=200M count=1 && echo survived", 60*time.Second)
	if strings.Contains(string(r.Stdout), "survived") {
		t.Fatalf("a 200 MB allocation under 96 MiB survived: %q", r.Stdout)
	}
	if kills := cgroupFile(t, sb.ID, "memory.events"); !strings.Contains(kills, "oom_kill ") || strings.Contains(kills, "oom_kill 0") {
		t.Errorf("memory.events after the hog: %q; want an oom_kill", kills)
	}
	if r := sh(t, sb, "echo alive", 10*time.Second); strings.TrimSpace(string(r.Stdout)) != "alive" {
		t.Fatalf("after the hog: %+v", r)
	}
	r = sh(t, sb, "i=0; while [ $i -lt 200 ]; do sleep 30 & i=$((i+1)); done 2>&1 | grep -c -i 'fork\\|resource' ; true", 30*time.Second)
	if n := cgroupFile(t, sb.ID, "pids.events"); n == "max 0" {
		t.Errorf("200 background sleeps under pids 64: pids.events %q; want refusals", n)
	}
	if cur, _ := strconv.Atoi(cgroupFile(t, sb.ID, "pids.current")); cur > 64 {
		t.Errorf("pids.current %d above 64", cur)
	}
	sh(t, sb, "kill $(pidof sleep) 2>/dev/null; true", 10*time.Second)
	if r := sh(t, sb, "echo alive", 10*time.Second); strings.TrimSpace(string(r.Stdout)) != "alive" {
		t.Fatalf("after the fork storm: %+v", r)
	}
}

// TestPauseAndResumeFreezeTheV2Cgroup: a paused container's cgroup is
// frozen (cgroup.freeze), and resumed it answers with its state.
func TestPauseAndResumeFreezeTheV2Cgroup(t *testing.T) {
	c := setup(t)
	ctx := ctxT(t, 2*time.Minute)
	sb := create(t, c, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest"})
	sh(t, sb, "echo kept > /root/state", 10*time.Second)
	if _, err := sb.Pause(ctx, sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE); err != nil {
		t.Fatal(err)
	}
	if got := cgroupFile(t, sb.ID, "cgroup.freeze"); got != "1" {
		t.Errorf("paused: cgroup.freeze = %s", got)
	}
	if _, err := c.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: sb.ID})); err != nil {
		t.Fatal(err)
	}
	if r := sh(t, sb, "cat /root/state", 10*time.Second); strings.TrimSpace(string(r.Stdout)) != "kept" {
		t.Fatalf("after resume: %+v", r)
	}
}

// TestGvisorForkKeepsAProcesssSecret: copies of a gVisor sandbox answer
// from the source's running shell, whose variable only memory holds.
func TestGvisorForkKeepsAProcesssSecret(t *testing.T) {
	c := setup(t)
	ctx := ctxT(t, 5*time.Minute)
	src := create(t, c, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}})
	sess, err := src.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := src.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "SECRET=$$-$(date +%s%N)"})); err != nil {
		t.Fatal(err)
	}
	want, err := src.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "echo $SECRET"}))
	if err != nil || len(strings.TrimSpace(string(want.Msg.Stdout))) < 4 {
		t.Fatalf("secret: %v %v", want, err)
	}
	resp, err := c.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 2}))
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			t.Fatalf("copy %d: %s: %s", i, r.ErrorCode, r.ErrorMessage)
		}
		cp := c.Sandbox(r.Sandbox.Id)
		t.Cleanup(func() { cp.Stop(context.Background()) }) //nolint:errcheck // gone is fine
		got, err := cp.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "echo $SECRET"}))
		if err != nil {
			t.Fatalf("copy %d: %v", i, err)
		}
		if string(got.Msg.Stdout) != string(want.Msg.Stdout) {
			t.Fatalf("copy %d: secret %q, want %q", i, got.Msg.Stdout, want.Msg.Stdout)
		}
	}
}

// TestSandboxesOutliveARestartOfEveryUnit: `systemctl restart` of each
// unit the installer made leaves a container and a gVisor sandbox running
// with their processes; the restarted edge re-attaches them.
func TestSandboxesOutliveARestartOfEveryUnit(t *testing.T) {
	c := setup(t)
	units := strings.Fields(os.Getenv("DSEC_UNITS"))
	if len(units) == 0 {
		t.Fatal("DSEC_UNITS names no unit; the installer writes them into the client env file")
	}
	var boxes []*client.Sandbox
	for _, be := range []string{"container", "gvisor"} {
		sb := create(t, c, &sandboxv1.SandboxSpec{Backend: be, Image: "root/busybox:latest"})
		sh(t, sb, "sleep 100000 > /dev/null 2>&1 & echo $! > /root/sleeper", 10*time.Second)
		boxes = append(boxes, sb)
	}
	for _, u := range units {
		start := time.Now()
		if out, err := exec.Command("systemctl", "restart", u).CombinedOutput(); err != nil {
			t.Fatalf("systemctl restart %s: %v: %s", u, err, out)
		}
		for _, sb := range boxes {
			var r *agentv1.RunResponse
			var err error
			for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(500 * time.Millisecond) {
				r, err = sb.Run(ctxT(t, time.Minute), &agentv1.ProcessConfig{Args: []string{"sh", "-c", "kill -0 $(cat /root/sleeper) && echo alive"}, TimeoutMs: 10000})
				if err == nil || time.Now().After(deadline) {
					break
				}
			}
			if err != nil || strings.TrimSpace(string(r.Stdout)) != "alive" {
				t.Fatalf("after restarting %s: sandbox %s: %+v %v", u, sb.ID, r, err)
			}
		}
		t.Logf("restarted %s: sandboxes answered again after %v", u, time.Since(start).Round(time.Millisecond))
	}
}

// TestATaskPauseWithOffloadGivesMemoryBack: a gVisor sandbox of a task,
// holding a file in its in-memory root and a mark in a shell session, is offloaded by a task pause (its
// cgroup's memory reclaimed through v2's memory.reclaim), and comes back
// with the session's state on resume.
func TestATaskPauseWithOffloadGivesMemoryBack(t *testing.T) {
	c := setup(t)
	ctx := ctxT(t, 8*time.Minute) // two commands of up to 3 minutes, a pause and a resume
	task := fmt.Sprintf("hosttest-%d", time.Now().UnixNano())
	sb := create(t, c, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Task: task, Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}})
	sess, err := sb.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	// 32 MiB in the sandbox's in-memory root file system (in 1 MiB writes:
	// every syscall is slow under ptrace in an emulated VM), and a mark in
	// the session's shell. A read of /dev/urandom may come back short under
	// gVisor, and dd without iflag=fullblock then writes a short block (a CI
	// run's file was 928 KiB short before it was ever paused). A checksum of
	// one page from the file's middle shows its content came back too (of
	// one page: a checksum of all 32 MiB takes 8,192 reads).
	before, err := sb.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "dd if=/dev/urandom of=/root/big bs=1048576 count=32 iflag=fullblock 2>/dev/null; MARK=kept-$$; echo $MARK $(wc -c < /root/big) $(dd if=/root/big bs=4096 skip=4100 count=1 2>/dev/null | md5sum)", TimeoutMs: 180_000}))
	if err != nil {
		t.Fatal(err)
	}
	if f := strings.Fields(string(before.Msg.Stdout)); len(f) < 3 || !strings.HasPrefix(f[0], "kept-") || f[1] != "33554432" {
		t.Fatalf("before the pause: %q, want a mark, the file's 33554432 bytes and a page's checksum", before.Msg.Stdout)
	}
	out, err := c.PauseTask(ctx, task, sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil {
		t.Fatal(err)
	}
	if len(out.Results) != 1 || out.Results[0].Sandbox.GetPauseDepth() != sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
		t.Fatalf("task pause: %+v", out)
	}
	if out.MemoryReleasedBytes < 16<<20 {
		t.Errorf("the offload gave back %d bytes; want at least half of the 32 MiB file's memory", out.MemoryReleasedBytes)
	}
	t.Logf("offload gave back %d MiB", out.MemoryReleasedBytes>>20)
	if _, err := c.ResumeTask(ctx, task); err != nil {
		t.Fatal(err)
	}
	// Reading the file back pages it in from the checkpoint: under ptrace in
	// an emulated VM on a busy machine that took longer than a command's
	// default minute.
	got, err := sb.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "echo $MARK $(wc -c < /root/big) $(dd if=/root/big bs=4096 skip=4100 count=1 2>/dev/null | md5sum)", TimeoutMs: 180_000}))
	if err != nil {
		t.Fatal(err)
	}
	if g, w := string(got.Msg.Stdout), string(before.Msg.Stdout); g != w {
		t.Fatalf("after resume the session printed %q; before the pause %q", g, w)
	}
}

// TestANetworkPolicyAllowsWhatItNamesAndNothingElse: a server in a
// namespace the test makes answers on two ports; a container sandbox whose
// policy names one reaches it there and is refused on the other.
func TestANetworkPolicyAllowsWhatItNamesAndNothingElse(t *testing.T) {
	c := setup(t)
	const ns, hostEnd, server = "dsech-web", "10.252.0.1", "10.252.0.2"
	cmds := [][]string{
		{"ip", "netns", "add", ns},
		{"ip", "link", "add", "dsechweb0", "type", "veth", "peer", "name", "eth0", "netns", ns},
		{"ip", "addr", "add", hostEnd + "/24", "dev", "dsechweb0"},
		{"ip", "link", "set", "dsechweb0", "up"},
		{"ip", "-n", ns, "addr", "add", server + "/24", "dev", "eth0"},
		{"ip", "-n", ns, "link", "set", "eth0", "up"},
		{"ip", "-n", ns, "route", "add", "default", "via", hostEnd},
	}
	t.Cleanup(func() {
		exec.Command("ip", "link", "del", "dsechweb0").Run() //nolint:errcheck // best effort
		exec.Command("ip", "netns", "del", ns).Run()         //nolint:errcheck // best effort
	})
	for _, args := range cmds {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%v: %v: %s", args, err, out)
		}
	}
	for _, port := range []string{"8080", "8081"} {
		ln := listenIn(t, ns, server+":"+port)
		go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { fmt.Fprint(w, "hello from "+port) })) //nolint:errcheck // ends with the test
	}
	sb := create(t, c, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest",
		Network: &sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{{Cidr: server + "/32", Protocol: "tcp", Ports: []string{"8080"}}}}})
	// busybox's nc (its static wget crashes looking up the service).
	get := func(port string) *agentv1.RunResponse {
		return sh(t, sb, `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 10 `+server+" "+port, 30*time.Second)
	}
	if r := get("8080"); !strings.HasSuffix(string(r.Stdout), "hello from 8080") {
		t.Fatalf("the allowed port: %q %q (exit %d)", r.Stdout, r.Stderr, r.ExitCode)
	}
	if r := get("8081"); r.ExitCode == 0 || strings.Contains(string(r.Stdout), "hello") {
		t.Fatalf("a port the policy does not name answered: %q", r.Stdout)
	}
}

// listenIn listens on addr inside network namespace ns: the socket is made
// on a thread that entered it, and stays there.
func listenIn(t *testing.T, ns, addr string) net.Listener {
	t.Helper()
	type result struct {
		ln  net.Listener
		err error
	}
	ch := make(chan result)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine, in ns
		f, err := os.Open("/var/run/netns/" + ns)
		if err != nil {
			ch <- result{err: err}
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			ch <- result{err: err}
			return
		}
		ln, err := net.Listen("tcp", addr)
		ch <- result{ln, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatalf("listen %s in %s: %v", addr, ns, r.err)
	}
	t.Cleanup(func() { r.ln.Close() })
	return r.ln
}

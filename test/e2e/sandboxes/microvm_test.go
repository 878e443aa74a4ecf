package sandboxes

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/test/e2e"
	"google.golang.org/protobuf/proto"
)

// TestMicrovmThroughTheAPI: a sandbox with backend "microvm" made through
// the apiserver runs on its own kernel (QEMU under TCG here), answers
// commands and file calls through the SDK's client like the other
// backends, keeps its files private from a second one, pauses and
// resumes, forks into copies that carry its memory, and leaves no QEMU
// behind when stopped.
func TestMicrovmThroughTheAPI(t *testing.T) {
	vm := e2e.MicrovmOptions(t)
	guest := vm["guest"]
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.Backends["microvm"] = vm }, "container", "microvm")
	ctx := e2e.Ctx(t)
	// The node says which hypervisor and accelerator it uses, and why not
	// a faster one.
	nodes, err := c.Client.Sandboxes.ListNodes(ctx, connect.NewRequest(&sandboxv1.ListNodesRequest{}))
	if err != nil || len(nodes.Msg.Nodes) != 1 {
		t.Fatalf("nodes: %v, %v", nodes, err)
	}
	detail := nodes.Msg.Nodes[0].BackendDetails["microvm"]
	if !strings.HasPrefix(detail, "qemu microvm, tcg") && !strings.HasPrefix(detail, "qemu microvm, kvm") {
		t.Fatalf("the node's microvm detail: %q", detail)
	}
	if _, err := os.Stat("/dev/kvm"); err == nil && strings.HasPrefix(detail, "qemu microvm, tcg") && !strings.Contains(detail, "not kvm: ") {
		t.Fatalf("/dev/kvm exists, TCG is used, and the detail does not say why: %q", detail)
	}
	t.Logf("microvm on this node: %s", detail)
	spec := &sandboxv1.SandboxSpec{Backend: "microvm", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256, DiskMb: 128}}
	a, err := c.Client.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	limited := proto.Clone(spec).(*sandboxv1.SandboxSpec)
	limited.Resources.Pids, limited.Resources.OpenFiles, limited.Resources.CpuCores = 64, 2048, 0.5
	b, err := c.Client.Create(ctx, limited)
	if err != nil {
		t.Fatal(err)
	}
	release, _ := os.ReadFile(filepath.Join(guest, "release"))
	host, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	if got := strings.TrimSpace(string(e2e.Shell(t, a, "uname -r").Stdout)); got != strings.TrimSpace(string(release)) || got == strings.TrimSpace(string(host)) {
		t.Fatalf("kernel in the microvm sandbox: %q (guest %q, host %q)", got, release, host)
	}
	if got := strings.TrimSpace(string(e2e.Shell(t, a, "hostname").Stdout)); got != a.ID {
		t.Fatalf("hostname %q, want %s", got, a.ID)
	}
	if _, err := a.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: "/root/note", Data: []byte("mine")})); err != nil {
		t.Fatal(err)
	}
	if got := string(e2e.Shell(t, a, "cat /root/note").Stdout); got != "mine" {
		t.Fatalf("file written through the API reads %q", got)
	}
	if got := string(e2e.Shell(t, b, "cat /root/note 2>/dev/null || echo absent").Stdout); got != "absent\n" {
		t.Fatalf("the second sandbox sees the first's file: %q", got)
	}
	// The sandbox's limits hold inside the guest, on its processes and
	// not on the agent: a fork bomb gets EAGAIN at the pids limit, a memory
	// hog is killed by the cgroup's OOM killer, and the agent answers on.
	if got := string(e2e.Shell(t, b, "ulimit -n; cat /proc/self/cgroup /proc/1/cgroup").Stdout); got != "2048\n0::/sandbox\n0::/\n" {
		t.Fatalf("open files limit and cgroups (a process's, the agent's): %q", got)
	}
	// The shell gives up at the first fork refused; what it started is
	// counted and killed with builtins only (a fork would be refused too).
	bomb := "(i=0; while [ $i -lt 200 ]; do sleep 60 & echo $! >> /tmp/pids; i=$((i+1)); done) 2>/dev/null; n=0; while read p; do n=$((n+1)); kill $p; done < /tmp/pids; echo $n"
	if n, err := strconv.Atoi(strings.TrimSpace(string(e2e.Shell(t, b, bomb).Stdout))); err != nil || n >= 64 || n < 16 {
		t.Fatalf("200 processes asked under a pids limit of 64: %d ran (%v)", n, err)
	}
	if got := string(e2e.Shell(t, b, `awk 'BEGIN { s = "x"; while (1) s = s s }'; echo "rc=$?"`).Stdout); got != "rc=137\n" {
		t.Fatalf("a memory hog past the guest's memory: %q, want it killed (rc=137)", got)
	}
	if got := string(e2e.Shell(t, b, "echo alive").Stdout); got != "alive\n" {
		t.Fatalf("after the fork bomb and the hog: %q", got)
	}
	// Both are reported: the guest cgroup's counts reach the sandbox.
	e2e.WaitLimitEvents(t, c, b.ID, func(le *sandboxv1.LimitEvents) bool { return le.GetOomKills() > 0 && le.GetForksRefused() > 0 })
	// An impostor agent cannot take the link: the agent holds the
	// virtio-serial port, which admits one opener.
	port := `for p in /sys/class/virtio-ports/*; do if [ "$(cat $p/name)" = dsec.agent ]; then cat /dev/${p##*/} 2>&1; echo rc=$?; fi; done`
	if got := string(e2e.Shell(t, b, port).Stdout); !strings.Contains(got, "busy") || !strings.HasSuffix(got, "rc=1\n") {
		t.Fatalf("opening the agent's port from inside: %q, want it busy", got)
	}
	// Its half core is held on the node: its QEMU is in its cpu cgroup,
	// with half a period's quota, and a busy loop gets throttled.
	if _, err := os.Stat("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"); err == nil {
		cpu := "/sys/fs/cgroup/cpu/opendsec/" + b.ID
		if q, _ := os.ReadFile(cpu + "/cpu.cfs_quota_us"); strings.TrimSpace(string(q)) != "50000" {
			t.Fatalf("the microVM's CPU quota: %q, want 50000 of 100000 us", q)
		}
		e2e.Shell(t, b, "timeout 2 sh -c 'while :; do :; done'; true")
		stat, _ := os.ReadFile(cpu + "/cpu.stat")
		if !regexp.MustCompile(`nr_throttled [1-9]`).Match(stat) {
			t.Fatalf("a busy loop in a 0.5-core microVM was never throttled: %s", stat)
		}
	} else {
		t.Logf("no cgroup v1 cpu controller on this host: the CPU limit is the vCPU count (not checked)")
	}
	if _, err := c.Client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: a.ID})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: a.ID})); err != nil {
		t.Fatal(err)
	}
	if got := string(e2e.Shell(t, a, "cat /root/note").Stdout); got != "mine" {
		t.Fatalf("after pause and resume: %q", got)
	}
	// Fork with memory: a shell session's variable and a process started
	// before the fork are in every copy; each copy has its own name and
	// files.
	sess, err := a.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	secret := e2e.RunIn(t, a, sess.Msg.Session.Id, "SECRET=$RANDOM$RANDOM$RANDOM; echo $SECRET")
	if _, err := a.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: []string{"sleep", "1000"}, Tag: "held"}})); err != nil {
		t.Fatal(err)
	}
	held := strings.TrimSpace(string(e2e.Shell(t, a, "pidof sleep").Stdout))
	resp, err := c.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: a.ID, Count: 2}))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork(2) of a microvm sandbox: source paused %d us", resp.Msg.SourcePauseUs)
	names := map[string]bool{}
	for i, r := range append([]*sandboxv1.ForkResult{{Sandbox: &sandboxv1.Sandbox{Id: a.ID}}}, resp.Msg.Results...) {
		if r.Sandbox == nil {
			t.Fatalf("copy %d: %s %s", i, r.ErrorCode, r.ErrorMessage)
		}
		sb := c.Client.Sandbox(r.Sandbox.Id)
		if got := e2e.RunIn(t, sb, sess.Msg.Session.Id, "echo $SECRET"); string(got) != string(secret) {
			t.Fatalf("sandbox %d: the session's variable reads %q, want %q", i, got, secret)
		}
		if got := strings.TrimSpace(string(e2e.Shell(t, sb, "pidof sleep; cat /root/note").Stdout)); got != held+"\nmine" {
			t.Fatalf("sandbox %d: process and file %q, want %q", i, got, held+"\nmine")
		}
		name := strings.TrimSpace(string(e2e.Shell(t, sb, "hostname").Stdout))
		if name != sb.ID || names[name] {
			t.Fatalf("sandbox %d: hostname %q", i, name)
		}
		names[name] = true
		e2e.Shell(t, sb, "echo "+sb.ID+" > /root/own")
	}
	if got := strings.TrimSpace(string(e2e.Shell(t, a, "cat /root/own").Stdout)); got != a.ID {
		t.Fatalf("the source reads a copy's file: %q", got)
	}
	// A QEMU stopped from the node (SIGSTOP) is reported failed within
	// seconds, with that reason, and its neighbours answer on.
	qemu, _ := exec.Command("pgrep", "-f", "qemu-system-x86_64.*/"+b.ID+"/").Output()
	pids := strings.Fields(string(qemu))
	if len(pids) != 1 {
		t.Fatalf("QEMU processes of %s: %q, want one", b.ID, qemu)
	}
	pid, _ := strconv.Atoi(pids[0])
	stopped := time.Now()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) }) //nolint:errcheck // it may be gone
	msg, took := e2e.WaitFailed(t, c, b.ID, stopped)
	t.Logf("a microVM whose QEMU was stopped: reported failed %v after the SIGSTOP: %s", took.Round(time.Millisecond), msg)
	if !strings.Contains(msg, "stopped by a signal on the node") {
		t.Fatalf("reason: %q, want it to say the runtime was stopped on the node", msg)
	}
	if got := string(e2e.Shell(t, a, "echo alive").Stdout); got != "alive\n" {
		t.Fatalf("its neighbour after the SIGSTOP: %q", got)
	}
	all := []string{a.ID, b.ID}
	for _, r := range resp.Msg.Results {
		all = append(all, r.Sandbox.Id)
	}
	for _, sb := range all {
		if err := c.Client.Sandbox(sb).Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if out, _ := exec.Command("pgrep", "-f", "qemu-system-x86_64.*"+c.Cfg.StateDir).Output(); len(out) > 0 {
		t.Fatalf("QEMU left running after stop: %s", out)
	}
}

// TestKillDsecUpLeavesVMsRunning: after `kill -9` of dsec up, a microvm
// sandbox's QEMU goes on running (the same process, not a reboot), and the
// next dsec up re-attaches it: its shell session's variable, a process
// and a file are there, and it stops leaving no QEMU behind.
func TestKillDsecUpLeavesVMsRunning(t *testing.T) {
	flags := e2e.MicrovmUpFlags(t)
	node := e2e.NewUpNode(t)
	state := node.State
	up := node.Start(t, flags...)
	defer func() {
		up.Cmd.Process.Signal(syscall.SIGTERM)
		up.Cmd.Wait()
	}()
	ctx := e2e.Ctx(t)
	sb, err := up.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "microvm", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256, DiskMb: 64}})
	if err != nil {
		t.Fatalf("create: %v; log: %s", err, e2e.TailFile(filepath.Join(node.State, "dsec.log")))
	}
	sess, err := sb.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	secret := e2e.RunIn(t, sb, sess.Msg.Session.Id, "SECRET=$RANDOM$RANDOM$RANDOM; echo $SECRET")
	e2e.Shell(t, sb, "echo kept > /root/mark; sleep 1000 >/dev/null 2>&1 &")
	qemu := func() string {
		out, _ := exec.Command("pgrep", "-f", "qemu-system-x86_64.*"+state).Output()
		return strings.TrimSpace(string(out))
	}
	before := qemu()
	if before == "" || strings.Contains(before, "\n") {
		t.Fatalf("QEMU processes of the sandbox: %q", before)
	}
	up.Cmd.Process.Signal(syscall.SIGKILL)
	up.Cmd.Wait()
	if got := qemu(); got != before {
		t.Fatalf("after kill -9 of dsec up, QEMU is %q, was %q", got, before)
	}
	up = node.Start(t, flags...)
	got, err := up.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
	if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after the restart: %v, %v; log: %s", got, err, e2e.TailFile(filepath.Join(state, "dsec.log")))
	}
	again := up.Client.Sandbox(sb.ID)
	if v := e2e.RunIn(t, again, sess.Msg.Session.Id, "echo $SECRET"); string(v) != string(secret) {
		t.Fatalf("the session's variable after the restart: %q, want %q", v, secret)
	}
	if r := e2e.Shell(t, again, "cat /root/mark; ps | grep -v grep | grep -q 'sleep 1000' && echo alive"); string(r.Stdout) != "kept\nalive\n" {
		t.Fatalf("after the restart: %q %q", r.Stdout, r.Stderr)
	}
	if got := qemu(); got != before {
		t.Fatalf("QEMU after the restart is %q, was %q: the guest was not re-attached", got, before)
	}
	if err := again.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if got := qemu(); got != "" {
		t.Fatalf("QEMU left running after stop: %s", got)
	}
}

// TestWarmImage: `dsec image warm` has each of two microvm edges build
// the template snapshot of an image and shape before any sandbox asks for
// it; warmed again, each says it had it; the container backend has
// nothing to prepare; a project's admin (not root's) may not warm.
func TestWarmImage(t *testing.T) {
	vm := e2e.MicrovmOptions(t)
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Backends["microvm"] = vm
		cfg.Edges = 2
	}, "container", "microvm")
	bin := e2e.DsecBinary(t)
	run := func(args ...string) (string, string, int) {
		t.Helper()
		return e2e.RunCLI(t, bin, []string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key}, "", args...)
	}
	templates := func() []string {
		ready, _ := filepath.Glob(filepath.Join(c.Cfg.StateDir, "edge*", "backends", "microvm", "templates", "*", "ready"))
		return ready
	}
	if got := templates(); len(got) != 0 {
		t.Fatalf("templates before any warm or create: %v", got)
	}
	out, errOut, code := run("image", "warm", "root/busybox:latest", "--memory", "256", "--cpu", "1")
	if code != 0 || strings.Count(out, "prepared it") != 2 {
		t.Fatalf("dsec image warm: %q %q exit %d", out, errOut, code)
	}
	if got := templates(); len(got) != 2 {
		t.Fatalf("templates after warming two edges: %v", got)
	}
	out, _, code = run("image", "warm", "root/busybox:latest", "--memory", "256", "--cpu", "1")
	if code != 0 || strings.Count(out, "had it prepared already") != 2 {
		t.Fatalf("dsec image warm again: %q exit %d", out, code)
	}
	if out, _, code := run("image", "warm", "root/busybox:latest", "--backend", "container"); code != 0 || strings.Count(out, "nothing to prepare") != 2 {
		t.Fatalf("dsec image warm --backend container: %q exit %d", out, code)
	}
	if _, errOut, code := run("image", "warm", "root/no-such:1"); code == 0 || !strings.Contains(errOut, "not_found") {
		t.Fatalf("warm of a missing image: %q exit %d", errOut, code)
	}
	team := c.Project(t, "root", "warmers", nil)
	if _, err := team.WarmImage(e2e.Ctx(t), "root/busybox:latest", "microvm", nil, false); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("a sub-project's admin warmed: %v", err)
	}
	// A create of the warmed shape on either edge uses its template.
	sb, err := c.Client.Create(e2e.Ctx(t), &sandboxv1.SandboxSpec{Backend: "microvm", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(e2e.Ctx(t)) //nolint:errcheck // cleanup
	if got := templates(); len(got) != 2 {
		t.Fatalf("a create of the warmed shape made another template: %v", got)
	}
}

// Package backendtest is the conformance suite every backend passes: the fake
// in plain unit tests, the real ones (container, gvisor) as root on a host
// that has them.
package backendtest

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/identity"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// Env is what the suite needs besides the backend.
type Env struct {
	// Layers of a busybox-like image (a shell, hostname, cat, ls).
	Layers []string
	// Agent is the aether binary.
	Agent string
	// Isolated is true for real backends: the suite then checks namespaces
	// and that pause freezes processes. The fake runs processes on the host
	// and its pause only holds the agent's requests.
	Isolated bool
}

// TmpVar names the directory a sandbox's test scripts write to: /tmp
// inside a real sandbox, a test's own temporary directory for the fake,
// whose commands run on the host (a fixed /tmp path would leak there and
// be shared between tests).
const TmpVar = "DSEC_TEST_TMP"

// Factory makes a backend whose state lives in stateDir. Calling it twice
// with the same dir simulates an edge restart.
type Factory func(t *testing.T, stateDir string) backend.Backend

// Sandbox is a created sandbox with its agent link.
type Sandbox struct {
	ID     sandboxid.ID
	Dir    string
	Handle *backend.Handle
	Spec   *backend.Spec
	Link   *agentlink.Link
	Proc   agentv1connect.ProcessServiceClient
	Files  agentv1connect.FilesystemServiceClient
}

// NewSpec prepares a sandbox directory and spec like the edge does.
func NewSpec(t *testing.T, env Env, node sandboxid.NodeID) *backend.Spec {
	t.Helper()
	id := sandboxid.New(node)
	dir := filepath.Join(t.TempDir(), string(id))
	runDir := filepath.Join(dir, "run")
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		t.Fatal(err)
	}
	hosts := filepath.Join(dir, "hosts")
	os.WriteFile(hosts, []byte("127.0.0.1 localhost "+string(id)+"\n"), 0o644)
	tmp := "/tmp"
	if !env.Isolated {
		tmp = t.TempDir()
	}
	return &backend.Spec{
		ID: id, Dir: dir, Layers: env.Layers, Hostname: string(id), LayerDir: filepath.Join(dir, "layer"),
		Env:       []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "DSEC_SANDBOX_ID=" + string(id), TmpVar + "=" + tmp},
		Resources: backend.Resources{CPUCores: 1, MemoryMB: 256, Pids: 128, DiskMB: 1024, NoFile: 4096},
		AgentPath: env.Agent, RunDir: runDir, HostsFile: hosts,
	}
}

// harnessKey is the agent key of every sandbox these tests start, as an
// edge's record would hold it: the first connection of a sandbox is given
// it, and its copies and re-attached agents present it.
var harnessKey = agentlink.NewKey()

// Attach opens the agent link for spec, a sandbox of b, and returns
// clients. The link authenticates the agent (agentlink/auth.go) unless b's
// link is a VM's serial port.
func Attach(t *testing.T, b backend.Backend, spec *backend.Spec) *Sandbox {
	t.Helper()
	var auth *agentlink.Auth
	if !b.Capabilities().LinkBeforeAgent {
		auth = &agentlink.Auth{Key: harnessKey}
	}
	link, err := agentlink.ListenAuthenticated(filepath.Join(spec.RunDir, "edge.sock"), auth, testutil.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { link.Close() })
	hc := &http.Client{Transport: link}
	return &Sandbox{
		ID: spec.ID, Dir: spec.Dir, Spec: spec, Link: link,
		Proc:  agentv1connect.NewProcessServiceClient(hc, "http://agent"),
		Files: agentv1connect.NewFilesystemServiceClient(hc, "http://agent"),
	}
}

// Start creates and starts a sandbox and waits for its agent.
func Start(t *testing.T, b backend.Backend, env Env) *Sandbox {
	t.Helper()
	return StartSpec(t, b, NewSpec(t, env, sandboxid.NewNodeID()))
}

// StartSpec is Start of a spec the test has changed.
func StartSpec(t *testing.T, b backend.Backend, spec *backend.Spec) *Sandbox {
	t.Helper()
	ctx := ctxFor(t, 60*time.Second)
	sb := Attach(t, b, spec)
	h, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	sb.Handle = h
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	if err := b.Start(ctx, spec.ID); err != nil {
		t.Fatalf("start: %v", err)
	}
	wait := WaitAgent
	if h.Restored {
		wait = func(ctx context.Context, b backend.Backend, link *agentlink.Link) error {
			return WaitCopy(ctx, link, spec, h)
		}
	}
	if err := wait(ctx, b, sb.Link); err != nil {
		t.Fatalf("agent did not connect: %v", err)
	}
	return sb
}

// WaitCopy waits for the agent of a copy (a restored snapshot, or a
// sandbox made from a template, h.Restored) as the edge does: its first
// request is its identity, with spec's settings for a template's copy and
// its network where h names one.
func WaitCopy(ctx context.Context, link *agentlink.Link, spec *backend.Spec, h *backend.Handle) error {
	var settings *agentv1.SandboxSettings
	if h.Restored {
		settings = identity.Settings(spec)
	}
	req := identity.Request(spec.Hostname, settings, h.Network)
	return link.WaitServingWith(ctx, func(try context.Context) (bool, error) { return identity.Set(try, link, req) })
}

// WaitAgent waits for the agent as the edge does: for its connection, or,
// for a backend whose link precedes its agent (a VM), for an answer.
func WaitAgent(ctx context.Context, b backend.Backend, link *agentlink.Link) error {
	if b.Capabilities().LinkBeforeAgent {
		return link.WaitServing(ctx)
	}
	return link.WaitReady(ctx)
}

func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// Sh runs a shell command in the sandbox and returns stdout, failing the
// test on a non-zero exit.
func (sb *Sandbox) Sh(t *testing.T, script string) string {
	t.Helper()
	r, err := sb.Proc.Run(ctxFor(t, 30*time.Second), connect.NewRequest(&agentv1.RunRequest{
		Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", script}},
	}))
	if err != nil {
		t.Fatalf("run %q: %v", script, err)
	}
	if r.Msg.ExitCode != 0 {
		t.Fatalf("run %q: exit %d: %s", script, r.Msg.ExitCode, r.Msg.Stderr)
	}
	return string(r.Msg.Stdout)
}

// Run runs the whole suite.
func Run(t *testing.T, newBackend Factory, env Env) {
	t.Run("Lifecycle", func(t *testing.T) { testLifecycle(t, newBackend, env) })
	t.Run("Pause", func(t *testing.T) { testPause(t, newBackend, env) })
	t.Run("Recover", func(t *testing.T) { testRecover(t, newBackend, env) })
	t.Run("Changes", func(t *testing.T) { testChanges(t, newBackend, env) })
	t.Run("Terminal", func(t *testing.T) { testTerminal(t, newBackend, env) })
	if env.Isolated {
		t.Run("Isolation", func(t *testing.T) { testIsolation(t, newBackend, env) })
	}
}

func testLifecycle(t *testing.T, newBackend Factory, env Env) {
	b := newBackend(t, t.TempDir())
	ctx := ctxFor(t, 60*time.Second)
	if err := b.Probe(ctx); err != nil {
		t.Fatalf("probe: %v", err)
	}
	sb := Start(t, b, env)
	st, err := b.Status(ctx, sb.ID)
	if err != nil || st.State != backend.StateRunning {
		t.Fatalf("status after start: %+v, %v", st, err)
	}
	if got := strings.TrimSpace(sb.Sh(t, "echo hello from $DSEC_SANDBOX_ID")); got != "hello from "+string(sb.ID) {
		t.Fatalf("echo = %q", got)
	}
	// A real runtime's use, read from the host, counts what the sandbox
	// runs (the fake reports what its test sets).
	if ur, ok := b.(backend.UsageReader); ok && env.Isolated {
		before, err := ur.Usage(sb.ID)
		if err != nil || before.MemoryBytes <= 0 || before.LimitBytes <= 0 {
			t.Fatalf("usage: %+v, %v", before, err)
		}
		sb.Sh(t, "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done")
		after, err := ur.Usage(sb.ID)
		if err != nil || after.CPUNanos < before.CPUNanos+uint64(20*time.Millisecond) {
			t.Fatalf("CPU use across a busy loop: %d ns, then %d ns (%v)", before.CPUNanos, after.CPUNanos, err)
		}
	}
	if err := b.Stop(ctx, sb.ID, 2*time.Second); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if st, err := b.Status(ctx, sb.ID); err != nil || st.State != backend.StateStopped {
		t.Fatalf("status after stop: %+v, %v", st, err)
	}
	if err := b.Destroy(ctx, sb.ID); err != nil {
		t.Fatalf("destroy: %v", err)
	}
	if err := b.Destroy(ctx, sb.ID); err != nil {
		t.Fatalf("second destroy: %v", err)
	}
	if mounts, _ := rootfs.MountsUnder(sb.Dir); len(mounts) != 0 {
		t.Fatalf("mounts left after destroy: %v", mounts)
	}
}

// WaitProbe polls a PauseProbe file in the sandbox until it shows at
// least minRounds rounds.
func (sb *Sandbox) WaitProbe(t *testing.T, file string, minRounds int) testutil.ProbeReading {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		last = sb.Sh(t, "cat "+file+" 2>/dev/null || true")
		if r, err := testutil.ParseProbe(last); err == nil && r.Rounds >= minRounds {
			return r
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("pause probe %s did not reach %d rounds (last read %q)", file, minRounds, last)
	return testutil.ProbeReading{}
}

// frozenFor is how long the pause tests keep a sandbox paused.
const frozenFor = 1500 * time.Millisecond

func testPause(t *testing.T, newBackend Factory, env Env) {
	b := newBackend(t, t.TempDir())
	p, ok := b.(backend.Pauser)
	if !ok || !b.Capabilities().Pause {
		t.Skip("backend cannot pause")
	}
	ctx := ctxFor(t, 60*time.Second)
	sb := Start(t, b, env)
	sb.Sh(t, "echo before > $"+TmpVar+"/marker")
	probe := "$" + TmpVar + "/probe"
	if env.Isolated {
		sb.Sh(t, testutil.PauseProbe(probe))
	}
	var before testutil.ProbeReading
	if env.Isolated {
		before = sb.WaitProbe(t, probe, 3)
	}
	// A VM's whole kernel stops with it, its clocks too: from inside, a
	// pause leaves no gap; its uptime falls behind the node's instead.
	vm := b.Capabilities().Isolation == "microvm" || b.Capabilities().Isolation == "vm"
	var upBefore float64
	var readBefore time.Time
	if vm {
		upBefore, _, readBefore = sb.uptime(t)
	}
	if err := p.Pause(ctx, sb.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	pausedAt := time.Now()
	if st, _ := b.Status(ctx, sb.ID); st.State != backend.StatePaused {
		t.Fatalf("status after pause: %+v", st)
	}
	// A paused sandbox does not answer: the call runs into its own
	// deadline (any other error would mean the agent failed, not froze).
	short, cancel := context.WithTimeout(ctx, time.Second)
	_, err := sb.Proc.Run(short, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"true"}}}))
	cancel()
	if connect.CodeOf(err) != connect.CodeDeadlineExceeded {
		t.Fatalf("a call to a paused sandbox ended with %v, want deadline_exceeded", err)
	}
	time.Sleep(time.Until(pausedAt.Add(frozenFor)))
	if err := p.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if got := sb.Sh(t, "cat $"+TmpVar+"/marker"); got != "before\n" {
		t.Fatalf("after resume: %q", got)
	}
	if vm {
		// The guest read its clock somewhere inside each call, so from the
		// first read's answer to the second read's send a guest that ran
		// saw at least as much time pass as the node. A paused one falls
		// behind by about the pause (1.2-1.35 s of 1.5 s under TCG here);
		// the bar is half of it.
		upAfter, sentAfter, _ := sb.uptime(t)
		hostDelta := sentAfter.Sub(readBefore)
		guestDelta := time.Duration((upAfter - upBefore) * float64(time.Second))
		if hostDelta-guestDelta < frozenFor/2 {
			t.Fatalf("the guest ran while paused: its uptime moved %v while the node's clock moved at least %v over a pause of %v", guestDelta, hostDelta, frozenFor)
		}
		// Its wall clock is the node's again (the agent steps it): a file's
		// time, in nanoseconds, against the node's around the call.
		sent := time.Now()
		out := strings.TrimSpace(sb.Sh(t, "f=$"+TmpVar+"/clock; touch $f; stat -c %y $f"))
		guest, err := time.Parse("2006-01-02 15:04:05.999999999 -0700", out)
		if err != nil {
			t.Fatalf("the guest's time %q: %v", out, err)
		}
		if guest.Before(sent.Add(-300*time.Millisecond)) || guest.After(time.Now().Add(300*time.Millisecond)) {
			t.Fatalf("the guest's clock reads %v after a resume; the node's was %v to %v", guest, sent, time.Now())
		}
		return
	}
	if env.Isolated {
		// The loop ran again, and the time it was frozen shows as a gap: in
		// the first round it finishes after the resume, so wait for a round
		// after the one it shows now (which may be from before the pause).
		now := sb.WaitProbe(t, probe, before.Rounds)
		after := sb.WaitProbe(t, probe, now.Rounds+1)
		if after.LongGap < frozenFor-300*time.Millisecond {
			t.Fatalf("processes kept running while paused: the longest gap between rounds is %v over a pause of %v", after.LongGap, frozenFor)
		}
	}
}

// uptime reads the guest's /proc/uptime through the files API (no
// process to start, so the call is short), with the node's time just
// before the call was sent and just after its answer came.
func (sb *Sandbox) uptime(t *testing.T) (up float64, sent, answered time.Time) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sent = time.Now()
	resp, err := sb.Files.ReadFile(ctx, connect.NewRequest(&agentv1.ReadFileRequest{Path: "/proc/uptime", Limit: 64}))
	answered = time.Now()
	if err != nil {
		t.Fatalf("read /proc/uptime: %v", err)
	}
	if _, err := fmt.Sscan(string(resp.Msg.Data), &up); err != nil {
		t.Fatalf("uptime %q: %v", resp.Msg.Data, err)
	}
	return up, sent, answered
}

func testRecover(t *testing.T, newBackend Factory, env Env) {
	state := t.TempDir()
	b := newBackend(t, state)
	ctx := ctxFor(t, 60*time.Second)
	sb := Start(t, b, env)
	sb.Sh(t, "echo kept > $"+TmpVar+"/state")
	// A process the agent manages: only the agent that started it knows
	// its tag, so finding it afterwards shows the backend re-attached to
	// the running sandbox instead of starting a new one.
	stream, err := sb.Proc.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: []string{"sleep", "3600"}, Tag: "kept"}}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() || stream.Msg().Event.GetStarted() == nil {
		t.Fatalf("start: %v %v", stream.Msg(), stream.Err())
	}
	pid := stream.Msg().Event.GetStarted().Pid
	stream.Close()
	// The edge goes away (its link too) and comes back with a new backend.
	sb.Link.Close()
	b2 := newBackend(t, state)
	sb2 := Attach(t, b2, sb.Spec)
	if err := b2.Recover(ctx, sb.Handle, sb.Spec); err != nil {
		t.Fatalf("recover: %v", err)
	}
	t.Cleanup(func() { b2.Destroy(context.Background(), sb.ID) })
	if err := WaitAgent(ctx, b2, sb2.Link); err != nil {
		t.Fatalf("agent did not reconnect: %v", err)
	}
	if got := sb2.Sh(t, "cat $"+TmpVar+"/state"); got != "kept\n" {
		t.Fatalf("state after recover: %q", got)
	}
	list, err := sb2.Proc.List(ctx, connect.NewRequest(&agentv1.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, p := range list.Msg.Processes {
		found = found || (p.Tag == "kept" && p.Pid == pid)
	}
	if !found {
		t.Fatalf("after recover the agent does not know the process it started (pid %d, tag kept): the sandbox was not re-attached", pid)
	}
	kept := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Tag{Tag: "kept"}}
	if _, err := sb2.Proc.SendSignal(ctx, connect.NewRequest(&agentv1.SendSignalRequest{Process: kept, Signal: 9})); err != nil {
		t.Fatal(err)
	}
	if err := b2.Destroy(ctx, sb.ID); err != nil {
		t.Fatal(err)
	}
}

// testTerminal: a process in a pseudo-terminal of the size asked, and
// POSIX shared memory (/dev/shm), as every runtime gives them.
func testTerminal(t *testing.T, newBackend Factory, env Env) {
	b := newBackend(t, t.TempDir())
	sb := Start(t, b, env)
	ctx := ctxFor(t, 60*time.Second)
	stream, err := sb.Proc.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{
		Args: []string{"sh"}, Pty: &agentv1.PtySize{Cols: 91, Rows: 27}, Tag: "term",
	}}))
	if err != nil {
		t.Fatal(err)
	}
	if !stream.Receive() {
		t.Fatalf("the terminal's process did not start: %v", stream.Err())
	}
	shm := "/dev/shm/dsec-conformance-" + string(sb.ID)
	input := "stty size; tty; touch " + shm + " && rm " + shm + " && echo shm-ok; exit 3\n"
	sel := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Tag{Tag: "term"}}
	if _, err := sb.Proc.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: sel, Data: []byte(input)})); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	var code int32 = -1
	for stream.Receive() {
		if o := stream.Msg().Event.GetOutput(); o != nil {
			out.Write(o.Data)
		}
		if e := stream.Msg().Event.GetExited(); e != nil {
			code = e.ExitCode
		}
	}
	if got := out.String(); !strings.Contains(got, "27 91") || !strings.Contains(got, "/dev/pts/") || !strings.Contains(got, "shm-ok") || code != 3 {
		t.Fatalf("terminal: output %q, exit %d; want its size, a /dev/pts name, shm-ok and exit 3 (%v)", got, code, stream.Err())
	}
}

func testIsolation(t *testing.T, newBackend Factory, env Env) {
	b := newBackend(t, t.TempDir())
	a := Start(t, b, env)
	c := Start(t, b, env)
	if got := strings.TrimSpace(a.Sh(t, "hostname")); got != string(a.ID) {
		t.Fatalf("hostname = %q, want the sandbox id %q", got, a.ID)
	}
	if got := strings.TrimSpace(a.Sh(t, "cat /proc/1/cmdline | tr '\\0' ' '")); !strings.HasPrefix(got, "/.dsec/aether") {
		t.Fatalf("PID 1 is %q, want the agent (own PID namespace)", got)
	}
	// /proc/net/dev, not /sys/class/net: the newer runsc's sysfs has no
	// network class in a sandbox without a network.
	if got := strings.TrimSpace(a.Sh(t, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")); got != "lo" {
		t.Fatalf("network interfaces %q, want only lo (own network namespace)", got)
	}
	a.Sh(t, "echo mine > /root/private")
	if out := c.Sh(t, "cat /root/private 2>/dev/null || echo absent"); out != "absent\n" {
		t.Fatalf("sandbox c sees a's file: %q", out)
	}
	for _, l := range env.Layers {
		if _, err := os.Stat(filepath.Join(l, "root", "private")); err == nil {
			t.Fatalf("a write reached the shared layer %s", l)
		}
	}
	// Its own PID namespace (or kernel): the agent and this command's few
	// processes, not the host's hundreds. Kernel threads (a VM's own, with
	// an empty command line) do not count.
	n, err := strconv.Atoi(strings.TrimSpace(a.Sh(t, `n=0; for p in /proc/[0-9]*; do c=$(tr -d '\0' < $p/cmdline 2>/dev/null); [ -n "$c" ] && n=$((n+1)); done; echo $n`)))
	if err != nil || n < 2 || n > 20 {
		t.Fatalf("%d processes visible (%v); want the sandbox's own few", n, err)
	}
}

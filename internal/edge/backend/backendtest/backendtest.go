// Package backendtest is the conformance suite every backend passes: the fake
// in plain unit tests, the real ones (container, gvisor) as root on a host
// that has them.
package backendtest

import (
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
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
	// Isolated is true for real backends: the suite then checks namespaces.
	Isolated bool
}

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
	return &backend.Spec{
		ID: id, Dir: dir, Layers: env.Layers, Hostname: string(id),
		Env:       []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "DSEC_SANDBOX_ID=" + string(id)},
		Resources: backend.Resources{CPUCores: 1, MemoryMB: 256, Pids: 128},
		AgentPath: env.Agent, RunDir: runDir, HostsFile: hosts,
	}
}

// Attach opens the agent link for spec and returns clients.
func Attach(t *testing.T, spec *backend.Spec) *Sandbox {
	t.Helper()
	link, err := agentlink.Listen(filepath.Join(spec.RunDir, "edge.sock"), testutil.Logger(t))
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
	ctx := ctxFor(t, 60*time.Second)
	spec := NewSpec(t, env, sandboxid.NewNodeID())
	sb := Attach(t, spec)
	h, err := b.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	sb.Handle = h
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	if err := b.Start(ctx, spec.ID); err != nil {
		t.Fatalf("start: %v", err)
	}
	if err := sb.Link.WaitReady(ctx); err != nil {
		t.Fatalf("agent did not connect: %v", err)
	}
	return sb
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

func testPause(t *testing.T, newBackend Factory, env Env) {
	b := newBackend(t, t.TempDir())
	p, ok := b.(backend.Pauser)
	if !ok || !b.Capabilities().Pause {
		t.Skip("backend cannot pause")
	}
	ctx := ctxFor(t, 60*time.Second)
	sb := Start(t, b, env)
	sb.Sh(t, "echo before > /tmp/marker")
	if err := p.Pause(ctx, sb.ID); err != nil {
		t.Fatalf("pause: %v", err)
	}
	if st, _ := b.Status(ctx, sb.ID); st.State != backend.StatePaused {
		t.Fatalf("status after pause: %+v", st)
	}
	// A paused sandbox does not answer.
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	_, err := sb.Proc.Run(short, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"true"}}}))
	cancel()
	if err == nil {
		t.Fatal("a paused sandbox ran a command")
	}
	if err := p.Resume(ctx, sb.ID); err != nil {
		t.Fatalf("resume: %v", err)
	}
	if got := sb.Sh(t, "cat /tmp/marker"); got != "before\n" {
		t.Fatalf("after resume: %q", got)
	}
}

func testRecover(t *testing.T, newBackend Factory, env Env) {
	state := t.TempDir()
	b := newBackend(t, state)
	ctx := ctxFor(t, 60*time.Second)
	sb := Start(t, b, env)
	sb.Sh(t, "echo kept > /tmp/state")
	// The edge goes away (its link too) and comes back with a new backend.
	sb.Link.Close()
	b2 := newBackend(t, state)
	sb2 := Attach(t, sb.Spec)
	if err := b2.Recover(ctx, sb.Handle, sb.Spec); err != nil {
		t.Fatalf("recover: %v", err)
	}
	t.Cleanup(func() { b2.Destroy(context.Background(), sb.ID) })
	if err := sb2.Link.WaitReady(ctx); err != nil {
		t.Fatalf("agent did not reconnect: %v", err)
	}
	if got := sb2.Sh(t, "cat /tmp/state"); got != "kept\n" {
		t.Fatalf("state after recover: %q", got)
	}
	if err := b2.Destroy(ctx, sb.ID); err != nil {
		t.Fatal(err)
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
	if got := strings.TrimSpace(a.Sh(t, "ls /sys/class/net")); got != "lo" {
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
	if out := a.Sh(t, "ls /proc | grep -c '^[0-9]' "); strings.TrimSpace(out) == "" {
		t.Fatal("no processes visible")
	}
}

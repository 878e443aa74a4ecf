package edge

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"connectrpc.com/connect"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/fake"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

type fixture struct {
	pausedLifetime time.Duration // Config.PausedLifetime of the edges it opens (0: the default)
	dir            string
	runBase        string // Config.RunBase: the test's own, never the host's /run/opendsec
	store          *image.Store
	fake           *fake.Backend
	edge           *Edge
	metrics        prometheus.Registerer // Deps.Metrics of the edges it opens
	pools          []Pool                // Config.Pools of the edges it opens
}

func newFixture(t *testing.T, room capacity.Node) *fixture {
	testutil.RequireRootUser(t)
	t.Helper()
	dir := t.TempDir()
	store, err := image.OpenStore(filepath.Join(dir, "images"))
	if err != nil {
		t.Fatal(err)
	}
	tree := filepath.Join(dir, "tree")
	os.MkdirAll(filepath.Join(tree, "etc"), 0o755)
	os.WriteFile(filepath.Join(tree, "etc", "motd"), []byte("hi\n"), 0o644)
	layer, err := store.PackDir(tree, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := image.ParseRef("root/tiny:1")
	if _, err := store.Commit(ref, nil, []image.Layer{layer}, ocispec.ImageConfig{Env: []string{"FROM_IMAGE=yes"}}); err != nil {
		t.Fatal(err)
	}
	agent := filepath.Join(dir, "aether")
	os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755)
	f := &fixture{dir: dir, store: store, runBase: testRunBase(t)}
	b, _ := fake.New(context.Background(), backend.Config{})
	f.fake = b.(*fake.Backend)
	f.edge = f.open(t, room)
	return f
}

func (f *fixture) open(t *testing.T, room capacity.Node) *Edge {
	t.Helper()
	e, err := New(context.Background(), Config{
		StateDir: filepath.Join(f.dir, "edge"), AgentPath: filepath.Join(f.dir, "aether"), RunBase: f.runBase,
		Capacity: room, AgentTimeout: 5 * time.Second, PausedLifetime: f.pausedLifetime, Pools: f.pools,
	}, Deps{Store: f.store, Backends: []backend.Backend{f.fake}, Log: testutil.Logger(t), Metrics: f.metrics})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e
}

// testRunBase is a run base of the test's own, short enough for socket
// paths (t.TempDir's carry the test's name) and not empty, so the edge
// mounts no tmpfs over it.
func testRunBase(t *testing.T) string {
	t.Helper()
	base, err := os.MkdirTemp("", "rb")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.WriteFile(filepath.Join(base, "keep"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return base
}

func smallCapacity() capacity.Node {
	return capacity.Node{CPUCores: 4, MemoryMB: 4096, MaxSandboxes: 10, HostCPUCores: 2, HostMemoryMB: 2048}
}

func spec() *sandboxv1.SandboxSpec {
	return &sandboxv1.SandboxSpec{Backend: "fake", Image: "root/tiny:1", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}}
}

// agentClient talks to a sandbox through the edge's handler, as the
// apiserver does.
func agentClient(t *testing.T, e *Edge, id, scope string) agentv1connect.ProcessServiceClient {
	srv := httptest.NewServer(e.Handler())
	t.Cleanup(srv.Close)
	hc := &http.Client{Transport: headerRT{id: id, scope: scope}}
	return agentv1connect.NewProcessServiceClient(hc, srv.URL)
}

type headerRT struct{ id, scope string }

func (h headerRT) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(headers.SandboxID, h.id)
	r.Header.Set(headers.Scope, h.scope)
	return http.DefaultTransport.RoundTrip(r)
}

func echo(t *testing.T, c agentv1connect.ProcessServiceClient) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := c.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", "echo $FROM_IMAGE $DSEC_SANDBOX_ID"}}}))
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(r.Msg.Stdout)), nil
}

func TestCreateExecDestroy(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root/team")
	if err != nil {
		t.Fatal(err)
	}
	if sb.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING || sb.NodeId != string(f.edge.Node()) || !strings.HasPrefix(sb.Id, string(f.edge.Node())) {
		t.Fatalf("created: %+v", sb)
	}
	got, err := echo(t, agentClient(t, f.edge, sb.Id, "root"))
	if err != nil || got != "yes "+sb.Id {
		t.Fatalf("exec = %q, %v", got, err)
	}
	// Another project's scope cannot reach it.
	if _, err := echo(t, agentClient(t, f.edge, sb.Id, "root/other")); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("exec from another project: %v", err)
	}
	if _, err := f.edge.Get(sb.Id, "root/teamx"); !errdefs.IsNotFound(err) {
		t.Fatalf("prefix without slash matched: %v", err)
	}
	if st := f.edge.Status(); st.Allocated.Sandboxes != 1 || len(st.Groups) != 1 || st.Groups[0].Project != "root/team" {
		t.Fatalf("status: %+v", st)
	}
	if _, err := f.edge.Destroy(ctx, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(f.edge.dirs.sandbox(sandboxIDOf(sb))); !os.IsNotExist(err) {
		t.Fatalf("sandbox directory left: %v", err)
	}
	if _, err := f.edge.Destroy(ctx, sb.Id, "root"); !errdefs.IsNotFound(err) {
		t.Fatalf("second destroy: %v", err)
	}
	if st := f.edge.Status(); st.Allocated.Sandboxes != 0 || st.Allocated.CpuCores != 0 {
		t.Fatalf("allocation not released: %+v", st.Allocated)
	}
}

// A sandbox its backend made from a template snapshot starts with the
// template's environment; its own arrives with its identity, in its first
// request, before anyone else's.
func TestTemplateCopyGetsItsOwnSettings(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.FromTemplate = true
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := echo(t, agentClient(t, f.edge, sb.Id, "root")); err != nil || got != "yes "+sb.Id {
		t.Fatalf("exec in a template copy = %q, %v; want the image's and the sandbox's variables", got, err)
	}
}

func TestBadRequestsLeaveNothing(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	cases := map[string]struct {
		mut  func(*sandboxv1.SandboxSpec)
		code error
		want string
	}{
		"unknown backend": {func(s *sandboxv1.SandboxSpec) { s.Backend = "qemu" }, errdefs.ErrInvalidArgument, `backend "qemu": unknown`},
		"malformed image": {func(s *sandboxv1.SandboxSpec) { s.Image = "tiny" }, errdefs.ErrInvalidArgument, "no project"},
		"missing image":   {func(s *sandboxv1.SandboxSpec) { s.Image = "root/nope:1" }, errdefs.ErrNotFound, `image "root/nope:1": not in the image store`},
		"foreign image":   {func(s *sandboxv1.SandboxSpec) { s.Image = "root/other/tiny:1" }, errdefs.ErrPermissionDenied, "not visible"},
		"too many cores":  {func(s *sandboxv1.SandboxSpec) { s.Resources.CpuCores = 3 }, errdefs.ErrInvalidArgument, "resources.cpu_cores 3: want 0.1 to 2"},
		"too much memory": {func(s *sandboxv1.SandboxSpec) { s.Resources.MemoryMb = 9999 }, errdefs.ErrInvalidArgument, "resources.memory_mb 9999: want 16 to 2048"},
	}
	for name, c := range cases {
		s := spec()
		c.mut(s)
		_, err := f.edge.Create(ctx, s, "root")
		if !errors.Is(err, c.code) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v; want %v containing %q", name, err, c.code, c.want)
		}
	}
	// Capacity: 4 cores in total, so the fifth 1-core sandbox is refused.
	for i := 0; i < 4; i++ {
		if _, err := f.edge.Create(ctx, spec(), "root"); err != nil {
			t.Fatal(err)
		}
	}
	_, err := f.edge.Create(ctx, spec(), "root")
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "cpu cores free") {
		t.Fatalf("over capacity: %v", err)
	}
	if n, err := f.edge.DestroyAll(ctx, "root"); n != 4 || err != nil {
		t.Fatalf("DestroyAll = %d, %v", n, err)
	}
	// A backend failure leaves no directory and no allocation.
	f.fake.Knobs.FailStart = errors.New("injected start failure")
	if _, err := f.edge.Create(ctx, spec(), "root"); err == nil || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("failing start: %v", err)
	}
	ents, _ := os.ReadDir(filepath.Join(f.dir, "edge", "sandboxes"))
	if len(ents) != 0 || f.edge.Status().Allocated.Sandboxes != 0 {
		t.Fatalf("half-created sandbox left: %d dirs, %+v", len(ents), f.edge.Status().Allocated)
	}
}

func TestTimeToLive(t *testing.T) {
	f := newFixture(t, smallCapacity())
	s := spec()
	s.TimeoutSeconds = 1
	sb, err := f.edge.Create(context.Background(), s, "root")
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if _, err := f.edge.Get(sb.Id, "root"); errdefs.IsNotFound(err) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("sandbox outlived its time to live")
}

func TestRestartReattaches(t *testing.T) {
	f := newFixture(t, smallCapacity())
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	if e2.Node() != f.edge.Node() {
		t.Fatalf("node id changed across restart: %s -> %s", f.edge.Node(), e2.Node())
	}
	got, err := e2.Get(sb.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after restart: %+v, %v", got, err)
	}
	if out, err := echo(t, agentClient(t, e2, sb.Id, "root")); err != nil || out != "yes "+sb.Id {
		t.Fatalf("exec after restart = %q, %v", out, err)
	}
	if st := e2.Status(); st.Allocated.Sandboxes != 1 {
		t.Fatalf("allocation after restart: %+v", st.Allocated)
	}
}

func TestPausedSandboxResumesOnCall(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	if p, err := freeze(ctx, f.edge, sb.Id, "root"); err != nil || p.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("pause: %+v, %v", p, err)
	}
	// A call that asks not to resume fails and leaves it paused.
	srv := httptest.NewServer(f.edge.Handler())
	t.Cleanup(srv.Close)
	probe := agentv1connect.NewAgentServiceClient(&http.Client{Transport: headerRT{id: sb.Id, scope: "root"}}, srv.URL)
	req := connect.NewRequest(&agentv1.HealthRequest{})
	req.Header().Set(headers.NoResume, "1")
	if _, err := probe.Health(ctx, req); connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "paused") {
		t.Fatalf("no-resume call to a paused sandbox: %v, want failed_precondition naming the pause", err)
	}
	if got, _ := f.edge.Get(sb.Id, "root"); got.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("a no-resume call resumed the sandbox: %v", got.State)
	}
	if _, err := echo(t, agentClient(t, f.edge, sb.Id, "root")); err != nil {
		t.Fatalf("call to a paused sandbox: %v", err)
	}
	if got, _ := f.edge.Get(sb.Id, "root"); got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("state after call: %v", got.State)
	}
}

// A sandbox made with explicit_resume stays paused through calls (the
// agent's and a restart of the edge) until it is resumed, and its copies
// keep the setting unless the restore says otherwise.
func TestExplicitResumeSandboxStaysPausedUntilResumed(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	s := spec()
	s.ExplicitResume = true
	sb, err := f.edge.Create(ctx, s, "root")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := freeze(ctx, f.edge, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	f.edge.Close()
	e := f.open(t, smallCapacity())
	if _, err := echo(t, agentClient(t, e, sb.Id, "root")); connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "explicit_resume") {
		t.Fatalf("call to a paused explicit-resume sandbox: %v, want failed_precondition naming explicit_resume", err)
	}
	if got, _ := e.Get(sb.Id, "root"); got.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("a call resumed it: %v", got.State)
	}
	if _, err := e.Resume(ctx, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if out, err := echo(t, agentClient(t, e, sb.Id, "root")); err != nil || out != "yes "+sb.Id {
		t.Fatalf("call after resume = %q, %v", out, err)
	}
}

func sandboxIDOf(s *sandboxv1.Sandbox) sandboxid.ID { return sandboxid.ID(s.Id) }

func sandboxIDOfSnap(s string) sandboxid.SnapshotID { return sandboxid.SnapshotID(s) }

// A staged agent that disappeared (another edge version pruned it, or the
// run base was cleaned) is staged again at the next create; an agent that
// changed since the edge started is a clear error, not a different binary
// under the running edge.
func TestCreateRestagesAMissingAgent(t *testing.T) {
	f := newFixture(t, smallCapacity())
	base := testRunBase(t)
	e, err := New(context.Background(), Config{
		StateDir: filepath.Join(f.dir, "edge2"), AgentPath: filepath.Join(f.dir, "aether"), RunBase: base,
		Capacity: smallCapacity(), AgentTimeout: 5 * time.Second,
	}, Deps{Store: f.store, Backends: []backend.Backend{f.fake}, Log: testutil.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	staged := e.parts.Agent
	if err := os.RemoveAll(filepath.Dir(staged)); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := e.Create(ctx, spec(), "root/team"); err != nil {
		t.Fatalf("create with the staged agent gone: %v", err)
	}
	if b, err := os.ReadFile(staged); err != nil || string(b) != "#!/bin/sh\n" {
		t.Fatalf("agent not staged again: %q %v", b, err)
	}
	os.RemoveAll(filepath.Dir(staged))
	os.WriteFile(filepath.Join(f.dir, "aether"), []byte("#!/bin/sh\n# v2\n"), 0o755)
	if _, err := e.Create(ctx, spec(), "root/team"); err == nil || !strings.Contains(err.Error(), "restart the edge") {
		t.Fatalf("create with a changed agent: %v", err)
	}
}

// A backend's least memory is refused below with the reason, before
// anything is admitted, rather than raised behind the caller's back.
func TestABackendsMinimumMemoryIsRefusedBelow(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.MinMemoryMB = 128
	small := spec()
	small.Resources.MemoryMb = 64
	_, err := f.edge.Create(context.Background(), small, "root/a")
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `resources.memory_mb 64: backend "fake" needs at least 128`) {
		t.Fatalf("64 MiB on a backend that needs 128: %v", err)
	}
	if n := len(f.edge.reg.all()); n != 0 {
		t.Fatalf("a refused create left %d sandboxes", n)
	}
	small.Resources.MemoryMb = 128
	if _, err := f.edge.Create(context.Background(), small, "root/a"); err != nil {
		t.Fatalf("128 MiB: %v", err)
	}
}

// Host devices go only to a backend that passes them through; elsewhere
// the create is refused naming the backend that does, with nothing
// admitted.
func TestDevicesAreRefusedToABackendWithoutPassthrough(t *testing.T) {
	f := newFixture(t, smallCapacity())
	withDevice := spec()
	withDevice.Devices = []string{"0000:01:00.0"}
	_, err := f.edge.Create(context.Background(), withDevice, "root/a")
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `devices 0000:01:00.0: backend "fake" passes no host PCI device through; the vm backend does`) {
		t.Fatalf("a device on the fake backend: %v", err)
	}
	if n := len(f.edge.reg.all()); n != 0 {
		t.Fatalf("a refused create left %d sandboxes", n)
	}
}

// freeze pauses a sandbox at the freeze depth, as the API's default pause.
func freeze(ctx context.Context, e *Edge, id, scope string) (*sandboxv1.Sandbox, error) {
	out, err := e.PauseAt(ctx, id, scope, sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE)
	if err != nil {
		return nil, err
	}
	return out.Sandbox, nil
}

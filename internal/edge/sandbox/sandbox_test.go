package sandbox

import (
	"context"
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/fake"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/netpolicy"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/testutil"
)

// fakeHost is an edge as a sandbox reaches it, counting what it is asked.
type fakeHost struct {
	wakes, released, layersRemoved, forgotten int
	net                                       fakeNetwork
}

func (h *fakeHost) Poke()                        { h.wakes++ }
func (h *fakeHost) Release(*Sandbox)             { h.released++ }
func (h *fakeHost) RemoveLayer(dir string) error { h.layersRemoved++; return nil }
func (h *fakeHost) Forget(sb *Sandbox)           { h.forgotten++; h.Release(sb) }
func (h *fakeHost) Reserve(string, int64, string) (func(), error) {
	return func() {}, nil
}
func (n *fakeNetwork) Reset(context.Context, *sandboxnet.Link) error { return nil }

// fakeNetwork is a node's sandbox network that counts what it is asked.
type fakeNetwork struct {
	attached, detached, forgotten int
	updated                       []netpolicy.Policy
}

func (n *fakeNetwork) Attach(_ context.Context, name string, _ netip.Addr, _ netpolicy.Policy) (*sandboxnet.Link, error) {
	n.attached++
	return &sandboxnet.Link{Sandbox: sandboxnet.Sandbox{Name: name, Addr: netip.MustParseAddr("10.0.0.2")}}, nil
}
func (n *fakeNetwork) Adopt(ctx context.Context, name string, _ netip.Addr, p netpolicy.Policy) (*sandboxnet.Link, error) {
	return n.Attach(ctx, name, netip.Addr{}, p)
}
func (n *fakeNetwork) Policy(*sandboxnet.Link) (netpolicy.Policy, error) {
	return netpolicy.Policy{}, nil
}
func (n *fakeNetwork) Update(_ context.Context, _ *sandboxnet.Link, p netpolicy.Policy) error {
	n.updated = append(n.updated, p)
	return nil
}
func (n *fakeNetwork) Detach(context.Context, *sandboxnet.Link) error { n.detached++; return nil }
func (n *fakeNetwork) Forget(context.Context, string) error           { n.forgotten++; return nil }
func (n *fakeNetwork) Node() sandboxnet.Node                          { return sandboxnet.Node{} }

// hostedSandbox is a running sandbox of the fake backend with a fake host
// and records in memory: no edge, no root.
func hostedSandbox(t *testing.T) (*Sandbox, *fakeHost, *records.Mem, *fake.Backend) {
	t.Helper()
	b, _ := fake.New(context.Background(), backend.Config{})
	be := b.(*fake.Backend)
	node := sandboxid.NewNodeID()
	rec := &records.Record{ID: sandboxid.New(node), Project: "root/team", State: records.StateRunning, CreatedAt: time.Now(), ExpiresAt: time.Now().Add(10 * time.Minute),
		LayerDir: "/layers/l-1", Spec: &sandboxv1.SandboxSpec{Backend: fake.Name, TimeoutSeconds: 600, Network: &sandboxv1.NetworkPolicy{}}}
	if _, err := be.Create(context.Background(), &backend.Spec{ID: rec.ID}); err != nil {
		t.Fatal(err)
	}
	h, store := &fakeHost{}, records.NewMem()
	sb := New(rec, be, Env{Node: node, Dir: t.TempDir(), PausedLifetime: time.Hour, Records: store, Expiry: h, Host: h, Net: &h.net, Disk: h, Log: testutil.Logger(t)})
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if err := sb.attachNetwork(context.Background()); err != nil || h.net.attached != 1 || sb.rec.NetAddr != "10.0.0.2" {
		t.Fatalf("attach its network: %v (attached %d, address %q)", err, h.net.attached, sb.rec.NetAddr)
	}
	return sb, h, store, be
}

// A sandbox owns its lifecycle: frozen, its time to live stands still and
// its paused lifetime runs (the expiry loop woken, the record saved, the
// view paused); resumed, its time to live goes on; failed, it gives back
// what it holds through its host once and keeps the reason. Without an
// edge or root.
func TestASandboxOwnsItsLifecycle(t *testing.T) {
	ctx := context.Background()
	sb, h, store, _ := hostedSandbox(t)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if err := sb.freeze(ctx); err != nil {
		t.Fatal(err)
	}
	left, until := sb.rec.TimeoutLeft, time.Until(sb.rec.ExpiresAt)
	if sb.rec.State != records.StatePaused || left < 9*time.Minute || left > 10*time.Minute || until < 59*time.Minute || until > time.Hour || h.wakes != 1 {
		t.Fatalf("frozen: state %s, time to live left %s, removed in %s, %d wakes", sb.rec.State, left, until, h.wakes)
	}
	if got, err := store.Get(sb.ID()); err != nil || got.State != records.StatePaused {
		t.Fatalf("its record: %v %v", got, err)
	}
	if sb.View().State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("its view: %v", sb.View().State)
	}
	sb.startClock()
	if until := time.Until(sb.rec.ExpiresAt); until < 9*time.Minute || until > 10*time.Minute || sb.rec.TimeoutLeft != 0 || h.wakes != 2 {
		t.Fatalf("resumed clock: ends in %s, %s left aside, %d wakes", until, sb.rec.TimeoutLeft, h.wakes)
	}

	sb.fail(ctx, "its agent stopped answering")
	if h.released != 1 || h.layersRemoved != 1 || h.net.detached != 1 {
		t.Fatalf("failed: released %d, layers removed %d, detached %d; want each once", h.released, h.layersRemoved, h.net.detached)
	}
	if got, err := store.Get(sb.ID()); err != nil || got.State != records.StateFailed || got.Message != "its agent stopped answering" {
		t.Fatalf("its record after the failure: %+v %v", got, err)
	}
	if sb.Ended().Err() == nil {
		t.Fatal("what is connected to its ports is not cut")
	}
}

// A sandbox whose remains the backend cannot remove stays counted (its
// host is not asked to release it), and its reason says so.
func TestAFailedSandboxThatCannotBeRemovedStaysCounted(t *testing.T) {
	sb, h, _, be := hostedSandbox(t)
	be.SetFailures(errors.New("device busy"), nil)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.fail(context.Background(), "it ended")
	if h.released != 0 || h.layersRemoved != 0 {
		t.Fatalf("released %d, layers removed %d; want nothing given back", h.released, h.layersRemoved)
	}
	if !strings.Contains(sb.rec.Message, "it ended; removing what it left failed (stop it to retry): device busy") {
		t.Fatalf("reason: %q", sb.rec.Message)
	}
}

// A sandbox takes a new time to live while paused (it starts when it is
// resumed), resumes itself, and removes itself: its backend's sandbox,
// its directory and its record go, its host forgets it once, and a
// removal that fails keeps its record, with the reason, to be retried.
func TestASandboxResumesAndRemovesItself(t *testing.T) {
	ctx := context.Background()
	sb, h, store, be := hostedSandbox(t)
	sb.mu.Lock()
	if err := sb.freeze(ctx); err != nil {
		t.Fatal(err)
	}
	sb.mu.Unlock()
	if _, err := sb.SetTimeout(30); err != nil {
		t.Fatal(err)
	}
	if sb.rec.TimeoutLeft != 30*time.Second || time.Until(sb.rec.ExpiresAt) < 59*time.Minute {
		t.Fatalf("a paused sandbox's new time to live: %s kept aside, removed in %s", sb.rec.TimeoutLeft, time.Until(sb.rec.ExpiresAt))
	}
	link, err := sb.EnsureRunning(ctx, true)
	if err == nil || link != nil || !strings.Contains(err.Error(), "no agent link") {
		t.Fatalf("a resumed sandbox without its agent: %v, %v", link, err)
	}
	if until := time.Until(sb.rec.ExpiresAt); sb.rec.State != records.StateRunning || until > 30*time.Second || until < 25*time.Second {
		t.Fatalf("resumed: %s, ends in %s", sb.rec.State, until)
	}

	be.SetFailures(errors.New("device busy"), nil)
	if err := sb.Destroy(ctx); err == nil || !strings.Contains(err.Error(), "device busy") {
		t.Fatalf("a removal the backend refuses: %v", err)
	}
	if got, err := store.Get(sb.ID()); err != nil || !strings.Contains(got.Message, "removal failed: device busy") || h.forgotten != 0 {
		t.Fatalf("after a failed removal: record %+v (%v), forgotten %d times", got, err, h.forgotten)
	}
	be.SetFailures(nil, nil)
	if err := sb.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Destroy(ctx); err != nil { // removed already: nothing to do
		t.Fatal(err)
	}
	if _, err := store.Get(sb.ID()); err == nil {
		t.Fatal("its record outlived it")
	}
	if _, err := os.Stat(sb.dir); !os.IsNotExist(err) {
		t.Fatalf("its directory: %v", err)
	}
	if h.forgotten != 1 || h.released != 1 || h.layersRemoved != 1 || h.net.detached != 1 || sb.Ended().Err() == nil {
		t.Fatalf("removed: forgotten %d, released %d, layers removed %d, detached %d, ports cut %v; want each once",
			h.forgotten, h.released, h.layersRemoved, h.net.detached, sb.Ended().Err() != nil)
	}
	if st, _ := be.Status(ctx, sb.ID()); st.Pid != 0 {
		t.Fatalf("the backend still has it: %+v", st)
	}
}

// A backend whose sandboxes take longer to start than a process (a guest
// booting under emulation) gives their agents longer: the edge waits for
// the longer of its own agent timeout and the backend's AgentWait, and its
// error says which it waited.
func TestAgentWaitIsTheLongerOfNodeAndBackend(t *testing.T) {
	log := testutil.Logger(t)
	for _, c := range []struct{ node, backend, want time.Duration }{
		{20 * time.Millisecond, 300 * time.Millisecond, 300 * time.Millisecond},
		{300 * time.Millisecond, 20 * time.Millisecond, 300 * time.Millisecond},
		{300 * time.Millisecond, 0, 300 * time.Millisecond},
	} {
		b, _ := fake.New(context.Background(), backend.Config{})
		be := b.(*fake.Backend)
		be.Knobs.AgentWait = c.backend
		node := sandboxid.NewNodeID()
		rec := &records.Record{ID: sandboxid.New(node), Project: "root", State: records.StateCreating, CreatedAt: time.Now(),
			Spec: &sandboxv1.SandboxSpec{Backend: fake.Name, TimeoutSeconds: 60}}
		h, dir := &fakeHost{}, t.TempDir()
		sb := New(rec, be, Env{Node: node, Dir: dir, AgentTimeout: c.node, Records: records.NewMem(), Expiry: h, Host: h, Disk: h, Log: log})
		link, err := agentlink.ListenAuthenticated(filepath.Join(dir, "edge.sock"), nil, log)
		if err != nil {
			t.Fatal(err)
		}
		sb.link = link
		began := time.Now()
		sb.mu.Lock()
		err = sb.running(context.Background(), false)
		sb.mu.Unlock()
		waited := time.Since(began)
		link.Close() //nolint:errcheck // a test's listener
		if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "did not connect within "+c.want.String()) || waited < c.want {
			t.Fatalf("node %v, backend %v: %v after %v; want unavailable after %v", c.node, c.backend, err, waited, c.want)
		}
	}
}

// A sandbox's ended context, which cuts what is connected to its ports, is
// done once it is removed, and once it failed: not before.
func TestEndedOnceRemovedOrFailed(t *testing.T) {
	ctx := context.Background()
	removed, _, _, _ := hostedSandbox(t)
	failed, _, _, _ := hostedSandbox(t)
	for _, sb := range []*Sandbox{removed, failed} {
		if sb.Ended().Err() != nil {
			t.Fatalf("a running sandbox's ended context is done: %v", sb.Ended().Err())
		}
	}
	if err := removed.Destroy(ctx); err != nil {
		t.Fatal(err)
	}
	failed.mu.Lock()
	failed.fail(ctx, "test")
	failed.mu.Unlock()
	for name, sb := range map[string]*Sandbox{"removed": removed, "failed": failed} {
		select {
		case <-sb.Ended().Done():
		default:
			t.Errorf("the %s sandbox's ended context is not done", name)
		}
	}
}

// A pool's networked sandbox takes the claiming create's policy; one
// without an attachment is refused.
func TestClaimNetworkAppliesTheCreatesPolicy(t *testing.T) {
	sb, h, _, _ := hostedSandbox(t)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	want := &sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{{Cidr: "192.0.2.0/24", Protocol: "tcp", Ports: []string{"443"}}}}
	if err := sb.claimNetwork(context.Background(), want); err != nil {
		t.Fatal(err)
	}
	if len(h.net.updated) != 1 || len(h.net.updated[0].Rules) != 1 || h.net.updated[0].Internet {
		t.Fatalf("policies applied: %+v", h.net.updated)
	}
	sb.net = nil
	if err := sb.claimNetwork(context.Background(), want); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("a claim of a sandbox without an attachment: %v", err)
	}
}

func TestMayPassOnRetry(t *testing.T) {
	for err, want := range map[error]bool{
		errors.New("runsc restore: exit status 128"):       true,
		errdefs.Unavailable("agent did not come back"):     true,
		errdefs.ResourceExhausted("no memory now"):         true,
		errdefs.NotFound("snapshot gone"):                  false,
		errdefs.FailedPrecondition("another runtime"):      false,
		errdefs.Unsupported("a network this runsc cannot"): false,
	} {
		if got := mayPassOnRetry(err); got != want {
			t.Errorf("mayPassOnRetry(%v) = %v, want %v", err, got, want)
		}
	}
}

package edge

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/fake"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// fakeHost is an edge as a sandbox reaches it, counting what it is asked.
type fakeHost struct {
	wakes, released, layersRemoved, detached int
	lifetime                                 time.Duration
}

func (h *fakeHost) wakeExpiry()                                   { h.wakes++ }
func (h *fakeHost) pausedLifetime() time.Duration                 { return h.lifetime }
func (h *fakeHost) release(*sandbox)                              { h.released++ }
func (h *fakeHost) removeLayer(dir string) error                  { h.layersRemoved++; return nil }
func (h *fakeHost) detachNetwork(context.Context, *sandbox) error { h.detached++; return nil }

// hostedSandbox is a running sandbox of the fake backend with a fake host
// and records in memory: no edge, no root.
func hostedSandbox(t *testing.T) (*sandbox, *fakeHost, *memRecords, *fake.Backend) {
	t.Helper()
	b, _ := fake.New(context.Background(), backend.Config{})
	be := b.(*fake.Backend)
	node := sandboxid.NewNodeID()
	rec := &record{ID: sandboxid.New(node), Project: "root/team", State: stateRunning, CreatedAt: time.Now(), ExpiresAt: time.Now().Add(10 * time.Minute),
		LayerDir: "/layers/l-1", spec: &sandboxv1.SandboxSpec{Backend: fake.Name, TimeoutSeconds: 600}}
	if _, err := be.Create(context.Background(), &backend.Spec{ID: rec.ID}); err != nil {
		t.Fatal(err)
	}
	h, store := &fakeHost{lifetime: time.Hour}, newMemRecords()
	return makeSandbox(rec, be, sandboxEnv{node: node, dir: t.TempDir(), records: store, host: h, log: testutil.Logger(t)}), h, store, be
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
	if sb.rec.State != statePaused || left < 9*time.Minute || left > 10*time.Minute || until < 59*time.Minute || until > time.Hour || h.wakes != 1 {
		t.Fatalf("frozen: state %s, time to live left %s, removed in %s, %d wakes", sb.rec.State, left, until, h.wakes)
	}
	if got, err := store.Get(sb.id); err != nil || got.State != statePaused {
		t.Fatalf("its record: %v %v", got, err)
	}
	if sb.published().State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("its view: %v", sb.published().State)
	}
	sb.startClock()
	if until := time.Until(sb.rec.ExpiresAt); until < 9*time.Minute || until > 10*time.Minute || sb.rec.TimeoutLeft != 0 || h.wakes != 2 {
		t.Fatalf("resumed clock: ends in %s, %s left aside, %d wakes", until, sb.rec.TimeoutLeft, h.wakes)
	}

	sb.fail(ctx, "its agent stopped answering")
	if h.released != 1 || h.layersRemoved != 1 || h.detached != 1 {
		t.Fatalf("failed: released %d, layers removed %d, detached %d; want each once", h.released, h.layersRemoved, h.detached)
	}
	if got, err := store.Get(sb.id); err != nil || got.State != stateFailed || got.Message != "its agent stopped answering" {
		t.Fatalf("its record after the failure: %+v %v", got, err)
	}
	if sb.ended.Err() == nil {
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

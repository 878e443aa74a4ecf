// Package fake is a backend for control-plane tests, in the manner of
// nomad's mock driver: a real agent (aether, in-process) serves each
// "sandbox", but processes run on the host without isolation. Knobs inject
// latency and failures. Never register it in a production binary.
package fake

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/opendsec/opendsec/internal/aether"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Name is the backend's name.
const Name = "fake"

// Knobs change the fake's behaviour; set them before use.
type Knobs struct {
	CreateDelay time.Duration
	FailCreate  error
	FailStart   error
	// FailRestoreAfter makes Restore fail after this many successes (0: never).
	FailRestoreAfter int
	// FailNextRestores makes the next this many Restores fail, as a
	// starved host's runtime can, and the ones after succeed.
	FailNextRestores int
	// FailRecover makes Recover fail, as for a sandbox that died while the
	// edge was down.
	FailRecover error
	// StuckForGood makes Continue leave a Hang in place.
	StuckForGood bool
	// FailRelease makes Release fail with it, leaving the sandbox running.
	FailRelease error
	// ConcurrentCalls is the backend's Capabilities.ConcurrentCalls.
	ConcurrentCalls int
	// DiskFile is the backend's Capabilities.DiskFile (a VM's disk).
	DiskFile bool
	// MinMemoryMB is the backend's Capabilities.MinMemoryMB.
	MinMemoryMB int64
	// AgentWait is the backend's Capabilities.AgentWait.
	AgentWait time.Duration
	// SnapshotStops makes Snapshot stop the sandbox, as Debian's runsc's
	// checkpoint does (the caller must restore it).
	SnapshotStops bool
	// PauseGate, if set, is received from at the start of each Pause and
	// Snapshot, so a test holds a pause under way (a checkpoint takes
	// seconds) until it sends or closes.
	PauseGate chan struct{}
	// FromTemplate makes Create say it restored a template (Handle.Restored):
	// the agent starts with only a PATH, and the sandbox's environment
	// reaches it in its first request or not at all.
	FromTemplate bool
	// DestroyGate, if set, is received from at the start of each Destroy,
	// so a test holds a removal under way until it sends or closes.
	DestroyGate chan struct{}
	// GuestReport is what GuestReport says of every sandbox, as a VM
	// backend's hypervisor reports its guest.
	GuestReport string
}

// waitGate waits for the PauseGate knob, if set.
func (b *Backend) waitGate(ctx context.Context) error {
	if b.Knobs.PauseGate == nil {
		return nil
	}
	select {
	case <-b.Knobs.PauseGate:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// running holds the agents of every fake sandbox in this process by sandbox
// id. Like a real sandbox, an agent outlives the Backend value that started
// it, so a second Backend (an "edge restart") re-attaches to it. This is
// shared state on purpose, and only in this test backend.
var running sync.Map // sandboxid.ID -> *box

// agentKeys is the memory of each sandbox's in-process agent that outlives
// it: the key its link gave it (agentlink/auth.go), which a real agent
// keeps through an edge restart and carries in its snapshots.
var agentKeys sync.Map // sandboxid.ID -> string

// Backend is the fake backend.
type Backend struct {
	Knobs Knobs

	mu       sync.Mutex
	boxes    map[sandboxid.ID]*box // guarded by mu
	restores int                   // guarded by mu
	// Failures a test sets while sandboxes run (SetFailures).
	failDestroy, failSnapshot error                          // guarded by mu
	usage                     map[sandboxid.ID]backend.Usage // guarded by mu; SetUsage
}

// SetUsage sets what Usage reports for id.
func (b *Backend) SetUsage(id sandboxid.ID, u backend.Usage) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.usage == nil {
		b.usage = map[sandboxid.ID]backend.Usage{}
	}
	b.usage[id] = u
}

// Usage reports what SetUsage set (zero until then).
func (b *Backend) Usage(id sandboxid.ID) (backend.Usage, error) {
	if _, err := b.get(id); err != nil {
		return backend.Usage{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.usage[id], nil
}

// SetFailures makes Destroy fail and leave the sandbox in place
// (destroy), and Snapshot fail after stopping its source, as runsc does
// when a checkpoint fails (snapshot); nil for either restores it. Unlike
// Knobs, they may change while sandboxes run.
func (b *Backend) SetFailures(destroy, snapshot error) {
	b.mu.Lock()
	b.failDestroy, b.failSnapshot = destroy, snapshot
	b.mu.Unlock()
}

func (b *Backend) failures() (destroy, snapshot error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.failDestroy, b.failSnapshot
}

type box struct {
	spec   *backend.Spec
	state  backend.State
	cancel context.CancelFunc
	done   chan struct{}
	gate   *gate
	agent  *aether.Agent // nil until launched
	// template says the agent starts with a template's environment.
	template bool
}

// gate blocks agent requests while the sandbox is paused.
type gate struct {
	mu     sync.Mutex
	paused chan struct{} // guarded by mu; non-nil while paused
}

func (g *gate) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g.mu.Lock()
		ch := g.paused
		g.mu.Unlock()
		if ch != nil {
			select {
			case <-ch:
			case <-r.Context().Done():
				return
			}
		}
		h.ServeHTTP(w, r)
	})
}

var (
	_ backend.Backend       = (*Backend)(nil)
	_ backend.Pauser        = (*Backend)(nil)
	_ backend.Snapshotter   = (*Backend)(nil)
	_ backend.Continuer     = (*Backend)(nil)
	_ backend.GuestReporter = (*Backend)(nil)
	_ backend.Releaser      = (*Backend)(nil)
)

// Options are the fake backend's options.
type Options struct {
	// CreateDelay sets Knobs.CreateDelay, for tests that run the fake
	// through a whole cluster.
	CreateDelay time.Duration `option:"create_delay"`
}

// New returns a fake backend.
func New(ctx context.Context, cfg backend.Config) (backend.Backend, error) {
	var o Options
	if err := backend.DecodeOptions(Name, cfg.Options, &o); err != nil {
		return nil, err
	}
	b := &Backend{boxes: map[sandboxid.ID]*box{}}
	b.Knobs.CreateDelay = o.CreateDelay
	return b, nil
}

// Name returns "fake".
func (b *Backend) Name() string { return Name }

// Capabilities: everything.
func (b *Backend) Capabilities() backend.Capabilities {
	return backend.Capabilities{Isolation: "none", Pause: true, Snapshot: true, ConcurrentCalls: b.Knobs.ConcurrentCalls, DiskFile: b.Knobs.DiskFile, MinMemoryMB: b.Knobs.MinMemoryMB, AgentWait: b.Knobs.AgentWait}
}

// Probe always succeeds.
func (b *Backend) Probe(ctx context.Context) error { return nil }

// Create records the sandbox.
func (b *Backend) Create(ctx context.Context, spec *backend.Spec) (*backend.Handle, error) {
	if b.Knobs.CreateDelay > 0 {
		select {
		case <-time.After(b.Knobs.CreateDelay):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if b.Knobs.FailCreate != nil {
		return nil, b.Knobs.FailCreate
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.boxes[spec.ID] = &box{spec: spec, state: backend.StateCreated, gate: &gate{}, template: b.Knobs.FromTemplate}
	state, _ := json.Marshal(spec)
	return &backend.Handle{ID: spec.ID, Backend: Name, Version: 1, State: state, Restored: b.Knobs.FromTemplate}, nil
}

func (b *Backend) get(id sandboxid.ID) (*box, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	bx, ok := b.boxes[id]
	if !ok {
		return nil, errdefs.NotFound("fake sandbox %s: unknown", id)
	}
	return bx, nil
}

// Start runs an in-process agent that dials the sandbox's edge socket.
func (b *Backend) Start(ctx context.Context, id sandboxid.ID) error {
	if b.Knobs.FailStart != nil {
		return b.Knobs.FailStart
	}
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	b.launch(bx)
	return nil
}

func (b *Backend) launch(bx *box) {
	env := map[string]string{}
	spec := bx.spec.Env
	if bx.template {
		env["PATH"], spec = os.Getenv("PATH"), nil
	}
	for _, kv := range spec {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	key, _ := agentKeys.Load(bx.spec.ID)
	k, _ := key.(string)
	a := aether.New(aether.Config{EdgeSocket: filepath.Join(bx.spec.RunDir, "edge.sock"), Env: env, Root: "/", AuthenticateLink: true, LinkKey: k}, nil)
	a.Wrap = bx.gate.wrap
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		a.Run(ctx)
		if k := a.LinkKey(); k != "" {
			agentKeys.Store(bx.spec.ID, k)
		}
		close(done)
	}()
	b.mu.Lock()
	bx.cancel, bx.done, bx.state, bx.agent = cancel, done, backend.StateRunning, a
	b.mu.Unlock()
	running.Store(bx.spec.ID, bx)
}

func (b *Backend) halt(bx *box) {
	running.CompareAndDelete(bx.spec.ID, bx)
	b.mu.Lock()
	cancel, done := bx.cancel, bx.done
	bx.cancel, bx.state = nil, backend.StateStopped
	b.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// Stop stops the agent.
func (b *Backend) Stop(ctx context.Context, id sandboxid.ID, grace time.Duration) error {
	bx, err := b.get(id)
	if err != nil {
		return nil
	}
	b.resumeGate(bx)
	b.halt(bx)
	return nil
}

// Destroy stops and forgets.
func (b *Backend) Destroy(ctx context.Context, id sandboxid.ID) error {
	if g := b.Knobs.DestroyGate; g != nil {
		select {
		case <-g:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if err, _ := b.failures(); err != nil {
		return err
	}
	bx, err := b.get(id)
	if err != nil {
		return nil
	}
	b.resumeGate(bx)
	b.halt(bx)
	b.mu.Lock()
	delete(b.boxes, id)
	b.mu.Unlock()
	return nil
}

// Status reports the recorded state.
func (b *Backend) Status(ctx context.Context, id sandboxid.ID) (backend.Status, error) {
	bx, err := b.get(id)
	if err != nil {
		return backend.Status{ID: id, State: backend.StateStopped}, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return backend.Status{ID: id, State: bx.state, Pid: os.Getpid()}, nil
}

// Recover re-attaches to the sandbox's agent if it still runs in this
// process, and starts a new one otherwise (the edge process restarted, and
// an in-process sandbox cannot outlive it).
func (b *Backend) Recover(ctx context.Context, h *backend.Handle, spec *backend.Spec) error {
	if b.Knobs.FailRecover != nil {
		// Like a real backend, it still knows the sandbox, so the edge's
		// Destroy removes what is left of it.
		if v, ok := running.Load(h.ID); ok {
			b.mu.Lock()
			b.boxes[h.ID] = v.(*box)
			b.mu.Unlock()
		}
		return b.Knobs.FailRecover
	}
	if v, ok := running.Load(h.ID); ok {
		b.mu.Lock()
		b.boxes[h.ID] = v.(*box)
		b.mu.Unlock()
		return nil
	}
	bx := &box{spec: spec, gate: &gate{}}
	if _, ok := released.Load(h.ID); ok {
		bx.state = backend.StateStopped
		b.mu.Lock()
		b.boxes[h.ID] = bx
		b.mu.Unlock()
		return errdefs.FailedPrecondition("fake sandbox %s was released after a checkpoint", h.ID)
	}
	b.mu.Lock()
	b.boxes[h.ID] = bx
	b.mu.Unlock()
	b.launch(bx)
	return nil
}

// Pause blocks agent requests until Resume.
func (b *Backend) Pause(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	if err := b.waitGate(ctx); err != nil {
		return err
	}
	bx.gate.mu.Lock()
	if bx.gate.paused == nil {
		bx.gate.paused = make(chan struct{})
	}
	bx.gate.mu.Unlock()
	b.mu.Lock()
	bx.state = backend.StatePaused
	b.mu.Unlock()
	return nil
}

// Resume lets requests through again.
func (b *Backend) Resume(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	b.resumeGate(bx)
	b.mu.Lock()
	if bx.state == backend.StatePaused {
		bx.state = backend.StateRunning
	}
	b.mu.Unlock()
	return nil
}

func (b *Backend) resumeGate(bx *box) {
	bx.gate.mu.Lock()
	if bx.gate.paused != nil {
		close(bx.gate.paused)
		bx.gate.paused = nil
	}
	bx.gate.mu.Unlock()
}

// Snapshot writes a marker file; the fake has no memory to capture.
func (b *Backend) Snapshot(ctx context.Context, id sandboxid.ID, ref backend.SnapshotRef) (*backend.SnapshotInfo, error) {
	bx, err := b.get(id)
	if err != nil {
		return nil, err
	}
	if err := b.waitGate(ctx); err != nil {
		return nil, err
	}
	if _, err := b.failures(); err != nil {
		b.halt(bx)
		return &backend.SnapshotInfo{Stopped: true}, err
	}
	if err := os.WriteFile(filepath.Join(ref.Dir, "fake-snapshot"), []byte(id), 0o600); err != nil {
		return nil, err
	}
	b.mu.Lock()
	a := bx.agent
	b.mu.Unlock()
	if a != nil { // its memory: the key its copies present
		if err := os.WriteFile(filepath.Join(ref.Dir, "fake-agent-key"), []byte(a.LinkKey()), 0o600); err != nil {
			return nil, err
		}
	}
	if b.Knobs.SnapshotStops {
		b.halt(bx)
		return &backend.SnapshotInfo{SizeBytes: int64(len(id)), Stopped: true}, nil
	}
	return &backend.SnapshotInfo{SizeBytes: int64(len(id))}, nil
}

// Release implements backend.Releaser: the agent stops (the fake's
// sandbox has no memory to give back).
func (b *Backend) Release(ctx context.Context, id sandboxid.ID) error {
	if b.Knobs.FailRelease != nil {
		return b.Knobs.FailRelease
	}
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	b.halt(bx)
	released.Store(id, true)
	return nil
}

// released holds the ids Release ended: like a real checkpointed sandbox,
// nothing of it runs until a Restore, also after a Recover.
var released sync.Map

// Restore starts a new sandbox (with a fresh agent).
func (b *Backend) Restore(ctx context.Context, ref backend.SnapshotRef, spec *backend.Spec) (*backend.Handle, error) {
	if _, err := os.Stat(filepath.Join(ref.Dir, "fake-snapshot")); err != nil {
		return nil, fmt.Errorf("fake restore: %w", err)
	}
	b.mu.Lock()
	b.restores++
	n := b.restores
	transient := b.Knobs.FailNextRestores > 0
	if transient {
		b.Knobs.FailNextRestores--
	}
	b.mu.Unlock()
	if transient {
		return nil, errdefs.Unavailable("fake restore: injected transient failure")
	}
	if b.Knobs.FailRestoreAfter > 0 && n > b.Knobs.FailRestoreAfter {
		return nil, errdefs.ResourceExhausted("fake restore: injected failure after %d restores", b.Knobs.FailRestoreAfter)
	}
	released.Delete(spec.ID)
	if key, err := os.ReadFile(filepath.Join(ref.Dir, "fake-agent-key")); err == nil && len(key) > 0 {
		agentKeys.Store(spec.ID, string(key))
	}
	h, err := b.Create(ctx, spec)
	if err != nil {
		return nil, err
	}
	if err := b.Start(ctx, spec.ID); err != nil {
		return nil, errors.Join(err, b.Destroy(ctx, spec.ID))
	}
	return h, nil
}

// Crash ends a sandbox as if its agent died: the agent stops (closing its
// connection) and Status reports it stopped.
func (b *Backend) Crash(id sandboxid.ID) {
	if bx, err := b.get(id); err == nil {
		b.resumeGate(bx)
		b.halt(bx)
	}
}

// Hang holds every request to the sandbox's agent, as a stuck agent would,
// while Status still reports it running.
func (b *Backend) Hang(id sandboxid.ID) {
	if bx, err := b.get(id); err == nil {
		bx.gate.mu.Lock()
		if bx.gate.paused == nil {
			bx.gate.paused = make(chan struct{})
		}
		bx.gate.mu.Unlock()
	}
}

// GuestReport implements backend.GuestReporter with the knob of that
// name.
func (b *Backend) GuestReport(ctx context.Context, id sandboxid.ID) string {
	return b.Knobs.GuestReport
}

// Continue lifts a Hang, as SIGCONT wakes a stopped agent.
func (b *Backend) Continue(ctx context.Context, id sandboxid.ID) error {
	if b.Knobs.StuckForGood {
		return nil
	}
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	b.resumeGate(bx)
	return nil
}

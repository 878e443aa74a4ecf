package edge

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// sandbox is the edge's live view of one sandbox. Lock order: sandbox.mu
// before the registry's (removal unregisters while holding its sandbox's
// lock), so no code may take a sandbox's lock while holding the registry's.
type sandbox struct {
	id   sandboxid.ID
	node sandboxid.NodeID
	dir  string
	// runDir holds its agent's socket (Config.RunBase; kept short for
	// the socket's path).
	runDir string
	// agentTimeout is how long its agent has to connect (or, re-attached,
	// answer).
	agentTimeout time.Duration
	// pausedLifetime is how long it is kept paused.
	pausedLifetime time.Duration
	be             backend.Backend
	proj           string // immutable
	// records is where save writes rec (the edge's record store).
	records records.Store
	// expiry is the node's expiry loop, told of a new deadline.
	expiry poker
	// host is what it reaches of the edge that runs it.
	host host
	// parts is what it is started from (images, layers, the agent); nil
	// in tests of a sandbox without an edge.
	parts *parts
	log   *slog.Logger // the edge's, with its id

	// view is the latest published description. Readers (Get, List,
	// Status) use it without the lifecycle lock, so a slow create or removal
	// never stalls the watcher.
	view atomic.Pointer[sandboxv1.Sandbox]

	mu   sync.Mutex       // serialises lifecycle changes
	rec  *records.Record  // guarded by mu
	link *agentlink.Link  // guarded by mu; nil once removed
	net  *sandboxnet.Link // guarded by mu; its network attachment, if any
	// nodeNet is the node's sandbox network it attaches to (nil: the
	// node runs without one, and nodeNetOff says why).
	nodeNet    sandboxNetwork
	nodeNetOff string
	// disk is the node's disk room its checkpoints are written into.
	disk diskReserver
	// released is set once, under mu, when its capacity is given back (it
	// failed and nothing of it is left); Status reads it without mu.
	released atomic.Bool
	removed  bool // guarded by mu; nothing of it is left
	// relink is set, under mu, for a VM the edge re-attached while it was
	// stopped (recover.go): its guest did not see the link go, and may
	// answer the new edge on its old session; its next resume waits for
	// the agent to serve.
	relink    bool
	compacted time.Time // guarded by mu; last compaction (compact.go)
	// downSince is when the health loop first saw its agent's link down,
	// if the link cannot say (guarded by mu).
	downSince time.Time
	// compacting is set while a compaction is started or running.
	compacting atomic.Bool
	// expiring is set while the expiry loop removes it.
	expiring atomic.Bool
	// pausing is set, under mu, for the whole of a pause: readers see it
	// paused from its start (a checkpoint takes seconds), and calls that
	// must not resume it are refused at once instead of waiting on mu.
	pausing atomic.Bool

	// limits counts what its limits did inside it (limitevents.go).
	limits limitCounts

	// calls counts agent calls in flight; lastCallEnd is when the last one
	// ended (unix nanoseconds). Compaction waits for quiet.
	calls       atomic.Int64
	slots       chan struct{} // its unary calls in flight (callgate.go)
	callTimes   callTimes     // how long they hold a slot (callgate.go)
	lastCallEnd atomic.Int64
	// lastAnswered is when a call the agent answered last ended.
	lastAnswered atomic.Int64
	// started is when the sandbox last became running (unix nanoseconds).
	started atomic.Int64
	hb      heartbeatState
	metrics metricsRing // its recorded use (metrics.go)
	// admitSeq is the usage change that counted it (registry.seq); set
	// once, under the registry's lock, before anyone else sees the sandbox.
	admitSeq uint64
	// ended is done once the sandbox failed or was removed: what is
	// connected to its ports is cut then, not left to TCP's keepalive
	// (a VM's or gVisor's network stack ends without a FIN).
	ended context.Context
	end   context.CancelFunc
}

// host is what a sandbox reaches of the edge that runs it; the rest of
// its lifecycle is its own.
type host interface {
	// release gives back what sb was admitted with, once.
	release(sb *sandbox)
	// removeLayer removes a writable layer the node made.
	removeLayer(dir string) error
	// forget unregisters a removed sb and releases its capacity.
	forget(sb *sandbox)
}

func (e *Edge) removeLayer(dir string) error { return e.parts.removeLayer(dir) }

// newSandbox is the sandbox of rec on backend be, on this edge.
func (e *Edge) newSandbox(rec *records.Record, be backend.Backend) *sandbox {
	return makeSandbox(rec, be, sandboxEnv{node: e.node, dir: e.dirs.sandbox(rec.ID), runDir: e.dirs.run(rec.ID), agentTimeout: e.cfg.AgentTimeout, pausedLifetime: e.cfg.PausedLifetime, net: asSandboxNetwork(e.net), netOff: e.netOff, disk: e.disk, records: e.records, expiry: e.expiry, host: e, parts: &e.parts, log: e.log})
}

// sandboxEnv is where a sandbox lives and what it reaches.
type sandboxEnv struct {
	node   sandboxid.NodeID
	dir    string // its directory
	runDir string // its run directory (the agent's socket)
	// agentTimeout is how long its agent has to connect or answer: the
	// node's, or its backend's AgentWait if longer.
	agentTimeout time.Duration
	// pausedLifetime is how long it is kept paused.
	pausedLifetime time.Duration
	// net is the node's sandbox network; nil without one, and netOff
	// says why.
	net     sandboxNetwork
	netOff  string
	disk    diskReserver // the node's disk room (diskroom.go)
	records records.Store
	expiry  poker // the node's expiry loop, told of a new deadline
	host    host
	parts   *parts
	log     *slog.Logger
}

// poker is told that something it watches changed.
type poker interface{ poke() }

// makeSandbox is the sandbox of rec on backend be in env.
func makeSandbox(rec *records.Record, be backend.Backend, env sandboxEnv) *sandbox {
	caps := be.Capabilities()
	sb := &sandbox{id: rec.ID, node: env.node, dir: env.dir, runDir: env.runDir, agentTimeout: max(env.agentTimeout, caps.AgentWait), pausedLifetime: env.pausedLifetime, nodeNet: env.net, nodeNetOff: env.netOff, disk: env.disk, be: be, proj: rec.Project, rec: rec, records: env.records, expiry: env.expiry, host: env.host, parts: env.parts,
		log: env.log.With(logging.SandboxID, rec.ID), slots: callSlots(caps.ConcurrentCalls, rec.Spec.GetResources().GetOpenFiles())}
	sb.ended, sb.end = context.WithCancel(context.Background())
	sb.view.Store(rec.Proto(env.node))
	return sb
}

func (sb *sandbox) project() string { return sb.proj }

// callStarted and callEnded bracket an agent call.
func (sb *sandbox) callStarted() { sb.calls.Add(1) }

// callEnded ends a call; answered says the agent answered it (a call that
// timed out or lost its connection is no sign of the agent's life, for
// the heartbeat).
func (sb *sandbox) callEnded(answered bool) {
	now := time.Now().UnixNano()
	sb.lastCallEnd.Store(now)
	if answered {
		sb.lastAnswered.Store(now)
	}
	sb.calls.Add(-1)
}

// lastCall is when the last agent call ended (zero if none did).
func (sb *sandbox) lastCall() time.Time {
	if n := sb.lastCallEnd.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// published is the sandbox's published description (its API view; not
// to be confused with a snapshot of its memory); callers must not modify it.
func (sb *sandbox) published() *sandboxv1.Sandbox {
	v := sb.view.Load()
	if le := sb.limits.proto(); le != nil && v != nil {
		v = proto.Clone(v).(*sandboxv1.Sandbox)
		v.LimitEvents = le
	}
	return v
}

// markCheckpoint records (dir) or clears ("") the checkpoint being taken
// of sb, so an edge that goes down meanwhile can bring it back from
// there. Callers hold sb.mu.
func (sb *sandbox) markCheckpoint(dir string) error {
	if sb.rec.Checkpoint == dir {
		return nil
	}
	sb.rec.Checkpoint = dir
	return sb.save()
}

// save persists the record and publishes it. Callers hold sb.mu.
func (sb *sandbox) save() error {
	err := sb.records.Put(sb.rec)
	sb.publish()
	return err
}

// publish stores the record's description as the view; while a pause is
// under way a running sandbox is shown paused. Callers hold sb.mu.
func (sb *sandbox) publish() {
	v := sb.rec.Proto(sb.node)
	if sb.pausing.Load() && v.State == sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		v.State = sandboxv1.SandboxState_SANDBOX_STATE_PAUSED
	}
	sb.view.Store(v)
}

// beginPause marks sb pausing and publishes it so; the returned func ends
// the mark (a nested pause's is a no-op) and publishes the record as it
// then is, paused or, if the pause failed, as it was. Callers hold sb.mu
// from beginPause until the returned func has run.
func (sb *sandbox) beginPause() (end func()) {
	if !sb.pausing.CompareAndSwap(false, true) {
		return func() {}
	}
	sb.publish()
	return func() {
		sb.pausing.Store(false)
		sb.publish()
	}
}

// Create admits, prepares and starts a sandbox, and returns once its agent
// is connected. On any failure nothing of it is left behind.
func (e *Edge) Create(ctx context.Context, spec *sandboxv1.SandboxSpec, project string) (*sandboxv1.Sandbox, error) {
	return e.CreateFor(ctx, spec, project, "")
}

// CreateFor is Create for an apiserver's quota reservation, which the
// sandbox records (FenceReservation finds it by it).
func (e *Edge) CreateFor(ctx context.Context, spec *sandboxv1.SandboxSpec, project, reservation string) (*sandboxv1.Sandbox, error) {
	if err := sandboxspec.Normalize(spec, e.cfg.Limits, e.backends.known()); err != nil {
		return nil, err
	}
	if project == "" {
		return nil, errdefs.InvalidArgument("project: empty")
	}
	be, err := e.backends.get(spec.Backend)
	if err != nil {
		return nil, err
	}
	if least := be.Capabilities().MinMemoryMB; spec.Resources.MemoryMb < least {
		return nil, errdefs.InvalidArgument("resources.memory_mb %d: backend %q needs at least %d (its guest kernel and agent)", spec.Resources.MemoryMb, be.Name(), least)
	}
	if err := checkPolicy(asSandboxNetwork(e.net), "network.rules", spec.Network); err != nil {
		return nil, err
	}
	im, err := e.parts.resolve(spec.Image, project)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	rec := &records.Record{ID: sandboxid.New(e.node), Project: project, State: records.StateCreating, CreatedAt: now, ImageDigest: im.Digest.String(), Reservation: reservation}
	if !be.Capabilities().LinkBeforeAgent {
		rec.AgentKey = agentlink.NewKey()
	}
	if err := rec.SetSpec(spec); err != nil {
		return nil, err
	}
	sb, err := e.admit(rec, be)
	if err != nil {
		return nil, err
	}
	log := e.log.With(logging.SandboxID, rec.ID, logging.Backend, be.Name())
	if err := sb.start(ctx, im); err != nil {
		if cerr := sb.discard(context.WithoutCancel(ctx)); cerr != nil {
			log.Error("clean up a sandbox that failed to start", logging.Error, cerr)
		}
		return nil, err
	}
	log.Info("sandbox started", logging.Project, project, logging.Image, spec.Image, "took", time.Since(now).Round(time.Millisecond))
	return sb.published(), nil
}

// admit reserves capacity for rec and registers its sandbox.
func (e *Edge) admit(rec *records.Record, be backend.Backend) (*sandbox, error) {
	sb := e.newSandbox(rec, be)
	if err := e.reg.admit(sb, rec.Reservation, e.diskOf(be, rec.Spec.Resources)); err != nil {
		sb.end()
		return nil, err
	}
	return sb, nil
}

// forget unregisters sb and releases its capacity.
func (e *Edge) forget(sb *sandbox) {
	e.release(sb)
	e.reg.forget(sb)
}

// release gives back what sb was admitted with, once. Callers hold sb.mu.
func (e *Edge) release(sb *sandbox) {
	e.reg.release(sb, e.diskOf(sb.be, sb.rec.Spec.Resources))
}

// diskOf is what a sandbox's disk limit takes from the node's disk: its
// disk_mb if its backend keeps the writable layer (or a VM's disk) there.
func (e *Edge) diskOf(be backend.Backend, r *sandboxv1.Resources) int64 {
	caps := be.Capabilities()
	if (e.parts.layers == nil || !caps.DiskLayer) && !caps.DiskFile {
		return 0
	}
	return r.DiskMb
}

// resolvConf replaces the image's (which names its build host's
// resolver): a sandbox without a network has no name server; one with a
// network asks the node's DNS proxy on its gateway.
const resolvConf = "# OpenDsec: this sandbox has no network access, so no name server.\noptions timeout:1 attempts:1\n"

// resolvConf is sb's resolv.conf. Callers hold sb.mu.
func (sb *sandbox) resolvConf() string {
	if sb.rec.Spec.Network == nil || sb.nodeNet == nil {
		return resolvConf
	}
	return fmt.Sprintf("# OpenDsec: the node's DNS proxy answers the names this sandbox's network policy allows.\nnameserver %s\noptions timeout:2 attempts:2\n", sb.nodeNet.Node().DNS.Addr())
}

// prepareDir makes the sandbox directory, its run directory, hosts file and
// the agent link. Callers hold sb.mu.
func (sb *sandbox) prepareDir() (*agentlink.Link, error) {
	rec, dir := sb.rec, sb.dir
	for _, d := range []string{dir, sb.runDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, err
		}
	}
	// hosts and resolv.conf live in the run directory, on the run base, so
	// the sandbox's mountinfo names no path on the node's disk.
	hosts := fmt.Sprintf("127.0.0.1\tlocalhost %s\n::1\tlocalhost ip6-localhost ip6-loopback\n", rec.ID)
	if err := os.WriteFile(filepath.Join(sb.runDir, "hosts"), []byte(hosts), 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(sb.runDir, "resolv.conf"), []byte(sb.resolvConf()), 0o644); err != nil {
		return nil, err
	}
	// The sandbox's boot id, for runtimes whose /proc has none (Debian's
	// runsc: the gvisor backend mounts it where compat/gvisor reads it).
	// Kept across edge restarts.
	if bootID := filepath.Join(sb.runDir, "boot_id"); !fileExists(bootID) {
		if err := os.WriteFile(bootID, []byte(newUUID()+"\n"), 0o644); err != nil {
			return nil, err
		}
	}
	if err := sb.save(); err != nil {
		return nil, err
	}
	var auth *agentlink.Auth
	if rec.AgentKey != "" {
		// A sandbox that ran, and a copy (its agent is its source's), has
		// an agent with the key; a new one still being created gives it to
		// its first connection. (One that never ran is removed at the
		// edge's restart, so a restart never hands the key out again.)
		auth = &agentlink.Auth{Key: rec.AgentKey, Issued: rec.State != records.StateCreating || rec.SourceSnapshot != ""}
	}
	return agentlink.ListenAuthenticated(filepath.Join(sb.runDir, "edge.sock"), auth, sb.log)
}

// start makes a new sandbox's directory, layer and network and starts it
// from im, until its agent answers.
func (sb *sandbox) start(ctx context.Context, im *image.Image) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	rec := sb.rec
	link, err := sb.prepareDir()
	if err != nil {
		return err
	}
	sb.link = link
	layers, err := sb.parts.cache.Layers(ctx, im, nil)
	if err != nil {
		return fmt.Errorf("image %s: %w", rec.Spec.Image, err)
	}
	if sb.be.Capabilities().DiskLayer {
		// The layer is recorded before the backend uses it: after a crash
		// between the two, the removal finds it (and a layer no record
		// names is removed at the next start).
		if rec.LayerDir, err = sb.parts.layers.Create(ctx, rec.Spec.Resources.DiskMb); err != nil {
			return err
		}
		// A layer is its own file system, or it bounds nothing.
		if ok, _ := rootfs.IsMountPoint(rec.LayerDir); !ok {
			return errdefs.Unavailable("writable layer %s is not mounted; its size limit would not hold", rec.LayerDir)
		}
		if err := sb.save(); err != nil {
			return err
		}
	}
	if err := sb.parts.ensureAgentStaged(); err != nil {
		return err
	}
	if err := sb.attachNetwork(ctx); err != nil {
		return err
	}
	bspec := sb.parts.backendSpec(rec, sb.dir, sb.runDir, layers, im.Config.Config)
	if sb.net != nil {
		bspec.NetNS = sb.net.NetNS
	}
	bspec.MachineID = newMachineID()
	h, err := sb.be.Create(ctx, bspec)
	if err != nil {
		return err
	}
	rec.Handle = h
	if err := sb.save(); err != nil {
		return err
	}
	if err := sb.be.Start(ctx, rec.ID); err != nil {
		return err
	}
	if err := sb.running(ctx, false); err != nil {
		return err
	}
	return sb.startService(ctx, im.Config.Config.Labels)
}

// Destroy stops and removes a sandbox the caller may see, and returns its
// last description.
func (e *Edge) Destroy(ctx context.Context, id, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	if err := sb.destroy(ctx); err != nil {
		return nil, err
	}
	return sb.published(), nil
}

// DestroyAll removes every sandbox in scope and returns how many.
func (e *Edge) DestroyAll(ctx context.Context, scope string) (int, error) {
	var errs []error
	n := 0
	for _, sb := range e.reg.all() {
		if !inScope(sb.project(), scope) {
			continue
		}
		if err := sb.destroy(ctx); err != nil {
			errs = append(errs, err)
			continue
		}
		n++
	}
	return n, errors.Join(errs...)
}

// AdmissionStamp is the usage change that counted the last admitted of
// ids (ids no longer here are skipped).
func (e *Edge) AdmissionStamp(ids ...string) *edgev1.UsageStamp { return e.reg.admissionStamp(ids...) }

// Get describes a sandbox.
func (e *Edge) Get(id, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	return sb.published(), nil
}

// List lists the sandboxes in scope, oldest first.
func (e *Edge) List(scope string) []*sandboxv1.Sandbox {
	var out []*sandboxv1.Sandbox
	for _, sb := range e.reg.all() {
		s := sb.published()
		if inScope(s.Project, scope) {
			out = append(out, s)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.AsTime().Before(out[j].CreatedAt.AsTime()) })
	return out
}

// SetTimeout sets a sandbox's time to live from now; 0 ends it now, as
// its time to live running out would (the expiry loop stops or pauses it).
func (e *Edge) SetTimeout(id, scope string, seconds int64) (*sandboxv1.Sandbox, error) {
	if seconds != 0 && sandboxspec.CheckTimeout(seconds, e.cfg.Limits) != nil {
		return nil, errdefs.InvalidArgument("timeout_seconds %d: want 0 (its time to live ends now) or 1 to %d", seconds, e.cfg.Limits.MaxTimeout)
	}
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	return sb.setTimeout(seconds)
}

// setTimeout sets sb's time to live to seconds from now (0: it ends now)
// and returns its description as it then is.
func (sb *sandbox) setTimeout(seconds int64) (*sandboxv1.Sandbox, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.rec.State != records.StateRunning && sb.rec.State != records.StatePaused {
		return nil, errdefs.FailedPrecondition("sandbox %s is %s", sb.id, sb.rec.State)
	}
	switch {
	case sb.rec.State == records.StatePaused && seconds == 0 && sb.rec.Spec.GetOnTimeout() == sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE:
		// Paused already: what its time to live running out would do.
		return sb.published(), nil
	case sb.rec.State == records.StatePaused && seconds == 0:
		// Removed now, as at the end of its paused lifetime.
		sb.rec.ExpiresAt = time.Now()
	case sb.rec.State == records.StatePaused:
		// It stands still while paused: the new time to live starts when
		// it is resumed.
		sb.rec.TimeoutLeft = time.Duration(seconds) * time.Second
	default:
		sb.rec.ExpiresAt = time.Now().Add(time.Duration(seconds) * time.Second)
	}
	if seconds != 0 { // the spec's 0 is the server's default
		sb.rec.Spec.TimeoutSeconds = seconds
	}
	if err := sb.save(); err != nil {
		return nil, err
	}
	sb.expiry.poke()
	return sb.published(), nil
}

// heartbeatState is the health loop's record of a sandbox's heartbeats.
type heartbeatState struct {
	running   atomic.Bool  // a Health call is in flight
	lastOK    atomic.Int64 // unix nanoseconds of the last answer
	strikes   atomic.Int32 // unanswered in a row
	continued atomic.Bool  // SIGCONT was sent since the last answer
	// stoppedPid is the runtime process a check found stopped from the
	// node (0: none found).
	stoppedPid atomic.Int64
}

// newUUID is a random (version 4) UUID, as the kernel's boot_id.
func newUUID() string {
	b := make([]byte, 16)
	rand.Read(b) //nolint:errcheck // crypto/rand does not fail on Linux
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// fenceKept is how long a fenced reservation is remembered: longer than
// any create that could still be on its way here.
const fenceKept = time.Hour

// Fence refuses any later create for reservation and returns the
// sandboxes made, or being made, for it. The fence is kept in memory for
// fenceKept (a restarted edge forgets it).
func (e *Edge) Fence(reservation string) ([]*sandboxv1.Sandbox, error) {
	if reservation == "" {
		return nil, errdefs.InvalidArgument("reservation: empty")
	}
	boxes := e.reg.fence(reservation, time.Now())
	out := make([]*sandboxv1.Sandbox, 0, len(boxes))
	for _, sb := range boxes {
		out = append(out, sb.published())
	}
	return out, nil
}

// Package sandbox is one sandbox on a node, as the edge runs it: its
// record, agent link, network attachment, metrics and health, and the
// verbs of its life (start, pause at a depth, resume, checkpoint and
// snapshot, compaction, a new time to live, expiry, failure, removal,
// re-attachment after the edge's restart). It reaches its node only
// through Env: the Host (capacity, layers), the node's Parts (images,
// layers, the staged agent), its disk room, network and expiry loop; so
// it is tested with the fake backend and fakes of those, without root.
package sandbox

import (
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/identity"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxnet"
)

// Sandbox is the edge's live view of one sandbox, and the owner of its
// lifecycle. Its lock is its own: its verbs take it, nothing outside this
// package does. Lock order: a sandbox's lock before the registry's (a
// removal unregisters it through its Host while holding its lock), so no
// code may ask a sandbox for a verb while holding the registry's.
type Sandbox struct {
	id   sandboxid.ID
	node sandboxid.NodeID
	dir  string
	// runDir holds its agent's socket (Config.RunBase; kept short for
	// the socket's path).
	runDir string
	// agentTimeout is how long its agent has to connect (or, re-attached,
	// answer).
	agentTimeout time.Duration
	// silenceAllowed is how long its agent may go unanswered before its
	// heartbeat fails it, beyond the strikes: its backend's AgentWait (a
	// guest under emulation is starved, not hung, on a busy node).
	silenceAllowed time.Duration
	// pausedLifetime is how long it is kept paused.
	pausedLifetime time.Duration
	be             backend.Backend
	proj           string // immutable once registered (a pool's sandbox takes its own when claimed, before)
	// records is where save writes rec (the edge's record store).
	records records.Store
	// expiry is the node's expiry loop, told of a new deadline.
	expiry Poker
	// host is what it reaches of the edge that runs it.
	host Host
	// parts is what it is started from (images, layers, the agent); nil
	// in tests of a sandbox without an edge.
	parts *Parts
	log   *slog.Logger // the edge's, with its id

	// view is the latest published description. Readers (Get, List,
	// Status) use it without the lifecycle lock, so a slow create or removal
	// never stalls the watcher.
	view atomic.Pointer[sandboxv1.Sandbox]

	mu   sync.Mutex       // serialises lifecycle changes
	rec  *records.Record  // guarded by mu
	link *agentlink.Link  // guarded by mu; nil once removed
	net  *sandboxnet.Link // guarded by mu; its network attachment, if any
	// settings, for a sandbox its backend made from a template snapshot,
	// go with its identity in its first request (guarded by mu).
	settings *agentv1.SandboxSettings
	// guestNet, for a restored VM with a network, goes with its identity
	// too (guarded by mu).
	guestNet *backend.GuestNetwork
	// nodeNet is the node's sandbox network it attaches to (nil: the
	// node runs without one, and nodeNetOff says why).
	nodeNet    Network
	nodeNetOff string
	// disk is the node's disk room its checkpoints are written into.
	disk DiskReserver
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
	// ended is done once the sandbox failed or was removed: what is
	// connected to its ports is cut then, not left to TCP's keepalive
	// (a VM's or gVisor's network stack ends without a FIN).
	ended context.Context
	end   context.CancelFunc
}

// Host is what a sandbox reaches of the edge that runs it; the rest of
// its lifecycle is its own. The sandbox calls it under its own lock, so
// its methods take only locks after a sandbox's (the registry's, the disk
// room's) and never call a sandbox's verbs.
type Host interface {
	// Release gives back what sb was admitted with, once.
	Release(sb *Sandbox)
	// RemoveLayer removes a writable layer the node made.
	RemoveLayer(dir string) error
	// Forget unregisters a removed sb and releases its capacity.
	Forget(sb *Sandbox)
}

// Env is where a sandbox lives and what it reaches.
type Env struct {
	Node   sandboxid.NodeID
	Dir    string // its directory
	RunDir string // its run directory (the agent's socket)
	// AgentTimeout is how long its agent has to connect or answer: the
	// node's, or its backend's AgentWait if longer.
	AgentTimeout time.Duration
	// PausedLifetime is how long it is kept paused.
	PausedLifetime time.Duration
	// Net is the node's sandbox network; nil without one, and NetOff
	// says why.
	Net     Network
	NetOff  string
	Disk    DiskReserver // the node's disk room (internal/edge/diskroom)
	Records records.Store
	Expiry  Poker // the node's expiry loop, told of a new deadline
	Host    Host
	Parts   *Parts
	Log     *slog.Logger
}

// DiskReserver holds room on a disk for a write (the edge's disk room).
type DiskReserver interface {
	Reserve(dir string, need int64, what string) (release func(), err error)
}

// Poker is told that something it watches changed.
type Poker interface{ Poke() }

// New is the sandbox of rec on backend be in env.
func New(rec *records.Record, be backend.Backend, env Env) *Sandbox {
	caps := be.Capabilities()
	sb := &Sandbox{id: rec.ID, node: env.Node, dir: env.Dir, runDir: env.RunDir, agentTimeout: max(env.AgentTimeout, caps.AgentWait), silenceAllowed: caps.AgentWait, pausedLifetime: env.PausedLifetime, nodeNet: env.Net, nodeNetOff: env.NetOff, disk: env.Disk, be: be, proj: rec.Project, rec: rec, records: env.Records, expiry: env.Expiry, host: env.Host, parts: env.Parts,
		log: env.Log.With(logging.SandboxID, rec.ID), slots: callSlots(caps.ConcurrentCalls, rec.Spec.GetResources().GetOpenFiles())}
	sb.ended, sb.end = context.WithCancel(context.Background())
	sb.view.Store(rec.Proto(env.Node))
	return sb
}

// Project is the project it belongs to (it does not change once it is
// registered).
func (sb *Sandbox) Project() string { return sb.proj }

// ID is its id.
func (sb *Sandbox) ID() sandboxid.ID { return sb.id }

// Backend is the backend it runs on.
func (sb *Sandbox) Backend() backend.Backend { return sb.be }

// Resources are what it was admitted with (they do not change).
func (sb *Sandbox) Resources() *sandboxv1.Resources { return sb.rec.Spec.GetResources() }

// Reservation is the apiserver's quota reservation its create settled
// (set before it is admitted, never after).
func (sb *Sandbox) Reservation() string { return sb.rec.Reservation }

// Ended is done once it failed or was removed.
func (sb *Sandbox) Ended() context.Context { return sb.ended }

// End ends it for its ports (Ended is done): a sandbox the node did not
// admit, or one removed.
func (sb *Sandbox) End() { sb.end() }

// MarkReleased records that its capacity is given back, and reports
// whether it was already.
func (sb *Sandbox) MarkReleased() (already bool) { return sb.released.Swap(true) }

// Released reports whether its capacity was given back (it failed and
// holds nothing, or was removed).
func (sb *Sandbox) Released() bool { return sb.released.Load() }

// CountLimits counts what its agent reports its limits did (the headers
// of an answer).
func (sb *Sandbox) CountLimits(h http.Header) { sb.limits.fromAgent(h) }

// callStarted and CallEnded bracket an agent call.
func (sb *Sandbox) callStarted() { sb.calls.Add(1) }

// CallEnded ends a call; answered says the agent answered it (a call that
// timed out or lost its connection is no sign of the agent's life, for
// the heartbeat).
func (sb *Sandbox) CallEnded(answered bool) {
	now := time.Now().UnixNano()
	sb.lastCallEnd.Store(now)
	if answered {
		sb.lastAnswered.Store(now)
	}
	sb.calls.Add(-1)
}

// lastCall is when the last agent call ended (zero if none did).
func (sb *Sandbox) lastCall() time.Time {
	if n := sb.lastCallEnd.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// View is the sandbox's published description (its API view; not
// to be confused with a snapshot of its memory); callers must not modify it.
func (sb *Sandbox) View() *sandboxv1.Sandbox {
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
func (sb *Sandbox) markCheckpoint(dir string) error {
	if sb.rec.Checkpoint == dir {
		return nil
	}
	sb.rec.Checkpoint = dir
	return sb.save()
}

// save persists the record and publishes it. Callers hold sb.mu.
func (sb *Sandbox) save() error {
	err := sb.records.Put(sb.rec)
	sb.publish()
	return err
}

// publish stores the record's description as the view; while a pause is
// under way a running sandbox is shown paused. Callers hold sb.mu.
func (sb *Sandbox) publish() {
	v := sb.rec.Proto(sb.node)
	v.AgentOutdated = sb.parts != nil && sb.parts.AgentVersion != "" && sb.rec.AgentVersion != sb.parts.AgentVersion
	if sb.pausing.Load() && v.State == sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		v.State = sandboxv1.SandboxState_SANDBOX_STATE_PAUSED
	}
	sb.view.Store(v)
}

// beginPause marks sb pausing and publishes it so; the returned func ends
// the mark (a nested pause's is a no-op) and publishes the record as it
// then is, paused or, if the pause failed, as it was. Callers hold sb.mu
// from beginPause until the returned func has run.
func (sb *Sandbox) beginPause() (end func()) {
	if !sb.pausing.CompareAndSwap(false, true) {
		return func() {}
	}
	sb.publish()
	return func() {
		sb.pausing.Store(false)
		sb.publish()
	}
}

// resolvConf replaces the image's (which names its build host's
// resolver): a sandbox without a network has no name server; one with a
// network asks the node's DNS proxy on its gateway.
const resolvConf = "# OpenDsec: this sandbox has no network access, so no name server.\noptions timeout:1 attempts:1\n"

// resolvConf is sb's resolv.conf. Callers hold sb.mu.
func (sb *Sandbox) resolvConf() string {
	if sb.rec.Spec.Network == nil || sb.nodeNet == nil {
		return resolvConf
	}
	return fmt.Sprintf("# OpenDsec: the node's DNS proxy answers the names this sandbox's network policy allows.\nnameserver %s\noptions timeout:2 attempts:2\n", sb.nodeNet.Node().DNS.Addr())
}

// prepareDir makes the sandbox directory, its run directory, hosts file and
// the agent link. Callers hold sb.mu.
func (sb *Sandbox) prepareDir() (*agentlink.Link, error) {
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
	if !regularFile(sb.bootIDFile()) {
		if err := sb.newBootID(); err != nil {
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
	var refused *agentlink.Refusals
	if sb.parts != nil {
		refused = sb.parts.LinkRefusals
	}
	return agentlink.ListenCounted(filepath.Join(sb.runDir, "edge.sock"), auth, refused, sb.log)
}

// Start makes a new sandbox's directory, layer and network and starts it
// from im, until its agent answers.
func (sb *Sandbox) Start(ctx context.Context, im *image.Image) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	rec := sb.rec
	link, err := sb.prepareDir()
	if err != nil {
		return err
	}
	sb.link = link
	layers, err := sb.parts.Cache.Layers(ctx, im, nil)
	if err != nil {
		return fmt.Errorf("image %s: %w", rec.Spec.Image, err)
	}
	if sb.be.Capabilities().DiskLayer {
		// The layer is recorded before the backend uses it: after a crash
		// between the two, the removal finds it (and a layer no record
		// names is removed at the next start).
		if rec.LayerDir, err = sb.parts.Layers.Create(ctx, rec.Spec.Resources.DiskMb); err != nil {
			return err
		}
		// A layer is its own file system, or it bounds nothing.
		if ok, _ := rootfs.HoldsOwnFileSystem(rec.LayerDir); !ok {
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
	if h.Restored {
		sb.settings, sb.guestNet = identity.Settings(bspec), h.Network
	}
	if err := sb.be.Start(ctx, rec.ID); err != nil {
		return err
	}
	if err := sb.running(ctx, h.Restored); err != nil {
		return err
	}
	if svc := serviceLabels(im.Config.Config.Labels); svc != nil {
		rec.Service = svc // to start it again after a filesystem-only pause
		if err := sb.save(); err != nil {
			return err
		}
	}
	return sb.startService(ctx, im.Config.Config.Labels)
}

// SetTimeout sets sb's time to live to seconds from now (0: it ends now)
// and returns its description as it then is.
func (sb *Sandbox) SetTimeout(seconds int64) (*sandboxv1.Sandbox, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.rec.State != records.StateRunning && sb.rec.State != records.StatePaused {
		return nil, errdefs.FailedPrecondition("sandbox %s is %s", sb.id, sb.rec.State)
	}
	switch {
	case sb.rec.State == records.StatePaused && seconds == 0 && sb.rec.Spec.GetOnTimeout() == sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE:
		// Paused already: what its time to live running out would do.
		return sb.View(), nil
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
	sb.expiry.Poke()
	return sb.View(), nil
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

func regularFile(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

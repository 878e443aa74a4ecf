// Package backend defines the seam between the edge and an isolation
// technology [ours]. A backend runs sandboxes from a prepared Spec; optional
// capabilities (pause, memory snapshots) are separate interfaces found by
// type assertion. Backends register in one place, cmd/dsec/backends.go.
package backend

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/spawn"
)

// Capabilities are what a backend can do, fixed per backend.
type Capabilities struct {
	// Isolation names the boundary: "container", "gvisor", "microvm" or
	// "vm".
	Isolation string
	Pause     bool
	// Snapshot means memory snapshots (and so fork) work on this node.
	Snapshot bool
	// SnapshotUnavailable says why Snapshot is false, for error messages.
	SnapshotUnavailable string
	// SnapshotNetwork means a sandbox with a network interface (Spec.NetNS)
	// can be snapshotted, and its copies get their own interface back.
	SnapshotNetwork bool
	// DiskLayer means the writable layer is on the node's disk: Create
	// then gets Spec.LayerDir, a directory the edge has limited to the
	// sandbox's disk_mb. Otherwise the backend bounds the layer itself.
	DiskLayer bool
	// DiskFile means the backend keeps a sparse disk of the sandbox's
	// disk_mb in the sandbox's directory on the node's state disk (a VM's
	// writable disk): the edge admits it against that disk's room as it
	// does a layer (internal/edge/diskroom).
	DiskFile bool
	// ChangesWhileRunning: the backend's ChangeReader reads a running
	// sandbox's changes, stopping its tasks itself (gVisor's sentry must
	// answer the call that writes them out).
	ChangesWhileRunning bool
	// LinkBeforeAgent means the agent's link is connected before the agent
	// runs (a VM's serial port, which the hypervisor joins to the edge's
	// socket at start): the edge waits for the agent to answer, not for a
	// connection.
	LinkBeforeAgent bool
	// ConcurrentCalls bounds the unary agent calls a sandbox serves at
	// once (the edge's call gate; 0: its default): past it, more
	// concurrency only slows every call.
	ConcurrentCalls int
	// MinMemoryMB is the least memory_mb a sandbox of this backend runs
	// in (a VM's kernel and agent); the edge refuses less (0: no minimum
	// beyond the API's).
	MinMemoryMB int64
	// PCIDevices means the backend hands host PCI devices (Spec.Devices)
	// to its sandboxes; the edge refuses them to other backends.
	PCIDevices bool
	// AgentWait is the least time a new or restored sandbox's agent is
	// given to connect and answer, when a start here takes more than a
	// process's (a guest kernel's boot under emulation); the edge waits
	// for the longer of it and its own agent timeout (0: the edge's).
	AgentWait time.Duration
}

// Resources are the limits a sandbox runs under.
type Resources struct {
	CPUCores float64
	MemoryMB int64
	Pids     int64
	DiskMB   int64
	// NoFile is RLIMIT_NOFILE of the sandbox's processes.
	NoFile int64
}

// Spec is everything a backend needs to create a sandbox. The edge owns Dir
// and removes it after Destroy.
type Spec struct {
	ID sandboxid.ID
	// Dir is the sandbox's own directory on the node, empty at Create.
	Dir string
	// Layers are the image's unpacked layer directories, lowest first.
	Layers []string
	// LayerDir, for backends with Capabilities.DiskLayer, holds the
	// writable layer (overlayfs upper and work directories); the node's
	// disk pool limits it to DiskMB.
	LayerDir string
	// Env is the environment of the sandbox's processes (KEY=VALUE).
	Env []string
	// WorkDir is the working directory of processes that name none (the
	// image's WORKDIR; empty: "/").
	WorkDir  string
	Hostname string
	// MachineID is the new sandbox's /etc/machine-id (32 hex), passed to
	// the agent; a restored copy gets its own through SetIdentity instead.
	MachineID string
	Resources
	// AgentPath is the host path of the static aether binary.
	AgentPath string
	// RunDir is mounted read-only at /.dsec/run; the edge's agent socket is there.
	RunDir string
	// HostsFile is mounted at /etc/hosts.
	HostsFile string
	// ResolvConf, if set, is mounted at /etc/resolv.conf (images carry
	// their build host's resolver there).
	ResolvConf string
	// Devices are host PCI devices by address (sysfs's form) the sandbox
	// gets, for backends with Capabilities.PCIDevices.
	Devices []string
	// NetNS, if set, is the network namespace (a path) the sandbox runs
	// in: the edge made it, with the sandbox's veth and address. Empty:
	// the sandbox gets a namespace of its own with loopback only.
	NetNS string
}

// Paths of the agent inside every sandbox.
const (
	AgentMount  = "/.dsec/aether"
	RunMount    = "/.dsec/run"
	AgentSocket = RunMount + "/edge.sock"
)

// RootfsLayout is where a backend stacks the sandbox's root file system:
// the merged tree in Dir, the writable layer in LayerDir when the edge gave
// one (else in Dir too).
func (s *Spec) RootfsLayout() rootfs.Layout {
	l := rootfs.LayoutIn(s.Dir)
	if s.LayerDir != "" {
		l.Upper, l.Work = filepath.Join(s.LayerDir, "upper"), filepath.Join(s.LayerDir, "work")
	}
	return l
}

// AgentArgs is the sandbox's first process. It authenticates its link
// (agentlink/auth.go): the edge gives every sandbox whose link is a
// socket in the sandbox an agent key.
func AgentArgs() []string { return []string{AgentMount, "-edge-socket", AgentSocket, "-link-auth"} }

// Handle is what the edge persists for a sandbox so the backend can find it
// again after an edge restart. State is backend-private.
type Handle struct {
	ID      sandboxid.ID `json:"id"`
	Backend string       `json:"backend"`
	// Version is bumped when State's layout changes.
	Version int    `json:"version"`
	State   []byte `json:"state,omitempty"`
	// Restored says Create made the sandbox from a snapshot of another
	// guest (a node's template of its image and shape): its agent starts
	// with that guest's identity and settings, and takes its own from its
	// first request.
	Restored bool `json:"restored,omitempty"`
	// Network, if set, is the interface a restored VM guest must give
	// itself (its memory holds its source's): the edge sends it in the
	// copy's first request.
	Network *GuestNetwork `json:"network,omitempty"`
}

// GuestNetwork is a VM guest's network interface: an IPv4 /32 reached
// through Gateway, on the NIC with MAC.
type GuestNetwork struct {
	Address string `json:"address"`
	Gateway string `json:"gateway"`
	MAC     string `json:"mac"`
}

// State is a sandbox's run state as the backend sees it.
type State string

// States.
const (
	StateCreated State = "created"
	StateRunning State = "running"
	StatePaused  State = "paused"
	StateStopped State = "stopped"
	StateUnknown State = "unknown"
)

// Status is a sandbox's state with the init process's pid.
type Status struct {
	ID    sandboxid.ID
	State State
	Pid   int
	// HostStopped reports that the process that runs the sandbox (gVisor's
	// sentry, a VM's hypervisor) was stopped by a signal on the node
	// (SIGSTOP): nothing in it answers, and no pause of the edge's did it.
	HostStopped bool
}

// ProcessStopped reports whether process pid is stopped by a signal
// (state T in /proc/PID/stat; not t, a tracee's stop, which gVisor's
// ptrace platform puts its stubs in all the time).
func ProcessStopped(pid int) bool {
	if pid <= 0 {
		return false
	}
	st, ok := spawn.ReadStat(pid)
	return ok && st.State == "T"
}

// WaitStopped polls b's status of id until it is stopped (true), the
// status cannot be read (its error), or limit passes (false, nil). A stop
// uses it for its grace period and again after SIGKILL: stopped means
// stopped once Stop returns.
func WaitStopped(ctx context.Context, b Backend, id sandboxid.ID, limit time.Duration) (bool, error) {
	for deadline := time.Now().Add(limit); ; {
		st, err := b.Status(ctx, id)
		if err != nil || st.State == StateStopped {
			return err == nil, err
		}
		if !time.Now().Before(deadline) {
			return false, nil
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// StopAfterKill bounds the wait for a sandbox to stop after SIGKILL.
const StopAfterKill = 5 * time.Second

// Inventory is an optional capability of a backend whose sandboxes can
// outlive what the edge recorded of them (a VMM that daemonized before a
// crash of the edge saved its handle): Found lists the ids of node's
// sandboxes it finds running or holding resources on the host. At start,
// after recovery, the edge destroys those it has no record of; Destroy of
// an id the backend has no handle of must then find them by the id.
type Inventory interface {
	Found(ctx context.Context, node sandboxid.NodeID) ([]sandboxid.ID, error)
}

// Backend runs sandboxes.
type Backend interface {
	Name() string
	Capabilities() Capabilities
	// Probe checks the host: binaries, kernel features, devices. Its error
	// names what is missing.
	Probe(ctx context.Context) error
	// Create prepares a sandbox (rootfs, bundle, cgroup) without running it.
	Create(ctx context.Context, spec *Spec) (*Handle, error)
	// Start runs the sandbox's first process (the agent).
	Start(ctx context.Context, id sandboxid.ID) error
	// Stop ends every process, waiting up to grace for a clean exit.
	Stop(ctx context.Context, id sandboxid.ID, grace time.Duration) error
	// Destroy removes everything Create made: processes, mounts, cgroups,
	// namespaces, runtime state. Destroying an unknown sandbox succeeds.
	Destroy(ctx context.Context, id sandboxid.ID) error
	Status(ctx context.Context, id sandboxid.ID) (Status, error)
	// Recover re-attaches to a sandbox after an edge restart. It may update
	// h to name what it found running (a generation of the sandbox that the
	// edge before it started and did not live to record); the edge saves it.
	Recover(ctx context.Context, h *Handle, spec *Spec) error
}

// ChangeReader is implemented by backends whose sandboxes' changes to
// their image can be read on the node as an overlayfs upper directory
// (whiteouts as 0/0 character devices, opaque directories marked by
// trusted.overlay.opaque): the container's writable layer, a microVM's
// writable disk. The edge commits them as an image layer (pack_diff).
type ChangeReader interface {
	// OpenChanges returns that directory, readable until release is
	// called. The edge pauses the sandbox first (unless the backend has
	// Capabilities.ChangesWhileRunning: then it quiesces the sandbox
	// itself) and, for a VM, has its file systems synced; spec carries the
	// sandbox's Dir and LayerDir.
	OpenChanges(ctx context.Context, spec *Spec) (upper string, release func() error, err error)
}

// Describer is implemented by backends that say how they run on this node
// (which hypervisor and accelerator, and why not a faster one), for node
// status.
type Describer interface {
	Describe() string
}

// Diagnoser is implemented by backends that can say why a sandbox died,
// e.g. "out of memory (limit 512 MiB)"; "" when they cannot tell.
type Diagnoser interface {
	Diagnose(ctx context.Context, id sandboxid.ID) string
}

// GuestReporter is implemented by VM backends: what the hypervisor
// reports of a guest whose agent went silent (its run state, the ends of
// the agent's channel, the console's last line), which the edge adds to
// the sandbox's failure reason; "" when it does not answer.
type GuestReporter interface {
	GuestReport(ctx context.Context, id sandboxid.ID) string
}

// ConsoleReader is implemented by backends that keep a sandbox's console
// themselves, bounded (a VM's: in QEMU's memory, or a ring file the edge
// drains Firecracker's output into): the edge quotes its end when the
// agent does not come up.
type ConsoleReader interface {
	ConsoleTail(ctx context.Context, id sandboxid.ID) string
}

// HostThreads is implemented by backends whose runtime holds host threads
// it does not give back (gVisor's ptrace platform): the edge compacts a
// sandbox that holds too many (checkpoint and restore in place).
type HostThreads interface {
	HostThreads(id sandboxid.ID) int
}

// Releaser is implemented by backends that can give a checkpointed
// sandbox's memory back to the node: after a Snapshot, Release ends what
// still runs of it and frees what it holds in memory, keeping what a
// Restore in place needs. The edge's offload (a pause that gives the
// memory back) uses it after its checkpoint.
type Releaser interface {
	Release(ctx context.Context, id sandboxid.ID) error
}

// Warmer is implemented by backends whose first sandbox of an image and
// shape costs more than the later ones (microvm builds a template
// snapshot for it): Warm pays that cost now, for sandboxes of spec (a
// sandbox's spec without its directories) with a network interface or
// without. prepared is false when the node had it already.
type Warmer interface {
	Warm(ctx context.Context, spec *Spec, network bool) (prepared bool, err error)
}

// CachePruner is implemented by backends that keep files of their own per
// image on the node (microvm's root disks): PruneCache removes those that
// no sandbox or snapshot uses and that were not used within grace, and
// returns the bytes freed. The edge calls it with its layer cache's prune.
type CachePruner interface {
	PruneCache(grace time.Duration) (freed int64, err error)
}

// UsageReader is implemented by backends that can read a sandbox's CPU
// and memory use from the host (its cgroups) without entering or waking
// it; the edge records it for metrics over time.
type UsageReader interface {
	Usage(id sandboxid.ID) (Usage, error)
}

// Usage is a sandbox's resource use as its cgroups count it.
type Usage struct {
	CPUNanos    uint64 // CPU time used since it started
	MemoryBytes int64  // memory used, less page cache the kernel can drop at once
	CacheBytes  int64  // page cache
	LimitBytes  int64  // memory limit
	// ActiveFileBytes is the part of MemoryBytes that is page cache of
	// files used lately: the kernel drops it as well when memory is short.
	ActiveFileBytes int64
	// OOMKills and ForksRefused count the sandbox's processes ended at its
	// memory limit and forks refused at its pids limit, where the node's
	// cgroup is the sandbox's own (a container); 0 where it is not.
	OOMKills, ForksRefused int64
}

// HeldBytes is what of the memory the kernel cannot simply drop: its use
// less all page cache of files. An offload gives back the fall of it.
func (u Usage) HeldBytes() int64 { return u.MemoryBytes - u.ActiveFileBytes }

// Continuer is implemented by backends that can send the sandbox's first
// process (the agent) SIGCONT from outside, for a runtime that lets the
// sandbox stop it (gVisor).
type Continuer interface {
	Continue(ctx context.Context, id sandboxid.ID) error
}

// Pauser is implemented by backends that can freeze a sandbox.
type Pauser interface {
	Pause(ctx context.Context, id sandboxid.ID) error
	Resume(ctx context.Context, id sandboxid.ID) error
}

// SnapshotRef names where a snapshot lives on the node.
type SnapshotRef struct {
	ID  sandboxid.SnapshotID
	Dir string // owned by the edge; empty at Snapshot
}

// SnapshotInfo describes a written snapshot.
type SnapshotInfo struct {
	SizeBytes int64
	// Stopped reports that taking the snapshot stopped the source (runsc's
	// checkpoint does); the caller must then restore it.
	Stopped bool
}

// Snapshotter is implemented by backends that can capture memory.
type Snapshotter interface {
	// Snapshot writes memory, execution state and a point-in-time copy of the
	// writable layer to ref.Dir. Before it is called the edge has detached
	// the agent link, so the sandbox holds no host socket.
	Snapshot(ctx context.Context, id sandboxid.ID, ref SnapshotRef) (*SnapshotInfo, error)
	// Restore creates and starts a sandbox from a snapshot; spec carries the
	// new sandbox's own id, Dir and RunDir.
	Restore(ctx context.Context, ref SnapshotRef, spec *Spec) (*Handle, error)
}

// Config is what every factory receives.
type Config struct {
	// StateDir is the backend's own directory on the node.
	StateDir string
	Log      *slog.Logger
	// Options are backend-specific settings ("runtime": "crun", ...).
	Options map[string]string
}

// Factory creates a backend.
type Factory func(ctx context.Context, cfg Config) (Backend, error)

// Registry maps backend names to factories. It is filled in cmd/dsec, so
// which backends a binary has is visible in one file.
type Registry struct {
	mu        sync.Mutex
	factories map[string]Factory // guarded by mu
}

// Register adds a factory.
func (r *Registry) Register(name string, f Factory) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.factories == nil {
		r.factories = map[string]Factory{}
	}
	if _, dup := r.factories[name]; dup {
		panic(fmt.Sprintf("backend %q registered twice", name))
	}
	r.factories[name] = f
}

// Lookup finds a factory.
func (r *Registry) Lookup(name string) (Factory, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f, ok := r.factories[name]
	return f, ok
}

// Names lists registered backends, sorted.
func (r *Registry) Names() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	names := make([]string, 0, len(r.factories))
	for n := range r.factories {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Open makes the backends named in opts (name → options), each with its
// state under stateDir/NAME.
func (r *Registry) Open(ctx context.Context, opts map[string]map[string]string, stateDir string, log *slog.Logger) ([]Backend, error) {
	var out []Backend
	for name, o := range opts {
		f, ok := r.Lookup(name)
		if !ok {
			return nil, fmt.Errorf("backend %q: not built into this binary (have %s)", name, strings.Join(r.Names(), ", "))
		}
		b, err := f(ctx, Config{StateDir: filepath.Join(stateDir, name), Log: log, Options: o})
		if err != nil {
			return nil, fmt.Errorf("backend %s: %w", name, err)
		}
		out = append(out, b)
	}
	return out, nil
}

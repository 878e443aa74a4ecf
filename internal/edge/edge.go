// Package edge is the node daemon [paper: role; ours: design]. It has the
// final say on admission against the node's real capacity, prepares each
// sandbox's rootfs from the layer cache, starts it on a backend, owns the
// channel to its agent, enforces its time to live and, because every
// sandbox's record is on the node's disk, re-attaches running sandboxes after
// its own restart instead of losing or leaking them.
package edge

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/edge/diskroom"
	"github.com/opendsec/opendsec/internal/edge/layerfs"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/runbase"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/metrics"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/sandboxspec"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures an edge.
type Config struct {
	// StateDir holds the node id, sandbox directories and the layer cache.
	StateDir string
	// AgentPath is the static aether binary put into every sandbox.
	AgentPath string
	// Capacity is what the edge admits; zero reads the host, with
	// CPUOvercommit and MemoryOvercommit (0: capacity.DefaultCPUOvercommit,
	// capacity.DefaultMemoryOvercommit) for the totals.
	Capacity         capacity.Node
	CPUOvercommit    float64
	MemoryOvercommit float64
	// MaxSandboxes, when above 0, is how many sandboxes the node admits,
	// instead of what its memory, tasks and descriptors allow
	// (capacity.SandboxLimit).
	MaxSandboxes int64
	Limits       sandboxspec.Limits
	// AgentTimeout bounds the wait for a new sandbox's agent.
	AgentTimeout time.Duration
	// RunBase holds each sandbox's agent socket directory. Unix socket paths
	// are limited to 107 bytes, so it must be short; default /run/opendsec.
	RunBase string
	// LayerDir holds the writable layers of backends with DiskLayer, each a
	// file system of its sandbox's disk_mb (internal/edge/layerfs); default
	// StateDir/layers.
	LayerDir string
	// LayerCacheLimit, if set, bounds the node's unpacked layers (bytes):
	// each prune (every 10 minutes, after a create that unpacked a layer,
	// and `dsec image gc`) removes the least recently used ones no
	// sandbox or snapshot here needs until the cache fits.
	LayerCacheLimit int64
	// WarmLayers is how many empty layers of the default size are kept
	// ready, so a create does not wait for one to be formatted; default 4.
	WarmLayers int
	// Pools are warm pools: sandboxes of an image and shape kept started,
	// which creates of that image and shape claim (pool.go).
	Pools []Pool
	// DiskOvercommit above 1 lets the disk limits of the sandboxes add up
	// to that many times the free space of LayerDir's file system when the
	// edge starts: layers are sparse and most sandboxes write far less than
	// their limit, but one that fills the disk then loses its neighbours'
	// writes. Default 1: a layer is admitted only while the disk has room
	// for every admitted layer written in full (internal/edge/diskroom).
	DiskOvercommit float64
	// DiskKeepFreeMB is what LayerDir's file system keeps free beyond what
	// the layers may write; default 2 % of its size, 64 MiB to 1 GiB.
	DiskKeepFreeMB int64
	// DiskLedgerDir is where the edges of one host count what each
	// promised of a file system they share (internal/diskledger): each
	// admits against the free space less the others' promise. Empty: this
	// edge counts only its own sandboxes, as if it had the disk alone.
	DiskLedgerDir string
	// Network turns on sandbox networking (sandboxnet.OpenNode); nil: sandboxes
	// have loopback only and a create that asks for a network fails.
	Network *sandboxnet.NodeConfig
	// PeerTLS is the client side of mutual TLS to other edges (this edge's
	// certificate), for pulling their snapshots (export.go); nil: copies of
	// other nodes' snapshots cannot start here.
	PeerTLS *tls.Config
	// PausedLifetime is how long a paused sandbox is kept before it is
	// removed (its time to live stands still meanwhile); default
	// DefaultPausedLifetime.
	PausedLifetime time.Duration
}

// DefaultPausedLifetime is Config.PausedLifetime's default.
const DefaultPausedLifetime = 7 * 24 * time.Hour

// Deps are the edge's collaborators.
type Deps struct {
	Store    *image.Store
	Backends []backend.Backend
	Log      *slog.Logger
	// Metrics registers the edge's Prometheus metrics (nil: none).
	Metrics prometheus.Registerer
}

// Edge manages the sandboxes of one node.
type Edge struct {
	cfg      Config
	log      *slog.Logger
	node     sandboxid.NodeID
	backends backendSet
	cgroup   string // the node's cgroup layout, "v1" or "v2" ("" unknown)
	// parts is what sandboxes start from: images, layers, the agent.
	parts sandbox.Parts
	prom  *promStats
	// usage adds up what the node's sandboxes used, by group (usage.go).
	usage *usageMeter
	dirs  nodeDirs
	// disk is LayerDir's file system, what it keeps free and what this
	// edge promised of it (internal/edge/diskroom), under a lock of its own.
	disk *diskroom.Room
	// records keeps the sandboxes' records.
	records records.Store
	// recoveryIncomplete is set when recovery could not read every record:
	// nothing found running is then taken for an orphan.
	recoveryIncomplete bool
	// net attaches sandboxes to the node's sandbox network; nil without
	// one, and netOff says why.
	net     *sandboxnet.Network
	netOff  string
	stopDNS context.CancelFunc
	// snaps keeps the node's snapshots, exports and pulled snapshots
	// (internal/edge/snapshots), under a lock of its own.
	snaps *snapshots.Store

	// reg is the node's sandboxes and what they were admitted with
	// (registry.go), under the edge's one lock over sandboxes.
	reg *registry
	// pools are the node's warm pools (pool.go).
	pools *pools

	expiry   *sandbox.Expiry
	stop     chan struct{}
	stopOnce sync.Once
	// pruneKick asks the cache prune loop for a prune now (a create
	// unpacked layers past the cache limit).
	pruneKick chan struct{}
	wg        sync.WaitGroup
}

// New opens the edge's state, probes the backends and re-attaches the
// sandboxes a previous run left.
func New(ctx context.Context, cfg Config, deps Deps) (*Edge, error) {
	if cfg.StateDir == "" || cfg.AgentPath == "" || deps.Store == nil {
		return nil, errors.New("edge: StateDir, AgentPath and Store are required")
	}
	if _, err := os.Stat(cfg.AgentPath); err != nil {
		return nil, fmt.Errorf("edge: agent binary: %w", err)
	}
	hostCapacity := cfg.Capacity.HostCPUCores == 0
	if hostCapacity {
		cfg.Capacity = capacity.Host(cfg.CPUOvercommit, cfg.MemoryOvercommit)
	}
	if cfg.Limits.MaxCPUCores == 0 {
		cfg.Limits = sandboxspec.DefaultLimits()
	}
	cfg.Limits.MaxCPUCores = min(cfg.Limits.MaxCPUCores, cfg.Capacity.HostCPUCores)
	cfg.Limits.MaxMemoryMB = min(cfg.Limits.MaxMemoryMB, cfg.Capacity.HostMemoryMB)
	if cfg.PausedLifetime <= 0 {
		cfg.PausedLifetime = DefaultPausedLifetime
	}
	if cfg.AgentTimeout == 0 {
		cfg.AgentTimeout = 30 * time.Second
	}
	if cfg.RunBase == "" {
		cfg.RunBase = "/run/opendsec"
	}
	for _, d := range []string{"sandboxes", "snapshots", "pulled", "cache"} {
		if err := os.MkdirAll(filepath.Join(cfg.StateDir, d), 0o700); err != nil {
			return nil, err
		}
	}
	node, err := loadNodeID(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	if sock := filepath.Join(cfg.RunBase, string(node), string(sandboxid.New(node)), "edge.sock"); len(sock) > maxSocketPath {
		return nil, fmt.Errorf("edge: run base %q is too long: agent socket paths would be %d bytes, the limit is %d", cfg.RunBase, len(sock), maxSocketPath)
	}
	cache, err := image.NewCache(filepath.Join(cfg.StateDir, "cache"), deps.Store)
	if err != nil {
		return nil, err
	}
	e := &Edge{
		cfg: cfg, log: logging.OrDiscard(deps.Log).With(logging.NodeID, node), node: node,
		parts: sandbox.Parts{Store: deps.Store, Cache: cache, AgentSource: cfg.AgentPath, Restage: func() (string, error) { return runbase.Stage(cfg.AgentPath, cfg.RunBase) }, LinkRefusals: &agentlink.Refusals{}}, records: records.Dir{Root: filepath.Join(cfg.StateDir, "sandboxes")},
		dirs: nodeDirs{stateDir: cfg.StateDir, runBase: cfg.RunBase, node: node}, backends: newBackendSet(node),
		stop: make(chan struct{}),
	}
	e.snaps = snapshots.New(node, cfg.StateDir, peerClient(cfg.PeerTLS), e.log)
	if e.parts.Agent, err = runbase.Prepare(cfg.RunBase, cfg.AgentPath, e.log); err != nil {
		return nil, fmt.Errorf("edge: run base %s: %w", cfg.RunBase, err)
	}
	e.parts.AgentVersion = runbase.AgentVersion(ctx, cfg.AgentPath, e.log)
	if h, err := cgroups.Detect(cgroups.DefaultRoot, ""); err == nil {
		e.cgroup = h.String()
	}
	var layersErr error
	for _, b := range deps.Backends {
		err := b.Probe(ctx)
		if err == nil && b.Capabilities().DiskLayer && e.parts.Layers == nil && layersErr == nil {
			e.parts.Layers, e.disk, layersErr = openLayers(cfg, e.log)
		}
		if err == nil && b.Capabilities().DiskLayer && layersErr != nil {
			err = layersErr
		}
		if err != nil {
			e.backends.unavailable[b.Name()] = err.Error()
			e.log.Warn("backend unavailable on this node", logging.Backend, b.Name(), logging.Error, err)
			continue
		}
		e.backends.usable[b.Name()] = b
	}
	if e.parts.Layers != nil {
		e.cfg.Limits.MaxDiskMB = min(e.cfg.Limits.MaxDiskMB, e.disk.BudgetMB())
	} else if e.disk, err = diskroom.New(cfg.StateDir, cfg.DiskOvercommit, cfg.DiskKeepFreeMB, e.log); err != nil {
		return nil, fmt.Errorf("edge: state directory %s: %w", cfg.StateDir, err)
	}
	if cfg.DiskLedgerDir != "" {
		if err := e.disk.OpenLedger(cfg.DiskLedgerDir, string(e.node)); err != nil {
			return nil, fmt.Errorf("edge: %w", err)
		}
	}
	if hostCapacity {
		// Read again: the backends raise kernel.pid_max and fs.file-max
		// as they start.
		e.cfg.Capacity.MaxSandboxes, e.cfg.Capacity.SandboxBound = capacity.SandboxLimit(capacity.ReadHostLimits(e.cfg.Capacity.HostMemoryMB))
	}
	e.cfg.Capacity = e.cfg.Capacity.WithMaxSandboxes(cfg.MaxSandboxes)
	e.reg = newRegistry(node, e.cfg.Capacity, e.disk)
	e.log.Info("node capacity", "max_sandboxes", e.cfg.Capacity.MaxSandboxes, "bounded_by", e.cfg.Capacity.SandboxBound,
		"cpu_cores", e.cfg.Capacity.CPUCores, "memory_mb", e.cfg.Capacity.MemoryMB)
	if e.usage, err = openUsageMeter(cfg.StateDir); err != nil {
		return nil, fmt.Errorf("edge: usage totals: %w", err)
	}
	// Prometheus may scrape as soon as the collector is registered, and
	// the collector reads the registry: register it only once that exists.
	e.prom = newPromStats(e, metrics.Instance(deps.Metrics, string(node)))
	e.expiry = sandbox.NewExpiry(e.reg.all, e.log)
	if e.pools, err = newPools(e, cfg.Pools); err != nil {
		return nil, fmt.Errorf("edge: %w", err)
	}
	e.netOff = "not configured"
	if cfg.Network != nil {
		nc := *cfg.Network
		nc.StateFile = filepath.Join(cfg.StateDir, "network.json")
		if e.net, e.stopDNS, err = sandboxnet.OpenNode(ctx, string(node), nc, networkedRecords(e.records), &e.wg, e.log); err != nil {
			e.netOff = err.Error()
			e.log.Warn("sandbox networking unavailable on this node: sandboxes get loopback only", logging.Error, err)
		}
	}
	e.recover(ctx)
	if e.recoveryIncomplete {
		e.log.Warn("not removing what backends run without a record: the records could not all be read")
	} else {
		e.dirs.sweepBackends(ctx, e.backends.usable, func(id sandboxid.ID) bool { _, ok := e.reg.get(id); return ok || e.pools.has(id) }, e.log)
	}
	sweepLayers(e.parts.Layers, e.records, e.log)
	e.dirs.sweepRuns(e.log)
	if e.parts.Layers != nil {
		e.parts.Layers.Start() // after the sweep: a warm layer being made would look unowned
	}
	e.snaps.Load()
	e.disk.Publish() // what recovery found
	e.wg.Add(1)
	go func() { defer e.wg.Done(); e.expiry.Run(e.stop, &e.wg) }()
	// Each tick checks every sandbox and starts the compactions the checks
	// ask for (counted in wg).
	every(e.stop, &e.wg, sandbox.HealthEvery, func(now time.Time) {
		for _, sb := range e.reg.all() {
			sb.CheckHealth(now, &e.wg, e.snaps)
		}
		e.pools.checkHealth(now, &e.wg)
	})
	every(e.stop, &e.wg, transferEvery, e.snaps.Sweep)
	every(e.stop, &e.wg, sandbox.MetricsEvery, e.sample)
	e.wg.Add(1)
	go func() { defer e.wg.Done(); e.pools.run(e.stop) }()
	e.pruneKick = make(chan struct{}, 1)
	e.wg.Add(1)
	go func() { defer e.wg.Done(); e.pruneLoop() }()
	return e, nil
}

// sample takes each sandbox's metrics sample, adds what they used to the
// node's totals and publishes the disk's room.
func (e *Edge) sample(now time.Time) {
	var uses []sandbox.Use
	for _, sb := range e.reg.all() {
		uses = append(uses, sb.RecordMetrics(now))
	}
	if err := e.usage.add(uses); err != nil {
		e.log.Warn("keep the sandboxes' usage totals", logging.Error, err)
	}
	e.disk.Publish()
}

// every calls f each period until stop is closed, counted in wg.
func every(stop <-chan struct{}, wg *sync.WaitGroup, period time.Duration, f func(now time.Time)) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(period)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case now := <-tick.C:
				f(now)
			}
		}
	}()
}

// Node returns the node id.
func (e *Edge) Node() sandboxid.NodeID { return e.node }

// Close stops background work. Sandboxes keep running.
func (e *Edge) Close() {
	e.stopOnce.Do(func() {
		close(e.stop)
		if e.stopDNS != nil {
			e.stopDNS()
		}
	})
	e.wg.Wait()
	if e.parts.Layers != nil {
		e.parts.Layers.Close() // removes the warm layers; sandboxes' stay
	}
	e.disk.Close()
	for _, sb := range append(e.reg.all(), e.pools.all()...) {
		sb.CloseLink()
	}
	// Layers mounted from their EROFS forms (running sandboxes' overlays
	// hold clones of theirs).
	if err := e.parts.Cache.UnmountLayers(); err != nil {
		e.log.Warn("unmount image layers", logging.Error, err)
	}
	if e.net != nil {
		// With no sandbox attached, nothing is left of the node's table's
		// use: test clusters and a node being retired leave no rules.
		if _, err := e.net.Close(context.Background()); err != nil {
			e.log.Warn("remove the node's nftables table", logging.Error, err)
		}
	}
	// The node's run directory goes when no sandbox uses it (it fails
	// harmlessly otherwise): test clusters each make one.
	os.Remove(e.dirs.runs()) //nolint:errcheck // see above
}

func loadNodeID(dir string) (sandboxid.NodeID, error) {
	p := filepath.Join(dir, "node-id")
	data, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		id := sandboxid.NewNodeID()
		return id, os.WriteFile(p, []byte(id), 0o600)
	}
	if err != nil {
		return "", err
	}
	return sandboxid.ValidateNode(strings.TrimSpace(string(data)))
}

// BackendNames lists the backends this node can run, then the others.
func (e *Edge) BackendNames() (usable, unusable []string) { return e.backends.names() }

// lookup finds a sandbox the caller may see.
func (e *Edge) lookup(id, scope string) (*sandbox.Sandbox, error) {
	sid, node, err := sandboxid.Parse(id)
	if err != nil {
		return nil, err
	}
	if node != e.node {
		return nil, errdefs.NotFound("sandbox %s: not on node %s", id, e.node)
	}
	sb, ok := e.reg.get(sid)
	if !ok || !project.Within(sb.Project(), scope) {
		return nil, errdefs.NotFound("sandbox %s: no such sandbox", id)
	}
	return sb, nil
}

// openLayers opens the writable-layer maker of cfg and the disk room
// that budgets it.
func openLayers(cfg Config, log *slog.Logger) (*layerfs.FS, *diskroom.Room, error) {
	dir := cfg.LayerDir
	if dir == "" {
		dir = filepath.Join(cfg.StateDir, "layers")
	}
	warm := cfg.WarmLayers
	if warm == 0 {
		warm = 4
	}
	fs, err := layerfs.Open(layerfs.Config{Dir: dir, WarmMB: cfg.Limits.DefaultDiskMB, Warm: max(warm, 0)}, log)
	if err != nil {
		return nil, nil, fmt.Errorf("writable layers: %w", err)
	}
	room, err := diskroom.New(dir, cfg.DiskOvercommit, cfg.DiskKeepFreeMB, log)
	if err != nil {
		fs.Close()
		return nil, nil, err
	}
	room.SetLayers(fs)
	return fs, room, nil
}

package edge

import (
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// Warm pools [ours; issue 28]: a node keeps sandboxes of an image and
// shape started ahead of any create (Config.Pools, or SetPool:
// poolset.go); a create of that image and shape, with a network if the
// pool's have one, claims one (sandbox/claim.go)
// instead of starting one, and the pool starts another in the
// background. A pool's sandboxes are not the registry's: no call finds
// them, and the node's admission does not count them; the pool fills only
// into room the registry's sandboxes leave, and gives a sandbox up
// whenever the registry's grow into it.

// Pool is one warm pool of a node.
type Pool struct {
	// Spec is its sandboxes' backend, image and resources; a network, a
	// time to live, an environment and the rest are not a pool's.
	Spec *sandboxv1.SandboxSpec
	// Project is whose view of images resolves Spec.Image.
	Project string
	// Size is how many it keeps started.
	Size int
	// Generation is the cluster's version of an API setting (unix ns; 0:
	// none): a setting older than the one the node holds for the same
	// pool is ignored.
	Generation int64
}

// poolProject owns a pool's sandboxes until a create claims one: it is
// within no key's scope.
const poolProject = ".pool"

// poolKey is the image and shape a pool's sandbox has, which a create's
// spec must have to claim it: its backend, image digest, resources, and
// whether it has a network (a pool's networked sandbox takes the
// create's policy when it is claimed).
func poolKey(spec *sandboxv1.SandboxSpec, digest string) string {
	shape, _ := proto.MarshalOptions{Deterministic: true}.Marshal(spec.Resources)
	key := spec.Backend + "|" + digest + "|" + hex.EncodeToString(shape)
	if spec.Network != nil {
		key += "|net"
	}
	if len(spec.Devices) > 0 {
		key += "|dev=" + strings.Join(spec.Devices, ",") // a pool's never has one (normalize)
	}
	return key
}

// pools are the node's warm pools.
type pools struct {
	e    *Edge
	kick chan struct{}
	// yieldKick asks the pools' loop to yield to the node's own; gone
	// takes sandboxes a claim gave up to that loop for removal.
	yieldKick chan struct{}
	gone      chan *sandbox.Sandbox
	// draining is set once the pools are emptied for good (Drain).
	draining atomic.Bool
	// claimedAt is when the last claim took a sandbox (unix ns): the
	// pools start none until pause (refillPause; tests change it) after it.
	claimedAt atomic.Int64
	pause     atomic.Int64

	mu    sync.Mutex
	ready map[string][]*sandbox.Sandbox // guarded by mu; by key, oldest first
	held  map[*sandbox.Sandbox]heldBy   // guarded by mu; every pool sandbox, ready or starting
	// The pools wanted (guarded by mu): the flags' (Config.Pools), each
	// replaced or removed by a SetPool of the same image and shape, which
	// the node keeps in its state (poolset.go). wants is the result; an
	// entry is replaced, never changed, so the loop may hold one.
	flags     []*poolWant
	overrides map[string]*poolWant // by identity; size 0 removes a flag's
	wants     []*poolWant
	// unloadable are settings of pools.json this start could not apply
	// (a backend or limit changed): written back with the others.
	unloadable []savedPool
}

// heldBy is a pool sandbox's key and what it holds of the node.
type heldBy struct {
	key string
	res *sandboxv1.Resources
}

// poolWant is a configured pool, its spec normalized.
type poolWant struct {
	Pool
	// source is where it was set: "flag" or "api".
	source string
	// failedAt is when its last start failed (the loop's alone): it is
	// tried again after poolRetry, and the other pools fill meanwhile.
	failedAt time.Time
	// skipped says why it is not filled at all ("": it is); lastErr is
	// its last start's error. Guarded by pools.mu.
	skipped, lastErr string
}

// resolve is the image w's name names now and w's key with it.
func (w *poolWant) resolve(e *Edge) (*image.Image, string, error) {
	im, err := e.parts.Resolve(w.Spec.Image, w.Project)
	if err != nil {
		return nil, "", err
	}
	return im, poolKey(w.Spec, im.Digest.String()), nil
}

// poolRetry is how long a pool whose start failed waits to try again.
const poolRetry = 10 * time.Second

// refillPause is how long the pools wait after a claim before they start
// another sandbox: a claimed sandbox's first commands come right after
// its create, and a start beside them (the runtime's, the agent's) took
// the first exec from 1.9 to 5-6 ms on this 2-core machine
// (bench/create). During a burst of claims the pools start nothing until
// it pauses; a create that finds its pool empty starts its own.
const refillPause = 100 * time.Millisecond

func newPools(e *Edge, cfg []Pool) (*pools, error) {
	p := &pools{e: e, kick: make(chan struct{}, 1), yieldKick: make(chan struct{}, 1), gone: make(chan *sandbox.Sandbox, 64), ready: map[string][]*sandbox.Sandbox{}, held: map[*sandbox.Sandbox]heldBy{}}
	for i, c := range cfg {
		if c.Size < 1 {
			return nil, errdefs.InvalidArgument("pool %d: size %d: want 1 or more", i+1, c.Size)
		}
		w, err := p.normalize(c, "flag")
		if err != nil {
			return nil, fmt.Errorf("pool %d: %w", i+1, err)
		}
		p.flags = append(p.flags, w)
	}
	p.pause.Store(int64(refillPause))
	var err error
	if p.overrides, err = p.loadOverrides(); err != nil {
		return nil, err
	}
	p.rebuildLocked()
	return p, nil
}

// normalize checks c and gives it a create's defaults; a pool's sandboxes
// have no network, environment or time to live of their own.
func (p *pools) normalize(c Pool, source string) (*poolWant, error) {
	e := p.e
	if c.Spec == nil || c.Project == "" {
		return nil, errdefs.InvalidArgument("a pool needs a spec and a project")
	}
	if len(c.Spec.Devices) > 0 {
		// A host device is one sandbox's at a time, and a pool's are no one's.
		return nil, errdefs.InvalidArgument("devices: a pool's sandboxes take no host device; create such a sandbox when it is needed")
	}
	spec := proto.Clone(c.Spec).(*sandboxv1.SandboxSpec)
	networked := spec.Network != nil
	spec.Network, spec.Env, spec.Metadata, spec.Task = nil, nil, nil, ""
	if networked {
		// Nothing out until a claim gives it the create's policy.
		spec.Network = &sandboxv1.NetworkPolicy{}
	}
	spec.TimeoutSeconds = e.cfg.Limits.MaxTimeout
	if err := sandboxspec.Normalize(spec, e.cfg.Limits, e.backends.known()); err != nil {
		return nil, err
	}
	if be, err := e.backends.get(spec.Backend); err == nil { // one not usable here never fills
		if err := checkMinMemory(be, spec.Resources); err != nil {
			return nil, err
		}
	}
	return &poolWant{Pool: Pool{Spec: spec, Project: c.Project, Size: c.Size, Generation: c.Generation}, source: source}, nil
}

// wantsNow is the pools wanted now.
func (p *pools) wantsNow() []*poolWant {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.wants
}

// poolHost is what a pool's sandbox reaches of the edge: its removal
// leaves the pool.
type poolHost struct{ p *pools }

func (h poolHost) Release(sb *sandbox.Sandbox)  { h.p.drop(sb) }
func (h poolHost) Forget(sb *sandbox.Sandbox)   { h.p.drop(sb) }
func (h poolHost) RemoveLayer(dir string) error { return h.p.e.parts.RemoveLayer(dir) }

// drop forgets sb, if the pool holds it.
func (p *pools) drop(sb *sandbox.Sandbox) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropLocked(sb)
}

func (p *pools) dropLocked(sb *sandbox.Sandbox) {
	delete(p.held, sb)
	for key, list := range p.ready {
		for i, r := range list {
			if r == sb {
				p.ready[key] = append(list[:i:i], list[i+1:]...)
				return
			}
		}
	}
}

// has says whether id is a pool's sandbox.
func (p *pools) has(id sandboxid.ID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for sb := range p.held {
		if sb.ID() == id {
			return true
		}
	}
	return false
}

// trim removes ready sandboxes no pool wants any more (their image's
// tag moved to another digest, or a pool was made smaller), the oldest
// first.
func (p *pools) trim(ctx context.Context) {
	want := p.sizeByKey()
	var extra []*sandbox.Sandbox
	p.mu.Lock()
	for key, list := range p.ready {
		if over := len(list) - want[key]; over > 0 {
			extra = append(extra, list[:over]...)
		}
	}
	for _, sb := range extra {
		p.dropLocked(sb)
	}
	p.mu.Unlock()
	for _, sb := range extra {
		p.e.log.Info("pool sandbox removed: no pool wants it any more", logging.SandboxID, sb.ID())
		p.remove(ctx, sb)
	}
}

// sizeByKey is how many sandboxes the node keeps of each pool key. Two
// pools whose images resolve to one digest, of one shape (py:3.11 and
// py:latest), share their sandboxes: a create of either claims them, so
// the node keeps the sum of their sizes.
func (p *pools) sizeByKey() map[string]int {
	want := map[string]int{}
	for _, w := range p.wantsNow() {
		if _, key, err := w.resolve(p.e); err == nil && p.skipped(w) == "" {
			want[key] += w.Size
		}
	}
	return want
}

// all is every pool sandbox, ready or starting.
func (p *pools) all() []*sandbox.Sandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*sandbox.Sandbox, 0, len(p.held))
	for sb := range p.held {
		out = append(out, sb)
	}
	return out
}

// take gives a ready sandbox of key out of its pool (the oldest), or nil,
// for claim.
func (p *pools) take(key string) *sandbox.Sandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	list := p.ready[key]
	if len(list) == 0 {
		return nil
	}
	// Out of ready, still held: until its claim is admitted (or failed)
	// it counts as the pool's, so no start of another takes its room.
	sb := list[0]
	p.ready[key] = list[1:]
	return sb
}

// ready counts the ready sandboxes of every pool.
func (p *pools) readyCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, list := range p.ready {
		n += len(list)
	}
	return n
}

func (p *pools) poke() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// heldUsage is what the pools' sandboxes hold.
func (p *pools) heldUsage() capacity.Usage {
	p.mu.Lock()
	defer p.mu.Unlock()
	var u capacity.Usage
	for _, h := range p.held {
		u.Add(h.res.CpuCores, h.res.MemoryMb, 1)
	}
	return u
}

// room says whether one more sandbox of r fits beside the registry's and
// the pools' own.
func (p *pools) room(r *sandboxv1.Resources) bool {
	used := plus(p.e.reg.allocatedNow(), p.heldUsage())
	return p.e.reg.capacity.Admit(string(p.e.node), used, r.CpuCores, r.MemoryMb, 1) == nil
}

// plus is u and v together.
func plus(u, v capacity.Usage) capacity.Usage {
	return capacity.Usage{Sandboxes: u.Sandboxes + v.Sandboxes, CPU: u.CPU + v.CPU, MemoryMB: u.MemoryMB + v.MemoryMB}
}

// yield gives up ready sandboxes while the registry's and the pools'
// together do not fit the node: a create never waits for a pool.
func (p *pools) yield(ctx context.Context) {
	for {
		held := p.heldUsage()
		if held.Sandboxes == 0 {
			return
		}
		if used := plus(p.e.reg.allocatedNow(), held); p.e.reg.capacity.Admit(string(p.e.node), used, 0, 0, 0) == nil {
			return
		}
		sb := p.takeAny()
		if sb == nil {
			return // only starting ones: they are checked when they are ready
		}
		p.e.log.Info("pool sandbox given up for the node's own", logging.SandboxID, sb.ID())
		p.remove(ctx, sb)
	}
}

// yieldSoon has the pools' loop yield to what the node's own admitted.
func (p *pools) yieldSoon() {
	select {
	case p.yieldKick <- struct{}{}:
	default:
	}
}

// removeLater has the pools' loop remove sb, taken from its pool.
func (p *pools) removeLater(ctx context.Context, sb *sandbox.Sandbox) {
	select {
	case p.gone <- sb:
	default:
		p.remove(ctx, sb)
	}
}

// checkHealth looks at the ready sandboxes as the node's own are looked
// at (an agent gone, a heartbeat unanswered); one found failed is removed,
// and the pool starts another, so a claim does not meet a dead one.
func (p *pools) checkHealth(now time.Time, wg *sync.WaitGroup) {
	p.mu.Lock()
	var ready []*sandbox.Sandbox
	for _, list := range p.ready {
		ready = append(ready, list...)
	}
	p.mu.Unlock()
	for _, sb := range ready {
		sb.CheckHealth(now, wg, p.e.snaps)
		// A create may have claimed it since the list was made: then it
		// is the node's, whose health loop has it, failed or not.
		v := sb.View()
		if v.State != sandboxv1.SandboxState_SANDBOX_STATE_FAILED || v.Project != poolProject {
			continue
		}
		p.drop(sb)
		p.e.log.Warn("pool sandbox failed while it waited; removed", logging.SandboxID, sb.ID(), "reason", v.Message)
		p.removeLater(context.Background(), sb)
		p.poke()
	}
}

// takeAny takes the newest ready sandbox of any pool.
func (p *pools) takeAny() *sandbox.Sandbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, list := range p.ready {
		if len(list) > 0 {
			sb := list[len(list)-1]
			p.dropLocked(sb)
			return sb
		}
	}
	return nil
}

// remove removes sb, taken from its pool.
func (p *pools) remove(ctx context.Context, sb *sandbox.Sandbox) {
	if err := sb.Destroy(context.WithoutCancel(ctx)); err != nil {
		p.e.log.Warn("remove a pool's sandbox", logging.SandboxID, sb.ID(), logging.Error, err)
	}
}

// run keeps each pool full until stop, starting one sandbox at a time
// (a pool must not slow the node's own creates more than one create
// does).
func (p *pools) run(stop <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { <-stop; cancel() }()
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	for {
		p.yield(ctx)
		p.trim(ctx)
		for p.fillOne(ctx) {
			if ctx.Err() != nil {
				break
			}
		}
		select {
		case <-stop:
			for {
				select {
				case sb := <-p.gone:
					p.remove(ctx, sb)
				default:
					return
				}
			}
		case sb := <-p.gone:
			p.remove(ctx, sb)
		case <-tick.C:
		case <-p.kick:
		case <-p.yieldKick:
		}
	}
}

// fillOne starts one sandbox for the first pool short of its size with
// room for it, and says whether it did.
func (p *pools) fillOne(ctx context.Context) bool {
	if p.draining.Load() || time.Since(time.Unix(0, p.claimedAt.Load())) < time.Duration(p.pause.Load()) {
		return false
	}
	sizes := p.sizeByKey()
	for _, w := range p.wantsNow() {
		be, err := p.e.backends.get(w.Spec.Backend)
		if err != nil {
			continue
		}
		if p.skipped(w) != "" || time.Since(w.failedAt) < poolRetry {
			continue
		}
		im, key, err := w.resolve(p.e)
		if err != nil {
			continue
		}
		if w.Spec.Network != nil && p.e.net == nil {
			p.mu.Lock()
			w.skipped = "its sandboxes have a network and the node runs without sandbox networking (" + p.e.netOff + ")"
			p.mu.Unlock()
			continue
		}
		if sandbox.HasService(im.Config.Config.Labels) {
			// Its service starts with the pool's environment, which a
			// claim does not change.
			p.mu.Lock()
			w.skipped = "the image starts a service"
			p.mu.Unlock()
			p.e.log.Warn("pool not filled: its image starts a service, which would keep the pool's environment", logging.Image, w.Spec.Image)
			continue
		}
		p.mu.Lock()
		have := 0
		for _, h := range p.held {
			if h.key == key {
				have++
			}
		}
		p.mu.Unlock()
		if have >= sizes[key] || !p.room(w.Spec.Resources) {
			continue
		}
		if err := p.start(ctx, w.Spec, key, im, be); err != nil {
			p.e.log.Warn("pool sandbox not started; the pool tries again later", logging.Image, w.Spec.Image, logging.Error, err, "after", poolRetry)
			w.failedAt = time.Now()
			p.mu.Lock()
			w.lastErr = err.Error()
			p.mu.Unlock()
			continue
		}
		p.mu.Lock()
		w.lastErr = ""
		p.mu.Unlock()
		return true
	}
	return false
}

// start starts one sandbox of spec for the pool of key.
func (p *pools) start(ctx context.Context, spec *sandboxv1.SandboxSpec, key string, im *image.Image, be backend.Backend) error {
	e := p.e
	rec := &records.Record{ID: sandboxid.New(e.node), Project: poolProject, State: records.StateCreating, CreatedAt: time.Now(),
		ImageDigest: im.Digest.String(), AgentVersion: e.parts.AgentVersion}
	if !be.Capabilities().LinkBeforeAgent {
		rec.AgentKey = agentlink.NewKey()
	}
	if err := rec.SetSpec(proto.Clone(spec).(*sandboxv1.SandboxSpec)); err != nil {
		return err
	}
	sb := p.newSandbox(rec, be)
	p.mu.Lock()
	p.held[sb] = heldBy{key: key, res: spec.Resources}
	p.mu.Unlock()
	began := time.Now()
	if err := sb.Start(ctx, im); err != nil {
		if derr := sb.Discard(context.WithoutCancel(ctx)); derr != nil {
			// What is left of it stays counted (held) until a restart
			// of the edge removes it.
			e.log.Error("clean up a pool sandbox that failed to start", logging.SandboxID, rec.ID, logging.Error, derr)
			return err
		}
		p.drop(sb)
		return err
	}
	p.mu.Lock()
	_, still := p.held[sb]
	still = still && !p.draining.Load()
	if still {
		p.ready[key] = append(p.ready[key], sb)
	} else {
		p.dropLocked(sb)
	}
	p.mu.Unlock()
	if !still { // removed while it started
		p.remove(ctx, sb)
		return nil
	}
	e.log.Debug("pool sandbox started", logging.SandboxID, rec.ID, logging.Image, spec.Image, "took", time.Since(began).Round(time.Millisecond))
	p.yield(ctx) // the node's own may have grown meanwhile
	return nil
}

// newSandbox is a pool's sandbox of rec on be.
func (p *pools) newSandbox(rec *records.Record, be backend.Backend) *sandbox.Sandbox {
	return p.e.newSandboxWith(rec, be, poolHost{p})
}

// adopt takes back a pool's sandbox a previous run of the edge left, if
// a pool still wants its key; else it is removed.
func (p *pools) adopt(ctx context.Context, rec *records.Record, be backend.Backend) error {
	sb := p.newSandbox(rec, be)
	key := poolKey(rec.Spec, rec.ImageDigest)
	p.mu.Lock()
	p.held[sb] = heldBy{key: key, res: rec.Spec.Resources}
	p.mu.Unlock()
	wanted := false
	for _, w := range p.wantsNow() {
		if _, k, err := w.resolve(p.e); err == nil && k == key {
			wanted = true
		}
	}
	if err := sb.Reattach(ctx, &p.e.wg); err != nil || !wanted || rec.State != records.StateRunning {
		p.remove(ctx, sb)
		return err
	}
	p.mu.Lock()
	p.ready[key] = append(p.ready[key], sb)
	p.mu.Unlock()
	return nil
}

// claim gives sb, taken from a pool, to a create of spec in project (of
// reservation), registered with the node's admission; on an error sb is
// removed and the create goes on without it.
func (p *pools) claim(ctx context.Context, sb *sandbox.Sandbox, spec *sandboxv1.SandboxSpec, project, reservation string, im *image.Image) (*sandboxv1.Sandbox, error) {
	e := p.e
	admit := func() error {
		err := e.reg.admit(sb, reservation, e.diskOf(sb.Backend(), spec.Resources))
		if err != nil {
			e.prom.refused(err)
		}
		return err
	}
	err := sb.Claim(ctx, spec, project, reservation, im, sandboxHost{e}, admit)
	if err != nil {
		p.removeLater(ctx, sb) // still the pool's: its removal drops it
		return nil, err
	}
	p.drop(sb) // the registry's now
	p.claimedAt.Store(time.Now().UnixNano())
	time.AfterFunc(time.Duration(p.pause.Load()), p.poke)
	return sb.View(), nil
}

// ParsePool reads a pool from its flag form,
// "IMAGE=SIZE[,backend=B][,cpu=CORES][,memory=MIB][,disk=MIB][,project=P][,network=true]"
// (backend container, project root and no network unless named; resources
// a create's defaults unless named).
func ParsePool(s string) (Pool, error) {
	fields := strings.Split(s, ",")
	name, size, ok := strings.Cut(fields[0], "=")
	if !ok || name == "" {
		return Pool{}, errdefs.InvalidArgument("pool %q: want IMAGE=SIZE first, then backend=, cpu=, memory=, disk=, project= or network=", errdefs.Clip(s, 80))
	}
	n, err := strconv.Atoi(size)
	if err != nil || n < 1 || n > maxPoolSize {
		return Pool{}, errdefs.InvalidArgument("pool %q: size %q: want a whole number from 1 to %d", errdefs.Clip(s, 80), errdefs.Clip(size, 20), maxPoolSize)
	}
	p := Pool{Spec: &sandboxv1.SandboxSpec{Backend: "container", Image: name, Resources: &sandboxv1.Resources{}}, Project: "root", Size: n}
	r := p.Spec.Resources
	for _, f := range fields[1:] {
		k, v, _ := strings.Cut(f, "=")
		var err error
		switch k {
		case "backend":
			p.Spec.Backend = v
		case "project":
			p.Project = v
		case "cpu":
			r.CpuCores, err = strconv.ParseFloat(v, 64)
			if err == nil && (math.IsNaN(r.CpuCores) || r.CpuCores <= 0) {
				err = errors.New("not a positive number")
			}
		case "memory":
			r.MemoryMb, err = strconv.ParseInt(v, 10, 64)
		case "disk":
			r.DiskMb, err = strconv.ParseInt(v, 10, 64)
		case "network":
			var on bool
			if on, err = strconv.ParseBool(v); on {
				p.Spec.Network = &sandboxv1.NetworkPolicy{}
			}
		default:
			return Pool{}, errdefs.InvalidArgument("pool %q: %q: want backend=, cpu=, memory=, disk=, project= or network=", errdefs.Clip(s, 80), errdefs.Clip(f, 40))
		}
		if err != nil || v == "" {
			return Pool{}, errdefs.InvalidArgument("pool %q: %s %q: %v", errdefs.Clip(s, 80), k, errdefs.Clip(v, 20), cmp.Or(err, errors.New("empty")))
		}
	}
	return p, nil
}

// maxPoolSize bounds one pool (each of its sandboxes runs).
const maxPoolSize = sandboxspec.MaxPoolSize

// DrainPools stops the node's warm pools and removes their sandboxes,
// for good (the next start of the edge fills its pools again).
func (e *Edge) DrainPools(ctx context.Context) {
	e.pools.draining.Store(true)
	for sb := e.pools.takeAny(); sb != nil; sb = e.pools.takeAny() {
		e.pools.remove(ctx, sb)
	}
}

// PoolReady is how many sandboxes the node's warm pools hold ready.
func (e *Edge) PoolReady() int { return e.pools.readyCount() }

// PoolSandboxes are the ids of the sandboxes the node's warm pools hold
// ready, each pool's in the order creates claim them.
func (e *Edge) PoolSandboxes() []string {
	p := e.pools
	p.mu.Lock()
	defer p.mu.Unlock()
	var ids []string
	for _, list := range p.ready {
		for _, sb := range list {
			ids = append(ids, string(sb.ID()))
		}
	}
	return ids
}

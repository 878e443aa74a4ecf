package edge

import (
	"context"
	"errors"
	"sort"
	"strings"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// sandboxHost is the edge as its sandboxes reach it (sandbox.Host).
type sandboxHost struct{ e *Edge }

func (h sandboxHost) Release(sb *sandbox.Sandbox)  { h.e.release(sb) }
func (h sandboxHost) Forget(sb *sandbox.Sandbox)   { h.e.forget(sb) }
func (h sandboxHost) RemoveLayer(dir string) error { return h.e.parts.RemoveLayer(dir) }

// newSandbox is the sandbox of rec on backend be, on this edge.
func (e *Edge) newSandbox(rec *records.Record, be backend.Backend) *sandbox.Sandbox {
	return e.newSandboxWith(rec, be, sandboxHost{e})
}

// newSandboxWith is newSandbox reaching the edge through host (a warm
// pool's sandbox reaches its pool).
func (e *Edge) newSandboxWith(rec *records.Record, be backend.Backend, host sandbox.Host) *sandbox.Sandbox {
	return sandbox.New(rec, be, sandbox.Env{Node: e.node, Dir: e.dirs.sandbox(rec.ID), RunDir: e.dirs.run(rec.ID), AgentTimeout: e.cfg.AgentTimeout, PausedLifetime: e.cfg.PausedLifetime,
		Net: asSandboxNetwork(e.net), NetOff: e.netOff, Disk: e.disk, Records: e.records, Expiry: e.expiry, Host: host, Parts: &e.parts, Log: e.log})
}

// Create admits, prepares and starts a sandbox, and returns once its agent
// is connected. On any failure nothing of it is left behind.
func (e *Edge) Create(ctx context.Context, spec *sandboxv1.SandboxSpec, project string) (*sandboxv1.Sandbox, error) {
	return e.CreateFor(ctx, spec, project, "")
}

// CreateFor is Create for an apiserver's quota reservation, which the
// sandbox records (FenceReservation finds it by it).
func (e *Edge) CreateFor(ctx context.Context, spec *sandboxv1.SandboxSpec, project, reservation string) (*sandboxv1.Sandbox, error) {
	defer e.kickPrune() // what it unpacked may take the cache past its limit
	if err := sandboxspec.Normalize(spec, e.cfg.Limits, e.backends.known()); err != nil {
		return nil, err
	}
	if project == "" {
		return nil, errdefs.InvalidArgument("project: empty")
	}
	be, err := e.backendFor(spec)
	if err != nil {
		return nil, err
	}
	if err := checkPolicy(asSandboxNetwork(e.net), "network.rules", spec.Network); err != nil {
		return nil, err
	}
	im, err := e.parts.Resolve(spec.Image, project)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	if sb := e.pools.take(poolKey(spec, im.Digest.String())); sb != nil {
		v, err := e.pools.claim(ctx, sb, spec, project, reservation, im)
		e.prom.claimed(err)
		if err == nil {
			e.prom.created(be.Name(), now, nil)
			e.log.Info("sandbox claimed from a warm pool", logging.SandboxID, v.Id, logging.Project, project, logging.Image, spec.Image, "took", time.Since(now).Round(time.Millisecond))
			return v, nil
		}
		if errors.Is(err, errdefs.ErrResourceExhausted) {
			return nil, err // the node is full: a create of its own would not fit either
		}
		e.log.Warn("pool sandbox not claimed; the create starts one", logging.SandboxID, sb.ID(), logging.Error, err)
	}
	rec := &records.Record{ID: sandboxid.New(e.node), Project: project, State: records.StateCreating, CreatedAt: now, ImageDigest: im.Digest.String(), Reservation: reservation,
		AgentVersion: e.parts.AgentVersion}
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
	err = sb.Start(ctx, im)
	e.prom.created(be.Name(), now, err)
	if err != nil {
		if cerr := sb.Discard(context.WithoutCancel(ctx)); cerr != nil {
			log.Error("clean up a sandbox that failed to start", logging.Error, cerr)
		}
		return nil, err
	}
	log.Info("sandbox started", logging.Project, project, logging.Image, spec.Image, "took", time.Since(now).Round(time.Millisecond))
	return sb.View(), nil
}

// backendFor is the backend that runs sandboxes of spec (normalized),
// which must give them the memory its guests need.
func (e *Edge) backendFor(spec *sandboxv1.SandboxSpec) (backend.Backend, error) {
	be, err := e.backends.get(spec.Backend)
	if err != nil {
		return nil, err
	}
	if err := checkMinMemory(be, spec.Resources); err != nil {
		return nil, err
	}
	return be, checkDevices(be, spec.Devices)
}

// checkDevices refuses host devices to a backend that passes none
// through.
func checkDevices(be backend.Backend, devices []string) error {
	if len(devices) > 0 && !be.Capabilities().PCIDevices {
		return errdefs.InvalidArgument("devices %s: backend %q passes no host PCI device through; the vm backend does", strings.Join(devices, ", "), be.Name())
	}
	return nil
}

// checkMinMemory refuses resources with less memory than be's sandboxes
// need.
func checkMinMemory(be backend.Backend, r *sandboxv1.Resources) error {
	if least := be.Capabilities().MinMemoryMB; r.MemoryMb < least {
		return errdefs.InvalidArgument("resources.memory_mb %d: backend %q needs at least %d (its guest kernel and agent)", r.MemoryMb, be.Name(), least)
	}
	return nil
}

// admit reserves capacity for rec and registers its sandbox.
func (e *Edge) admit(rec *records.Record, be backend.Backend) (*sandbox.Sandbox, error) {
	sb := e.newSandbox(rec, be)
	if err := e.reg.admit(sb, rec.Reservation, e.diskOf(be, rec.Spec.Resources)); err != nil {
		sb.End()
		e.prom.refused(err)
		return nil, err
	}
	e.pools.yieldSoon()
	return sb, nil
}

// forget unregisters sb and releases its capacity.
func (e *Edge) forget(sb *sandbox.Sandbox) {
	e.release(sb)
	e.reg.forget(sb)
}

// release gives back what sb was admitted with, once. The sandbox calls
// it (Host.Release) under its own lock.
func (e *Edge) release(sb *sandbox.Sandbox) {
	e.reg.release(sb, e.diskOf(sb.Backend(), sb.Resources()))
}

// diskOf is what a sandbox's disk limit takes from the node's disk: its
// disk_mb if its backend keeps the writable layer (or a VM's disk) there.
func (e *Edge) diskOf(be backend.Backend, r *sandboxv1.Resources) int64 {
	caps := be.Capabilities()
	if (e.parts.Layers == nil || !caps.DiskLayer) && !caps.DiskFile {
		return 0
	}
	return r.DiskMb
}

// Resume continues a paused sandbox.
func (e *Edge) Resume(ctx context.Context, id, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	v, err := sb.Resume(ctx)
	e.prom.took("resume", sb.Backend().Name(), began, err)
	return v, err
}

// Destroy stops and removes a sandbox the caller may see, and returns its
// last description.
func (e *Edge) Destroy(ctx context.Context, id, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	if err := sb.Destroy(ctx); err != nil {
		return nil, err
	}
	return sb.View(), nil
}

// DestroyAll removes every sandbox in scope and returns how many.
func (e *Edge) DestroyAll(ctx context.Context, scope string) (int, error) {
	var errs []error
	n := 0
	for _, sb := range e.reg.all() {
		if !project.Within(sb.Project(), scope) {
			continue
		}
		if err := sb.Destroy(ctx); err != nil {
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
	return sb.View(), nil
}

// List lists the sandboxes in scope, oldest first.
func (e *Edge) List(scope string) []*sandboxv1.Sandbox {
	var out []*sandboxv1.Sandbox
	for _, sb := range e.reg.all() {
		s := sb.View()
		if project.Within(s.Project, scope) {
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
	return sb.SetTimeout(seconds)
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
		out = append(out, sb.View())
	}
	return out, nil
}

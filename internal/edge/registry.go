package edge

import (
	"crypto/rand"
	"sync"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/edge/diskroom"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// registry is the edge's sandboxes by id, what they were admitted with,
// and the reservations another apiserver took over. Lock order: a
// sandbox's mu before the registry's (a removal unregisters while holding
// its sandbox's lock), so no sandbox lock is taken under it; the disk
// room's is taken under it.
type registry struct {
	node     sandboxid.NodeID
	capacity capacity.Node
	disk     *diskroom.Room
	// epoch names this run of the edge; with seq it stamps what Status
	// counts. Apiservers drop a placement they count themselves once a
	// status stamped at or after its admission shows it (status.go).
	epoch string

	mu    sync.Mutex
	boxes map[sandboxid.ID]*sandbox.Sandbox // guarded by mu
	// admitSeqs are the usage changes that counted the admitted
	// sandboxes (guarded by mu).
	admitSeqs map[sandboxid.ID]uint64
	fenced    map[string]time.Time // guarded by mu; reservations taken over, when
	allocated capacity.Usage       // guarded by mu
	seq       uint64               // guarded by mu; changes of what Status counts
}

func newRegistry(node sandboxid.NodeID, room capacity.Node, disk *diskroom.Room) *registry {
	return &registry{node: node, capacity: room, disk: disk, epoch: rand.Text(),
		boxes: map[sandboxid.ID]*sandbox.Sandbox{}, admitSeqs: map[sandboxid.ID]uint64{}, fenced: map[string]time.Time{}}
}

// admit counts sb (of reservation, taking diskMB of the node's disk)
// against the node's capacity and registers it, or says why it does not
// fit.
func (r *registry) admit(sb *sandbox.Sandbox, reservation string, diskMB int64) error {
	res := sb.Resources()
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, fenced := r.fenced[reservation]; fenced && reservation != "" {
		return errdefs.FailedPrecondition("reservation %s: another apiserver took its create over (the client retried there)", reservation)
	}
	if err := r.capacity.Admit(string(r.node), r.allocated, res.CpuCores, res.MemoryMb, 1); err != nil {
		return err
	}
	if err := r.disk.Admit(diskMB); err != nil {
		return capacity.Refused("disk", err)
	}
	r.allocated.Add(res.CpuCores, res.MemoryMb, 1)
	r.boxes[sb.ID()] = sb
	r.seq++
	r.admitSeqs[sb.ID()] = r.seq
	return nil
}

// allocatedNow is what the admitted sandboxes hold.
func (r *registry) allocatedNow() capacity.Usage {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.allocated
}

// adopt registers a sandbox a previous run of the edge left; counted says
// it still holds what it was admitted with.
func (r *registry) adopt(sb *sandbox.Sandbox, counted bool, diskMB int64) {
	res := sb.Resources()
	r.mu.Lock()
	defer r.mu.Unlock()
	r.boxes[sb.ID()] = sb
	if counted {
		r.allocated.Add(res.CpuCores, res.MemoryMb, 1)
		r.disk.Count(diskMB)
	}
}

// release gives back what sb was admitted with, once. The sandbox calls
// it (Host.Release) under its own lock.
func (r *registry) release(sb *sandbox.Sandbox, diskMB int64) {
	if sb.MarkReleased() {
		return
	}
	res := sb.Resources()
	r.mu.Lock()
	r.allocated.Add(res.CpuCores, res.MemoryMb, -1)
	r.disk.Count(-diskMB) // with the rest, as an admission sees them
	r.seq++               // a failed sandbox that holds nothing is no longer counted
	r.mu.Unlock()
	r.disk.Publish()
}

// forget unregisters sb.
func (r *registry) forget(sb *sandbox.Sandbox) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.boxes[sb.ID()] == sb {
		delete(r.boxes, sb.ID())
		delete(r.admitSeqs, sb.ID())
		r.seq++
	}
}

// get is the sandbox id, if registered.
func (r *registry) get(id sandboxid.ID) (*sandbox.Sandbox, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	sb, ok := r.boxes[id]
	return sb, ok
}

// all is every registered sandbox.
func (r *registry) all() []*sandbox.Sandbox {
	out, _ := r.stamped()
	return out
}

// stamped is all() and the usage change it reflects, read together.
func (r *registry) stamped() ([]*sandbox.Sandbox, *edgev1.UsageStamp) {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*sandbox.Sandbox, 0, len(r.boxes))
	for _, sb := range r.boxes {
		out = append(out, sb)
	}
	return out, &edgev1.UsageStamp{Epoch: r.epoch, Seq: r.seq}
}

// admissionStamp is the usage change that counted the last admitted of
// ids (ids no longer here are skipped).
func (r *registry) admissionStamp(ids ...string) *edgev1.UsageStamp {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := &edgev1.UsageStamp{Epoch: r.epoch}
	for _, id := range ids {
		if seq, ok := r.admitSeqs[sandboxid.ID(id)]; ok && seq > st.Seq {
			st.Seq = seq
		}
	}
	return st
}

// fence refuses any later admission for reservation and returns the
// sandboxes admitted for it. A fence is kept for fenceKept.
func (r *registry) fence(reservation string, now time.Time) []*sandbox.Sandbox {
	r.mu.Lock()
	defer r.mu.Unlock()
	for res, at := range r.fenced {
		if now.Sub(at) > fenceKept {
			delete(r.fenced, res)
		}
	}
	r.fenced[reservation] = now
	var out []*sandbox.Sandbox
	for _, sb := range r.boxes {
		if sb.Reservation() == reservation { // set before the box is admitted, never after
			out = append(out, sb)
		}
	}
	return out
}

// lookupAny finds a sandbox of this node by id alone, for public port
// requests.
func (r *registry) lookupAny(id string) (*sandbox.Sandbox, error) {
	sid, node, err := sandboxid.Parse(id)
	if err != nil {
		return nil, err
	}
	sb, ok := r.get(sid)
	if node != r.node || !ok {
		return nil, errdefs.NotFound("sandbox %s: no such sandbox", id)
	}
	return sb, nil
}

// ofTask lists the sandboxes of task in scope.
func (r *registry) ofTask(task, scope string) []*sandbox.Sandbox {
	var out []*sandbox.Sandbox
	for _, sb := range r.all() {
		v := sb.View()
		if v.GetSpec().GetTask() == task && project.Within(v.Project, scope) {
			out = append(out, sb)
		}
	}
	return out
}

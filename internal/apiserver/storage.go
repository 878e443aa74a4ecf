package apiserver

import (
	"context"
	"sync"

	"github.com/opencontainers/go-digest"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/project"
)

// Storage quotas [ours]. A project's storage is what its subtree keeps:
// the blobs of its images in the shared store (config and layers, each
// counted once however many of its images share it) and its snapshots on
// the edges. Quota.storage_mb bounds it on every ancestor that sets one.
// An import stops streaming once it would pass the tightest room left;
// a snapshot is refused when no room is left, and removed again when it
// turned out larger than the room. It is counted from the store and the
// edges at each import or snapshot, not kept in IAM: a storage change
// needs no Raft write, and nothing can drift; an edge that does not answer
// fails the count (unavailable) rather than count as empty. Imports and
// snapshots at the same moment on one apiserver see each other through
// storageHolds; on two apiservers they do not, and together can pass the
// quota by what the other adds.

// storage is what the cluster stores, to be counted by project.
type storage struct {
	images    []*image.Image
	snapshots []*sandboxv1.Snapshot
}

// storageIn reads what scope's subtree stores.
func (s *Server) storageIn(ctx context.Context, scope string) (*storage, error) {
	images, err := s.images.List(scope)
	if err != nil {
		return nil, err
	}
	snaps, err := s.snapshotsIn(ctx, scope, true)
	if err != nil {
		return nil, err
	}
	return &storage{images: images, snapshots: snaps}, nil
}

// usedBy is what proj's subtree stores, in bytes.
func (st *storage) usedBy(proj string) int64 {
	var n int64
	seen := map[digest.Digest]bool{}
	for _, im := range st.images {
		if !project.Within(im.Ref.Project, proj) {
			continue
		}
		for _, d := range append(im.Manifest.Layers, im.Manifest.Config) {
			if !seen[d.Digest] {
				seen[d.Digest] = true
				n += d.Size
			}
		}
	}
	for _, sn := range st.snapshots {
		if project.Within(sn.Project, proj) {
			n += sn.SizeBytes
		}
	}
	return n
}

// storageBudget is one import's or snapshot's room under the storage
// quotas of its project and their ancestors, as counted when it began.
type storageBudget struct {
	holds  *storageHolds
	proj   string
	began  uint64         // holds.seq when it began
	limits []storageLimit // empty: no quota binds it
	// registered says it is among holds.active (a quota binds it).
	registered bool
	held       int64 // guarded by holds.mu
	over       func(need int64) error
}

// storageLimit is what one quota left when a budget began.
type storageLimit struct {
	proj string
	left int64
}

// storageHolds are the bytes of imports and snapshots under way on this
// apiserver, so that two at once see each other's room taken: each take
// counts the others' holds, and the holds that ended since it began
// (stored by now, but not in its count of the store).
type storageHolds struct {
	mu       sync.Mutex
	seq      uint64
	active   map[*storageBudget]struct{} // guarded by mu
	finished []endedHold                 // guarded by mu; ended since the oldest active began
}

type endedHold struct {
	seq   uint64
	proj  string
	bytes int64
}

func newStorageHolds() *storageHolds {
	return &storageHolds{active: map[*storageBudget]struct{}{}}
}

// begin registers b before its store is counted: what ends later is
// counted as ended, never missed. Only bound budgets are registered.
func (h *storageHolds) begin(b *storageBudget) {
	h.mu.Lock()
	defer h.mu.Unlock()
	b.began, b.registered = h.seq, true
	h.active[b] = struct{}{}
}

// heldWithin is what the budgets other than self hold in proj's subtree,
// with the holds that ended after self began. Callers hold h.mu.
func (h *storageHolds) heldWithin(proj string, self *storageBudget) int64 {
	var n int64
	for b := range h.active {
		if b != self && project.Within(b.proj, proj) {
			n += b.held
		}
	}
	for _, e := range h.finished {
		if e.seq > self.began && project.Within(e.proj, proj) {
			n += e.bytes
		}
	}
	return n
}

// limited says whether a storage quota binds b.
func (b *storageBudget) limited() bool { return len(b.limits) > 0 }

// take raises what b holds to total bytes, or answers the quota's error
// when that with the others' holds passes what a quota left.
func (b *storageBudget) take(total int64) error {
	if !b.limited() {
		return nil
	}
	h := b.holds
	h.mu.Lock()
	defer h.mu.Unlock()
	if total <= b.held {
		return nil
	}
	for _, l := range b.limits {
		if others := h.heldWithin(l.proj, b); total+others > l.left {
			return b.over(total + others)
		}
	}
	b.held = total
	return nil
}

// done ends b once what it stored is in the store (or nothing was).
func (b *storageBudget) done() {
	if !b.registered {
		return
	}
	h := b.holds
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.active, b)
	h.seq++
	if b.held > 0 {
		h.finished = append(h.finished, endedHold{seq: h.seq, proj: b.proj, bytes: b.held})
	}
	// An ended hold matters only to budgets that began before it ended.
	oldest := h.seq
	for a := range h.active {
		oldest = min(oldest, a.began)
	}
	keep := h.finished[:0]
	for _, e := range h.finished {
		if e.seq > oldest {
			keep = append(keep, e)
		}
	}
	h.finished = keep
}

// storageBudgetFor counts the room proj has under the storage quotas of it
// and its ancestors; the caller takes from it as it stores and ends it
// with done once what it stored is counted by the store (or the edges).
func (s *Server) storageBudgetFor(ctx context.Context, proj string) (*storageBudget, error) {
	b := &storageBudget{holds: s.storageHolds, proj: proj}
	state := s.iam.State()
	ancestry := project.Ancestry(proj)
	bound := false
	for _, p := range ancestry {
		if pr, ok := state.Project(p); ok && pr.Quota.StorageMB > 0 {
			bound = true
		}
	}
	if !bound {
		return b, nil
	}
	s.storageHolds.begin(b)
	var st *storage
	tightest, used, quota := "", int64(0), int64(0)
	var room int64
	for _, p := range ancestry {
		pr, ok := state.Project(p)
		if !ok || pr.Quota.StorageMB <= 0 {
			continue
		}
		if st == nil {
			// The farthest ancestor's subtree holds every nearer one's.
			var err error
			if st, err = s.storageIn(ctx, ancestry[len(ancestry)-1]); err != nil {
				b.done()
				return nil, err
			}
		}
		u := st.usedBy(p)
		left := pr.Quota.StorageMB<<20 - u
		b.limits = append(b.limits, storageLimit{proj: p, left: left})
		if tightest == "" || left < room {
			room, tightest, used, quota = left, p, u, pr.Quota.StorageMB
		}
	}
	b.over = func(need int64) error {
		return errdefs.ResourceExhausted("storage quota of project %s: its images and snapshots hold %d of %d MiB, and this needs about %d MiB with what is being stored now; delete images (dsec image rm) or snapshots, or ask an admin of its parent for more",
			tightest, (used+1<<20-1)>>20, quota, (need+1<<20-1)>>20)
	}
	return b, nil
}

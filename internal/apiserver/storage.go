package apiserver

import (
	"context"

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
// snapshots at the same moment each see the same room: together they can
// pass the quota by what each adds.

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

// storageRoom is how many bytes proj may still store under the storage
// quotas of it and its ancestors (limited false: none set one), and the
// error to answer once a write would pass it.
func (s *Server) storageRoom(ctx context.Context, proj string) (room int64, limited bool, over func(need int64) error, err error) {
	state := s.iam.State()
	ancestry := project.Ancestry(proj)
	var st *storage
	tightest := ""
	var quota int64
	for _, p := range ancestry {
		pr, ok := state.Project(p)
		if !ok || pr.Quota.StorageMB <= 0 {
			continue
		}
		if st == nil {
			// The farthest ancestor's subtree holds every nearer one's.
			if st, err = s.storageIn(ctx, ancestry[len(ancestry)-1]); err != nil {
				return 0, false, nil, err
			}
		}
		left := pr.Quota.StorageMB<<20 - st.usedBy(p)
		if !limited || left < room {
			room, limited, tightest, quota = left, true, p, pr.Quota.StorageMB
		}
	}
	used := int64(0)
	if limited {
		used = st.usedBy(tightest)
	}
	over = func(need int64) error {
		return errdefs.ResourceExhausted("storage quota of project %s: its images and snapshots hold %d of %d MiB, and this needs about %d MiB; delete images (dsec image rm) or snapshots, or ask an admin of its parent for more",
			tightest, (used+1<<20-1)>>20, quota, (need+1<<20-1)>>20)
	}
	return room, limited, over, nil
}

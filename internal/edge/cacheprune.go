package edge

import (
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/logging"
)

// The node's layer cache keeps each unpacked layer for as long as an image
// of the store or a sandbox or snapshot of this node needs it [ours]: a
// deleted image's layers go from the node within pruneEvery of its
// sandboxes' end (image.Cache.Prune), and so do the files a backend keeps
// per image (backend.CachePruner: microvm's root disks).
const (
	pruneEvery = 10 * time.Minute
	pruneGrace = 10 * time.Minute // a create between unpacking and mounting
)

// pruneCache removes the unpacked layers nothing needs any more.
func (e *Edge) pruneCache(grace time.Duration) int64 {
	seen := map[digest.Digest]bool{}
	var inUse []digest.Digest
	use := func(d string) {
		if md := digest.Digest(d); d != "" && !seen[md] {
			seen[md] = true
			inUse = append(inUse, md)
		}
	}
	for _, sb := range e.reg.all() {
		use(sb.View().GetImageDigest())
	}
	for _, d := range e.snaps.ImageDigests() {
		use(d)
	}
	freed, err := e.parts.Cache.Prune(inUse, grace)
	if err != nil {
		e.log.Warn("prune the layer cache", logging.Error, err)
	}
	for _, b := range e.backends.usable {
		if p, ok := b.(backend.CachePruner); ok {
			n, err := p.PruneCache(grace)
			if err != nil {
				e.log.Warn("prune a backend's cache", "backend", b.Name(), logging.Error, err)
			}
			freed += n
		}
	}
	if freed > 0 {
		e.log.Info("layer cache pruned", "freed_bytes", freed)
	}
	return freed
}

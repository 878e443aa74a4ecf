package edge

import (
	"fmt"
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

// pruneCache removes the unpacked layers nothing needs any more, and,
// with a cache limit, the least recently used ones beyond it; each
// removal is logged with why.
func (e *Edge) pruneCache(grace time.Duration) int64 {
	freed, _ := e.pruneCacheReport(grace)
	return freed
}

func (e *Edge) pruneCacheReport(grace time.Duration) (int64, []string) {
	seen := map[digest.Digest]bool{}
	var inUse []digest.Digest
	use := func(d string) {
		if md := digest.Digest(d); d != "" && !seen[md] {
			seen[md] = true
			inUse = append(inUse, md)
		}
	}
	for _, sb := range append(e.reg.all(), e.pools.all()...) {
		use(sb.View().GetImageDigest())
	}
	for _, d := range e.snaps.ImageDigests() {
		use(d)
	}
	res, err := e.parts.Cache.Prune(inUse, grace, e.cfg.LayerCacheLimit)
	if err != nil {
		e.log.Warn("prune the layer cache", logging.Error, err)
	}
	for _, r := range res.Removed {
		e.log.Info("layer removed from the node's cache", "layer", r)
	}
	freed := res.Freed
	removed := res.Removed
	for _, b := range e.backends.usable {
		if p, ok := b.(backend.CachePruner); ok {
			n, err := p.PruneCache(grace)
			if err != nil {
				e.log.Warn("prune a backend's cache", "backend", b.Name(), logging.Error, err)
			}
			if n > 0 {
				removed = append(removed, fmt.Sprintf("%s backend's per-image files (%.1f MiB): no sandbox or snapshot uses them", b.Name(), float64(n)/(1<<20)))
			}
			freed += n
		}
	}
	if freed > 0 {
		e.log.Info("layer cache pruned", "freed_bytes", freed, "cache_bytes", res.Size)
	}
	return freed, removed
}

// kickedPruneEvery spaces the prunes creates ask for: each walks the
// whole cache, which a burst of creates must not keep doing.
const kickedPruneEvery = 30 * time.Second

// pruneLoop prunes the layer cache every pruneEvery, and when a create
// asks (kickPrune) while the cache has a limit, at most every
// kickedPruneEvery.
func (e *Edge) pruneLoop() {
	tick := time.NewTicker(pruneEvery)
	defer tick.Stop()
	var kicked time.Time
	for {
		select {
		case <-e.stop:
			return
		case <-tick.C:
		case <-e.pruneKick:
			if time.Since(kicked) < kickedPruneEvery {
				continue
			}
			kicked = time.Now()
		}
		e.pruneCache(pruneGrace)
	}
}

// kickPrune asks for a prune soon if the cache has a limit.
func (e *Edge) kickPrune() {
	if e.cfg.LayerCacheLimit <= 0 || e.pruneKick == nil {
		return
	}
	select {
	case e.pruneKick <- struct{}{}:
	default: // one is asked for already
	}
}

// gcGrace is how recent a layer's use may be for `dsec image gc` to
// remove it: long enough for a create that unpacked it to mount it.
const gcGrace = 5 * time.Second

// CollectGarbage prunes the layer cache now (`dsec image gc`) and says
// what went and why.
func (e *Edge) CollectGarbage() (int64, []string) { return e.pruneCacheReport(gcGrace) }

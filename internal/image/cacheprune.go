package image

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/opencontainers/go-digest"
)

// LayersOf returns the layer digests of the image whose manifest is md.
func (s *Store) LayersOf(md digest.Digest) ([]digest.Digest, error) {
	if err := validDigest(md); err != nil {
		return nil, err
	}
	m, err := s.loadManifest(md)
	if err != nil {
		return nil, err
	}
	out := make([]digest.Digest, 0, len(m.Layers))
	for _, l := range m.Layers {
		out = append(out, l.Digest)
	}
	return out, nil
}

// PruneResult is what a prune of the layer cache did.
type PruneResult struct {
	Freed int64
	// Removed says, for each layer removed, its size and why.
	Removed []string
	// Size is what the cache holds after it.
	Size int64
}

// Prune removes the node's unpacked layers that no image of the store and
// no image of inUse (the manifests of the node's sandboxes and snapshots)
// has, unless used or unpacked within grace (a create between unpacking
// and mounting). With a limit, it then removes the least recently used
// layers that no sandbox or snapshot of the node needs until the cache
// holds at most limit bytes: a stored image's layers are unpacked again
// when a sandbox next needs them. If a manifest of inUse cannot be read,
// nothing is removed: what it needs is unknown.
func (c *Cache) Prune(inUse []digest.Digest, grace time.Duration, limit int64) (PruneResult, error) {
	var res PruneResult
	stored := map[string]bool{}
	images, err := c.store.List("")
	if err != nil {
		return res, err
	}
	for _, im := range images {
		for _, l := range im.Manifest.Layers {
			stored[filepath.Base(c.LayerDir(l.Digest))] = true
		}
	}
	needed := map[string]bool{}
	for _, md := range inUse {
		layers, err := c.store.LayersOf(md)
		if err != nil {
			return res, fmt.Errorf("layers of %s, which a sandbox here uses: %w; no layer pruned", md, err)
		}
		for _, l := range layers {
			needed[filepath.Base(c.LayerDir(l))] = true
		}
	}
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return res, err
	}
	type cached struct {
		name     string
		size     int64
		lastUsed time.Time
	}
	// Sizes are counted before the lock: a walk of a large cache must not
	// hold up the creates that mark layers used.
	var all []cached
	for _, ent := range ents {
		name := ent.Name()
		if !ent.IsDir() || name == "tmp" {
			continue
		}
		fi, err := ent.Info()
		if err != nil {
			continue
		}
		size := int64(0) // a mounted EROFS form takes nothing of the node's disk
		if !isEROFSLayer(filepath.Join(c.dir, name)) {
			size = dirSize(filepath.Join(c.dir, name))
		}
		all = append(all, cached{name: name, size: size, lastUsed: fi.ModTime()})
	}
	c.mu.Lock()
	defer c.mu.Unlock() // no unpack finishes meanwhile
	var kept []cached
	var errs []error
	remove := func(l cached, why string) {
		if err := unmountLayer(filepath.Join(c.dir, l.name, "fs")); err != nil {
			errs = append(errs, err)
			return
		}
		if err := os.RemoveAll(filepath.Join(c.dir, l.name)); err != nil {
			errs = append(errs, err)
			return
		}
		delete(c.used, l.name)
		res.Freed += l.size
		res.Removed = append(res.Removed, fmt.Sprintf("%s (%.1f MiB): %s", l.name, float64(l.size)/(1<<20), why))
	}
	for _, l := range all {
		name := l.name
		if used, ok := c.used[name]; ok && used.After(l.lastUsed) {
			l.lastUsed = used
		}
		recent := time.Since(l.lastUsed) < grace
		if !stored[name] && !needed[name] && !recent {
			remove(l, "no stored image and no sandbox or snapshot here uses it")
			continue
		}
		res.Size += l.size
		if !needed[name] && !recent && l.size > 0 { // a mounted form frees nothing
			kept = append(kept, l)
		}
	}
	if limit > 0 && res.Size > limit {
		sort.Slice(kept, func(i, j int) bool { return kept[i].lastUsed.Before(kept[j].lastUsed) })
		for _, l := range kept {
			if res.Size <= limit {
				break
			}
			remove(l, fmt.Sprintf("the cache held %.1f MiB, over its limit of %.1f MiB, and this layer was the least recently used (%s) that no sandbox or snapshot here needs", float64(res.Size)/(1<<20), float64(limit)/(1<<20), l.lastUsed.UTC().Format(time.RFC3339)))
			res.Size -= l.size
		}
	}
	return res, errors.Join(errs...)
}

// dirSize is what a directory tree holds on disk, in bytes.
func dirSize(dir string) int64 {
	var n int64
	filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error { //nolint:errcheck // a best-effort count
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return n
}

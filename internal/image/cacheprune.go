package image

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
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

// Prune removes the node's unpacked layers that no image of the store and
// no image of inUse (the manifests of the node's sandboxes and snapshots)
// has, unless used or unpacked within grace (a create between unpacking
// and mounting), and returns the bytes freed. If a manifest of inUse
// cannot be read, nothing is removed: what it needs is unknown.
func (c *Cache) Prune(inUse []digest.Digest, grace time.Duration) (int64, error) {
	keep := map[string]bool{}
	images, err := c.store.List("")
	if err != nil {
		return 0, err
	}
	for _, im := range images {
		for _, l := range im.Manifest.Layers {
			keep[filepath.Base(c.LayerDir(l.Digest))] = true
		}
	}
	for _, md := range inUse {
		layers, err := c.store.LayersOf(md)
		if err != nil {
			return 0, fmt.Errorf("layers of %s, which a sandbox here uses: %w; no layer pruned", md, err)
		}
		for _, l := range layers {
			keep[filepath.Base(c.LayerDir(l))] = true
		}
	}
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	defer c.mu.Unlock() // no unpack finishes meanwhile
	var freed int64
	var errs []error
	for _, ent := range ents {
		name := ent.Name()
		if !ent.IsDir() || name == "tmp" || keep[name] {
			continue
		}
		if used, ok := c.used[name]; ok && time.Since(used) < grace {
			continue
		}
		fi, err := ent.Info()
		if err != nil || time.Since(fi.ModTime()) < grace {
			continue
		}
		size := dirSize(filepath.Join(c.dir, name))
		if err := os.RemoveAll(filepath.Join(c.dir, name)); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(c.used, name)
		freed += size
	}
	return freed, errors.Join(errs...)
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

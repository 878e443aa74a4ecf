package image

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
)

// PruneGrace is how old an unreferenced blob must be before Prune removes
// it: an import stores its blobs before it names its image, and a blob it
// reuses is touched when it does (PutBlob), so a blob younger than this
// may belong to an import in progress.
const PruneGrace = time.Hour

// Prune removes the blobs that no name of the store and no manifest of
// keep (the images running sandboxes and snapshots were made from)
// references, if older than grace, and returns the bytes freed. A manifest
// that cannot be read marks nothing of its own: its name's blobs are kept
// only by other references (the name is broken anyway).
func (s *Store) Prune(keep []digest.Digest, grace time.Duration) (int64, error) {
	live := map[digest.Digest]bool{}
	liveRoots := map[string]bool{}
	mark := func(md digest.Digest) {
		live[md] = true
		m, err := s.loadManifest(md)
		if err != nil {
			return
		}
		liveRoots[vmRootKeyOf(m)+".erofs"] = true
		liveRoots[vmRootKeyOf(m)+".erofs.lock"] = true
		live[m.Config.Digest] = true
		for _, l := range m.Layers {
			live[l.Digest] = true
		}
	}
	images, err := s.List("")
	if err != nil {
		return 0, err
	}
	for _, im := range images {
		mark(im.Digest)
	}
	for _, d := range keep {
		if validDigest(d) == nil {
			mark(d)
		}
	}
	dir := filepath.Join(s.dir, "blobs", string(digest.SHA256))
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	var freed int64
	var errs []error
	for _, ent := range ents {
		d := digest.NewDigestFromEncoded(digest.SHA256, ent.Name())
		if live[d] || d.Validate() != nil {
			continue
		}
		fi, err := ent.Info()
		if err != nil || time.Since(fi.ModTime()) < grace {
			continue
		}
		if err := os.Remove(filepath.Join(dir, ent.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		freed += fi.Size()
	}
	// A layer's EROFS form goes with its blob (a node that mounted it
	// keeps reading it until it unmounts it).
	forms, _ := os.ReadDir(filepath.Join(s.dir, "blobs", "erofs"))
	for _, ent := range forms {
		hex, _ := strings.CutSuffix(ent.Name(), ".failed")
		d := digest.NewDigestFromEncoded(digest.SHA256, hex)
		if live[d] || d.Validate() != nil || s.HasBlob(d) {
			continue
		}
		fi, err := ent.Info()
		if err != nil {
			continue
		}
		if err := os.Remove(filepath.Join(s.dir, "blobs", "erofs", ent.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		freed += fi.Size()
	}
	// MicroVM roots of images no name and no sandbox uses.
	roots, _ := os.ReadDir(s.VMRootDir())
	for _, ent := range roots {
		fi, err := ent.Info()
		if err != nil || liveRoots[ent.Name()] || time.Since(fi.ModTime()) < grace {
			continue
		}
		if err := os.Remove(filepath.Join(s.VMRootDir(), ent.Name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
			continue
		}
		freed += fi.Size()
	}
	return freed, errors.Join(errs...)
}

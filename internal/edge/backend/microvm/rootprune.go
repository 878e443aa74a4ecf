package microvm

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// A root disk (roots/KEY.ext4) is made once per image per node and hard
// linked into each guest's and each snapshot's directory, so its link
// count says whether anything uses it. Where a link cannot be made (another
// file system) the guest names it by a symlink instead, and the root is
// marked (KEY.ext4.linked) to be kept for good.
const symlinkedSuffix = ".linked"

// PruneCache implements backend.CachePruner: it removes the template
// snapshots, what was taken of images' kernels that no guest boots, and
// then the root disks that no guest or snapshot links to, each unused by
// any create within grace.
func (b *Backend) PruneCache(grace time.Duration) (int64, error) {
	// Templates first: each links its root disk.
	freed, err := b.tpl.prune(grace)
	errs := []error{err}
	n, err := b.pruneKernels(grace)
	freed += n
	errs = append(errs, err)
	dir := filepath.Join(b.cfg.StateDir, "roots")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return freed, errors.Join(append(errs, err)...)
	}
	for _, ent := range ents {
		key, ok := strings.CutSuffix(ent.Name(), ".ext4")
		if !ok || ent.IsDir() {
			continue
		}
		n, err := b.pruneRoot(dir, key, grace)
		freed += n
		if err != nil {
			errs = append(errs, err)
		}
	}
	return freed, errors.Join(errs...)
}

// pruneRoot removes one root disk if nothing uses it, under its key's lock
// (rootImage holds it while it makes or hands out that root).
func (b *Backend) pruneRoot(dir, key string, grace time.Duration) (int64, error) {
	l := b.rootLock(key)
	l.Lock()
	defer l.Unlock()
	path := filepath.Join(dir, key+".ext4")
	if _, err := os.Stat(path + symlinkedSuffix); err == nil {
		return 0, nil
	}
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || st.Nlink > 1 || time.Since(fi.ModTime()) < grace {
		return 0, nil
	}
	if err := os.Remove(path); err != nil {
		return 0, err
	}
	b.log.Info("root image pruned", "image", key, "bytes", st.Blocks*512)
	return st.Blocks * 512, nil
}

// rootLock is the lock of the root disk named key.
func (b *Backend) rootLock(key string) *sync.Mutex {
	b.mu.Lock()
	defer b.mu.Unlock()
	l := b.roots[key]
	if l == nil {
		l = &sync.Mutex{}
		b.roots[key] = l
	}
	return l
}

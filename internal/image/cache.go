package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
)

// Cache is a node's unpacked-layer cache: each layer is unpacked once, when a
// sandbox first needs it, and shared read-only by every sandbox on the node.
type Cache struct {
	dir   string
	store *Store
	log   *slog.Logger

	mu       sync.Mutex
	inflight map[digest.Digest]*unpackCall // guarded by mu
	used     map[string]time.Time          // guarded by mu; by LayerDir's base: when Layers last handed it out
}

type unpackCall struct {
	done chan struct{}
	err  error
}

// NewCache opens the cache at dir.
func NewCache(dir string, store *Store) (*Cache, error) {
	if err := os.MkdirAll(filepath.Join(dir, "tmp"), 0o700); err != nil {
		return nil, err
	}
	// Half-unpacked layers from a crash are garbage.
	ents, _ := os.ReadDir(filepath.Join(dir, "tmp"))
	for _, e := range ents {
		os.RemoveAll(filepath.Join(dir, "tmp", e.Name()))
	}
	return &Cache{dir: dir, store: store, log: store.log, inflight: map[digest.Digest]*unpackCall{}, used: map[string]time.Time{}}, nil
}

// LayerDir is where a layer's files are once unpacked. The name is short,
// because overlayfs takes every lower directory in one mount option of at
// most a page.
func (c *Cache) LayerDir(d digest.Digest) string {
	return filepath.Join(c.dir, d.Encoded()[:16])
}

// Layers returns the unpacked directories of im's layers, lowest first,
// unpacking the ones this node has not seen yet.
func (c *Cache) Layers(ctx context.Context, im *Image, progress Progress) ([]string, error) {
	dirs := make([]string, 0, len(im.Manifest.Layers))
	for i, l := range im.Manifest.Layers {
		stage := fmt.Sprintf("unpacking layer %d/%d", i+1, len(im.Manifest.Layers))
		// Marked first: a Prune after this keeps it, one before made
		// ensure unpack it again.
		c.mu.Lock()
		c.used[filepath.Base(c.LayerDir(l.Digest))] = time.Now()
		c.mu.Unlock()
		if err := c.ensure(ctx, l, stage, progress); err != nil {
			return nil, err
		}
		dirs = append(dirs, filepath.Join(c.LayerDir(l.Digest), "fs"))
	}
	return dirs, nil
}

// Has reports whether a layer is ready: unpacked, or its EROFS form
// mounted.
func (c *Cache) Has(d digest.Digest) bool {
	dir := c.LayerDir(d)
	data, err := os.ReadFile(filepath.Join(dir, "digest"))
	if err != nil || string(data) != d.String() {
		return false
	}
	if isEROFSLayer(dir) {
		return isMountPoint(filepath.Join(dir, "fs")) // gone with a reboot
	}
	return true
}

// isEROFSLayer reports whether a layer directory mounts the layer's EROFS
// form instead of holding it unpacked.
func isEROFSLayer(dir string) bool {
	_, err := os.Stat(filepath.Join(dir, "erofs"))
	return err == nil
}

// prepare makes a layer ready: its EROFS form mounted where the store has
// one and the kernel mounts it, else unpacked.
func (c *Cache) prepare(l ocispec.Descriptor, stage string, progress Progress) error {
	if validDigest(l.Digest) == nil && erofsKernel() && c.store.HasEROFS(l.Digest) {
		err := c.mountLayer(l.Digest)
		if err == nil {
			return nil
		}
		c.log.Warn("could not mount a layer's EROFS form; unpacking it", "layer", l.Digest.String(), logging.Error, err)
	}
	return c.unpack(l, stage, progress)
}

// mountLayer mounts the layer's EROFS form from the store at its
// directory's fs: the directory (with its digest and an "erofs" mark) is
// put in place first, then mounted, so a crash between leaves a directory
// that Has does not take for ready.
func (c *Cache) mountLayer(d digest.Digest) error {
	dir := c.LayerDir(d)
	data, err := os.ReadFile(filepath.Join(dir, "digest"))
	if err != nil || string(data) != d.String() || !isEROFSLayer(dir) {
		tmp, err := os.MkdirTemp(filepath.Join(c.dir, "tmp"), "layer-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		for _, f := range []struct{ name, data string }{{"erofs", c.store.EROFSPath(d) + "\n"}, {"digest", d.String()}} {
			if err := os.WriteFile(filepath.Join(tmp, f.name), []byte(f.data), 0o644); err != nil {
				return err
			}
		}
		if err := os.Mkdir(filepath.Join(tmp, "fs"), 0o755); err != nil {
			return err
		}
		// A stale directory under the short name (another digest, an
		// unpacked copy, a crash) goes first.
		if err := unmountLayer(filepath.Join(dir, "fs")); err != nil {
			return err
		}
		if err := os.RemoveAll(dir); err != nil {
			return err
		}
		if err := os.Rename(tmp, dir); err != nil {
			return err
		}
	}
	if isMountPoint(filepath.Join(dir, "fs")) {
		return nil // mounted already: a second mount would stack on it
	}
	return mountEROFS(c.store.EROFSPath(d), filepath.Join(dir, "fs"))
}

func (c *Cache) ensure(ctx context.Context, l ocispec.Descriptor, stage string, progress Progress) error {
	if c.Has(l.Digest) {
		return nil
	}
	c.mu.Lock()
	if call, ok := c.inflight[l.Digest]; ok {
		c.mu.Unlock()
		select {
		case <-call.done:
			return call.err
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	call := &unpackCall{done: make(chan struct{})}
	c.inflight[l.Digest] = call
	c.mu.Unlock()
	if !c.Has(l.Digest) { // another call may have made it since the look above
		call.err = c.prepare(l, stage, progress)
	}
	c.mu.Lock()
	delete(c.inflight, l.Digest)
	c.mu.Unlock()
	close(call.done)
	return call.err
}

func (c *Cache) unpack(l ocispec.Descriptor, stage string, progress Progress) error {
	tmp, err := os.MkdirTemp(filepath.Join(c.dir, "tmp"), "layer-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	if err := c.store.unpackStored(l, filepath.Join(tmp, "fs"), stage, progress); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(tmp, "digest"), []byte(l.Digest.String()), 0o644); err != nil {
		return err
	}
	dst := c.LayerDir(l.Digest)
	if err := os.Rename(tmp, dst); err != nil {
		if c.Has(l.Digest) {
			return nil
		}
		// A stale directory under the short name (another digest or a crash).
		if rerr := os.RemoveAll(dst); rerr != nil {
			return rerr
		}
		return os.Rename(tmp, dst)
	}
	return nil
}

// UnmountLayers unmounts the layers' EROFS forms, at a node's shutdown,
// so that a stopped node leaves no mounts of its own. Running sandboxes
// are not affected (overlayfs holds private clones of its lower mounts);
// the cache stays usable: a layer is mounted again when next needed.
func (c *Cache) UnmountLayers() error {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range ents {
		dir := filepath.Join(c.dir, e.Name(), "fs")
		if !e.IsDir() || !isMountPoint(dir) {
			continue
		}
		if err := unix.Unmount(dir, 0); err != nil {
			errs = append(errs, fmt.Errorf("unmount layer %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}

// unpackStored unpacks the stored layer l into dir (made here), checking
// its digest as it reads it.
func (s *Store) unpackStored(l ocispec.Descriptor, dir, stage string, progress Progress) error {
	if err := validDigest(l.Digest); err != nil {
		return err
	}
	f, err := os.Open(s.BlobPath(l.Digest))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return errdefs.NotFound("layer %s: not in the image store", l.Digest)
		}
		return err
	}
	defer f.Close()
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	h := sha256.New()
	counted := &countingReader{r: io.TeeReader(f, h), total: l.Size, stage: stage, p: progress}
	dr, err := decompress(counted)
	if err != nil {
		return err
	}
	defer dr.Close()
	if err := unpackLayer(dr, dir, l.Size); err != nil {
		return fmt.Errorf("unpack layer %s: %w", l.Digest, err)
	}
	io.Copy(io.Discard, counted) //nolint:errcheck // trailing padding, for the digest
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != l.Digest.String() {
		return fmt.Errorf("layer %s: content has digest %s (corrupt image store)", l.Digest, got)
	}
	return nil
}

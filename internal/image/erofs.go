package image

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/loopdev"
)

// EROFS forms of layers [ours; the paper loads layers on demand from its
// shared file system]: when a name is set on an image (an import, a pull,
// a commit, a build), each of its layers is also written once into the
// store as an EROFS image (blobs/erofs/HEX, the layer unpacked and packed
// by mkfs.erofs, overlayfs whiteouts and opaque directories kept). A node
// mounts that file read-only, straight from the shared store (file-backed
// EROFS, no loop device), as the layer's lower directory: nothing is
// unpacked on a node and files are read when a sandbox opens them.
//
// Where mkfs.erofs (erofs-utils) is missing, or the store is written by a
// process that is not root (a layer's whiteouts are device nodes), layers
// get no EROFS form and nodes unpack them as before; where the kernel has
// no EROFS, nodes unpack too.

// EROFSPath is where the EROFS image of layer d is kept.
func (s *Store) EROFSPath(d digest.Digest) string {
	return filepath.Join(s.dir, "blobs", "erofs", d.Encoded())
}

// HasEROFS reports whether layer d has its EROFS image in the store.
func (s *Store) HasEROFS(d digest.Digest) bool {
	if validDigest(d) != nil {
		return false
	}
	fi, err := os.Stat(s.EROFSPath(d))
	return err == nil && fi.Mode().IsRegular()
}

// erofsFailed is where a layer's failed conversion is described, so that
// it is not tried again at every name set on it.
func (s *Store) erofsFailed(d digest.Digest) string { return s.EROFSPath(d) + ".failed" }

var mkfsEROFS = sync.OnceValue(func() string {
	if os.Geteuid() != 0 {
		return ""
	}
	p, _ := exec.LookPath("mkfs.erofs")
	return p
})

// CanMakeEROFS reports whether this process makes EROFS forms of layers.
func CanMakeEROFS() bool { return mkfsEROFS() != "" }

// makeEROFS writes the EROFS images the manifest's layers lack. A layer
// whose conversion fails keeps no EROFS image (nodes unpack it) and the
// reason in blobs/erofs/HEX.failed; the first such error is returned for
// the caller to log, never to fail on.
func (s *Store) makeEROFS(ctx context.Context, m ocispec.Manifest) error {
	if !CanMakeEROFS() || s.noEROFS {
		return nil
	}
	var first error
	for _, l := range m.Layers {
		if validDigest(l.Digest) != nil || s.HasEROFS(l.Digest) {
			continue
		}
		if fi, err := os.Stat(s.erofsFailed(l.Digest)); err == nil && time.Since(fi.ModTime()) < time.Hour {
			continue // tried within the hour (a full disk passes; a bad layer does not)
		}
		if err := s.makeLayerEROFS(ctx, l); err != nil {
			if ctx.Err() != nil {
				return err
			}
			os.WriteFile(s.erofsFailed(l.Digest), []byte(err.Error()+"\n"), 0o644) //nolint:errcheck // only spares a retry
			if first == nil {
				first = fmt.Errorf("layer %s: no EROFS form (nodes unpack it instead): %w", l.Digest, err)
			}
		}
	}
	return first
}

// EROFSMaker makes layers' EROFS forms in the background, one at a time,
// while the layers after them are still being fetched (a pull); Tag then
// finds them made.
type EROFSMaker struct {
	layers chan ocispec.Descriptor
	done   chan struct{}
	close  sync.Once
}

// StartEROFS starts an EROFSMaker; Wait ends it.
func (s *Store) StartEROFS(ctx context.Context) *EROFSMaker {
	m := &EROFSMaker{layers: make(chan ocispec.Descriptor, 1024), done: make(chan struct{})}
	go func() {
		defer close(m.done)
		for l := range m.layers {
			if ctx.Err() == nil {
				s.makeEROFS(ctx, ocispec.Manifest{Layers: []ocispec.Descriptor{l}}) //nolint:errcheck // Tag reports it
			}
		}
	}()
	return m
}

// Add queues a stored layer.
func (m *EROFSMaker) Add(l ocispec.Descriptor) {
	select {
	case m.layers <- l:
	default: // a manifest of more layers than the queue: Tag makes the rest
	}
}

// Wait returns once every queued layer is done (it may be called again).
func (m *EROFSMaker) Wait() {
	m.close.Do(func() { close(m.layers) })
	<-m.done
}

func (s *Store) makeLayerEROFS(ctx context.Context, l ocispec.Descriptor) error {
	tmp, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "erofs-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	root := filepath.Join(tmp, "fs")
	if err := s.unpackStored(l, root, "", nil); err != nil {
		return err
	}
	out := filepath.Join(tmp, "layer.erofs")
	var msg bytes.Buffer
	cmd := exec.CommandContext(ctx, mkfsEROFS(), out, root)
	cmd.Stdout, cmd.Stderr = &msg, &msg
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("mkfs.erofs: %v: %s", err, strings.TrimSpace(msg.String()))
	}
	if err := os.MkdirAll(filepath.Dir(s.EROFSPath(l.Digest)), 0o755); err != nil {
		return err
	}
	if err := os.Chmod(out, 0o444); err != nil {
		return err
	}
	if err := syncFile(out); err != nil {
		return err
	}
	// The name is set last, and the directory synced: a crash leaves only
	// a temporary directory, which the next open of the store sweeps, or
	// the whole image.
	if err := os.Rename(out, s.EROFSPath(l.Digest)); err != nil {
		return err
	}
	return syncFile(filepath.Dir(s.EROFSPath(l.Digest)))
}

// syncFile flushes a file or directory to its disk.
func syncFile(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// VMRootDir is where microVM root disks made once per image live: EROFS
// images of the image's merged layers, shared by every node's guests
// (internal/edge/backend/microvm), named by VMRootKey.
func (s *Store) VMRootDir() string { return filepath.Join(s.dir, "blobs", "vm-root") }

// VMRootKey names the merged root of an image by its layers, given as the
// first 16 hex digits of each digest (what a node's layer directories are
// named), lowest first.
func VMRootKey(layers []string) string {
	sum := sha256.Sum256([]byte(strings.Join(layers, "\n")))
	return hex.EncodeToString(sum[:16])
}

// vmRootKeyOf is VMRootKey of a manifest's layers.
func vmRootKeyOf(m ocispec.Manifest) string {
	short := make([]string, len(m.Layers))
	for i, l := range m.Layers {
		short[i] = l.Digest.Encoded()[:min(16, len(l.Digest.Encoded()))]
	}
	return VMRootKey(short)
}

// erofsKernel reports whether this kernel mounts EROFS.
var erofsKernel = sync.OnceValue(func() bool {
	data, err := os.ReadFile("/proc/filesystems")
	return err == nil && bytes.Contains(data, []byte("\terofs\n"))
})

// mountEROFS mounts the EROFS image file at dir, read-only: straight from
// the file where the kernel can (6.12 and later), else through a loop
// device.
func mountEROFS(file, dir string) error {
	err := unix.Mount(file, dir, "erofs", unix.MS_RDONLY, "")
	if errors.Is(err, unix.ENOTBLK) {
		err = loopdev.Mount(file, dir, "erofs", unix.MS_RDONLY, "")
	}
	if err != nil {
		return fmt.Errorf("mount the EROFS image %s at %s: %w", file, dir, err)
	}
	return nil
}

// isMountPoint reports whether dir is on another file system than its
// parent (something is mounted there).
func isMountPoint(dir string) bool {
	var st, parent unix.Stat_t
	if unix.Lstat(dir, &st) != nil || unix.Lstat(filepath.Dir(dir), &parent) != nil {
		return false
	}
	return st.Dev != parent.Dev
}

// unmountLayer unmounts a mounted layer directory (a no-op for an
// unpacked one).
func unmountLayer(dir string) error {
	if !isMountPoint(dir) {
		return nil
	}
	if err := unix.Unmount(dir, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("unmount layer %s: %w", dir, err)
	}
	return nil
}

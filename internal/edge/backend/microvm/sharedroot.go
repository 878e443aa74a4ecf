package microvm

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/image"
)

// Shared roots [ours]: where the image store has room for them
// (Options.RootStore, the store's blobs/vm-root), an image's root disk is
// an EROFS image of its merged layers, made once for every node by the
// first that needs it (mkfs.erofs takes a fifth of mkfs.ext4's time) and
// named by the image's layers (image.VMRootKey), so that other nodes and
// later creates only link to it. The guest mounts it read-only by its
// magic (cmd/dsec-vminit), which needs the guest kernel's erofs module.
// Elsewhere the node builds an ext4 root per image as before (rootImage).

// sharedRootSuffix ends a shared root's name.
const sharedRootSuffix = ".erofs"

var layerDirRE = regexp.MustCompile(`/([0-9a-f]{16})/fs/?$`)

// sharedRootKey is the key of the image whose layer directories are
// given, if each is a node's layer cache directory (…/HEX16/fs).
func sharedRootKey(layers []string) (string, bool) {
	short := make([]string, len(layers))
	for i, l := range layers {
		m := layerDirRE.FindStringSubmatch(l)
		if m == nil {
			return "", false
		}
		short[i] = m[1]
	}
	return image.VMRootKey(short), true
}

// sharedRootsWhyNot says why shared roots cannot be used here, or "".
func (b *Backend) sharedRootsWhyNot() string {
	switch {
	case b.rootStore == "":
		return "no root store"
	case b.mkfsEROFS == "":
		return "mkfs.erofs (erofs-utils) is not installed"
	}
	if _, err := os.Stat(filepath.Join(b.qemu.Modules, "erofs.ko")); err != nil {
		return "the guest kernel has no erofs module (scripts/guest-kernel.sh fetches it)"
	}
	return ""
}

// sharedRoot returns the shared root of key, making it from the merged
// tree merged gives if no node has.
func (b *Backend) sharedRoot(ctx context.Context, key string, merged func() (string, func(), error)) (string, error) {
	out := filepath.Join(b.rootStore, key+sharedRootSuffix)
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	if err := os.MkdirAll(b.rootStore, 0o755); err != nil {
		return "", err
	}
	// Nodes sharing the store take turns: the second waits for the first's
	// root instead of making its own.
	lock, err := os.OpenFile(out+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := flockContext(ctx, lock); err != nil {
		return "", err
	}
	if _, err := os.Stat(out); err == nil {
		return out, nil
	}
	tree, done, err := merged()
	if err != nil {
		return "", err
	}
	defer done()
	tmp := fmt.Sprintf("%s.%d.tmp", out, os.Getpid())
	os.Remove(tmp)
	var msg bytes.Buffer
	cmd := exec.CommandContext(ctx, b.mkfsEROFS, tmp, tree)
	cmd.Stdout, cmd.Stderr = &msg, &msg
	if err := cmd.Run(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("microvm: mkfs.erofs of the image's root: %v: %s", err, strings.TrimSpace(msg.String()))
	}
	if err := os.Chmod(tmp, 0o444); err != nil {
		return "", err
	}
	return out, os.Rename(tmp, out)
}

// flockContext takes an exclusive lock on f, giving up when ctx ends.
func flockContext(ctx context.Context, f *os.File) error {
	done := make(chan error, 1)
	go func() { done <- unix.Flock(int(f.Fd()), unix.LOCK_EX) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		// The lock is released when f is closed, even if taken later.
		return ctx.Err()
	}
}

// WithRootStore returns backend options (name → options) in which the
// microvm and vm backends, where named, keep their shared roots in dir
// unless they name a root store of their own (both make the same root of
// an image); opts is not changed.
func WithRootStore(opts map[string]map[string]string, dir string) map[string]map[string]string {
	out := make(map[string]map[string]string, len(opts))
	for k, v := range opts {
		out[k] = v
	}
	for _, name := range []string{Name, VMName} {
		o, ok := opts[name]
		if !ok || o["root-store"] != "" {
			continue
		}
		mo := make(map[string]string, len(o)+1)
		for k, v := range o {
			mo[k] = v
		}
		mo["root-store"] = dir
		out[name] = mo
	}
	return out
}

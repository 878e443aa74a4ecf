// Package rootfs stacks a sandbox's root file system: the image's unpacked
// layers, shared read-only by every sandbox on the node, under the sandbox's
// own writable layer, with overlayfs [paper: layering; ours: overlayfs].
package rootfs

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Layout names the directories of one sandbox's root file system.
type Layout struct {
	Upper  string // the sandbox's writable layer
	Work   string // overlayfs work directory (same file system as Upper)
	Target string // where the merged tree is mounted
}

// LayoutIn returns the standard layout below dir.
func LayoutIn(dir string) Layout {
	return Layout{Upper: filepath.Join(dir, "upper"), Work: filepath.Join(dir, "work"), Target: filepath.Join(dir, "rootfs")}
}

// Mount stacks layers (lowest first) under l.Upper at l.Target.
func Mount(layers []string, l Layout) error {
	if len(layers) == 0 {
		return errdefs.InvalidArgument("rootfs: no layers")
	}
	for _, d := range []string{l.Upper, l.Work, l.Target} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	// The options name the directories relative to their common parent, and
	// the mount is made from there: the sandbox sees its options in
	// /proc/self/mountinfo, which then shows paths below the edge's state
	// directory (cache/…, layers/…) and not where that directory is (the
	// edge keeps layers and writable layers under it; directories with no
	// common parent but / would show nearly whole). Shorter options also
	// leave room for more layers in the page.
	base := commonDir(append([]string{l.Upper, l.Work}, layers...))
	rel := func(p string) string {
		if r, err := filepath.Rel(base, p); err == nil && !strings.HasPrefix(r, "..") {
			return r
		}
		return p
	}
	lower := make([]string, len(layers))
	for i, d := range layers {
		if strings.ContainsAny(d, ":,") {
			return fmt.Errorf("rootfs: layer path %q has ':' or ','", d)
		}
		lower[len(layers)-1-i] = rel(d) // overlayfs wants the top first
	}
	opts := "lowerdir=" + strings.Join(lower, ":") + ",upperdir=" + rel(l.Upper) + ",workdir=" + rel(l.Work)
	if len(opts) >= os.Getpagesize() {
		return errdefs.Unsupported("rootfs: %d layers make the overlay mount options longer than a page (%d bytes)", len(layers), os.Getpagesize())
	}
	if err := mountIn(base, "overlay", l.Target, "overlay", opts); err != nil {
		return fmt.Errorf("rootfs: mount overlay at %s: %w", l.Target, err)
	}
	return nil
}

// commonDir is the deepest directory containing every path.
func commonDir(paths []string) string {
	dir := filepath.Clean(paths[0])
	for _, p := range paths[1:] {
		p = filepath.Clean(p)
		for dir != "/" && p != dir && !strings.HasPrefix(p, dir+"/") {
			dir = filepath.Dir(dir)
		}
	}
	return dir
}

// mountIn mounts with dir as the working directory, so relative paths in
// opts resolve there. The working directory belongs to the whole process,
// so the mount runs on a thread of its own that unshares it and then ends
// (a goroutine that exits locked to its thread takes the thread with it).
func mountIn(dir, source, target, fstype, opts string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_FS); err != nil {
			errc <- os.NewSyscallError("unshare(CLONE_FS)", err)
			return
		}
		if err := unix.Chdir(dir); err != nil {
			errc <- err
			return
		}
		errc <- unix.Mount(source, target, fstype, 0, opts)
	}()
	return <-errc
}

// Unmount removes the mount at target (and anything mounted below it). A
// busy mount is detached lazily, which still frees it once unused.
func Unmount(target string) error {
	for i := 0; i < 50; i++ {
		mounted, err := IsMounted(target)
		if err != nil || !mounted {
			return err
		}
		err = unix.Unmount(target, 0)
		switch {
		case err == nil, errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOENT):
			continue
		case errors.Is(err, unix.EBUSY):
			if i >= 10 {
				if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
					return fmt.Errorf("rootfs: detach %s: %w", target, err)
				}
				continue
			}
			time.Sleep(20 * time.Millisecond)
		default:
			return fmt.Errorf("rootfs: unmount %s: %w", target, err)
		}
	}
	return fmt.Errorf("rootfs: %s is still mounted", target)
}

// IsMounted reports whether something is mounted at path or below it.
func IsMounted(path string) (bool, error) {
	mounts, err := MountsUnder(path)
	return len(mounts) > 0, err
}

// HoldsOwnFileSystem reports whether path is the root of a file system
// other than its parent directory's: a mount of another device. It costs
// two stats, where IsMountPoint reads the whole mount table (on a node of
// a thousand sandboxes, two thousand lines for every create).
func HoldsOwnFileSystem(path string) (bool, error) {
	var st, parent unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return false, err
	}
	if err := unix.Stat(filepath.Dir(filepath.Clean(path)), &parent); err != nil {
		return false, err
	}
	return st.Dev != parent.Dev, nil
}

// IsMountPoint reports whether something is mounted exactly at path.
func IsMountPoint(path string) (bool, error) {
	mounts, err := MountsUnder(path)
	for _, m := range mounts {
		if m == filepath.Clean(path) {
			return true, err
		}
	}
	return false, err
}

// MountsUnder lists mount points at or below path, from /proc/self/mountinfo.
func MountsUnder(path string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	path = filepath.Clean(path)
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		mp := unescapeOctal(fields[4])
		if mp == path || strings.HasPrefix(mp, path+"/") {
			out = append(out, mp)
		}
	}
	return out, sc.Err()
}

// unescapeOctal undoes mountinfo's \040-style escapes.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

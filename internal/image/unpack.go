package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
)

const (
	whiteoutPrefix = ".wh."
	whiteoutOpaque = ".wh..wh..opq"
	// overlayfs marks an opaque directory with this xattr.
	opaqueXattr = "trusted.overlay.opaque"
)

// MaxLayerBytes bounds what one layer may expand to on a node, so a
// compression bomb cannot fill the layer cache's disk. A variable for tests.
var MaxLayerBytes int64 = 64 << 30

// unpackLayer applies an uncompressed layer tar to dir, converting OCI
// whiteouts to overlayfs ones (a 0/0 character device for a removed file, the
// opaque xattr for a replaced directory). No entry may write outside dir: a
// name with "..", or a path through a symlink, is refused. compressed is
// the layer blob's size: its content may expand only so far (expansionCheck).
func unpackLayer(r io.Reader, dir string, compressed int64) error {
	return unpackTar(r, dir, compressed, false)
}

// UnpackUpper applies a tar of an overlayfs upper directory (as `runsc tar
// rootfs-upper` writes one: whiteouts as 0/0 character devices, opaque
// directories marked by their trusted.overlay.opaque record) to dir, an
// upper directory again, with unpackLayer's checks. limit bounds what it
// may expand to.
func UnpackUpper(r io.Reader, dir string, limit int64) error {
	return unpackTar(r, dir, limit, true)
}

func unpackTar(r io.Reader, dir string, compressed int64, upper bool) error {
	tr := tar.NewReader(r)
	type dirTime struct {
		path  string
		mtime time.Time
	}
	var dirTimes []dirTime
	var total int64
	for n := 0; ; n++ {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return errdefs.InvalidArgument("layer: not a readable tar: %v", err)
		}
		if n > 10*maxArchiveEntries {
			return errdefs.InvalidArgument("layer: more than %d entries", 10*maxArchiveEntries)
		}
		total += max(hdr.Size, 0)
		if total > MaxLayerBytes || hdr.Size < 0 {
			return errdefs.InvalidArgument("layer: expands to more than %d bytes", MaxLayerBytes)
		}
		if err := expansionCheck("layer", total, compressed); err != nil {
			return err
		}
		rel, err := cleanEntryName(hdr.Name)
		if err != nil {
			return err
		}
		if rel == "" {
			continue // the root itself
		}
		parent, base := filepath.Dir(rel), filepath.Base(rel)
		if err := mkdirNoFollow(dir, parent); err != nil {
			return err
		}
		parentPath := filepath.Join(dir, parent)
		if base == whiteoutOpaque {
			if err := unix.Lsetxattr(parentPath, opaqueXattr, []byte("y"), 0); err != nil {
				return fmt.Errorf("layer: mark %s opaque: %w", parent, err)
			}
			continue
		}
		if name, ok := strings.CutPrefix(base, whiteoutPrefix); ok {
			if name == "" || name == "." || name == ".." {
				return errdefs.InvalidArgument("layer entry %q: bad whiteout", hdr.Name)
			}
			target := filepath.Join(parentPath, name)
			if err := os.RemoveAll(target); err != nil {
				return err
			}
			if err := unix.Mknod(target, unix.S_IFCHR, 0); err != nil {
				return fmt.Errorf("layer: whiteout %s: %w", rel, err)
			}
			continue
		}
		target := filepath.Join(dir, rel)
		if fi, err := os.Lstat(target); err == nil {
			// A later entry replaces an earlier one, except dir over dir.
			if !(fi.IsDir() && hdr.Typeflag == tar.TypeDir) {
				if err := os.RemoveAll(target); err != nil {
					return err
				}
			}
		}
		if err := createEntry(tr, hdr, dir, target, upper); err != nil {
			return fmt.Errorf("layer entry %q: %w", hdr.Name, err)
		}
		if hdr.Typeflag == tar.TypeDir {
			dirTimes = append(dirTimes, dirTime{target, hdr.ModTime})
		}
	}
	// Directory times last: creating their children changed them.
	for i := len(dirTimes) - 1; i >= 0; i-- {
		d := dirTimes[i]
		ts := []unix.Timespec{unix.NsecToTimespec(d.mtime.UnixNano()), unix.NsecToTimespec(d.mtime.UnixNano())}
		unix.UtimesNanoAt(unix.AT_FDCWD, d.path, ts, unix.AT_SYMLINK_NOFOLLOW) //nolint:errcheck // times are cosmetic
	}
	return nil
}

// mkdirNoFollow makes sure every component of rel below root is a real
// directory, creating missing ones, and refuses symlinks on the way.
func mkdirNoFollow(root, rel string) error {
	if rel == "." || rel == "" {
		return nil
	}
	cur := root
	for _, part := range strings.Split(rel, string(filepath.Separator)) {
		cur = filepath.Join(cur, part)
		fi, err := os.Lstat(cur)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			if err := os.Mkdir(cur, 0o755); err != nil {
				return err
			}
		case err != nil:
			return err
		case fi.Mode()&fs.ModeSymlink != 0:
			return errdefs.InvalidArgument("layer: path %q goes through a symlink", rel)
		case !fi.IsDir():
			return errdefs.InvalidArgument("layer: path %q goes through a non-directory", rel)
		}
	}
	return nil
}

func createEntry(tr *tar.Reader, hdr *tar.Header, root, target string, upper bool) error {
	mode := uint32(hdr.Mode & 0o7777)
	switch hdr.Typeflag {
	case tar.TypeDir:
		if err := os.Mkdir(target, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	case tar.TypeReg:
		f, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			return err
		}
		_, err = io.Copy(f, tr)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	case tar.TypeSymlink:
		if strings.ContainsRune(hdr.Linkname, 0) {
			return errdefs.InvalidArgument("NUL in symlink target")
		}
		// The target is interpreted inside the sandbox's root, never here.
		return finishLink(os.Symlink(hdr.Linkname, target), hdr, target)
	case tar.TypeLink:
		rel, err := cleanEntryName(hdr.Linkname)
		if err != nil || rel == "" {
			return errdefs.InvalidArgument("hard link target %q outside the layer", hdr.Linkname)
		}
		if err := mkdirNoFollow(root, filepath.Dir(rel)); err != nil {
			return err
		}
		return unix.Linkat(unix.AT_FDCWD, filepath.Join(root, rel), unix.AT_FDCWD, target, 0)
	case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
		kind := map[byte]uint32{tar.TypeChar: unix.S_IFCHR, tar.TypeBlock: unix.S_IFBLK, tar.TypeFifo: unix.S_IFIFO}[hdr.Typeflag]
		dev := unix.Mkdev(uint32(hdr.Devmajor), uint32(hdr.Devminor))
		if err := unix.Mknod(target, kind|mode, int(dev)); err != nil {
			return err
		}
	case tar.TypeXGlobalHeader:
		return nil
	default:
		return errdefs.InvalidArgument("entry type %q not supported", string(hdr.Typeflag))
	}
	if err := os.Lchown(target, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	// chmod after chown: chown clears setuid bits.
	if err := unix.Fchmodat(unix.AT_FDCWD, target, mode, 0); err != nil {
		return err
	}
	setXattrs(hdr, target, upper)
	ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
	unix.UtimesNanoAt(unix.AT_FDCWD, target, ts, unix.AT_SYMLINK_NOFOLLOW) //nolint:errcheck // times are cosmetic
	return nil
}

func finishLink(err error, hdr *tar.Header, target string) error {
	if err != nil {
		return err
	}
	if err := os.Lchown(target, hdr.Uid, hdr.Gid); err != nil {
		return err
	}
	ts := []unix.Timespec{unix.NsecToTimespec(hdr.ModTime.UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
	unix.UtimesNanoAt(unix.AT_FDCWD, target, ts, unix.AT_SYMLINK_NOFOLLOW) //nolint:errcheck // times are cosmetic
	return nil
}

// setXattrs applies extended attributes carried in PAX records, except the
// overlay ones, which a layer must not forge (an upper directory's opaque
// mark is kept when upper).
func setXattrs(hdr *tar.Header, target string, upper bool) {
	for k, v := range hdr.PAXRecords {
		name, ok := strings.CutPrefix(k, "SCHILY.xattr.")
		if !ok || strings.HasPrefix(name, "trusted.overlay.") && !(upper && name == opaqueXattr && v == "y" && hdr.Typeflag == tar.TypeDir) {
			continue
		}
		unix.Lsetxattr(target, name, []byte(v), 0) //nolint:errcheck // a file system may not support it
	}
}

package image

import (
	"archive/tar"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	"github.com/klauspost/compress/gzip"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"
)

// Layer is a packed layer: its descriptor in the store and its diff id.
type Layer struct {
	Desc   ocispec.Descriptor
	DiffID digest.Digest
}

// PackDir writes the tree at dir as a gzip layer into the store. With
// overlayUpper, dir is an overlayfs upper directory and its whiteouts become
// OCI whiteouts (this is how a sandbox's changes become an image layer).
func (s *Store) PackDir(dir string, overlayUpper bool, progress Progress) (Layer, error) {
	return s.pack(dir, overlayUpper, nil, progress)
}

// PackChanges writes an overlayfs upper directory (a sandbox's changes to
// its image) as a gzip layer into the store, leaving out what exclude
// matches (and, under a directory it matches, everything).
func (s *Store) PackChanges(upper string, exclude *Exclude, progress Progress) (Layer, error) {
	return s.pack(upper, true, exclude, progress)
}

func (s *Store) pack(dir string, overlayUpper bool, exclude *Exclude, progress Progress) (Layer, error) {
	var total int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error { //nolint:errcheck // size is for progress only
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				total += fi.Size()
			}
		}
		return nil
	})
	pr, pw := io.Pipe()
	diffHash := sha256.New()
	go func() {
		zw, _ := gzip.NewWriterLevel(pw, gzip.BestSpeed)
		err := writeTree(io.MultiWriter(zw, diffHash), dir, overlayUpper, exclude, total, progress)
		if cerr := zw.Close(); err == nil {
			err = cerr
		}
		pw.CloseWithError(err)
	}()
	d, n, err := s.PutBlob(pr, "")
	if err != nil {
		return Layer{}, fmt.Errorf("pack %s: %w", dir, err)
	}
	return Layer{
		Desc:   ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayerGzip, Digest: d, Size: n},
		DiffID: digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(diffHash.Sum(nil))),
	}, nil
}

// writeTree writes dir as a tar stream in lexical order, with numeric owners
// and hard links kept.
func writeTree(w io.Writer, dir string, overlayUpper bool, exclude *Exclude, total int64, progress Progress) error {
	tw := tar.NewWriter(w)
	links := map[uint64]string{}
	var done int64
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		if exclude.Matches(filepath.ToSlash(rel)) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		name := filepath.ToSlash(rel)
		if overlayUpper && fi.Mode()&fs.ModeCharDevice != 0 && st.Rdev == 0 {
			// overlayfs whiteout: the file was removed in this layer.
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: filepath.ToSlash(filepath.Join(filepath.Dir(rel), whiteoutPrefix+filepath.Base(rel))), Mode: 0o644, ModTime: fi.ModTime()})
		}
		if fi.Mode()&fs.ModeSocket != 0 {
			return nil
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		hdr.Name, hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = name, int(st.Uid), int(st.Gid), "", ""
		hdr.Format = tar.FormatPAX
		hdr.AccessTime, hdr.ChangeTime = time0, time0
		if fi.IsDir() {
			hdr.Name += "/"
		}
		if fi.Mode().IsRegular() && st.Nlink > 1 {
			if first, ok := links[st.Ino]; ok {
				hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
			} else {
				links[st.Ino] = name
			}
		}
		if capData, err := getXattr(p, "security.capability"); err == nil && len(capData) > 0 {
			hdr.PAXRecords = map[string]string{"SCHILY.xattr.security.capability": string(capData)}
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.IsDir() && overlayUpper {
			if v, err := getXattr(p, opaqueXattr); err == nil && string(v) == "y" {
				if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name + "/" + whiteoutOpaque, Mode: 0o644, ModTime: fi.ModTime()}); err != nil {
					return err
				}
			}
		}
		if hdr.Typeflag == tar.TypeReg {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			n, err := io.Copy(tw, f)
			f.Close()
			if err != nil {
				return err
			}
			done += n
			progress.Report("packing layer", done, total)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

func getXattr(path, name string) ([]byte, error) {
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(path, name, buf)
	if err != nil {
		return nil, err
	}
	return buf[:n], nil
}

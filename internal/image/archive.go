package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// decompress returns a reader of r's content, undoing gzip or zstd if its
// first bytes say so.
func decompress(r io.Reader) (io.ReadCloser, error) {
	br := bufio.NewReaderSize(r, 64*1024)
	head, _ := br.Peek(4)
	switch {
	case bytes.HasPrefix(head, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, errdefs.InvalidArgument("gzip stream: %v", err)
		}
		return zr, nil
	case bytes.HasPrefix(head, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br)
		if err != nil {
			return nil, errdefs.InvalidArgument("zstd stream: %v", err)
		}
		return zr.IOReadCloser(), nil
	}
	return io.NopCloser(br), nil
}

// Limits on an archive being imported.
const maxArchiveEntries = 100000

// MaxArchiveBytes bounds an imported archive's content. A variable for tests.
var MaxArchiveBytes int64 = 64 << 30

// An archive or a layer may expand to at most expansionFloor plus
// maxExpansion times its compressed size. Real layers compress 2 to 10
// times; only a compression bomb (zeros compress a thousandfold) meets the
// bound, and a small upload cannot become a large image on the node.
const (
	maxExpansion   = 100
	expansionFloor = 256 << 20
)

// expansionCheck fails once content of total bytes came from more than the
// bound allows of compressed bytes; what names the input in the error.
func expansionCheck(what string, total, compressed int64) error {
	if total > expansionFloor+maxExpansion*compressed {
		return errdefs.InvalidArgument("%s: expands to more than %d MiB from %d KiB (at most %d MiB plus %d times its compressed size): a compression bomb?",
			what, total>>20, compressed>>10, expansionFloor>>20, maxExpansion)
	}
	return nil
}

// cleanEntryName turns a tar entry name into a safe relative path, or fails.
func cleanEntryName(name string) (string, error) {
	if strings.ContainsRune(name, 0) {
		return "", errdefs.InvalidArgument("archive entry %q: NUL in name", name)
	}
	if len(name) > 4096 {
		return "", errdefs.InvalidArgument("archive entry name longer than 4096 bytes")
	}
	n := filepath.Clean("/" + filepath.FromSlash(name))
	if n == "/" {
		return "", nil
	}
	rel := n[1:]
	// Clean on an absolute path removes every "..", but refuse names that
	// tried, rather than silently writing elsewhere.
	for _, part := range strings.Split(filepath.ToSlash(name), "/") {
		if part == ".." {
			return "", errdefs.InvalidArgument("archive entry %q: escapes the archive root", name)
		}
	}
	return rel, nil
}

// extractPlain extracts the regular files and directories of an image
// archive (OCI layout or docker save) into dir. Links and devices have no
// place in such an archive and are refused. declared is asked before each
// file with what the files' declared sizes add up to with it (a bound on
// what may be stored), written as the bytes are written, with what was
// written so far (a bound on expansion: how much came in is known only as
// it is read).
func extractPlain(r io.Reader, dir string, declared, written func(total int64) error) error {
	tr := tar.NewReader(r)
	var total, wrote int64
	for n := 0; ; n++ {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return errdefs.InvalidArgument("image archive: not a readable tar: %v", err)
		}
		if n >= maxArchiveEntries {
			return errdefs.InvalidArgument("image archive: more than %d entries", maxArchiveEntries)
		}
		rel, err := cleanEntryName(hdr.Name)
		if err != nil {
			return err
		}
		if rel == "" {
			continue
		}
		target := filepath.Join(dir, rel)
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(target, 0o755); err != nil {
				return err
			}
		case tar.TypeReg:
			total += max(hdr.Size, 0)
			if total > MaxArchiveBytes {
				return errdefs.InvalidArgument("image archive: larger than %d bytes", MaxArchiveBytes)
			}
			if err := declared(total); err != nil {
				return err
			}
			if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
				return err
			}
			f, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|os.O_EXCL, 0o644)
			if err != nil {
				if os.IsExist(err) {
					return errdefs.InvalidArgument("image archive: %q appears twice", hdr.Name)
				}
				return err
			}
			_, err = io.Copy(&checkedWriter{w: f, n: &wrote, check: written}, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("image archive %q: %w", hdr.Name, err)
			}
		case tar.TypeSymlink, tar.TypeLink:
			// docker save writes legacy symlinked layers; the files they
			// point to are in the archive too, and manifest.json names them.
			continue
		case tar.TypeXGlobalHeader:
			continue
		default:
			return errdefs.InvalidArgument("image archive entry %q: type %q not allowed", hdr.Name, string(hdr.Typeflag))
		}
	}
}

// checkedWriter counts what passes into *n and asks check before each
// write, so a bound is met within one chunk of being passed.
type checkedWriter struct {
	w     io.Writer
	n     *int64
	check func(total int64) error
}

func (c *checkedWriter) Write(p []byte) (int, error) {
	*c.n += int64(len(p))
	if err := c.check(*c.n); err != nil {
		return 0, err
	}
	return c.w.Write(p)
}

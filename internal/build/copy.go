package build

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// copyFile is one file or directory a COPY or ADD writes.
type copyFile struct {
	src        string // on the host
	dest       string // in the sandbox
	dir        bool
	perm       uint32
	sum        string // sha256 of the content (the cache key's)
	linkTarget string
}

// MaxCopyFiles bounds one COPY.
const MaxCopyFiles = 100000

// sources resolves a COPY or ADD: its sources inside the context (globs
// allowed; a directory copies its content), their destinations, and each
// file's hash for the cache key.
func (st *state) sources(in Instruction, ctxDir string, ignore *Ignore) ([]copyFile, string, error) {
	text, err := expand(in.Text, st.vars())
	if err != nil {
		return nil, "", lineErr(in.Line, "%s: %v", in.Cmd, err)
	}
	ws := in.JSON
	if ws == nil {
		if ws, err = words(text); err != nil {
			return nil, "", lineErr(in.Line, "%s: %v", in.Cmd, err)
		}
	}
	if len(ws) < 2 {
		return nil, "", lineErr(in.Line, "%s: want SOURCE... DEST", in.Cmd)
	}
	srcs, dest := ws[:len(ws)-1], ws[len(ws)-1]
	if !path.IsAbs(dest) {
		base := st.cfg.WorkingDir
		if base == "" {
			base = "/"
		}
		keepSlash := strings.HasSuffix(dest, "/")
		dest = path.Join(base, dest)
		if keepSlash {
			dest += "/"
		}
	}
	if ctxDir == "" {
		return nil, "", lineErr(in.Line, "%s: no build context", in.Cmd)
	}
	root, err := filepath.Abs(ctxDir)
	if err != nil {
		return nil, "", err
	}
	var matches []string
	for _, s := range srcs {
		if strings.Contains(s, "://") {
			return nil, "", lineErr(in.Line, "%s %s: URLs are not supported; download the file into the context", in.Cmd, errdefs.Clip(s, 80))
		}
		clean := filepath.Clean(strings.TrimPrefix(s, "/")) // "/x" is the context's x, as docker reads it
		if clean == ".." || strings.HasPrefix(clean, "../") {
			return nil, "", lineErr(in.Line, "%s %s: outside the build context", in.Cmd, s)
		}
		m, err := filepath.Glob(filepath.Join(root, clean))
		if err != nil || len(m) == 0 {
			return nil, "", lineErr(in.Line, "%s %s: no such file in the build context %s", in.Cmd, s, ctxDir)
		}
		kept := m[:0]
		for _, x := range m {
			if rel, _ := filepath.Rel(root, x); !ignore.Excluded(rel) {
				kept = append(kept, x)
			}
		}
		if len(kept) == 0 {
			return nil, "", lineErr(in.Line, "%s %s: left out of the build context by its .dockerignore", in.Cmd, s)
		}
		matches = append(matches, kept...)
	}
	intoDir := strings.HasSuffix(dest, "/") || len(matches) > 1
	var out []copyFile
	for _, m := range matches {
		fi, err := os.Stat(m)
		if err != nil {
			return nil, "", lineErr(in.Line, "%s: %v", in.Cmd, err)
		}
		if in.Cmd == "ADD" && !fi.IsDir() && isArchive(m) {
			return nil, "", lineErr(in.Line, "ADD %s: unpacking archives is not supported; COPY it and RUN tar, or unpack it into the context", filepath.Base(m))
		}
		if !fi.IsDir() {
			d := dest
			if intoDir {
				d = path.Join(dest, filepath.Base(m))
			}
			f, err := hashed(m, d, fi)
			if err != nil {
				return nil, "", err
			}
			out = append(out, f)
			continue
		}
		// A directory: its content goes to dest.
		err = filepath.WalkDir(m, func(p string, de fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if ctxRel, _ := filepath.Rel(root, p); p != m && ignore.Excluded(ctxRel) {
				if de.IsDir() && !ignore.keepsAny() {
					return filepath.SkipDir
				}
				return nil
			}
			rel, _ := filepath.Rel(m, p)
			d := path.Join(dest, filepath.ToSlash(rel))
			info, err := os.Stat(p) // links are followed
			if err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			if real, err := filepath.EvalSymlinks(p); err != nil || !within(root, real) {
				return fmt.Errorf("%s: a link out of the build context", p)
			}
			if info.IsDir() {
				out = append(out, copyFile{src: p, dest: d, dir: true, perm: uint32(info.Mode().Perm())})
			} else {
				f, err := hashed(p, d, info)
				if err != nil {
					return err
				}
				out = append(out, f)
			}
			if len(out) > MaxCopyFiles {
				return fmt.Errorf("more than %d files", MaxCopyFiles)
			}
			return nil
		})
		if err != nil {
			return nil, "", lineErr(in.Line, "%s: %v", in.Cmd, err)
		}
	}
	for _, f := range out {
		if real, err := filepath.EvalSymlinks(f.src); err != nil || !within(root, real) {
			return nil, "", lineErr(in.Line, "%s %s: a link out of the build context", in.Cmd, f.src)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].dest < out[j].dest })
	return out, dest, nil
}

func within(root, p string) bool {
	rel, err := filepath.Rel(root, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

func isArchive(name string) bool {
	for _, ext := range []string{".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst"} {
		if strings.HasSuffix(name, ext) {
			return true
		}
	}
	return false
}

func hashed(src, dest string, fi fs.FileInfo) (copyFile, error) {
	f, err := os.Open(src)
	if err != nil {
		return copyFile{}, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return copyFile{}, err
	}
	return copyFile{src: src, dest: dest, perm: uint32(fi.Mode().Perm()), sum: hex.EncodeToString(h.Sum(nil))}, nil
}

// copy writes the files into the sandbox, owned by --chown's user (a user
// name of the image) with --chmod's mode if given.
func (st *state) copy(ctx context.Context, box Box, in Instruction, files []copyFile, dest string) error {
	user := in.Flags["chown"]
	if u, _, ok := strings.Cut(user, ":"); ok {
		user = u // the user's own group
	}
	if _, err := strconv.Atoi(user); err == nil && user != "" {
		return lineErr(in.Line, "%s --chown=%s: give a user name of the image, not a number", in.Cmd, user)
	}
	var chmod uint32
	if m := in.Flags["chmod"]; m != "" {
		v, err := strconv.ParseUint(m, 8, 32)
		if err != nil || v > 0o7777 {
			return lineErr(in.Line, "%s --chmod=%s: want octal permission bits such as 0755", in.Cmd, m)
		}
		chmod = uint32(v)
	}
	if strings.HasSuffix(dest, "/") {
		if err := box.MakeDir(ctx, strings.TrimSuffix(dest, "/"), user); err != nil {
			return lineErr(in.Line, "%s: make %s: %v", in.Cmd, dest, err)
		}
	}
	for _, f := range files {
		if f.dir {
			if err := box.MakeDir(ctx, f.dest, user); err != nil {
				return lineErr(in.Line, "%s: make %s: %v", in.Cmd, f.dest, err)
			}
			continue
		}
		if err := box.MakeDir(ctx, path.Dir(f.dest), user); err != nil {
			return lineErr(in.Line, "%s: make %s: %v", in.Cmd, path.Dir(f.dest), err)
		}
		r, err := os.Open(f.src)
		if err != nil {
			return err
		}
		perm := f.perm
		if chmod != 0 {
			perm = chmod
		}
		err = box.WriteFile(ctx, f.dest, r, perm, user)
		r.Close()
		if err != nil {
			return lineErr(in.Line, "%s %s: %v", in.Cmd, f.dest, err)
		}
	}
	return nil
}

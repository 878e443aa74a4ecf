// Package snapxfer moves a memory snapshot from the edge that holds it to
// another edge [ours]: the holder describes the snapshot's files in a
// manifest (size and SHA-256 of each) and serves them with HTTP ranges; the
// puller streams each file to disk, resumes a cut transfer where it
// stopped, and checks every file against the manifest before the snapshot
// is used. The apiserver only tells the puller where to pull from; it never
// carries snapshot bytes.
package snapxfer

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// File is one file of a snapshot, by its path relative to the snapshot's
// directory.
type File struct {
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
}

// Manifest describes a snapshot for a puller: the holder's description of
// it (opaque here) and its files.
type Manifest struct {
	Snapshot json.RawMessage `json:"snapshot"`
	Files    []File          `json:"files"`
}

// Bounds on what a manifest may describe; a peer's manifest past them is
// refused rather than trusted.
const (
	MaxFiles        = 10000
	MaxManifestSize = 4 << 20
	maxPathLen      = 512
)

// Total is the sum of the files' sizes.
func (m *Manifest) Total() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}

// Build describes the regular files under dir, except those skip names
// (relative paths), hashing each.
func Build(dir string, snapshot json.RawMessage, skip ...string) (*Manifest, error) {
	m := &Manifest{Snapshot: snapshot}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		for _, s := range skip {
			if rel == s {
				return nil
			}
		}
		sum, size, err := hashFile(p)
		if err != nil {
			return err
		}
		m.Files = append(m.Files, File{Path: rel, Size: size, SHA256: sum})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot manifest of %s: %w", dir, err)
	}
	sort.Slice(m.Files, func(i, j int) bool { return m.Files[i].Path < m.Files[j].Path })
	return m, m.Validate()
}

func hashFile(p string) (string, int64, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// Validate checks what a manifest from a peer claims: safe relative paths
// (no "..", no absolute path, no duplicates), sizes and hashes well formed.
func (m *Manifest) Validate() error {
	if len(m.Files) > MaxFiles {
		return fmt.Errorf("manifest: %d files, at most %d", len(m.Files), MaxFiles)
	}
	seen := make(map[string]bool, len(m.Files))
	for i, f := range m.Files {
		if err := checkPath(f.Path); err != nil {
			return fmt.Errorf("manifest: files[%d]: %w", i, err)
		}
		if seen[f.Path] {
			return fmt.Errorf("manifest: files[%d]: path %q listed twice", i, f.Path)
		}
		seen[f.Path] = true
		if f.Size < 0 {
			return fmt.Errorf("manifest: files[%d] %q: negative size %d", i, f.Path, f.Size)
		}
		if b, err := hex.DecodeString(f.SHA256); err != nil || len(b) != sha256.Size {
			return fmt.Errorf("manifest: files[%d] %q: sha256 %q is not 64 hex digits", i, f.Path, errdefs.Clip(f.SHA256, 80))
		}
	}
	// A file may not also be a directory of another (a/b and a/b/c).
	for p := range seen {
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			if seen[d] {
				return fmt.Errorf("manifest: %q is both a file and a directory", d)
			}
		}
	}
	return nil
}

// checkPath accepts slash-separated relative paths of letters, digits and
// "._-" whose elements are not "." or "..".
func checkPath(p string) error {
	if p == "" || len(p) > maxPathLen {
		return fmt.Errorf("path %q: want 1 to %d characters", errdefs.Clip(p, 80), maxPathLen)
	}
	for _, c := range p {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("._-/", c)) {
			return fmt.Errorf("path %q: only letters, digits and \"._-/\" are allowed", errdefs.Clip(p, 80))
		}
	}
	for _, el := range strings.Split(p, "/") {
		if el == "" || el == "." || el == ".." {
			return fmt.Errorf("path %q: want a relative path without empty, \".\" or \"..\" elements", errdefs.Clip(p, 80))
		}
	}
	if strings.HasSuffix(p, partSuffix) {
		return fmt.Errorf("path %q: the %s suffix is the puller's own", errdefs.Clip(p, 80), partSuffix)
	}
	return nil
}

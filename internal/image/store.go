package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/project"
)

// Store is an image store rooted at a directory (a shared file system in a
// cluster; a local directory on one machine).
type Store struct {
	dir string
	log *slog.Logger
	// noEROFS turns the EROFS forms off (tests of unpacked layers).
	noEROFS bool
}

// Image is a resolved name.
type Image struct {
	Ref      Ref
	Digest   digest.Digest // of the manifest
	Manifest ocispec.Manifest
	Config   ocispec.Image
	Created  time.Time // when the name was last set
}

// Size is the compressed size of all layers.
func (im *Image) Size() int64 {
	var n int64
	for _, l := range im.Manifest.Layers {
		n += l.Size
	}
	return n
}

// OpenStore opens (creating if needed) the store at dir.
func OpenStore(dir string) (*Store, error) {
	for _, d := range []string{"blobs/sha256", "refs", "tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, fmt.Errorf("image store %s: %w", dir, err)
		}
	}
	layout := filepath.Join(dir, ocispec.ImageLayoutFile)
	if _, err := os.Stat(layout); errors.Is(err, fs.ErrNotExist) {
		data, _ := json.Marshal(ocispec.ImageLayout{Version: ocispec.ImageLayoutVersion})
		if err := writeFileAtomic(dir, layout, data); err != nil {
			return nil, err
		}
	}
	sweepTemporary(filepath.Join(dir, "tmp"))
	return &Store{dir: dir, log: logging.OrDiscard(nil)}, nil
}

// SetEROFS turns the EROFS forms of new layers on (the default where
// mkfs.erofs is installed and the process is root) or off.
func (s *Store) SetEROFS(on bool) { s.noEROFS = !on }

// SetLogger sets where the store reports what it could not do but went
// on without (a layer's EROFS form).
func (s *Store) SetLogger(l *slog.Logger) { s.log = logging.OrDiscard(l) }

// sweepTemporary removes EROFS conversions a crash left (an hour old: the
// store may be shared with a process converting now).
func sweepTemporary(tmp string) {
	ents, _ := os.ReadDir(tmp)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && strings.HasPrefix(e.Name(), "erofs-") && time.Since(fi.ModTime()) > time.Hour {
			os.RemoveAll(filepath.Join(tmp, e.Name()))
		}
	}
}

// Dir returns the store's root.
func (s *Store) Dir() string { return s.dir }

// BlobPath returns where a blob is kept. The digest must be valid.
func (s *Store) BlobPath(d digest.Digest) string {
	return filepath.Join(s.dir, "blobs", d.Algorithm().String(), d.Encoded())
}

func validDigest(d digest.Digest) error {
	if d.Validate() != nil || d.Algorithm() != digest.SHA256 {
		return errdefs.InvalidArgument("digest %q: want sha256:<64 hex>", string(d))
	}
	return nil
}

// HasBlob reports whether the blob is present.
func (s *Store) HasBlob(d digest.Digest) bool {
	if validDigest(d) != nil {
		return false
	}
	_, err := os.Stat(s.BlobPath(d))
	return err == nil
}

// PutBlob copies r into the store and returns its digest and size. If want
// is set, content that does not match it is rejected.
func (s *Store) PutBlob(r io.Reader, want digest.Digest) (digest.Digest, int64, error) {
	if want != "" {
		if err := validDigest(want); err != nil {
			return "", 0, err
		}
	}
	tmp, err := os.CreateTemp(filepath.Join(s.dir, "tmp"), "blob-")
	if err != nil {
		return "", 0, err
	}
	defer os.Remove(tmp.Name())
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), r)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", 0, fmt.Errorf("write blob: %w", err)
	}
	got := digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(h.Sum(nil)))
	if want != "" && got != want {
		return "", 0, errdefs.InvalidArgument("blob content has digest %s, but %s was declared", got, want)
	}
	dst := s.BlobPath(got)
	// Reused: touched, so that Prune's grace covers it until the import
	// that reuses it names its image. If a Prune removed it meanwhile
	// (the touch fails), this copy takes its place.
	now := time.Now()
	if err := os.Chtimes(dst, now, now); err == nil {
		return got, n, nil
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", 0, err
	}
	return got, n, nil
}

// PutJSON stores v as a JSON blob.
func (s *Store) PutJSON(v any) (digest.Digest, int64, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return "", 0, err
	}
	return s.PutBlob(strings.NewReader(string(data)), "")
}

// ReadBlob reads a whole (small) blob, checking its digest.
func (s *Store) ReadBlob(d digest.Digest, maxSize int64) ([]byte, error) {
	if err := validDigest(d); err != nil {
		return nil, err
	}
	f, err := os.Open(s.BlobPath(d))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, errdefs.NotFound("blob %s: not in the store", d)
		}
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxSize+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > maxSize {
		return nil, errdefs.InvalidArgument("blob %s: larger than %d bytes", d, maxSize)
	}
	if digest.FromBytes(data) != d {
		return nil, fmt.Errorf("blob %s: content does not match its digest (corrupt store)", d)
	}
	return data, nil
}

func (s *Store) refPath(r Ref) string {
	return filepath.Join(s.dir, "refs", filepath.FromSlash(r.Project), r.Name, r.Tag)
}

// Tag points r at a manifest already in the store, after writing the
// EROFS forms its layers lack (erofs.go).
func (s *Store) Tag(r Ref, manifest digest.Digest) error {
	m, err := s.loadManifest(manifest)
	if err != nil {
		return err
	}
	if err := s.makeEROFS(context.Background(), m); err != nil {
		s.log.Warn("image layers kept without their EROFS form; nodes unpack them", "image", r.String(), logging.Error, err)
	}
	p := s.refPath(r)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return writeFileAtomic(s.dir, p, []byte(manifest.String()+"\n"))
}

const maxManifestSize = 4 << 20

func (s *Store) loadManifest(d digest.Digest) (ocispec.Manifest, error) {
	var m ocispec.Manifest
	data, err := s.ReadBlob(d, maxManifestSize)
	if err != nil {
		return m, err
	}
	if err := json.Unmarshal(data, &m); err != nil {
		return m, errdefs.InvalidArgument("manifest %s: %v", d, err)
	}
	if m.MediaType != "" && m.MediaType != ocispec.MediaTypeImageManifest && m.MediaType != mediaTypeDockerManifest {
		return m, errdefs.Unsupported("manifest %s: media type %q (want an image manifest)", d, m.MediaType)
	}
	return m, nil
}

// Resolve looks a name up.
func (s *Store) Resolve(r Ref) (*Image, error) {
	p := s.refPath(r)
	data, err := os.ReadFile(p)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, errdefs.NotFound("image %q: not in the image store (list with `dsec image ls`)", r.String())
		}
		return nil, err
	}
	fi, _ := os.Stat(p)
	d := digest.Digest(strings.TrimSpace(string(data)))
	if err := validDigest(d); err != nil {
		return nil, fmt.Errorf("image %s: corrupt ref file: %w", r, err)
	}
	im, err := s.Load(d)
	if err != nil {
		return nil, fmt.Errorf("image %s: %w", r, err)
	}
	im.Ref, im.Created = r, fi.ModTime()
	return im, nil
}

// Load reads the image whose manifest has digest d, whatever it is named
// (a sandbox's image, after its name moved on). Ref and Created are unset.
func (s *Store) Load(d digest.Digest) (*Image, error) {
	m, err := s.loadManifest(d)
	if err != nil {
		return nil, err
	}
	cfgData, err := s.ReadBlob(m.Config.Digest, maxManifestSize)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	im := &Image{Digest: d, Manifest: m}
	if err := json.Unmarshal(cfgData, &im.Config); err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return im, nil
}

// List returns every image whose project is project or below it ("" = all).
func (s *Store) List(proj string) ([]*Image, error) {
	root := filepath.Join(s.dir, "refs")
	var out []*Image
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		parts := strings.Split(filepath.ToSlash(rel), "/")
		if len(parts) < 3 {
			return nil
		}
		name := strings.Join(parts[:len(parts)-1], "/") + ":" + parts[len(parts)-1]
		r, err := ParseRef(name)
		if err != nil {
			return nil
		}
		if proj != "" && !project.Within(r.Project, proj) {
			return nil
		}
		if im, err := s.Resolve(r); err == nil {
			out = append(out, im)
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Ref.String() < out[j].Ref.String() })
	return out, err
}

// Delete removes a name. Its blobs stay until Prune (another name, or a
// sandbox made from it, may need them).
func (s *Store) Delete(r Ref) error {
	if err := os.Remove(s.refPath(r)); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return errdefs.NotFound("image %q: not in the image store", r.String())
		}
		return err
	}
	return nil
}

func writeFileAtomic(storeDir, path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Join(storeDir, "tmp"), "w-")
	if err != nil {
		if err := os.MkdirAll(filepath.Join(storeDir, "tmp"), 0o755); err != nil {
			return err
		}
		if tmp, err = os.CreateTemp(filepath.Join(storeDir, "tmp"), "w-"); err != nil {
			return err
		}
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

const mediaTypeDockerManifest = "application/vnd.docker.distribution.manifest.v2+json"

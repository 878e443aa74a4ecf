package image

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Progress reports how far a long operation is: stage names what is being
// done; total is 0 when unknown.
type Progress func(stage string, done, total int64)

// Report calls p if set.
func (p Progress) Report(stage string, done, total int64) {
	if p != nil {
		p(stage, done, total)
	}
}

// countingReader reports bytes read.
type countingReader struct {
	r        io.Reader
	n, total int64
	stage    string
	p        Progress
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n += int64(n)
	c.p.Report(c.stage, c.n, c.total)
	return n, err
}

// ImportOptions are an import's progress and bounds.
type ImportOptions struct {
	// Size is the archive's size, for progress (0 if unknown).
	Size     int64
	Progress Progress
	// Room, if set, is asked before what the archive holds (the image's
	// blobs) grows to each new total; its error ends the import (a storage
	// quota).
	Room func(total int64) error
}

// Import reads an image archive — an OCI image layout or a `docker save`
// tarball, optionally gzip- or zstd-compressed — and names it ref. What it
// holds is bounded by o.Room and by its compressed size (expansionCheck).
func (s *Store) Import(ctx context.Context, r io.Reader, ref Ref, o ImportOptions) (*Image, error) {
	progress := o.Progress
	work, err := os.MkdirTemp(filepath.Join(s.dir, "tmp"), "import-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	read := &countingReader{r: r, total: o.Size, stage: "reading archive", p: progress}
	dr, err := decompress(read)
	if err != nil {
		return nil, err
	}
	defer dr.Close()
	declared := func(total int64) error {
		if o.Room != nil {
			return o.Room(total)
		}
		return nil
	}
	written := func(total int64) error { return expansionCheck("image archive", total, read.n) }
	if err := extractPlain(dr, work, declared, written); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var md digest.Digest
	switch {
	case exists(filepath.Join(work, ocispec.ImageLayoutFile)):
		md, err = s.importLayout(work, ref, progress)
	case exists(filepath.Join(work, "manifest.json")):
		md, err = s.importDockerSave(work, progress)
	default:
		err = errdefs.InvalidArgument("image archive: neither an OCI image layout (no oci-layout file) nor a docker save tarball (no manifest.json)")
	}
	if err != nil {
		return nil, err
	}
	if err := s.Tag(ref, md); err != nil {
		return nil, err
	}
	return s.Resolve(ref)
}

// ImportLayoutDir imports an OCI image layout directory.
func (s *Store) ImportLayoutDir(dir string, ref Ref, progress Progress) (*Image, error) {
	md, err := s.importLayout(dir, ref, progress)
	if err != nil {
		return nil, err
	}
	if err := s.Tag(ref, md); err != nil {
		return nil, err
	}
	return s.Resolve(ref)
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func readJSON(path string, v any) error {
	data, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return errdefs.InvalidArgument("image archive: %s is missing", filepath.Base(path))
		}
		return err
	}
	if len(data) > maxManifestSize {
		return errdefs.InvalidArgument("image archive: %s is larger than %d bytes", filepath.Base(path), maxManifestSize)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return errdefs.InvalidArgument("image archive: %s: %v", filepath.Base(path), err)
	}
	return nil
}

// copyBlob moves a blob from an extracted layout into the store, verifying it.
func (s *Store) copyBlob(layoutDir string, d digest.Digest, progress Progress) (int64, error) {
	if err := validDigest(d); err != nil {
		return 0, err
	}
	f, err := os.Open(filepath.Join(layoutDir, "blobs", "sha256", d.Encoded()))
	if err != nil {
		return 0, errdefs.InvalidArgument("image archive: blob %s is referenced but missing", d)
	}
	defer f.Close()
	fi, _ := f.Stat()
	_, n, err := s.PutBlob(&countingReader{r: f, total: fi.Size(), stage: "storing " + d.Encoded()[:12], p: progress}, d)
	return n, err
}

func platformOK(p *ocispec.Platform) bool {
	return p == nil || (p.OS == "linux" && (p.Architecture == "amd64" || p.Architecture == ""))
}

func (s *Store) importLayout(dir string, ref Ref, progress Progress) (digest.Digest, error) {
	var index ocispec.Index
	if err := readJSON(filepath.Join(dir, "index.json"), &index); err != nil {
		return "", err
	}
	desc, err := pickManifest(dir, index, ref, 0)
	if err != nil {
		return "", err
	}
	var m ocispec.Manifest
	if err := readJSON(filepath.Join(dir, "blobs", "sha256", desc.Digest.Encoded()), &m); err != nil {
		return "", err
	}
	if err := CheckManifest(m); err != nil {
		return "", err
	}
	for _, d := range append([]ocispec.Descriptor{m.Config}, m.Layers...) {
		if _, err := s.copyBlob(dir, d.Digest, progress); err != nil {
			return "", err
		}
	}
	if _, err := s.copyBlob(dir, desc.Digest, progress); err != nil {
		return "", err
	}
	return desc.Digest, nil
}

// pickManifest chooses the linux/amd64 image manifest of an index, preferring
// one annotated with the wanted tag, and descending into nested indexes.
func pickManifest(dir string, index ocispec.Index, ref Ref, depth int) (ocispec.Descriptor, error) {
	if depth > 4 {
		return ocispec.Descriptor{}, errdefs.InvalidArgument("image archive: indexes nested too deep")
	}
	var candidates []ocispec.Descriptor
	for _, d := range index.Manifests {
		if validDigest(d.Digest) != nil || !platformOK(d.Platform) {
			continue
		}
		candidates = append(candidates, d)
	}
	for _, d := range candidates {
		if d.Annotations[ocispec.AnnotationRefName] == ref.Tag || d.Annotations[ocispec.AnnotationRefName] == ref.String() {
			candidates = []ocispec.Descriptor{d}
			break
		}
	}
	for _, d := range candidates {
		switch d.MediaType {
		case ocispec.MediaTypeImageManifest, mediaTypeDockerManifest:
			return d, nil
		case ocispec.MediaTypeImageIndex, "application/vnd.docker.distribution.manifest.list.v2+json":
			var inner ocispec.Index
			if err := readJSON(filepath.Join(dir, "blobs", "sha256", d.Digest.Encoded()), &inner); err != nil {
				return ocispec.Descriptor{}, err
			}
			return pickManifest(dir, inner, ref, depth+1)
		}
	}
	return ocispec.Descriptor{}, errdefs.InvalidArgument("image archive: no linux/amd64 image manifest in index.json")
}

var layerTypes = map[string]bool{
	ocispec.MediaTypeImageLayer:                         true,
	ocispec.MediaTypeImageLayerGzip:                     true,
	ocispec.MediaTypeImageLayerZstd:                     true,
	"application/vnd.docker.image.rootfs.diff.tar.gzip": true,
}

// CheckManifest checks that m is an image manifest the store can hold: a
// valid config digest and 1 to 127 layers of known media types.
func CheckManifest(m ocispec.Manifest) error {
	if validDigest(m.Config.Digest) != nil {
		return errdefs.InvalidArgument("image manifest: bad config digest %q", m.Config.Digest)
	}
	if len(m.Layers) == 0 || len(m.Layers) > 127 {
		return errdefs.InvalidArgument("image manifest: %d layers; want 1 to 127", len(m.Layers))
	}
	for _, l := range m.Layers {
		if !layerTypes[l.MediaType] {
			return errdefs.Unsupported("image layer %s: media type %q", l.Digest, l.MediaType)
		}
		if validDigest(l.Digest) != nil {
			return errdefs.InvalidArgument("image manifest: bad layer digest %q", l.Digest)
		}
	}
	return nil
}

type dockerSaveEntry struct {
	Config   string
	RepoTags []string
	Layers   []string
}

func (s *Store) importDockerSave(dir string, progress Progress) (digest.Digest, error) {
	var entries []dockerSaveEntry
	if err := readJSON(filepath.Join(dir, "manifest.json"), &entries); err != nil {
		return "", err
	}
	if len(entries) == 0 {
		return "", errdefs.InvalidArgument("docker save archive: manifest.json lists no image")
	}
	e := entries[0]
	open := func(name string) (*os.File, error) {
		rel, err := cleanEntryName(name)
		if err != nil || rel == "" {
			return nil, errdefs.InvalidArgument("docker save archive: bad path %q in manifest.json", name)
		}
		f, err := os.Open(filepath.Join(dir, rel))
		if err != nil {
			return nil, errdefs.InvalidArgument("docker save archive: %q is listed but missing", name)
		}
		return f, nil
	}
	cf, err := open(e.Config)
	if err != nil {
		return "", err
	}
	cfgDigest, cfgSize, err := s.PutBlob(cf, "")
	cf.Close()
	if err != nil {
		return "", err
	}
	m := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: cfgDigest, Size: cfgSize},
	}
	for i, l := range e.Layers {
		f, err := open(l)
		if err != nil {
			return "", err
		}
		fi, _ := f.Stat()
		mt, err := sniffLayer(f)
		if err != nil {
			f.Close()
			return "", err
		}
		d, n, err := s.PutBlob(&countingReader{r: f, total: fi.Size(), stage: fmt.Sprintf("storing layer %d/%d", i+1, len(e.Layers)), p: progress}, "")
		f.Close()
		if err != nil {
			return "", err
		}
		m.Layers = append(m.Layers, ocispec.Descriptor{MediaType: mt, Digest: d, Size: n})
	}
	if err := CheckManifest(m); err != nil {
		return "", err
	}
	md, _, err := s.PutJSON(m)
	return md, err
}

// sniffLayer tells a layer's media type from its first bytes and rewinds.
func sniffLayer(f *os.File) (string, error) {
	head := make([]byte, 4)
	n, _ := io.ReadFull(f, head)
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", err
	}
	switch {
	case n >= 2 && head[0] == 0x1f && head[1] == 0x8b:
		return ocispec.MediaTypeImageLayerGzip, nil
	case n == 4 && string(head) == "\x28\xb5\x2f\xfd":
		return ocispec.MediaTypeImageLayerZstd, nil
	}
	return ocispec.MediaTypeImageLayer, nil
}

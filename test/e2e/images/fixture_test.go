package images

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/testutil"
)

// entry is one member of a test layer.
type entry struct {
	name, body, link string
	typ              byte
	mode             int64
	uid, gid         int
}

// tarLayer is a gzip-compressed layer and its diff id.
func tarLayer(t *testing.T, entries []entry) (gz []byte, diffID digest.Digest) {
	t.Helper()
	var raw bytes.Buffer
	tw := tar.NewWriter(&raw)
	mtime := time.Unix(1700000000, 0)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Gid: e.gid, Linkname: e.link, ModTime: mtime, Format: tar.FormatPAX}
		if h.Typeflag == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Mode == 0 {
			h.Mode = 0o644
			if h.Typeflag == tar.TypeDir {
				h.Mode = 0o755
			}
		}
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			io.WriteString(tw, e.body)
		}
	}
	tw.Close()
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	zw.Write(raw.Bytes())
	zw.Close()
	return out.Bytes(), digest.FromBytes(raw.Bytes())
}

// randomText is n bytes of seeded noise (incompressible, so the layer is
// as large as the file).
func randomText(seed uint64, n int) string {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := 0; i < n; i += 8 {
		v := r.Uint64()
		for j := 0; j < 8 && i+j < n; j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return string(b)
}

// richFixture is what the rich image holds, for the checks.
type richFixture struct {
	layout  string // OCI image layout directory, tagged "rich" (and "multi")
	bigSum  string // sha256 of /opt/big
	bigSize int
}

// writeRichLayout writes an OCI image layout with the image the tests
// pull: root/busybox's layer, then a layer with a directory, files, a
// symlink, a hard link, a setuid file, a file of another owner and a large
// file, then a layer deleting a file (a whiteout) and replacing a
// directory's content (an opaque directory). ENV and WORKDIR are set. The
// tag "multi" is an index of it for linux/amd64 and a stand-in for
// linux/arm64. seed varies the large file, so that two fixtures share only
// the busybox layer.
func writeRichLayout(t *testing.T, store *image.Store, seed uint64, bigSize int) richFixture {
	t.Helper()
	ref, _ := image.ParseRef("root/busybox:latest")
	base, err := store.Resolve(ref)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	blobs := filepath.Join(dir, "blobs", "sha256")
	os.MkdirAll(blobs, 0o755)
	put := func(data []byte) ocispec.Descriptor {
		d := digest.FromBytes(data)
		if err := os.WriteFile(filepath.Join(blobs, d.Encoded()), data, 0o644); err != nil {
			t.Fatal(err)
		}
		return ocispec.Descriptor{Digest: d, Size: int64(len(data))}
	}
	var layers []ocispec.Descriptor
	for _, l := range base.Manifest.Layers {
		data, err := os.ReadFile(store.BlobPath(l.Digest))
		if err != nil {
			t.Fatal(err)
		}
		d := put(data)
		d.MediaType = l.MediaType
		layers = append(layers, d)
	}
	diffIDs := append([]digest.Digest(nil), base.Config.RootFS.DiffIDs...)
	big := randomText(seed, bigSize)
	sum := sha256.Sum256([]byte(big))
	l2, id2 := tarLayer(t, []entry{
		{name: "etc/rich/", typ: tar.TypeDir},
		{name: "etc/rich/kept", body: "kept\n"},
		{name: "etc/rich/deleted", body: "gone\n"},
		{name: "etc/rich/link", typ: tar.TypeSymlink, link: "kept"},
		{name: "etc/rich/hard", typ: tar.TypeLink, link: "etc/rich/kept"},
		{name: "etc/rich/owned", body: "owned\n", uid: 1234, gid: 5678, mode: 0o640},
		{name: "opt/", typ: tar.TypeDir},
		{name: "opt/data/", typ: tar.TypeDir},
		{name: "opt/data/a", body: "a\n"},
		{name: "opt/data/b", body: "b\n"},
		{name: "opt/big", body: big},
		{name: "usr/local/bin/", typ: tar.TypeDir},
		{name: "usr/local/bin/suid", body: "#!/bin/sh\necho suid\n", mode: 0o4755},
		{name: "work/", typ: tar.TypeDir},
	})
	l3, id3 := tarLayer(t, []entry{
		{name: "etc/rich/.wh.deleted"},
		{name: "etc/rich/new", body: "new\n"},
		{name: "opt/data/", typ: tar.TypeDir},
		{name: "opt/data/.wh..wh..opq"},
		{name: "opt/data/c", body: "c\n"},
	})
	for _, l := range [][]byte{l2, l3} {
		d := put(l)
		d.MediaType = ocispec.MediaTypeImageLayerGzip
		layers = append(layers, d)
	}
	diffIDs = append(diffIDs, id2, id3)
	cfg := ocispec.Image{
		Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		Config: ocispec.ImageConfig{
			Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin", "RICH_FROM_IMAGE=yes"},
			WorkingDir: "/work",
			Cmd:        []string{"/bin/sh"},
		},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: diffIDs},
	}
	cfgJSON, _ := json.Marshal(cfg)
	cd := put(cfgJSON)
	cd.MediaType = ocispec.MediaTypeImageConfig
	m := ocispec.Manifest{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageManifest, Config: cd, Layers: layers}
	mJSON, _ := json.Marshal(m)
	md := put(mJSON)
	md.MediaType = ocispec.MediaTypeImageManifest

	// The stand-in for arm64: the same layers under another config.
	armCfg := cfg
	armCfg.Architecture = "arm64"
	armJSON, _ := json.Marshal(armCfg)
	acd := put(armJSON)
	acd.MediaType = ocispec.MediaTypeImageConfig
	am := m
	am.Config = acd
	amJSON, _ := json.Marshal(am)
	amd := put(amJSON)
	amd.MediaType = ocispec.MediaTypeImageManifest
	amd.Platform = &ocispec.Platform{OS: "linux", Architecture: "arm64"}
	x86 := md
	x86.Platform = &ocispec.Platform{OS: "linux", Architecture: "amd64"}
	multi := ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{amd, x86}}
	multiJSON, _ := json.Marshal(multi)
	mi := put(multiJSON)
	mi.MediaType = ocispec.MediaTypeImageIndex

	md.Annotations = map[string]string{ocispec.AnnotationRefName: "rich"}
	mi.Annotations = map[string]string{ocispec.AnnotationRefName: "multi"}
	index := ocispec.Index{Versioned: specs.Versioned{SchemaVersion: 2}, MediaType: ocispec.MediaTypeImageIndex, Manifests: []ocispec.Descriptor{md, mi}}
	indexJSON, _ := json.Marshal(index)
	os.WriteFile(filepath.Join(dir, "index.json"), indexJSON, 0o644)
	os.WriteFile(filepath.Join(dir, ocispec.ImageLayoutFile), []byte(`{"imageLayoutVersion":"1.0.0"}`), 0o644)
	return richFixture{layout: dir, bigSum: hex.EncodeToString(sum[:]), bigSize: bigSize}
}

// skopeoCopy runs skopeo copy, an independent implementation of the
// registry protocol; extra flags go first (e.g. "--all").
func skopeoCopy(t *testing.T, src, dst string, extra ...string) {
	t.Helper()
	bin := testutil.RequireBinary(t, "skopeo")
	args := append([]string{"copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false"}, extra...)
	args = append(args, src, dst)
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir()) // no user's registries.conf or logins
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("skopeo %v: %v\n%s", args, err, out)
	}
}

// skopeoInspect returns what skopeo reads of a registry's image (the
// manifest with --raw).
func skopeoInspect(t *testing.T, ref string, raw bool) []byte {
	t.Helper()
	bin := testutil.RequireBinary(t, "skopeo")
	args := []string{"inspect", "--tls-verify=false"}
	if raw {
		args = append(args, "--raw")
	}
	cmd := exec.Command(bin, append(args, "docker://"+ref)...)
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir())
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("skopeo inspect %s: %v", ref, err)
	}
	return out
}

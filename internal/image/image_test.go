package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/testutil"
)

func TestParseRef(t *testing.T) {
	good := map[string]Ref{
		"root/py:3.11":          {"root", "py", "3.11"},
		"root/busybox":          {"root", "busybox", "latest"},
		"root/team-a/tool:v1.2": {"root/team-a", "tool", "v1.2"},
	}
	for in, want := range good {
		got, err := ParseRef(in)
		if err != nil || got != want {
			t.Errorf("ParseRef(%q) = %+v, %v; want %+v", in, got, err, want)
		}
		if err == nil && strings.Contains(in, ":") && got.String() != in {
			t.Errorf("String() = %q, want %q", got.String(), in)
		}
	}
	for _, in := range []string{"", "py", "/py:1", "root/", "Root/py:1", "root/py:", "root/../py:1", "root/py:a/b", "root//py", "root/py:-x"} {
		if _, err := ParseRef(in); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("ParseRef(%q) err = %v, want invalid argument", in, err)
		}
	}
}

func FuzzParseRef(f *testing.F) {
	f.Add("root/py:3.11")
	f.Add("root/b/c/d:e")
	f.Add("0../0") // once accepted with project "0..", which is no project
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRef(s)
		if err != nil {
			return
		}
		again, err := ParseRef(r.String())
		if err != nil || again != r {
			t.Fatalf("%q parsed to %+v, which does not round-trip: %+v %v", s, r, again, err)
		}
		// The project is a real project path (so safe as a directory
		// under refs/), and the name cannot climb out of it.
		if err := project.Valid(r.Project); err != nil {
			t.Fatalf("%q: project %q accepted by ParseRef, refused by project.Valid: %v", s, r.Project, err)
		}
		if r.Name == "." || r.Name == ".." || strings.ContainsAny(r.Name, "/:") {
			t.Fatalf("%q: unsafe name %q", s, r.Name)
		}
	})
}

// makeTree writes a small root file system.
func makeTree(t *testing.T) string {
	dir := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(dir, "etc"), 0o755))
	must(os.MkdirAll(filepath.Join(dir, "usr/bin"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "etc/hostname"), []byte("box\n"), 0o644))
	must(os.WriteFile(filepath.Join(dir, "usr/bin/tool"), []byte("#!/bin/sh\necho tool\n"), 0o755))
	must(os.Link(filepath.Join(dir, "usr/bin/tool"), filepath.Join(dir, "usr/bin/tool2")))
	must(os.Symlink("usr/bin", filepath.Join(dir, "bin")))
	return dir
}

func TestPackCommitExportImport(t *testing.T) {
	ctx := context.Background()
	s, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	layer, err := s.PackDir(makeTree(t), false, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := ParseRef("root/tiny:1")
	im, err := s.Commit(ref, nil, []Layer{layer}, ocispec.ImageConfig{Env: []string{"A=1"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifest.Layers) != 1 || im.Config.Config.Env[0] != "A=1" || im.Size() != layer.Desc.Size {
		t.Fatalf("committed image: %+v", im)
	}
	list, err := s.List("root")
	if err != nil || len(list) != 1 || list[0].Ref != ref {
		t.Fatalf("List = %v, %v", list, err)
	}
	var archive bytes.Buffer
	if err := s.Export(im, &archive); err != nil {
		t.Fatal(err)
	}
	other, _ := OpenStore(t.TempDir())
	ref2, _ := ParseRef("root/copy:2")
	im2, err := other.Import(ctx, bytes.NewReader(archive.Bytes()), ref2, ImportOptions{Size: int64(archive.Len())})
	if err != nil {
		t.Fatal(err)
	}
	if im2.Digest != im.Digest {
		t.Fatalf("import changed the manifest: %s vs %s", im2.Digest, im.Digest)
	}
	if err := other.Delete(ref2); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Resolve(ref2); !errdefs.IsNotFound(err) {
		t.Fatalf("after delete: %v", err)
	}
}

func TestImportDockerSave(t *testing.T) {
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	tw.WriteHeader(&tar.Header{Name: "hello.txt", Mode: 0o644, Size: 2, Typeflag: tar.TypeReg})
	tw.Write([]byte("hi"))
	tw.Close()
	cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"}, Config: ocispec.ImageConfig{Cmd: []string{"sh"}}})
	manifest := `[{"Config":"abc.json","RepoTags":["x:1"],"Layers":["l1/layer.tar"]}]`
	var archive bytes.Buffer
	aw := tar.NewWriter(&archive)
	for _, f := range []struct {
		name string
		data []byte
	}{{"abc.json", cfg}, {"l1/layer.tar", layer.Bytes()}, {"manifest.json", []byte(manifest)}} {
		aw.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.data)), Typeflag: tar.TypeReg})
		aw.Write(f.data)
	}
	aw.Close()
	s, _ := OpenStore(t.TempDir())
	ref, _ := ParseRef("root/saved:1")
	im, err := s.Import(context.Background(), &archive, ref, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifest.Layers) != 1 || im.Manifest.Layers[0].MediaType != ocispec.MediaTypeImageLayer || im.Config.Config.Cmd[0] != "sh" {
		t.Fatalf("imported: %+v", im.Manifest)
	}
}

func TestImportRejectsBadArchives(t *testing.T) {
	s, _ := OpenStore(t.TempDir())
	ref, _ := ParseRef("root/bad:1")
	cases := map[string][]tarEntry{
		"empty":      nil,
		"traversal":  {{name: "../evil", data: []byte("x")}},
		"no blobs":   {{name: "oci-layout", data: []byte(`{"imageLayoutVersion":"1.0.0"}`)}, {name: "index.json", data: []byte(`{"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:` + strings.Repeat("a", 64) + `","size":1}]}`)}},
		"bad json":   {{name: "manifest.json", data: []byte(`[{`)}},
		"missing":    {{name: "manifest.json", data: []byte(`[{"Config":"c.json","Layers":["x.tar"]}]`)}},
		"abs config": {{name: "manifest.json", data: []byte(`[{"Config":"/etc/passwd","Layers":["x.tar"]}]`)}},
	}
	for name, entries := range cases {
		_, err := s.Import(context.Background(), bytes.NewReader(tarOf(entries)), ref, ImportOptions{})
		if err == nil {
			t.Errorf("%s: imported", name)
		} else if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: err %v is not invalid argument", name, err)
		}
	}
	if _, err := s.Import(context.Background(), strings.NewReader("not a tar at all, clearly"), ref, ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("garbage: %v", err)
	}
}

type tarEntry struct {
	name     string
	typeflag byte
	data     []byte
	link     string
}

func tarOf(entries []tarEntry) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		tf := e.typeflag
		if tf == 0 {
			tf = tar.TypeReg
		}
		tw.WriteHeader(&tar.Header{Name: e.name, Mode: 0o644, Size: int64(len(e.data)), Typeflag: tf, Linkname: e.link})
		tw.Write(e.data)
	}
	tw.Close()
	return buf.Bytes()
}

func TestUnpackLayerWhiteoutsAndLinks(t *testing.T) {
	testutil.RequireRoot(t)
	dir := t.TempDir()
	layer := tarOf([]tarEntry{
		{name: "etc/", typeflag: tar.TypeDir},
		{name: "etc/passwd", data: []byte("root:x:0:0::/root:/bin/sh\n")},
		{name: "etc/.wh.shadow"},
		{name: "var/cache/", typeflag: tar.TypeDir},
		{name: "var/cache/.wh..wh..opq"},
		{name: "bin", typeflag: tar.TypeSymlink, link: "/usr/bin"},
		{name: "etc/passwd-link", typeflag: tar.TypeLink, link: "etc/passwd"},
	})
	if err := unpackLayer(bytes.NewReader(layer), dir, int64(len(layer))); err != nil {
		t.Fatal(err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(dir, "etc/shadow"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Fatalf("whiteout: %+v %v", st, err)
	}
	buf := make([]byte, 8)
	if n, err := unix.Lgetxattr(filepath.Join(dir, "var/cache"), opaqueXattr, buf); err != nil || string(buf[:n]) != "y" {
		t.Fatalf("opaque xattr: %q %v", buf[:n], err)
	}
	if target, err := os.Readlink(filepath.Join(dir, "bin")); err != nil || target != "/usr/bin" {
		t.Fatalf("symlink: %q %v", target, err)
	}
	var a, b unix.Stat_t
	unix.Stat(filepath.Join(dir, "etc/passwd"), &a)
	unix.Stat(filepath.Join(dir, "etc/passwd-link"), &b)
	if a.Ino != b.Ino {
		t.Fatal("hard link not kept")
	}
}

func TestUnpackLayerRefusesEscapes(t *testing.T) {
	testutil.RequireRoot(t)
	outside := t.TempDir()
	for name, entries := range map[string][]tarEntry{
		"dotdot":          {{name: "../../escape", data: []byte("x")}},
		"through symlink": {{name: "d", typeflag: tar.TypeSymlink, link: outside}, {name: "d/escape", data: []byte("x")}},
		"hardlink out":    {{name: "h", typeflag: tar.TypeLink, link: "../../../etc/passwd"}},
		"forged opaque":   {{name: "x/.wh..", data: nil}},
	} {
		dir := t.TempDir()
		err := unpackLayer(bytes.NewReader(tarOf(entries)), dir, 1<<30)
		if err == nil {
			t.Errorf("%s: unpacked", name)
		}
		if ents, _ := os.ReadDir(outside); len(ents) != 0 {
			t.Fatalf("%s: wrote outside the layer", name)
		}
	}
}

func FuzzUnpackLayer(f *testing.F) {
	if os.Geteuid() != 0 {
		f.Skip("needs root")
	}
	f.Add(tarOf([]tarEntry{{name: "a/b", data: []byte("x")}, {name: "a/.wh.c"}}))
	f.Add(tarOf([]tarEntry{{name: "l", typeflag: tar.TypeSymlink, link: "/"}, {name: "l/x", data: []byte("x")}}))
	MaxLayerBytes = 1 << 20
	defer func() { MaxLayerBytes = 64 << 30 }()
	f.Fuzz(func(t *testing.T, data []byte) {
		parent := t.TempDir()
		dir := filepath.Join(parent, "layer")
		os.Mkdir(dir, 0o755)
		unpackLayer(bytes.NewReader(data), dir, int64(len(data))) //nolint:errcheck // only escapes matter
		ents, _ := os.ReadDir(parent)
		if len(ents) != 1 {
			t.Fatalf("wrote beside the layer: %v", ents)
		}
	})
}

func FuzzImport(f *testing.F) {
	f.Add(tarOf([]tarEntry{{name: "manifest.json", data: []byte(`[{"Config":"c","Layers":["l"]}]`)}, {name: "c", data: []byte("{}")}, {name: "l", data: []byte("x")}}))
	f.Add(tarOf([]tarEntry{{name: "oci-layout", data: []byte("{}")}, {name: "index.json", data: []byte(`{"manifests":[]}`)}}))
	MaxArchiveBytes = 1 << 20
	defer func() { MaxArchiveBytes = 64 << 30 }()
	f.Fuzz(func(t *testing.T, data []byte) {
		root := t.TempDir()
		s, err := OpenStore(filepath.Join(root, "store"))
		if err != nil {
			t.Fatal(err)
		}
		ref, _ := ParseRef("root/fuzz:1")
		s.Import(context.Background(), bytes.NewReader(data), ref, ImportOptions{}) //nolint:errcheck // must not panic or escape
		ents, _ := os.ReadDir(root)
		if len(ents) != 1 {
			t.Fatalf("wrote beside the store: %v", ents)
		}
	})
}

// zeroArchive streams a gzip-compressed tar of one file of size zero
// bytes, made as it is read: a compression bomb costs the test nothing.
func zeroArchive(t *testing.T, size int64) io.Reader { return zeroTar(t, size, true) }

// zeroTar streams a tar of one file of size zero bytes, gzip-compressed or
// plain.
func zeroTar(t *testing.T, size int64, compressed bool) io.Reader {
	pr, pw := io.Pipe()
	t.Cleanup(func() { pr.Close() })
	go func() {
		var zw io.WriteCloser = nopCloser{pw}
		if compressed {
			zw = gzip.NewWriter(pw)
		}
		tw := tar.NewWriter(zw)
		tw.WriteHeader(&tar.Header{Name: "blobs/sha256/zeros", Mode: 0o644, Size: size, Typeflag: tar.TypeReg}) //nolint:errcheck // the reader's error is the test's
		io.CopyN(tw, zeroReader{}, size)                                                                        //nolint:errcheck // stops when the import does
		tw.Close()
		zw.Close()
		pw.Close()
	}()
	return pr
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }

type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// A small upload cannot become a large image: an archive whose content is
// far more than its compressed bytes allow is refused before its files are
// written, and so is a layer that expands past its blob's bound.
func TestCompressionBombsAreRefused(t *testing.T) {
	s, _ := OpenStore(t.TempDir())
	ref, _ := ParseRef("root/bomb:1")
	_, err := s.Import(context.Background(), zeroArchive(t, 1<<30), ref, ImportOptions{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "compression bomb") {
		t.Fatalf("1 GiB of zeros in a few KiB: %v, want refused as a compression bomb", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "tmp")); len(ents) != 0 {
		t.Fatalf("the refused import left %d entries in the store's tmp", len(ents))
	}
	// A plain archive with a file past the floor (a docker save of a large
	// layer) is read whole: its bytes came in as they are.
	_, err = s.Import(context.Background(), zeroTar(t, 300<<20, false), ref, ImportOptions{})
	if err == nil || strings.Contains(err.Error(), "compression bomb") {
		t.Fatalf("a plain 300 MiB archive: %v, want it read (and refused only as no image layout)", err)
	}
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	tw.WriteHeader(&tar.Header{Name: "big", Mode: 0o644, Size: 300 << 20, Typeflag: tar.TypeReg})
	err = unpackLayer(bytes.NewReader(layer.Bytes()), t.TempDir(), 4096)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "compression bomb") {
		t.Fatalf("a layer blob of 4 KiB claiming 300 MiB: %v, want refused", err)
	}
}

// Room bounds what an import may store, with the caller's error (a
// storage quota's); within it, the same archive imports.
func TestImportStopsAtItsRoom(t *testing.T) {
	s, _ := OpenStore(t.TempDir())
	ref, _ := ParseRef("root/big:1")
	over := errdefs.ResourceExhausted("over the quota")
	_, err := s.Import(context.Background(), zeroArchive(t, 2<<20), ref, ImportOptions{Room: roomOf(1<<20, over)})
	if err != over {
		t.Fatalf("2 MiB into a bound of 1 MiB: %v, want the caller's error", err)
	}
	_, err = s.Import(context.Background(), zeroArchive(t, 2<<20), ref, ImportOptions{Room: roomOf(4<<20, over)})
	if err == over || err == nil || !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("2 MiB within 4 MiB: %v, want it read (and refused only as no image layout)", err)
	}
}

func roomOf(n int64, over error) func(int64) error {
	return func(total int64) error {
		if total > n {
			return over
		}
		return nil
	}
}

func TestExclude(t *testing.T) {
	e, err := ParseExclude([]string{"/root/.cache", "/tmp/*", "__pycache__", "*.pyc", "/etc/secret[0-9]"})
	if err != nil {
		t.Fatal(err)
	}
	for rel, want := range map[string]bool{
		"root/.cache":         true,
		"root/.cache2":        false,
		"tmp/x":               true,
		"tmp":                 false,
		"usr/lib/__pycache__": true,
		"a/b/c.pyc":           true,
		"a/b/c.py":            false,
		"etc/secret1":         true,
		"etc/secretx":         false,
		"home/root/.cache":    false,
	} {
		if got := e.Matches(rel); got != want {
			t.Errorf("Matches(%q) = %v", rel, got)
		}
	}
	for _, bad := range []string{"", "/", "a/b", "[", "/x/[", strings.Repeat("x", 2000)} {
		if _, err := ParseExclude([]string{bad}); errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
			t.Errorf("ParseExclude(%q) = %v", bad, err)
		}
	}
}

func FuzzParseExclude(f *testing.F) {
	for _, s := range []string{"/root/.cache", "*.pyc", "[a-", "/", "a/../b"} {
		f.Add(s, "root/.cache/x")
	}
	f.Fuzz(func(t *testing.T, pattern, rel string) {
		e, err := ParseExclude([]string{pattern})
		if err != nil {
			if errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
				t.Fatalf("refusal is not invalid argument: %v", err)
			}
			return
		}
		e.Matches(rel) // never panics
	})
}

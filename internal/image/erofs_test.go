package image

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/testutil"
)

// TestLayersAreMountedFromTheirEROFSFormsNotUnpacked: naming an image
// writes its layers' EROFS forms; a node's cache mounts them instead of
// unpacking, and an overlay of them shows what unpacked layers would
// (a whiteout hides a file, an opaque directory hides the lower one's
// content, links kept). A mount lost to a reboot comes back; a prune
// unmounts what it removes.
func TestLayersAreMountedFromTheirEROFSFormsNotUnpacked(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.erofs")
	if !erofsKernel() {
		t.Skip("this kernel does not mount EROFS")
	}
	s, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tree := makeTree(t)
	os.MkdirAll(filepath.Join(tree, "var/cache"), 0o755)
	os.WriteFile(filepath.Join(tree, "var/cache/old"), []byte("old"), 0o644)
	os.WriteFile(filepath.Join(tree, "etc/shadow"), []byte("secret"), 0o600)
	base, err := s.PackDir(tree, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	raw := tarOf([]tarEntry{
		{name: "etc/.wh.shadow"},
		{name: "var/cache/", typeflag: tar.TypeDir},
		{name: "var/cache/.wh..wh..opq"},
		{name: "var/cache/new", data: []byte("new")},
	})
	d, n, err := s.PutBlob(bytes.NewReader(raw), "")
	if err != nil {
		t.Fatal(err)
	}
	top := Layer{Desc: ocispec.Descriptor{MediaType: ocispec.MediaTypeImageLayer, Digest: d, Size: n}, DiffID: d}
	ref, _ := ParseRef("root/erofs:1")
	im, err := s.Commit(ref, nil, []Layer{base, top}, ocispec.ImageConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range im.Manifest.Layers {
		if !s.HasEROFS(l.Digest) {
			t.Fatalf("layer %s has no EROFS form after the name was set", l.Digest)
		}
	}

	c, err := NewCache(t.TempDir(), s)
	if err != nil {
		t.Fatal(err)
	}
	dirs, err := c.Layers(context.Background(), im, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, dir := range dirs {
		if !isMountPoint(dir) {
			t.Fatalf("%s is not a mount: the layer was unpacked", dir)
		}
	}
	merged, up, work := t.TempDir(), t.TempDir(), t.TempDir()
	if err := unix.Mount("overlay", merged, "overlay", 0, "lowerdir="+dirs[1]+":"+dirs[0]+",upperdir="+up+",workdir="+work); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(merged, 0) //nolint:errcheck // also unmounted below
	for name, want := range map[string]string{"etc/hostname": "box\n", "var/cache/new": "new", "usr/bin/tool2": "#!/bin/sh\necho tool\n", "bin/tool": "#!/bin/sh\necho tool\n"} {
		if got, err := os.ReadFile(filepath.Join(merged, name)); err != nil || string(got) != want {
			t.Errorf("%s = %q, %v; want %q", name, got, err, want)
		}
	}
	for _, gone := range []string{"etc/shadow", "var/cache/old"} {
		if _, err := os.Lstat(filepath.Join(merged, gone)); !os.IsNotExist(err) {
			t.Errorf("%s shows through: %v", gone, err)
		}
	}
	if err := unix.Unmount(merged, 0); err != nil {
		t.Fatal(err)
	}

	// A reboot takes the mounts; the next use mounts again.
	if err := unix.Unmount(dirs[0], 0); err != nil {
		t.Fatal(err)
	}
	if c.Has(im.Manifest.Layers[0].Digest) {
		t.Fatal("a layer whose mount is gone is taken for ready")
	}
	if _, err := c.Layers(context.Background(), im, nil); err != nil || !isMountPoint(dirs[0]) {
		t.Fatalf("remount: %v", err)
	}
	res, err := c.Prune(nil, 0, 0)
	if err != nil || len(res.Removed) != 0 || res.Size != 0 {
		t.Fatalf("prune of layers a stored image has: %+v %v (their forms take no node disk)", res, err)
	}
	if err := s.Delete(ref); err != nil {
		t.Fatal(err)
	}
	if res, err = c.Prune(nil, 0, 0); err != nil || len(res.Removed) != 2 {
		t.Fatalf("prune after the image went: %+v %v", res, err)
	}
	mounts, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mounts), c.dir) {
		t.Fatalf("mounts left under the cache: %s", mounts)
	}
	if _, err := s.Prune(nil, 0); err != nil {
		t.Fatal(err)
	}
	if left, _ := os.ReadDir(filepath.Join(s.Dir(), "blobs", "erofs")); len(left) != 0 {
		t.Fatalf("EROFS forms left after their blobs went: %v", left)
	}
}

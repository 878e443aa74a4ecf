package image

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// commitTree makes an image named name of one layer holding file=data
// plus a layer shared by every image of the test.
func commitTree(t *testing.T, s *Store, shared Layer, name, data string) *Image {
	t.Helper()
	tree := t.TempDir()
	os.WriteFile(filepath.Join(tree, "file"), []byte(data), 0o644)
	own, err := s.PackDir(tree, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := ParseRef(name)
	im, err := s.Commit(ref, nil, []Layer{shared, own}, ocispec.ImageConfig{Env: []string{"NAME=" + name}})
	if err != nil {
		t.Fatal(err)
	}
	return im
}

func blobs(im *Image) []digest.Digest {
	out := []digest.Digest{im.Digest, im.Manifest.Config.Digest}
	for _, l := range im.Manifest.Layers {
		out = append(out, l.Digest)
	}
	return out
}

// Prune frees what only a deleted name used, keeps what another name, a
// kept manifest (a sandbox's image) or its grace protects, and leaves the
// other images whole.
func TestPruneFreesOnlyWhatNothingUses(t *testing.T) {
	s, _ := OpenStore(t.TempDir())
	base := t.TempDir()
	os.WriteFile(filepath.Join(base, "shared"), []byte("shared by both"), 0o644)
	shared, err := s.PackDir(base, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := commitTree(t, s, shared, "root/a:1", "a's own")
	b := commitTree(t, s, shared, "root/b:1", "b's own")
	kept := commitTree(t, s, shared, "root/kept:1", "in use by a sandbox")
	for _, name := range []string{"root/a:1", "root/kept:1"} {
		ref, _ := ParseRef(name)
		if err := s.Delete(ref); err != nil {
			t.Fatal(err)
		}
	}
	if freed, err := s.Prune([]digest.Digest{kept.Digest}, time.Hour); err != nil || freed != 0 {
		t.Fatalf("within the grace: freed %d, %v; want nothing", freed, err)
	}
	freed, err := s.Prune([]digest.Digest{kept.Digest}, 0)
	if err != nil {
		t.Fatal(err)
	}
	// a's manifest, config and own layer go; the shared layer stays.
	for _, d := range []digest.Digest{a.Digest, a.Manifest.Config.Digest, a.Manifest.Layers[1].Digest} {
		if s.HasBlob(d) {
			t.Fatalf("a's blob %s survived the prune", d)
		}
	}
	if want := a.Manifest.Config.Size + a.Manifest.Layers[1].Size; freed < want {
		t.Fatalf("freed %d bytes, want at least a's own config and layer (%d)", freed, want)
	}
	for _, im := range []*Image{b, kept} {
		for _, d := range blobs(im) {
			if !s.HasBlob(d) {
				t.Fatalf("%s lost blob %s", im.Ref, d)
			}
		}
	}
	if _, err := s.Resolve(b.Ref); err != nil {
		t.Fatalf("the other image after the prune: %v", err)
	}
}

// A cache over its limit loses its least recently used layers first, never
// one a sandbox or snapshot of the node needs, and says why; a stored
// image whose layers went is unpacked again when asked.
func TestCacheLimitRemovesLeastRecentlyUsed(t *testing.T) {
	s, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	s.noEROFS = true // unpacked layers, which take the node's disk
	shared, err := s.PackDir(t.TempDir(), false, nil)
	if err != nil {
		t.Fatal(err)
	}
	big := func(n int) string { return string(make([]byte, n)) }
	old := commitTree(t, s, shared, "root/old:1", big(300<<10))
	mid := commitTree(t, s, shared, "root/mid:1", big(300<<10))
	running := commitTree(t, s, shared, "root/running:1", big(300<<10))
	c, err := NewCache(t.TempDir(), s)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for i, im := range []*Image{running, old, mid} {
		if _, err := c.Layers(ctx, im, nil); err != nil {
			t.Fatal(err)
		}
		// running used longest ago, then old, then mid.
		at := time.Now().Add(-time.Duration(3-i) * time.Hour)
		c.mu.Lock()
		for _, l := range im.Manifest.Layers[1:] {
			c.used[filepath.Base(c.LayerDir(l.Digest))] = at
			os.Chtimes(c.LayerDir(l.Digest), at, at)
		}
		c.mu.Unlock()
	}
	res, err := c.Prune([]digest.Digest{running.Digest}, 0, 700<<10)
	if err != nil {
		t.Fatal(err)
	}
	own := func(im *Image) digest.Digest { return im.Manifest.Layers[1].Digest }
	if c.Has(own(old)) || !c.Has(own(mid)) || !c.Has(own(running)) || !c.Has(shared.Desc.Digest) {
		t.Fatalf("after the prune: old %v mid %v running %v shared %v; want only old's own layer gone", c.Has(own(old)), c.Has(own(mid)), c.Has(own(running)), c.Has(shared.Desc.Digest))
	}
	if len(res.Removed) != 1 || !strings.Contains(res.Removed[0], "over its limit") || res.Size > 700<<10 || res.Freed < 300<<10 {
		t.Fatalf("result: %+v", res)
	}
	// Under a limit nothing can meet, what a sandbox needs still stays.
	if _, err := c.Prune([]digest.Digest{running.Digest}, 0, 1); err != nil {
		t.Fatal(err)
	}
	if !c.Has(own(running)) || c.Has(own(mid)) {
		t.Fatal("a limit of 1 byte: the running sandbox's layer must stay and the others go")
	}
	if _, err := c.Layers(ctx, old, nil); err != nil || !c.Has(own(old)) {
		t.Fatalf("unpacked again: %v", err)
	}
}

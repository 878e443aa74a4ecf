package image

import (
	"os"
	"path/filepath"
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

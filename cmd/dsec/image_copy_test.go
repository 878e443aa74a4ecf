package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/image"
)

// dsec image copy (make bundle's): the named images reach the other store
// with their digests and nothing else does; a name the store lacks is
// refused naming it.
func TestImageCopyBetweenStores(t *testing.T) {
	dir := t.TempDir()
	src, err := image.OpenStore(filepath.Join(dir, "src"))
	if err != nil {
		t.Fatal(err)
	}
	tree := filepath.Join(dir, "tree")
	os.MkdirAll(filepath.Join(tree, "etc"), 0o755)
	os.WriteFile(filepath.Join(tree, "etc", "motd"), []byte("hi\n"), 0o644)
	layer, err := src.PackDir(tree, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	digests := map[string]string{}
	for _, name := range []string{"root/one:1", "root/two:1", "root/left:1"} {
		ref, _ := image.ParseRef(name)
		im, err := src.Commit(ref, nil, []image.Layer{layer}, ocispec.ImageConfig{Env: []string{"NAME=" + name}})
		if err != nil {
			t.Fatal(err)
		}
		digests[name] = im.Digest.String()
	}
	to := filepath.Join(dir, "dst")
	ctx := context.Background()
	if err := imageCopy(ctx, []string{"--from", filepath.Join(dir, "src"), "--to", to, "root/one:1", "root/two:1"}); err != nil {
		t.Fatal(err)
	}
	dst, err := image.OpenStore(to)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"root/one:1", "root/two:1"} {
		ref, _ := image.ParseRef(name)
		im, err := dst.Resolve(ref)
		if err != nil || im.Digest.String() != digests[name] {
			t.Fatalf("%s in the copy: %v, %v; want %s", name, im, err, digests[name])
		}
	}
	ref, _ := image.ParseRef("root/left:1")
	if _, err := dst.Resolve(ref); err == nil {
		t.Fatal("root/left:1 was not asked for and is in the copy")
	}
	err = imageCopy(ctx, []string{"--from", filepath.Join(dir, "src"), "--to", to, "root/none:1"})
	if err == nil || !strings.Contains(err.Error(), "root/none:1") {
		t.Fatalf("a name the store lacks: %v", err)
	}
}

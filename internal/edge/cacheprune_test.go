package edge

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/opendsec/opendsec/internal/image"
)

// A deleted image's layers (unpacked or mounted) stay on the node while a sandbox of it
// lives, and go once it has ended; an image still named keeps its layers.
func TestLayerCacheKeepsWhatSandboxesUse(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	ref, _ := image.ParseRef("root/tiny:1")
	im, err := f.store.Resolve(ref)
	if err != nil {
		t.Fatal(err)
	}
	layer := f.edge.parts.Cache.LayerDir(im.Manifest.Layers[0].Digest)
	sb, err := f.edge.Create(ctx, spec(), "root/a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(layer); err != nil {
		t.Fatalf("the image's layer is not in the cache after a create: %v", err)
	}
	if freed := f.edge.pruneCache(0); freed != 0 {
		t.Fatalf("pruned %d bytes of an image still named", freed)
	}
	if err := f.store.Delete(ref); err != nil {
		t.Fatal(err)
	}
	if freed := f.edge.pruneCache(0); freed != 0 {
		t.Fatalf("pruned %d bytes while a sandbox of the image runs", freed)
	}
	if _, err := os.Stat(layer); err != nil {
		t.Fatalf("a running sandbox's layer was removed: %v", err)
	}
	if _, err := f.edge.Destroy(ctx, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	// A layer mounted from its EROFS form takes none of the node's disk.
	_, mounted := os.Stat(filepath.Join(layer, "erofs"))
	if freed := f.edge.pruneCache(0); freed <= 0 && mounted != nil {
		t.Fatalf("pruned %d bytes once nothing uses the unpacked layer", freed)
	}
	if _, err := os.Stat(layer); !os.IsNotExist(err) {
		t.Fatalf("the layer is still cached: %v", err)
	}
}

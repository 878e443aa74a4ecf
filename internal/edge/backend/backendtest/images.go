package backendtest

import (
	"context"
	"path/filepath"
	"sync"
	"testing"

	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/image/baseimage"
	"github.com/opendsec/opendsec/internal/testutil"
)

var (
	busyboxOnce   sync.Once
	busyboxLayers []string
	busyboxErr    error
)

// BusyboxLayers builds root/busybox once per test process into a scratch
// store and node cache, and returns its unpacked layers. Needs root.
func BusyboxLayers(t *testing.T) []string {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "busybox")
	busyboxOnce.Do(func() {
		dir, err := testutil.ProcessDir("busybox")
		if err != nil {
			busyboxErr = err
			return
		}
		store, err := image.OpenStore(filepath.Join(dir, "store"))
		if err != nil {
			busyboxErr = err
			return
		}
		ref, _ := image.ParseRef("root/busybox:latest")
		im, err := baseimage.Build(context.Background(), store, "busybox", ref, baseimage.Options{})
		if err != nil {
			busyboxErr = err
			return
		}
		cache, err := image.NewCache(filepath.Join(dir, "cache"), store)
		if err != nil {
			busyboxErr = err
			return
		}
		busyboxLayers, busyboxErr = cache.Layers(context.Background(), im, nil)
	})
	if busyboxErr != nil {
		t.Fatalf("busybox image: %v", busyboxErr)
	}
	return busyboxLayers
}

// StoreImageLayers unpacks name from the repository's image store
// (.cache/images, which make images fills) into a scratch node cache and
// returns its layers; without it the test is skipped (fails when strict),
// naming what builds it. Needs root.
func StoreImageLayers(t *testing.T, name, buildWith string) []string {
	t.Helper()
	testutil.RequireRoot(t)
	store, err := image.OpenStore(filepath.Join(testutil.RepoRoot(t), ".cache", "images"))
	if err != nil {
		t.Fatal(err)
	}
	ref, err := image.ParseRef(name)
	if err != nil {
		t.Fatal(err)
	}
	im, err := store.Resolve(ref)
	if err != nil {
		testutil.Missing(t, "image %s is not in .cache/images (%s builds it): %v", name, buildWith, err)
	}
	// Its layers are mounted read-only: they go where a later run removes
	// them, as busybox's do.
	dir, err := testutil.ProcessDir("store-images")
	if err != nil {
		t.Fatal(err)
	}
	cache, err := image.NewCache(filepath.Join(dir, "cache"), store)
	if err != nil {
		t.Fatal(err)
	}
	layers, err := cache.Layers(context.Background(), im, nil)
	if err != nil {
		t.Fatalf("unpack %s: %v", name, err)
	}
	return layers
}

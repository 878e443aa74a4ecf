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

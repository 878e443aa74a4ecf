package e2e

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/image/baseimage"
)

// busyboxStore makes an image store under dir holding root/busybox:latest
// and returns its path, for clusters of separate processes.
func busyboxStore(t *testing.T, dir string) string {
	t.Helper()
	storeDir := filepath.Join(dir, "images")
	store, err := image.OpenStore(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	ref, _ := image.ParseRef("root/busybox:latest")
	if _, err := baseimage.Build(context.Background(), store, "busybox", ref, baseimage.Options{}); err != nil {
		t.Fatal(err)
	}
	return storeDir
}

// apiClients returns a client of every apiserver of c, with key.
func apiClients(t *testing.T, c *cluster, key string) []*client.Client {
	t.Helper()
	var out []*client.Client
	for _, u := range c.APIURLs {
		cl, err := client.New(u, key)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, cl)
	}
	return out
}

package e2e

import (
	"path/filepath"
	"testing"

	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/testutil"
)

// Clusters on the real runtimes. Their guards skip where the host lacks a
// runtime or image, and fail instead in a strict run (make test).

// containerCluster runs the container backend (crun) with root/busybox.
func containerCluster(t *testing.T) *cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	testutil.RequireBinary(t, "busybox")
	return startCluster(t, "container")
}

// gvisorCluster runs the gvisor and container backends with root/busybox
// only, in a store of its own: tests that need no Python image do not
// depend on one.
func gvisorCluster(t *testing.T) *cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "busybox")
	return startCluster(t, "gvisor", "container")
}

// gvisorPyCluster runs the gvisor and container backends on the image
// store `make images` fills, which has root/py:3.11.
func gvisorPyCluster(t *testing.T) *cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	return startClusterWithStore(t, pyStore(t), "gvisor", "container")
}

// pyStore is the image store `make images` fills, with root/py:3.11.
func pyStore(t *testing.T) string {
	store := filepath.Join(testutil.RepoRoot(t), ".cache", "images")
	s, err := image.OpenStore(store)
	if err != nil {
		testutil.Missing(t, "no image store at %s (make images): %v", store, err)
	}
	ref, _ := image.ParseRef("root/py:3.11")
	if _, err := s.Resolve(ref); err != nil {
		testutil.Missing(t, "root/py:3.11 is not built (make images): %v", err)
	}
	return store
}

package oci

import (
	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// Cgroups finds the node's cgroup layout with the sandboxes under parent
// (a backend's "cgroup-parent" option, `--cgroup-parent`; empty for
// cgroups.DefaultParent).
func Cgroups(parent string) (*cgroups.Host, error) {
	h, err := cgroups.Detect(cgroups.DefaultRoot, parent)
	if err != nil {
		return nil, errdefs.InvalidArgument("%v", err)
	}
	return h, nil
}

// ReadUsage reads a sandbox's cgroup from the host: it neither enters nor
// wakes the sandbox.
func ReadUsage(g cgroups.Group) (backend.Usage, error) {
	u, err := g.ReadUsage()
	return backend.Usage{CPUNanos: u.CPUNanos, MemoryBytes: u.MemoryBytes, CacheBytes: u.CacheBytes, LimitBytes: u.LimitBytes, ActiveFileBytes: u.ActiveFileBytes}, err
}

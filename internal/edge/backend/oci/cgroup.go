package oci

import (
	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// CgroupParentOption is the backend option naming the sandboxes' parent
// cgroup (`--cgroup-parent`); empty for cgroups.DefaultParent.
const CgroupParentOption = "cgroup-parent"

// Cgroups finds the node's cgroup layout for a backend with options opts.
func Cgroups(opts map[string]string) (*cgroups.Host, error) {
	h, err := cgroups.Detect(cgroups.DefaultRoot, opts[CgroupParentOption])
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

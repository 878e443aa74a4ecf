package microvm

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// A microVM's CPU limit [ours]: its vCPUs are whole (ceil of cpu_cores),
// so the fraction is held by the node's CFS bandwidth control on the VMM
// process, all its threads, in the sandbox's own cpu cgroup (the same
// place a container's is), on cgroup v1 (cpu.cfs_quota_us) and v2
// (cpu.max) alike. QEMU daemonizes before it can be placed: the first
// milliseconds of its start are not bound.

const cfsPeriodUs = 100_000

var errNoCPUController = errors.New("no cgroup cpu controller on this node; the limit is the vCPU count")

// limitCPU puts process pid (a VMM) in sandbox id's cpu cgroup with a
// bandwidth of cores.
func (b *Backend) limitCPU(id sandboxid.ID, pid int, cores float64) error {
	if b.cg == nil || !hasCPUController(b.cg) {
		return errNoCPUController
	}
	g := b.cg.Group(string(id))
	if err := g.Create("cpu"); err != nil {
		return err
	}
	if err := g.SetCPUQuota(int64(cores*cfsPeriodUs), cfsPeriodUs); err != nil {
		return err
	}
	// A process id written to cgroup.procs moves all its threads.
	return g.AddProcess(pid, "cpu")
}

// hasCPUController reports whether the sandboxes' cgroups can hold a CPU
// bandwidth: v1's cpu hierarchy, or v2's cpu controller enabled for them.
func hasCPUController(h *cgroups.Host) bool {
	if h.Version == cgroups.V2 {
		data, err := os.ReadFile(filepath.Join(h.Root, h.Parent, "cgroup.subtree_control"))
		return err == nil && slices.Contains(strings.Fields(string(data)), "cpu")
	}
	_, err := os.Stat(filepath.Join(h.Root, "cpu", "cpu.cfs_quota_us"))
	return err == nil
}

// removeCPUCgroup removes sandbox id's cpu cgroup once its VMM is gone;
// the threads of a killed VMM leave it a little after the process ends.
func (b *Backend) removeCPUCgroup(id sandboxid.ID) error {
	if b.cg == nil {
		return nil
	}
	return b.cg.Group(string(id)).Remove()
}

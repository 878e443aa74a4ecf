package microvm

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/edge/backend/oci"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// A microVM's CPU limit [ours]: its vCPUs are whole (ceil of cpu_cores),
// so the fraction is held by the node's CFS bandwidth control on the VMM
// process, all its threads, in the sandbox's own cpu cgroup (the same
// place a container's is). QEMU daemonizes before it can be placed: the
// first milliseconds of its start are not bound.

const cfsPeriodUs = 100_000

// cpuHierarchy is the v1 cpu controller's mount; cgroup v2 hosts are not
// handled yet (the hosts issue), and there the limit is the vCPU count.
var cpuHierarchy = "/sys/fs/cgroup/cpu"

var errNoCPUController = errors.New("no cgroup v1 cpu controller on this node; the limit is the vCPU count")

// limitCPU puts process pid (a VMM) in sandbox id's cpu cgroup with a
// bandwidth of cores.
func limitCPU(id sandboxid.ID, pid int, cores float64) error {
	if _, err := os.Stat(filepath.Join(cpuHierarchy, "cpu.cfs_quota_us")); err != nil {
		return errNoCPUController
	}
	dir := filepath.Join(cpuHierarchy, oci.CgroupsPath(string(id)))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := oci.SetCPUQuota(string(id), int64(cores*cfsPeriodUs), cfsPeriodUs); err != nil {
		return err
	}
	// In v1, a process id written to cgroup.procs moves all its threads.
	return os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644)
}

// removeCPUCgroup removes sandbox id's cpu cgroup once its VMM is gone;
// the threads of a killed VMM leave it a little after the process ends.
func removeCPUCgroup(id sandboxid.ID) error {
	dir := filepath.Join(cpuHierarchy, oci.CgroupsPath(string(id)))
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		err := os.Remove(dir)
		if err == nil || errors.Is(err, os.ErrNotExist) {
			return nil
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			return err
		}
	}
}

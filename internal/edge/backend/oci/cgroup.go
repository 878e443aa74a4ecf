package oci

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

const cgroupRoot = "/sys/fs/cgroup"

// CgroupParent is where sandbox cgroups live in every v1 hierarchy.
const CgroupParent = "/opendsec"

// CgroupsPath is a sandbox's cgroup below every hierarchy.
func CgroupsPath(id string) string { return CgroupParent + "/" + id }

// freezerState is the freezer file of a sandbox's cgroup.
func freezerState(id string) string {
	return filepath.Join(cgroupRoot, "freezer", CgroupParent, id, "freezer.state")
}

// Freeze stops every process of the sandbox's cgroup and waits until the
// kernel reports them frozen. The v1 freezer can stay in FREEZING while a
// task is ptrace-stopped or in a vfork (gVisor's ptrace platform has both),
// so like runc it thaws briefly and freezes again every 100 ms; after 5 s it
// thaws the cgroup, leaving it running, and reports the failure.
func Freeze(id string) error {
	p := freezerState(id)
	deadline := time.Now().Add(5 * time.Second)
	for attempt := 0; time.Now().Before(deadline); attempt++ {
		if attempt > 0 {
			if err := os.WriteFile(p, []byte("THAWED"), 0o644); err != nil {
				return fmt.Errorf("freeze %s: %w", id, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if err := os.WriteFile(p, []byte("FROZEN"), 0o644); err != nil {
			return fmt.Errorf("freeze %s: %w", id, err)
		}
		for i := 0; i < 50; i++ {
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			if strings.TrimSpace(string(data)) == "FROZEN" {
				return nil
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	Thaw(id) //nolint:errcheck // reporting the freeze failure matters more
	return errdefs.Unavailable("freeze %s: the cgroup freezer did not settle within 5s; the sandbox keeps running", id)
}

// Thaw lets a frozen cgroup run again.
func Thaw(id string) error {
	if err := os.WriteFile(freezerState(id), []byte("THAWED"), 0o644); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("thaw %s: %w", id, err)
	}
	return nil
}

// SetCPUShares sets the CPU weight of a sandbox's cgroup.
func SetCPUShares(id string, shares uint64) error {
	p := filepath.Join(cgroupRoot, "cpu", CgroupParent, id, "cpu.shares")
	return os.WriteFile(p, []byte(fmt.Sprint(shares)), 0o644)
}

// SetCPUQuota sets the CFS bandwidth limit of a sandbox's cgroup; a quota
// of -1 lifts it.
func SetCPUQuota(id string, quota int64, period uint64) error {
	dir := filepath.Join(cgroupRoot, "cpu", CgroupParent, id)
	if period > 0 {
		if err := os.WriteFile(filepath.Join(dir, "cpu.cfs_period_us"), []byte(fmt.Sprint(period)), 0o644); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(dir, "cpu.cfs_quota_us"), []byte(fmt.Sprint(quota)), 0o644)
}

// Frozen reports whether the sandbox's cgroup is frozen.
func Frozen(id string) bool {
	data, err := os.ReadFile(freezerState(id))
	return err == nil && strings.TrimSpace(string(data)) != "THAWED"
}

// FixHybridCgroups makes a hybrid (v1 + v2) host usable by crun, which
// refuses to run while any controller is attached to the v2 hierarchy. On
// Debian 12 that is hugetlb, because no v1 hierarchy mounts it; mounting one
// moves it off v2. This changes the host until reboot and is logged.
func FixHybridCgroups(log *slog.Logger) error {
	unified := filepath.Join(cgroupRoot, "unified", "cgroup.controllers")
	data, err := os.ReadFile(unified)
	if err != nil {
		return nil // pure v1 or pure v2: nothing to do
	}
	controllers := strings.Fields(string(data))
	if len(controllers) == 0 {
		return nil
	}
	for _, c := range controllers {
		dir := filepath.Join(cgroupRoot, c)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fixError(controllers, err)
		}
		if err := syscall.Mount("cgroup", dir, "cgroup", 0, c); err != nil {
			return fixError(controllers, err)
		}
		log.Info("mounted a v1 cgroup hierarchy so crun accepts this hybrid host", "controller", c, "path", dir)
	}
	return nil
}

func fixError(controllers []string, err error) error {
	return errdefs.FailedPrecondition("container backend: crun refuses hybrid cgroups while %v are on cgroup v2, and mounting them as v1 failed (%v); mount them by hand (mkdir /sys/fs/cgroup/hugetlb && mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb) or use runtime=runc", controllers, err)
}

// RemoveCgroups removes rel (e.g. "/opendsec/ID") from every hierarchy, in
// case the runtime left it behind.
func RemoveCgroups(rel string) error {
	ents, err := os.ReadDir(cgroupRoot)
	if err != nil {
		return nil
	}
	var errs []error
	for _, e := range ents {
		dir := filepath.Join(cgroupRoot, e.Name(), rel)
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}

// CgroupDirs lists the cgroup directories of a sandbox that still exist;
// tests use it to check that nothing leaked.
func CgroupDirs(id string) []string {
	ents, _ := os.ReadDir(cgroupRoot)
	var out []string
	for _, e := range ents {
		dir := filepath.Join(cgroupRoot, e.Name(), CgroupParent, id)
		if _, err := os.Stat(dir); err == nil {
			out = append(out, dir)
		}
	}
	return out
}

// OOMKills is how many processes the kernel's OOM killer ended in the
// sandbox's memory cgroup, and the cgroup's limit in bytes.
func OOMKills(id string) (kills int, limit int64) {
	dir := filepath.Join(cgroupRoot, "memory", CgroupParent, id)
	if data, err := os.ReadFile(filepath.Join(dir, "memory.oom_control")); err == nil {
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "oom_kill "); ok {
				kills, _ = strconv.Atoi(strings.TrimSpace(v))
			}
		}
	}
	if data, err := os.ReadFile(filepath.Join(dir, "memory.limit_in_bytes")); err == nil {
		limit, _ = strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	}
	return kills, limit
}

// PidsRefused is how many forks the sandbox's pids cgroup refused.
func PidsRefused(id string) int {
	data, err := os.ReadFile(filepath.Join(cgroupRoot, "pids", CgroupParent, id, "pids.events"))
	if err != nil {
		return 0
	}
	v, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(string(data)), "max")))
	return v
}

// DiagnoseOOM says "out of memory (limit N MiB)" if the OOM killer acted in
// the sandbox's cgroup, else "".
func DiagnoseOOM(id string) string {
	kills, limit := OOMKills(id)
	if kills == 0 {
		return ""
	}
	return fmt.Sprintf("out of memory (limit %d MiB): the kernel's OOM killer ended %d process(es) in it", limit>>20, kills)
}

// PidsCurrent is how many tasks the sandbox's pids cgroup holds.
func PidsCurrent(id string) int {
	data, err := os.ReadFile(filepath.Join(cgroupRoot, "pids", CgroupParent, id, "pids.current"))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return n
}

// KillAll ends every process left in a sandbox's cgroup (thawing it first:
// a frozen process cannot die) and waits up to 5 s for them to go. It is the
// last resort of a removal: the runtime's own delete ends them normally, but
// after a crash the runtime may have lost track of them.
func KillAll(id string) error {
	Thaw(id) //nolint:errcheck // it may not be frozen, or not exist
	deadline := time.Now().Add(5 * time.Second)
	for {
		pids := cgroupProcs(id)
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s: %d processes survive SIGKILL", id, len(pids))
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL) //nolint:errcheck // it may be gone
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitEmpty waits up to d for a sandbox's cgroup to hold no process and
// reports whether it came to hold none.
func WaitEmpty(id string, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for len(cgroupProcs(id)) > 0 {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}

// Procs lists the processes in a sandbox's cgroup on the node.
func Procs(id string) []int { return cgroupProcs(id) }

// cgroupProcs lists the processes in a sandbox's cgroup, from every
// hierarchy that has one (a process could have been moved in one only).
func cgroupProcs(id string) []int {
	seen := map[int]bool{}
	var out []int
	ents, _ := os.ReadDir(cgroupRoot)
	for _, e := range ents {
		data, err := os.ReadFile(filepath.Join(cgroupRoot, e.Name(), CgroupParent, id, "cgroup.procs"))
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil && !seen[pid] {
				seen[pid] = true
				out = append(out, pid)
			}
		}
	}
	return out
}

// CgroupsWithPrefix lists the cgroup names below CgroupParent, in any
// hierarchy, that start with prefix.
func CgroupsWithPrefix(prefix string) []string {
	seen := map[string]bool{}
	var out []string
	ents, _ := os.ReadDir(cgroupRoot)
	for _, e := range ents {
		subs, _ := os.ReadDir(filepath.Join(cgroupRoot, e.Name(), CgroupParent))
		for _, s := range subs {
			if s.IsDir() && strings.HasPrefix(s.Name(), prefix) && !seen[s.Name()] {
				seen[s.Name()] = true
				out = append(out, s.Name())
			}
		}
	}
	return out
}

// EmptyMemory has the kernel reclaim every page still charged to id's
// memory cgroup once nothing runs in it (cgroup v1 memory.force_empty):
// the page cache of files it wrote (a checkpoint image) is written back
// and dropped, so the node has that memory back. A cgroup that is gone
// has nothing to give.
func EmptyMemory(id string) error {
	err := os.WriteFile(filepath.Join(cgroupRoot, "memory", CgroupParent, id, "memory.force_empty"), []byte("0"), 0o200)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return err
}

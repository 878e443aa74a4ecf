package cgroups

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Group is one sandbox's cgroup. Its methods act on a cgroup that may not
// exist (yet or any more): readers answer zero, writers the error.
type Group struct {
	h  *Host
	id string
}

func (g Group) rel() string { return g.h.Path(g.id) }

func (g Group) dir(controller string) string { return g.h.dir(controller, g.rel()) }

func (g Group) file(controller, name string) string {
	return filepath.Join(g.dir(controller), name)
}

// Create makes the cgroup in the hierarchies of controllers (every
// controller shares one directory on v2); for processes the edge places
// itself, such as a VMM.
func (g Group) Create(controllers ...string) error {
	if g.h.Version == V2 {
		controllers = []string{""}
	}
	for _, c := range controllers {
		if err := os.MkdirAll(g.dir(c), 0o755); err != nil {
			return fmt.Errorf("cgroup %s: %w", g.dir(c), err)
		}
	}
	return nil
}

// AddProcess moves process pid, all its threads, into the cgroup of each
// of controllers (one write on v2).
func (g Group) AddProcess(pid int, controllers ...string) error {
	if g.h.Version == V2 {
		controllers = []string{""}
	}
	for _, c := range controllers {
		if err := write(g.file(c, "cgroup.procs"), strconv.Itoa(pid)); err != nil {
			return err
		}
	}
	return nil
}

// freezer file and the values it takes.
func (g Group) freezer() (file, frozen, thawed string) {
	if g.h.Version == V2 {
		return g.file("", "cgroup.freeze"), "1", "0"
	}
	return g.file("freezer", "freezer.state"), "FROZEN", "THAWED"
}

// Freeze stops every process of the cgroup and waits until the kernel
// reports them frozen. The v1 freezer can stay in FREEZING while a task is
// ptrace-stopped or in a vfork (gVisor's ptrace platform has both), so like
// runc it thaws briefly and freezes again every 100 ms; after 5 s it thaws
// the cgroup, leaving it running, and reports the failure.
func (g Group) Freeze() error {
	p, frozen, thawed := g.freezer()
	deadline := time.Now().Add(5 * time.Second)
	for attempt := 0; time.Now().Before(deadline); attempt++ {
		if attempt > 0 {
			if err := write(p, thawed); err != nil {
				return fmt.Errorf("freeze %s: %w", g.id, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if err := write(p, frozen); err != nil {
			return fmt.Errorf("freeze %s: %w", g.id, err)
		}
		for i := 0; i < 50; i++ {
			if g.settled() {
				return nil
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	g.Thaw() //nolint:errcheck // reporting the freeze failure matters more
	return errdefs.Unavailable("freeze %s: the cgroup freezer did not settle within 5s; the sandbox keeps running", g.id)
}

// settled reports whether every process of the cgroup is frozen: v2 says
// so in cgroup.events ("frozen 1"), v1 in freezer.state.
func (g Group) settled() bool {
	if g.h.Version == V2 {
		return keyed(g.file("", "cgroup.events"))["frozen"] == 1
	}
	data, err := os.ReadFile(g.file("freezer", "freezer.state"))
	return err == nil && strings.TrimSpace(string(data)) == "FROZEN"
}

// Thaw lets a frozen cgroup run again; a cgroup that is gone is thawed.
func (g Group) Thaw() error {
	p, _, thawed := g.freezer()
	if err := writeOnce(p, thawed); err != nil && !notExist(err) {
		return fmt.Errorf("thaw %s: %w", g.id, err)
	}
	return nil
}

// Frozen reports whether the cgroup is frozen or freezing.
func (g Group) Frozen() bool {
	p, _, thawed := g.freezer()
	data, err := os.ReadFile(p)
	return err == nil && strings.TrimSpace(string(data)) != thawed
}

// SetCPUShares sets the cgroup's CPU weight in v1 shares (2..262144,
// 1024 normal); v2's cpu.weight (1..10000, 100 normal) gets the value the
// OCI runtimes convert shares to.
func (g Group) SetCPUShares(shares uint64) error {
	if g.h.Version == V2 {
		return write(g.file("cpu", "cpu.weight"), strconv.FormatUint(SharesToWeight(shares), 10))
	}
	return write(g.file("cpu", "cpu.shares"), strconv.FormatUint(shares, 10))
}

// SharesToWeight is crun's and runc's conversion of v1 shares to v2 weight.
func SharesToWeight(shares uint64) uint64 {
	if shares == 0 {
		return 0
	}
	shares = min(max(shares, 2), 262144)
	return 1 + ((shares-2)*9999)/262142
}

// SetCPUQuota sets the CFS bandwidth limit: quota µs of CPU per period µs;
// a quota below 0 lifts it, a period of 0 keeps the current one.
func (g Group) SetCPUQuota(quota int64, period uint64) error {
	if g.h.Version == V2 {
		if period == 0 {
			period = 100000
			if data, err := os.ReadFile(g.file("cpu", "cpu.max")); err == nil {
				if f := strings.Fields(string(data)); len(f) == 2 {
					if p, err := strconv.ParseUint(f[1], 10, 64); err == nil {
						period = p
					}
				}
			}
		}
		q := "max"
		if quota >= 0 {
			q = strconv.FormatInt(quota, 10)
		}
		return write(g.file("cpu", "cpu.max"), q+" "+strconv.FormatUint(period, 10))
	}
	if period > 0 {
		if err := write(g.file("cpu", "cpu.cfs_period_us"), strconv.FormatUint(period, 10)); err != nil {
			return err
		}
	}
	return write(g.file("cpu", "cpu.cfs_quota_us"), strconv.FormatInt(quota, 10))
}

// Usage is what the cgroup has used.
type Usage struct {
	CPUNanos    uint64 // CPU time since the cgroup was made
	MemoryBytes int64  // memory charged, less inactive page cache the kernel drops first
	CacheBytes  int64  // page cache
	LimitBytes  int64  // memory limit (0: none)
	// ActiveFileBytes is page cache of files (not shared memory) used
	// lately: the kernel drops it too when memory is short, once written
	// back; a checkpoint just written leaves much of it.
	ActiveFileBytes int64
}

// ReadUsage reads the cgroup's CPU and memory use from the host; it
// neither enters nor wakes the sandbox.
func (g Group) ReadUsage() (Usage, error) {
	var u Usage
	var used, limit uint64
	var stat map[string]uint64
	var err error
	if g.h.Version == V2 {
		cpu := keyed(g.file("cpu", "cpu.stat"))
		usec, ok := cpu["usage_usec"]
		if !ok {
			return u, fmt.Errorf("cpu use of %s: no usage_usec in %s", g.id, g.file("cpu", "cpu.stat"))
		}
		u.CPUNanos = usec * 1000
		if used, err = readUint(g.file("memory", "memory.current")); err != nil {
			return u, fmt.Errorf("memory use of %s: %w", g.id, err)
		}
		limit, _ = readUint(g.file("memory", "memory.max")) // "max": no limit
		stat = keyed(g.file("memory", "memory.stat"))
		u.CacheBytes = int64(stat["file"])
	} else {
		if u.CPUNanos, err = readUint(g.file("cpuacct", "cpuacct.usage")); err != nil {
			return u, fmt.Errorf("cpu use of %s: %w", g.id, err)
		}
		if used, err = readUint(g.file("memory", "memory.usage_in_bytes")); err != nil {
			return u, fmt.Errorf("memory use of %s: %w", g.id, err)
		}
		limit, _ = readUint(g.file("memory", "memory.limit_in_bytes"))
		stat = keyed(g.file("memory", "memory.stat"))
		u.CacheBytes = int64(stat["total_cache"])
		stat["inactive_file"] = stat["total_inactive_file"]
		stat["active_file"] = stat["total_active_file"]
	}
	u.LimitBytes = int64(min(limit, 1<<62))
	u.MemoryBytes = int64(used) - int64(min(stat["inactive_file"], used))
	u.ActiveFileBytes = int64(min(stat["active_file"], uint64(u.MemoryBytes)))
	return u, nil
}

// OOMKills is how many processes the kernel's OOM killer ended in the
// cgroup (v2 memory.events, v1 memory.oom_control), and the memory limit.
func (g Group) OOMKills() (kills int, limit int64) {
	var lim uint64
	if g.h.Version == V2 {
		kills = int(keyed(g.file("memory", "memory.events"))["oom_kill"])
		lim, _ = readUint(g.file("memory", "memory.max"))
	} else {
		kills = int(keyed(g.file("memory", "memory.oom_control"))["oom_kill"])
		lim, _ = readUint(g.file("memory", "memory.limit_in_bytes"))
	}
	return kills, int64(min(lim, 1<<62))
}

// DiagnoseOOM says "out of memory (limit N MiB)…" if the OOM killer acted
// in the cgroup, else "".
func (g Group) DiagnoseOOM() string {
	kills, limit := g.OOMKills()
	if kills == 0 {
		return ""
	}
	return fmt.Sprintf("out of memory (limit %d MiB): the kernel's OOM killer ended %d process(es) in it", limit>>20, kills)
}

// PidsRefused is how many forks the cgroup's pids limit refused
// (pids.events "max N" on both layouts).
func (g Group) PidsRefused() int {
	return int(keyed(g.file("pids", "pids.events"))["max"])
}

// PidsCurrent is how many tasks the cgroup holds.
func (g Group) PidsCurrent() int {
	n, _ := readUint(g.file("pids", "pids.current"))
	return int(n)
}

// Procs lists the processes in the cgroup, from every hierarchy that has
// it (on v1 a process could have been moved in one only).
func (g Group) Procs() []int {
	seen := map[int]bool{}
	var out []int
	for _, dir := range g.h.hierarchies(g.rel()) {
		data, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
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

// KillAll ends every process left in the cgroup (thawing it first: a
// frozen process cannot die on v1) and waits up to 5 s for them to go. On
// v2 the kernel's cgroup.kill does it at once, forks in flight included.
// It is the last resort of a removal: the runtime's own delete ends them
// normally, but after a crash the runtime may have lost track of them.
func (g Group) KillAll() error {
	g.Thaw() //nolint:errcheck // it may not be frozen, or not exist
	if g.h.Version == V2 {
		if err := writeOnce(g.file("", "cgroup.kill"), "1"); err != nil && !notExist(err) {
			// Kernels before 5.14 lack cgroup.kill: signal each process.
			if !errors.Is(err, syscall.EINVAL) && !errors.Is(err, os.ErrPermission) {
				return fmt.Errorf("kill cgroup %s: %w", g.id, err)
			}
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		pids := g.Procs()
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("cgroup %s: %d processes survive SIGKILL", g.id, len(pids))
		}
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL) //nolint:errcheck // it may be gone
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// WaitEmpty waits up to d for the cgroup to hold no process and reports
// whether it came to hold none.
func (g Group) WaitEmpty(d time.Duration) bool {
	deadline := time.Now().Add(d)
	for len(g.Procs()) > 0 {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
	return true
}

// Reclaim has the kernel give back every page still charged to the cgroup
// once nothing runs in it: the page cache of files it wrote (a checkpoint
// image) is written back and dropped. v1 has memory.force_empty; v2 has
// memory.reclaim (Linux 5.19), asked for more than the cgroup holds (the
// kernel answers EAGAIN when it could not reclaim all it was asked, which
// is the usual answer here). A cgroup that is gone has nothing to give.
// Both stop with EINTR when a signal comes for the writing thread (Go's
// own preemption signal does, on a busy node), keeping what they freed:
// the write is made again.
func (g Group) Reclaim() error {
	err := againOnEINTR(reclaimTries, func() error {
		if g.h.Version == V2 {
			cur, err := readUint(g.file("memory", "memory.current"))
			if err != nil {
				return err
			}
			err = writeOnce(g.file("memory", "memory.reclaim"), strconv.FormatUint(cur+1<<20, 10))
			if errors.Is(err, syscall.EAGAIN) {
				err = nil
			}
			return err
		}
		return writeOnce(g.file("memory", "memory.force_empty"), "0")
	})
	if notExist(err) {
		return nil
	}
	return err
}

// reclaimTries bounds Reclaim's writes interrupted by a signal.
const reclaimTries = 10

// againOnEINTR calls f until it ends other than with EINTR, at most tries
// times.
func againOnEINTR(tries int, f func() error) error {
	var err error
	for range tries {
		if err = f(); !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
	return err
}

// Remove removes the cgroup from every hierarchy (children first), in
// case the runtime left it behind; one that is gone is removed.
func (g Group) Remove() error {
	var errs []error
	for _, dir := range g.h.hierarchies(g.rel()) {
		if err := removeTree(dir); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// removeTree removes the cgroup dir and any child cgroups below it; the
// kernel refuses EBUSY while a process is still leaving, so it retries for
// up to 2 s.
func removeTree(dir string) error {
	subs, err := os.ReadDir(dir)
	if notExist(err) {
		return nil
	}
	for _, s := range subs {
		if s.IsDir() {
			if err := removeTree(filepath.Join(dir, s.Name())); err != nil {
				return err
			}
		}
	}
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		err := os.Remove(dir)
		if err == nil || notExist(err) {
			return nil
		}
		if !errors.Is(err, syscall.EBUSY) || time.Now().After(deadline) {
			return fmt.Errorf("remove cgroup %s: %w", dir, err)
		}
	}
}

// Dirs lists the cgroup's directories that still exist; tests use it to
// check that nothing leaked.
func (g Group) Dirs() []string {
	var out []string
	for _, dir := range g.h.hierarchies(g.rel()) {
		if _, err := os.Stat(dir); err == nil {
			out = append(out, dir)
		}
	}
	return out
}

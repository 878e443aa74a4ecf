package main

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The sandbox's limits inside the guest [ours]. The VM's size bounds the
// guest as a whole; inside it, every process the agent starts is born in
// a cgroup of its own (the agent's -spawn-cgroup) with the sandbox's pids
// limit and all of the guest's memory but the agent's reserve, so a fork
// bomb gets EAGAIN and a memory hog is killed by the cgroup's OOM killer
// while the agent, outside, keeps serving. Open files are the rlimit the
// agent and so every process inherits. Root in the guest can still raise
// these or end the VM itself: the VM is the boundary that holds against it.

// sandboxCgroup is where the agent starts the sandbox's processes.
const sandboxCgroup = "/sys/fs/cgroup/sandbox"

// agentReserveMB is the guest memory kept out of the sandbox's cgroup, for
// the agent and the kernel's own needs under pressure.
const agentReserveMB = 32

// limit applies the sandbox's limits and returns the cgroup its processes
// go in ("" if cgroups are unavailable: the limits then are the VM's).
func (c *config) limit() (string, error) {
	var errs []error
	if c.NoFile > 0 {
		lim := unix.Rlimit{Cur: uint64(c.NoFile), Max: uint64(c.NoFile)}
		if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
			errs = append(errs, fmt.Errorf("open files limit %d: %w", c.NoFile, err))
		}
	}
	root := filepath.Dir(sandboxCgroup)
	if err := unix.Mount("cgroup2", root, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return "", errors.Join(append(errs, fmt.Errorf("mount cgroup2: %w", err))...)
	}
	if err := os.WriteFile(filepath.Join(root, "cgroup.subtree_control"), []byte("+pids +memory"), 0); err != nil {
		return "", errors.Join(append(errs, fmt.Errorf("enable the pids and memory controllers: %w", err))...)
	}
	if err := os.Mkdir(sandboxCgroup, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return "", errors.Join(append(errs, err)...)
	}
	if c.Pids > 0 {
		if err := os.WriteFile(filepath.Join(sandboxCgroup, "pids.max"), []byte(strconv.FormatInt(c.Pids, 10)), 0); err != nil {
			errs = append(errs, fmt.Errorf("pids.max: %w", err))
		}
	}
	if total, err := memTotalMB(); err == nil && total > 2*agentReserveMB {
		max := strconv.FormatInt((total-agentReserveMB)<<20, 10)
		if err := os.WriteFile(filepath.Join(sandboxCgroup, "memory.max"), []byte(max), 0); err != nil {
			errs = append(errs, fmt.Errorf("memory.max: %w", err))
		}
	}
	return sandboxCgroup, errors.Join(errs...)
}

// memTotalMB is the guest's memory as its kernel counts it.
func memTotalMB() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb >> 10, err
		}
	}
	return 0, errors.New("/proc/meminfo: no MemTotal")
}

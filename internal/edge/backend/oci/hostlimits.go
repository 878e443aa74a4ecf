package oci

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Host-wide limits [ours]. Each sandbox's cgroups bound it; together they
// must still leave the node what it needs to run (its daemons, the edge,
// an operator's shell):
//   - threads: the sandboxes' parent pids cgroup is bounded below the
//     kernel's threads-max, so however many threads they make together
//     (gVisor's ptrace platform holds host threads), the node keeps
//     HostThreadReserve of them;
//   - open files: the kernel's file table (fs.file-max) is raised to its
//     maximum, as systemd does on every current distribution, so the
//     memory each open file costs, charged to its sandbox's memory cgroup,
//     is what bounds a sandbox's descriptors, not a table shared with the
//     node. (320k descriptors of one sandbox were 13 % of this machine's
//     table of 2.4 million.)

// HostThreadReserve is the share of threads-max kept for the node.
const HostThreadReserve = 0.2

// fileMaxUnlimited is Linux's largest fs.file-max (LONG_MAX).
const fileMaxUnlimited = "9223372036854775807"

// SandboxThreadBound is what every sandbox's threads may add up to on a
// node whose kernel allows threadsMax.
func SandboxThreadBound(threadsMax int64) int64 {
	reserve := max(int64(float64(threadsMax)*HostThreadReserve), 4096)
	return max(threadsMax-reserve, 1024)
}

// BoundSandboxes applies the host-wide limits (see above). It is
// idempotent, and logs what it changed.
func BoundSandboxes(log *slog.Logger) error {
	tm, err := readInt("/proc/sys/kernel/threads-max")
	if err != nil {
		return err
	}
	bound := SandboxThreadBound(tm)
	parent := filepath.Join(cgroupRoot, "pids", CgroupParent)
	if _, err := os.Stat(filepath.Join(cgroupRoot, "pids")); err == nil {
		if err := os.MkdirAll(parent, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(parent, "pids.max"), []byte(strconv.FormatInt(bound, 10)), 0o644); err != nil {
			return fmt.Errorf("bound the sandboxes' threads: %w", err)
		}
	}
	if fm, err := os.ReadFile("/proc/sys/fs/file-max"); err == nil && strings.TrimSpace(string(fm)) != fileMaxUnlimited {
		if err := os.WriteFile("/proc/sys/fs/file-max", []byte(fileMaxUnlimited), 0o644); err != nil {
			return fmt.Errorf("raise fs.file-max: %w", err)
		}
		log.Info("raised fs.file-max to its maximum (as systemd does): a sandbox's open files are bounded by its memory cgroup, not a table shared with the node", "was", strings.TrimSpace(string(fm)))
	}
	return nil
}

// SandboxThreadsMax reads the sandboxes' parent's pids.max ("max" when none).
func SandboxThreadsMax() string {
	data, err := os.ReadFile(filepath.Join(cgroupRoot, "pids", CgroupParent, "pids.max"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(data))
}

func readInt(path string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}

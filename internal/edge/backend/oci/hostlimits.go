package oci

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/cgroups"
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

// BoundSandboxes applies the host-wide limits (see above) to the node's
// cgroups h. It is idempotent, and logs what it changed.
func BoundSandboxes(log *slog.Logger, h *cgroups.Host) error {
	tm, err := readInt("/proc/sys/kernel/threads-max")
	if err != nil {
		return err
	}
	if err := h.BoundTasks(SandboxThreadBound(tm)); err != nil {
		return fmt.Errorf("bound the sandboxes' threads: %w", err)
	}
	if fm, err := os.ReadFile("/proc/sys/fs/file-max"); err == nil && strings.TrimSpace(string(fm)) != fileMaxUnlimited {
		if err := os.WriteFile("/proc/sys/fs/file-max", []byte(fileMaxUnlimited), 0o644); err != nil {
			return fmt.Errorf("raise fs.file-max: %w", err)
		}
		log.Info("raised fs.file-max to its maximum (as systemd does): a sandbox's open files are bounded by its memory cgroup, not a table shared with the node", "was", strings.TrimSpace(string(fm)))
	}
	return nil
}

func readInt(path string) (int64, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}

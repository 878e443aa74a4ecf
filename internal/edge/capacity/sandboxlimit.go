package capacity

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// What one sandbox takes of the node beyond its own limits, measured on an
// idle container sandbox (docs/design.md, "Node capacity"): its agent's
// threads and the kernel worker of its writable layer (14 tasks), the
// edge's descriptors for it (2), and host memory outside its cgroup
// (3.0 to 3.4 MiB in bench/density). Each is rounded up for headroom.
const (
	tasksPerSandbox      = 16
	filesPerSandbox      = 4
	hostMemoryPerSandbox = 4 // MiB
	// hostTaskShare is the part of the host's task limit sandboxes may
	// take: the node itself and its other daemons run beside them.
	hostTaskShare = 0.9
)

// HostLimits are the node-wide limits the number of sandboxes is bounded
// by, beside the totals of their CPU and memory limits.
type HostLimits struct {
	MemoryMB int64 // host memory, less the node's reserve
	Tasks    int64 // processes and threads: the lower of kernel.pid_max and kernel.threads-max
	Files    int64 // file descriptors the edge's process may hold (RLIMIT_NOFILE)
}

// SandboxLimit is how many sandboxes lim allows, and what bounds it
// ("memory", "tasks" or "file descriptors"), with the figures that say so.
func SandboxLimit(lim HostLimits) (n int64, bound string) {
	n, bound = lim.MemoryMB/hostMemoryPerSandbox, fmt.Sprintf("memory (%d MiB, %d MiB a sandbox)", lim.MemoryMB, hostMemoryPerSandbox)
	if t := int64(float64(lim.Tasks)*hostTaskShare) / tasksPerSandbox; t < n {
		n, bound = t, fmt.Sprintf("tasks (%d of kernel.pid_max and kernel.threads-max, %d a sandbox)", lim.Tasks, tasksPerSandbox)
	}
	if f := lim.Files / filesPerSandbox; f < n {
		n, bound = f, fmt.Sprintf("file descriptors (RLIMIT_NOFILE %d, %d a sandbox)", lim.Files, filesPerSandbox)
	}
	return max(n, 1), bound
}

// ReadHostLimits reads the limits of this host and process, with
// memoryMB for the memory sandboxes may take.
func ReadHostLimits(memoryMB int64) HostLimits {
	tasks := min(readSysctl("/proc/sys/kernel/pid_max", 32768), readSysctl("/proc/sys/kernel/threads-max", 32768))
	files := int64(1024)
	var rl syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl) == nil && rl.Cur > 0 {
		files = int64(min(rl.Cur, 1<<40))
	}
	return HostLimits{MemoryMB: memoryMB, Tasks: tasks, Files: files}
}

func readSysctl(path string, fallback int64) int64 {
	data, err := os.ReadFile(path)
	if err != nil {
		return fallback
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil || v <= 0 {
		return fallback
	}
	return v
}

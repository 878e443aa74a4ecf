package aether

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// TaskCgroup is where the agent mounts the pids controller of the kernel
// it runs on, when it limits the sandbox's tasks itself (gVisor).
const TaskCgroup = "/run/opendsec-pids"

// LimitTasks bounds the number of processes and threads in the sandbox
// [ours]. Under gVisor the host's pids cgroup holds the sentry's own
// threads, and a limit there starves the sentry (it dies when it cannot
// make a thread), so the limit is set in the sentry's kernel instead: the
// agent mounts its pids controller, makes a cgroup with pids.max = max and
// moves itself in; every process it starts is born there, and a fork past
// the limit fails with EAGAIN inside, as on Linux.
//
// It then drops CAP_SYS_ADMIN from its bounding set, so no process it
// starts can mount the controller again and move out; the agent keeps its
// own (a restored copy sets its hostname with it).
func LimitTasks(max int) error {
	if err := os.MkdirAll(TaskCgroup, 0o700); err != nil {
		return err
	}
	if err := unix.Mount("none", TaskCgroup, "cgroup", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "pids"); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mount the pids controller: %w", err)
	}
	dir := filepath.Join(TaskCgroup, "sandbox")
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.Itoa(max)), 0o644); err != nil {
		return fmt.Errorf("set pids.max: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return fmt.Errorf("join the task cgroup: %w", err)
	}
	if err := unix.Prctl(unix.PR_CAPBSET_DROP, unix.CAP_SYS_ADMIN, 0, 0, 0); err != nil {
		return os.NewSyscallError("prctl(PR_CAPBSET_DROP)", err)
	}
	return nil
}

package aether

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

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
// Root in the sandbox could write pids.max as well, so the agent then
// covers the hierarchy with an empty read-only tmpfs (gVisor 2022-12
// refuses to remount the cgroup read-only, and unmounting it drops the
// limit), checks that the cover holds, and drops CAP_SYS_ADMIN from its
// bounding set: no process it starts can unmount the cover or mount the
// controller again. The agent keeps its own (a restored copy sets its
// hostname with it).
func LimitTasks(max int) error {
	if err := os.MkdirAll(TaskCgroup, 0o700); err != nil {
		return err
	}
	if err := unix.Mount("none", TaskCgroup, "cgroup", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "pids"); err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mount the pids controller: %w", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(TaskCgroup, &st); err != nil {
		return os.NewSyscallError("statfs", err)
	}
	if st.Type != unix.CGROUP_SUPER_MAGIC {
		return fmt.Errorf("%s is not a cgroup file system (type %#x)", TaskCgroup, st.Type)
	}
	dir := filepath.Join(TaskCgroup, "sandbox")
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if err := writeExisting(filepath.Join(dir, "pids.max"), strconv.Itoa(max)); err != nil {
		return fmt.Errorf("set pids.max: %w", err)
	}
	if err := writeExisting(filepath.Join(dir, "cgroup.procs"), strconv.Itoa(os.Getpid())); err != nil {
		return fmt.Errorf("join the task cgroup: %w", err)
	}
	if err := unix.Mount("none", TaskCgroup, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=4k,mode=0500"); err != nil {
		return fmt.Errorf("cover the pids controller: %w", err)
	}
	if err := writeExisting(filepath.Join(dir, "pids.max"), "max"); err == nil {
		return fmt.Errorf("pids.max is still writable under the cover of %s", TaskCgroup)
	}
	// The bounding set is per thread, and a child is forked from whichever
	// thread runs its goroutine: drop it on every thread (a static build;
	// with cgo this is ENOTSUP), then check that none kept it.
	if _, _, errno := syscall.AllThreadsSyscall(syscall.SYS_PRCTL, unix.PR_CAPBSET_DROP, unix.CAP_SYS_ADMIN, 0); errno != 0 {
		return os.NewSyscallError("prctl(PR_CAPBSET_DROP) on every thread", errno)
	}
	return checkBoundingDropped(unix.CAP_SYS_ADMIN)
}

// checkBoundingDropped fails if any of the process's threads still has
// capability c in its bounding set.
func checkBoundingDropped(c int) error {
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return err
	}
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join("/proc/self/task", t.Name(), "status"))
		if err != nil {
			continue // the thread ended
		}
		for _, line := range strings.Split(string(b), "\n") {
			v, ok := strings.CutPrefix(line, "CapBnd:")
			if !ok {
				continue
			}
			set, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return fmt.Errorf("thread %s: CapBnd %q: %w", t.Name(), v, err)
			}
			if set&(1<<c) != 0 {
				return fmt.Errorf("thread %s still has capability %d in its bounding set", t.Name(), c)
			}
		}
	}
	return nil
}

// writeExisting writes a control file that must already exist: a file
// created in its place (the cgroup not mounted) would hold a limit nothing
// enforces.
func writeExisting(path, value string) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, werr := f.Write([]byte(value))
	if err := f.Close(); werr == nil {
		werr = err
	}
	return werr
}

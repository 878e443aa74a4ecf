package aether

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/logging"
)

// WatchMemory keeps the sandbox's memory under max bytes by killing, like
// a kernel's OOM killer, the process that holds the most [ours]. Under
// gVisor nothing else does: the sentry enforces no memory limit of its
// own (its cgroupfs only stores one), so a process past the sandbox's
// limit made the host's OOM killer end the sentry, and the sandbox with it.
// The host's limit is set above max by the backend, for the sentry's own
// use; this watch, every interval, holds what the sandbox's processes and
// files use (the sentry's /proc/meminfo: MemTotal less MemFree) to max.
// The agent, PID 1, is never chosen, and no process is while the
// processes together hold less than half of max: then files hold the
// memory (a filled root file system, which lives in memory), killing
// bystanders would not free it, and it is logged instead; the host's
// limit then bounds it.
// Each kill is counted in ev (nil: not counted).
func WatchMemory(ctx context.Context, max int64, interval time.Duration, ev *LimitEvents, log *slog.Logger) {
	log = logging.OrDiscard(log)
	timer := time.NewTimer(interval)
	defer timer.Stop()
	warned := false
	next := interval
	for {
		timer.Reset(next)
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		used, err := memoryUsed("/proc/meminfo")
		next = watchInterval(used, max, interval)
		if err != nil || used <= max {
			warned = false
			continue
		}
		pid, rss, comm, all := largestProcess("/proc")
		if pid == 0 || all < max/2 {
			if !warned {
				log.Warn("the sandbox is over its memory limit and no process holds it (files in memory)", "used", used, "limit", max)
				warned = true
			}
			continue
		}
		log.Warn("the sandbox is over its memory limit: killing the process that holds the most", "used", used, "limit", max, "pid", pid, "comm", comm, "rss", rss)
		if syscall.Kill(pid, syscall.SIGKILL) == nil {
			ev.memoryKill()
		}
		// One kill per excess: wait for its memory to go before the next.
		for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); time.Sleep(interval) {
			if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); err != nil {
				break
			}
		}
	}
}

// nearInterval is how often the watch reads once the sandbox is near its
// limit: a process that writes its memory as fast as the kernel copies
// (dd's read of /dev/zero into a 512 MiB buffer) would otherwise pass the
// sentry's reserve between two reads of interval.
const nearInterval = 2 * time.Millisecond

// watchInterval is the wait before the next reading: nearInterval above
// three quarters of max, else interval.
func watchInterval(used, max int64, interval time.Duration) time.Duration {
	if used > max/4*3 {
		return min(nearInterval, interval)
	}
	return interval
}

// memoryUsed reads what a meminfo file counts as used: MemTotal less
// MemFree, in bytes.
func memoryUsed(path string) (int64, error) {
	mi := meminfo(path)
	total, hasTotal := mi["MemTotal"]
	free, hasFree := mi["MemFree"]
	if !hasTotal || !hasFree {
		return 0, os.ErrInvalid
	}
	return total - free, nil
}

// largestProcess is the process under procDir with the largest resident
// set, other than PID 1 (the agent) and this process: its pid, its RSS
// in bytes and its name (pid 0 if there is none), and what all of them
// hold.
func largestProcess(procDir string) (pid int, rss int64, comm string, all int64) {
	ents, _ := os.ReadDir(procDir)
	self := os.Getpid()
	for _, ent := range ents {
		p, err := strconv.Atoi(ent.Name())
		if err != nil || p == 1 || p == self {
			continue
		}
		status, err := os.ReadFile(filepath.Join(procDir, ent.Name(), "status"))
		if err != nil {
			continue
		}
		var name string
		var r int64
		for _, line := range strings.Split(string(status), "\n") {
			if v, ok := strings.CutPrefix(line, "Name:"); ok {
				name = strings.TrimSpace(v)
			}
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				r = kb << 10
			}
		}
		all += r
		if r > rss {
			pid, rss, comm = p, r, name
		}
	}
	return pid, rss, comm, all
}

package aether

import (
	"fmt"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/headers"
)

// LimitEvents counts what the sandbox's limits ended or refused inside it,
// as the agent sees them [ours]: processes the memory watch killed (gVisor)
// and, in a microVM's guest, what the kernel did in the cgroup the agent
// starts processes in (memory.events "oom_kill", pids.events "max"). The
// edge reads them from every answer (headers.LimitEvents) and adds what it
// sees on the node (a container's cgroup): a process killed at its memory
// limit, or a fork refused at its task limit, leaves the sandbox running
// and is reported, not silent. A nil *LimitEvents counts nothing.
type LimitEvents struct {
	memoryKills atomic.Int64

	mu    sync.Mutex
	read  time.Time // when the cgroup's counts were last read
	oom   int64
	forks int64
	ttl   time.Duration
	// readCgroup reads a keyed file of the spawn cgroup; nil without one.
	readCgroup func(name string) (map[string]uint64, error)
}

// NewLimitEvents counts events, reading the kernel's counts from cgroup
// (a cgroup v2 directory, or nil) at most every 250 ms.
func NewLimitEvents(cgroup *os.File) *LimitEvents {
	ev := &LimitEvents{ttl: 250 * time.Millisecond}
	if cgroup != nil {
		ev.readCgroup = func(name string) (map[string]uint64, error) {
			data, err := os.ReadFile(fmt.Sprintf("/proc/self/fd/%d/%s", cgroup.Fd(), name))
			if err != nil {
				return nil, err
			}
			return cgroups.ParseKeyed(string(data)), nil
		}
	}
	return ev
}

// memoryKill counts a process the memory watch killed.
func (ev *LimitEvents) memoryKill() {
	if ev != nil {
		ev.memoryKills.Add(1)
	}
}

// Counts are the processes ended at the memory limit and the forks
// refused at the task limit so far.
func (ev *LimitEvents) Counts() (oomKills, forksRefused int64) {
	if ev == nil {
		return 0, 0
	}
	oom, forks := ev.kernelCounts()
	return ev.memoryKills.Load() + oom, forks
}

func (ev *LimitEvents) kernelCounts() (oom, forks int64) {
	if ev.readCgroup == nil {
		return 0, 0
	}
	ev.mu.Lock()
	defer ev.mu.Unlock()
	if time.Since(ev.read) >= ev.ttl {
		if m, err := ev.readCgroup("memory.events"); err == nil {
			ev.oom = int64(min(m["oom_kill"], 1<<62))
		}
		if p, err := ev.readCgroup("pids.events"); err == nil {
			ev.forks = int64(min(p["max"], 1<<62))
		}
		ev.read = time.Now()
	}
	return ev.oom, ev.forks
}

// reportLimits puts the counts on every answer (headers.LimitEvents), as
// of the call's start.
func reportLimits(next http.Handler, ev *LimitEvents) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		oom, forks := ev.Counts()
		w.Header().Set(headers.LimitEvents, headers.FormatLimitEvents(oom, forks))
		next.ServeHTTP(w, r)
	})
}

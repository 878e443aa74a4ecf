package sandbox

import (
	"context"
	"sync"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/logging"
)

// Compaction [ours]. Debian's runsc (ptrace platform) gives every task of a
// gVisor sandbox about ten host threads and keeps them after the task ends,
// so a sandbox that once ran many processes holds thousands of idle host
// threads (2 waves of 200 `sleep &`: 50 -> 3300), and more with every wave.
// Its host bound (HostThreadBound) protects the node; compaction gives the
// threads back: a checkpoint and a restore in place, as a snapshot does,
// which leaves the sandbox as it was (processes, memory, files) on a fresh
// sentry with the threads it needs. It runs only when the sandbox holds more
// than compactAbove host threads, no call to it is in flight (a call would
// be cut), and not more than once per compactEvery.

const (
	compactAbove = 1024
	compactEvery = time.Minute
	// compactQuiet is how long no call may have been in flight.
	compactQuiet = 2 * time.Second
)

// compactionDue reports whether sb needs a compaction and can have one
// (ht nil: not), and marks one started. Callers hold sb.mu.
func (sb *Sandbox) compactionDue(now time.Time) (ht backend.HostThreads, threads int) {
	ht, ok := sb.be.(backend.HostThreads)
	if !ok || !sb.compactable(now) {
		return nil, 0
	}
	n := ht.HostThreads(sb.id)
	if n <= compactAbove || !sb.compacting.CompareAndSwap(false, true) {
		return nil, 0
	}
	sb.compacted = now
	return ht, n
}

// compactSoon compacts sb, which compactionDue marked, on its own
// goroutine (wg counts it; store takes the checkpoint): a checkpoint and
// restore take seconds, and the health loop must not wait for them. The
// goroutine takes sb's lock once its caller lets go of it.
func (sb *Sandbox) compactSoon(wg *sync.WaitGroup, store *snapshots.Store, ht backend.HostThreads, before int) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer sb.compacting.Store(false)
		sb.mu.Lock()
		defer sb.mu.Unlock()
		if sb.rec.State != records.StateRunning || sb.calls.Load() != 0 || time.Since(sb.lastCall()) < compactQuiet {
			return // a call or a lifecycle change came first
		}
		sb.compact(store, ht, before)
	}()
}

// compactable reports whether sb is running and quiet. Calls are counted
// under sb.mu (EnsureRunning), which callers hold, so none can start while
// a compaction that saw none runs. Callers hold sb.mu.
func (sb *Sandbox) compactable(now time.Time) bool {
	return sb.rec.State == records.StateRunning && sb.calls.Load() == 0 &&
		now.Sub(sb.lastCall()) >= compactQuiet && now.Sub(sb.compacted) >= compactEvery
}

// compact checkpoints sb (an ephemeral snapshot in store) and restores it
// in place. A failure leaves the sandbox failed with the reason (its
// record stays), never silently gone. Callers hold sb.mu.
func (sb *Sandbox) compact(store *snapshots.Store, ht backend.HostThreads, before int) {
	// A checkpoint and restore take longer for more memory: up to 10 min.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	snap, began, stopped, err := sb.checkpoint(ctx, store, "", true)
	if err != nil {
		sb.log.Warn("compaction: checkpoint failed", "host_threads", before, logging.Error, err)
		return
	}
	defer store.Drop(snap) //nolint:errcheck // an ephemeral snapshot; the snapshot store removes leftovers at start
	paused, err := sb.bringBack(ctx, snap, began, stopped)
	if err != nil {
		sb.log.Error("compaction: the sandbox could not be restored", logging.Error, err)
		return
	}
	sb.log.Info("compacted the sandbox's host threads", "before", before, "after", ht.HostThreads(sb.id), "paused", paused.Round(time.Millisecond))
}

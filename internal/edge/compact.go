package edge

import (
	"context"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
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

// maybeCompact compacts sb if it needs it and can. Callers hold sb.mu.
func (e *Edge) maybeCompact(sb *sandbox, now time.Time) {
	ht, ok := sb.be.(backend.HostThreads)
	if !ok || sb.rec.State != stateRunning || sb.calls.Load() != 0 || now.Sub(sb.lastCall()) < compactQuiet || now.Sub(sb.compacted) < compactEvery {
		return
	}
	n := ht.HostThreads(sb.id)
	if n <= compactAbove {
		return
	}
	sb.compacted = now
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	log := e.log.With(logging.SandboxID, sb.id)
	snap, began, stopped, err := e.checkpoint(ctx, sb, true)
	if err != nil {
		log.Warn("compaction: checkpoint failed", "host_threads", n, logging.Error, err)
		return
	}
	defer e.dropSnapshot(snap) //nolint:errcheck // an ephemeral snapshot; loadSnapshots removes leftovers
	paused, err := e.bringBack(ctx, sb, snap, began, stopped)
	if err != nil {
		log.Error("compaction: the sandbox could not be restored", logging.Error, err)
		return
	}
	log.Info("compacted the sandbox's host threads", "before", n, "after", ht.HostThreads(sb.id), "paused", paused.Round(time.Millisecond))
}

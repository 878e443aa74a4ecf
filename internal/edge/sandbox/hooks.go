package sandbox

import (
	"context"
	"time"

	"github.com/opendsec/opendsec/internal/edge/snapshots"
)

// Hooks for the edge's tests of recovery, expiry and heartbeats, which
// need a sandbox in a state its verbs never leave it in for long, or a
// faster clock. Nothing but tests calls them (their names say so).

// CheckpointOnlyForTest takes a checkpoint of sb into store and leaves sb as an
// edge killed right after would: stopped if the checkpoint stopped it,
// and not brought back.
func (sb *Sandbox) CheckpointOnlyForTest(ctx context.Context, store *snapshots.Store) (stopped bool, err error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	_, _, stopped, err = sb.checkpoint(ctx, store, "", true)
	return stopped, err
}

// MoveDeadlineForTest sets when sb's time (to live, or paused) ends, as a clock
// that moved on would.
func (sb *Sandbox) MoveDeadlineForTest(at time.Time) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.rec.ExpiresAt = at
}

// SetHeartbeatForTest has every sandbox's agent asked after every idle
// for an answer within timeout, until restore is called.
func SetHeartbeatForTest(every, timeout time.Duration) (restore func()) {
	oldEvery, oldTimeout := heartbeatEvery, heartbeatTimeout
	heartbeatEvery, heartbeatTimeout = every, timeout
	return func() { heartbeatEvery, heartbeatTimeout = oldEvery, oldTimeout }
}

package sandbox

import (
	"context"
	"time"

	"github.com/opendsec/opendsec/internal/edge/snapshots"
)

// Hooks for the edge's tests of recovery and expiry, which need a sandbox
// in a state its verbs never leave it in for long. Nothing else calls
// them.

// CheckpointOnly takes a checkpoint of sb into store and leaves sb as an
// edge killed right after would: stopped if the checkpoint stopped it,
// and not brought back.
func (sb *Sandbox) CheckpointOnly(ctx context.Context, store *snapshots.Store) (stopped bool, err error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	_, _, stopped, err = sb.checkpoint(ctx, store, "", true)
	return stopped, err
}

// MoveDeadline sets when sb's time (to live, or paused) ends, as a clock
// that moved on would.
func (sb *Sandbox) MoveDeadline(at time.Time) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	sb.rec.ExpiresAt = at
}

package edge

import (
	"context"

	"github.com/opendsec/opendsec/internal/edge/backend"
)

// restoreInPlace brings sb back from a checkpoint of its own (an offload's,
// one a snapshot or fork took that stopped it, one in flight when the edge
// went down): under its own id, in its own network namespace, which gets
// its address and routes back first (the stopped runtime had taken them
// over), with the new handle recorded before the agent is waited for.
// Callers hold sb.mu.
func (e *Edge) restoreInPlace(ctx context.Context, sb *sandbox, ref backend.SnapshotRef) error {
	sn, err := snapshotter(sb.be)
	if err != nil {
		return err
	}
	bspec, err := e.recoverSpec(ctx, sb.rec)
	if err != nil {
		return err
	}
	if sb.net != nil {
		bspec.NetNS = sb.net.NetNS
		if err := e.net.Reset(ctx, sb.net); err != nil {
			return err
		}
	}
	h, err := sn.Restore(ctx, ref, bspec)
	if err != nil {
		return err
	}
	sb.rec.Handle = h
	if err := sb.save(); err != nil {
		return err
	}
	wait, cancel := context.WithTimeout(ctx, e.cfg.AgentTimeout)
	defer cancel()
	return agentReady(sb)(wait)
}

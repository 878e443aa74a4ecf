package sandbox

import (
	"context"
	"errors"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
)

// restoreInPlace brings sb back from a checkpoint of its own (an offload's,
// one a snapshot or fork took that stopped it, one in flight when the edge
// went down): under its own id, in its own network namespace, which gets
// its address and routes back first (the stopped runtime had taken them
// over), with the new handle recorded before the agent is waited for.
// Callers hold sb.mu.
func (sb *Sandbox) restoreInPlace(ctx context.Context, ref backend.SnapshotRef) error {
	sn, err := Snapshotter(sb.be)
	if err != nil {
		return err
	}
	bspec, err := sb.specOf(ctx)
	if err != nil {
		return err
	}
	restore := func() (*backend.Handle, error) {
		if sb.net != nil {
			bspec.NetNS = sb.net.NetNS
			if err := sb.nodeNet.Reset(ctx, sb.net); err != nil {
				return nil, err
			}
		}
		return sn.Restore(ctx, ref, bspec)
	}
	h, err := restore()
	if err != nil && ctx.Err() == nil && mayPassOnRetry(err) {
		// The checkpoint is intact and a backend's failed restore leaves
		// nothing behind, so one more try (its network set up again, as a
		// runtime may have taken the address over) before the sandbox is
		// failed: a starved host's runsc once exited 128 on a source's
		// restore after its fork, and the source was lost with it.
		sb.log.Warn("restore in place failed; trying once more", logging.Error, err)
		h, err = restore()
	}
	if err != nil {
		return err
	}
	sb.rec.Handle = h
	if err := sb.save(); err != nil {
		return err
	}
	wait, cancel := context.WithTimeout(ctx, sb.agentTimeout)
	defer cancel()
	return agentReady(sb)(wait)
}

// mayPassOnRetry is false for the errors a second try would meet again
// (a snapshot or bundle that is not there, one this node cannot restore).
func mayPassOnRetry(err error) bool {
	for _, class := range []error{errdefs.ErrNotFound, errdefs.ErrFailedPrecondition, errdefs.ErrInvalidArgument, errdefs.ErrUnsupported, errdefs.ErrPermissionDenied} {
		if errors.Is(err, class) {
			return false
		}
	}
	return true
}

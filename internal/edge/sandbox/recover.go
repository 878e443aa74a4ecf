package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Reattach takes sb back after the edge's restart: a running or paused
// sandbox gets its agent link, network and backend state back; one
// interrupted while it was created or removed is removed; one that cannot
// come back is failed with the reason. A VM's relink runs on its own
// goroutine, which wg counts.
func (sb *Sandbox) Reattach(ctx context.Context, wg *sync.WaitGroup) error {
	rec, be := sb.rec, sb.be
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if rec.Handle == nil || (rec.State != records.StateRunning && rec.State != records.StatePaused) {
		// Interrupted while being created or removed: finish the removal.
		return sb.removeLocked(ctx)
	}
	bspec, err := sb.specOf(ctx)
	if err != nil {
		return err
	}
	link, err := sb.prepareDir()
	if err != nil {
		return err
	}
	sb.link = link
	// A sandbox that cannot come back is failed, never dropped: its record
	// stays, with the reason, until it is stopped or its time runs out;
	// what is left of it on the node is removed and its capacity freed.
	if err := sb.adoptNetwork(ctx); err != nil {
		sb.fail(ctx, "lost its network while the edge was down: "+err.Error())
		return nil
	}
	if sb.net != nil {
		bspec.NetNS = sb.net.NetNS
	}
	if rec.Offloaded != "" {
		// Nothing of it runs: its memory is in its checkpoint, which the
		// next call restores. The backend takes back what it tracks of it
		// (a stopped runtime container, for a restore in place); that it
		// does not run is expected.
		if _, err := os.Stat(offloadDir(sb)); err != nil {
			sb.fail(ctx, "its offloaded memory is gone: "+err.Error())
			return nil
		}
		be.Recover(ctx, rec.Handle, bspec) //nolint:errcheck // see above
		if st, err := be.Status(ctx, rec.ID); err == nil && (st.State == backend.StateRunning || st.State == backend.StatePaused) {
			// The edge went down between the offload's checkpoint and its
			// release: what still runs is ended, as the release would.
			if r, ok := be.(backend.Releaser); ok {
				if err := r.Release(ctx, rec.ID); err != nil {
					sb.fail(ctx, "its offload was cut by the edge going down, and what still ran of it could not be ended: "+err.Error())
					return nil
				}
				sb.log.Info("finished an offload the edge's restart cut")
			}
		}
		rec.Checkpoint = ""
		return sb.save()
	}
	if err := be.Recover(ctx, rec.Handle, bspec); err != nil {
		if rec.Checkpoint != "" {
			// A checkpoint stopped it and the edge went down before it was
			// brought back: it comes back from that checkpoint.
			rerr := sb.restoreFromCheckpoint(ctx)
			if rerr == nil {
				sb.log.Info("brought back from the checkpoint in flight when the edge went down")
				return sb.save()
			}
			err = fmt.Errorf("%w; restoring it from the checkpoint in flight failed: %v", err, rerr)
		}
		rec.Checkpoint = ""
		sb.fail(ctx, "lost while the edge was down: "+err.Error())
		return nil
	}
	if rec.Checkpoint != "" {
		// The checkpoint left it running (or never began).
		rec.Checkpoint = ""
	}
	st, err := be.Status(ctx, rec.ID)
	switch {
	case err != nil:
	case rec.State == records.StatePaused && st.State == backend.StateRunning:
		// Resumed just before the edge died: its clock runs again.
		sb.startClock()
		rec.State = records.StateRunning
	case rec.State == records.StateRunning && st.State == backend.StatePaused:
		// The edge's own pause was in flight (a VM stops for its snapshot
		// or a fork's, or a pause not yet recorded): it runs again.
		if p, ok := be.(backend.Pauser); ok {
			if err := p.Resume(ctx, rec.ID); err != nil {
				sb.fail(ctx, "stopped by a snapshot in flight when the edge went down, and could not be resumed: "+err.Error())
				return nil
			}
			sb.log.Info("resumed: it was stopped for a snapshot in flight when the edge went down")
		}
	}
	if be.Capabilities().LinkBeforeAgent {
		// A VM stopped while the edge was down did not see its link go:
		// its agent may hold a session the new edge cannot speak to.
		sb.relink = true
		if rec.State == records.StateRunning {
			sb.relinkSoon(wg)
		}
	}
	return sb.save()
}

// relinkSoon runs relinkLocked for a running sb in the background (wg
// counts it), once recovery has let go of it. A failure is left to the
// health loop.
func (sb *Sandbox) relinkSoon(wg *sync.WaitGroup) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		sb.mu.Lock()
		defer sb.mu.Unlock()
		if sb.rec.State != records.StateRunning {
			return
		}
		if err := sb.relinkLocked(context.Background()); err != nil {
			sb.log.Warn("re-attached VM", logging.Error, err)
		}
	}()
}

// specOf is the backend's spec for sb brought back (recovered, restored
// in place): its image resolved again, by digest.
func (sb *Sandbox) specOf(ctx context.Context) (*backend.Spec, error) {
	if sb.parts == nil {
		return nil, errdefs.Unavailable("sandbox %s: no images to bring it back from", sb.id)
	}
	layers, cfg, err := sb.parts.recordLayers(ctx, sb.rec)
	if err != nil {
		return nil, err
	}
	return sb.parts.backendSpec(sb.rec, sb.dir, sb.runDir, layers, cfg), nil
}

// restoreFromCheckpoint restores sb in place from the checkpoint its
// record names and waits for its agent. Callers hold sb.mu.
func (sb *Sandbox) restoreFromCheckpoint(ctx context.Context) error {
	dir := sb.rec.Checkpoint
	if _, err := os.Stat(dir); err != nil {
		return err
	}
	if err := sb.restoreInPlace(ctx, backend.SnapshotRef{ID: sandboxid.SnapshotID(filepath.Base(dir)), Dir: dir}); err != nil {
		return err
	}
	sb.rec.Checkpoint = ""
	return nil
}

package sandbox

import (
	"context"
	"fmt"
	"os"

	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
)

// CloseLink closes sb's agent link as the edge goes down; the sandbox
// runs on, and the next edge re-attaches it.
func (sb *Sandbox) CloseLink() {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.link != nil {
		sb.link.Close()
	}
}

// Discard removes a sandbox that never became usable.
func (sb *Sandbox) Discard(ctx context.Context) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.removeLocked(ctx)
}

// removeLocked destroys the backend's sandbox, closes the link, deletes the
// directory and unregisters. Callers hold sb.mu. On failure the record
// stays, so the removal can be retried and nothing is silently leaked.
func (sb *Sandbox) removeLocked(ctx context.Context) error {
	// Destroy even without a handle: a crash can come after the backend
	// made something and before its handle was saved, and backends find
	// what a sandbox left by its id.
	if err := sb.be.Destroy(ctx, sb.id); err != nil {
		sb.rec.Message = "removal failed: " + err.Error()
		sb.save() //nolint:errcheck // best effort; the error is returned
		return fmt.Errorf("destroy sandbox %s: %w", sb.id, err)
	}
	// Its processes are gone: what is connected to its ports is cut now,
	// even if a later step of the removal fails and is retried.
	sb.end()
	if sb.link != nil {
		sb.link.Close()
		sb.link = nil
	}
	if err := sb.detachNetwork(ctx); err != nil {
		return err
	}
	// What is still mounted in the sandbox's directory (its rootfs, after
	// such a crash) is unmounted here, deepest first.
	if mounts, _ := rootfs.MountsUnder(sb.dir); len(mounts) > 0 {
		for i := len(mounts) - 1; i >= 0; i-- {
			rootfs.Unmount(mounts[i]) //nolint:errcheck // checked below
		}
		if still, _ := rootfs.MountsUnder(sb.dir); len(still) > 0 {
			return fmt.Errorf("sandbox %s: still mounted after destroy: %v", sb.id, still)
		}
	}
	if err := sb.host.RemoveLayer(sb.rec.LayerDir); err != nil {
		return fmt.Errorf("remove sandbox %s writable layer: %w", sb.id, err)
	}
	// The run directory goes first: the sandbox directory (with its record)
	// is what a crash between the two needs to find to finish the removal.
	os.RemoveAll(sb.runDir) //nolint:errcheck // only the socket and two small files were in it
	if err := os.RemoveAll(sb.dir); err != nil {
		return fmt.Errorf("remove sandbox %s directory: %w", sb.id, err)
	}
	if err := sb.records.Delete(sb.id); err != nil {
		return fmt.Errorf("remove sandbox %s record: %w", sb.id, err)
	}
	sb.host.Forget(sb)
	sb.removed = true
	return nil
}

// Destroy stops and removes a sandbox.
func (sb *Sandbox) Destroy(ctx context.Context) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.destroyLocked(ctx)
}

// destroyLocked is Destroy with the sandbox's lock held.
func (sb *Sandbox) destroyLocked(ctx context.Context) error {
	if sb.removed {
		return nil // removed meanwhile
	}
	sb.rec.State = records.StateStopping
	sb.save() //nolint:errcheck // the removal below decides
	err := sb.removeLocked(ctx)
	if err == nil {
		sb.log.Info("sandbox removed")
	}
	return err
}

package sandbox

import (
	"context"
	"fmt"
	"os"
	"time"

	"google.golang.org/protobuf/proto"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Snapshotter returns the backend's snapshot capability or why it has none.
func Snapshotter(be backend.Backend) (backend.Snapshotter, error) {
	caps := be.Capabilities()
	sn, ok := be.(backend.Snapshotter)
	if !ok || !caps.Snapshot {
		why := caps.SnapshotUnavailable
		if why == "" {
			why = "it has no memory snapshots"
		}
		return nil, errdefs.Unsupported("backend %q cannot snapshot memory on this node: %s", be.Name(), why)
	}
	return sn, nil
}

// checkpoint writes a snapshot (called name, if not "") of a running
// sandbox into the node's store. If the backend had to stop the sandbox
// for it, stopped is true and bringBack must follow. Callers hold sb.mu
// until then.
func (sb *Sandbox) checkpoint(ctx context.Context, store *snapshots.Store, name string, ephemeral bool) (snap *snapshots.Snapshot, began time.Time, stopped bool, err error) {
	sn, err := Snapshotter(sb.be)
	if err != nil {
		return nil, began, false, err
	}
	if sb.net != nil && !sb.be.Capabilities().SnapshotNetwork {
		return nil, began, false, errdefs.Unsupported("sandbox %s has a network interface, and backend %q cannot snapshot one on this node (a restored copy would lose it); snapshot and fork need a sandbox created without a network policy", sb.id, sb.be.Name())
	}
	if sb.rec.State == records.StatePaused {
		if err := sb.resumeLocked(ctx); err != nil {
			return nil, began, false, err
		}
	}
	if sb.rec.State != records.StateRunning || sb.link == nil {
		return nil, began, false, errdefs.FailedPrecondition("sandbox %s is %s; only a running sandbox can be snapshotted", sb.id, sb.rec.State)
	}
	snap = &snapshots.Snapshot{
		ID: sandboxid.NewSnapshot(sb.node), Project: sb.rec.Project, SourceSandbox: sb.id, Backend: sb.be.Name(),
		ImageDigest: sb.rec.ImageDigest, Spec: sb.rec.SpecJSON, CreatedAt: time.Now().UTC(), Ephemeral: ephemeral, Name: name,
		AgentKey: sb.rec.AgentKey, AgentVersion: sb.rec.AgentVersion, SandboxSpec: proto.Clone(sb.rec.Spec).(*sandboxv1.SandboxSpec),
	}
	snap.Dir = store.Dir(snap.ID)
	if err := os.MkdirAll(snap.Dir, 0o700); err != nil {
		return nil, began, false, err
	}
	release, err := sb.disk.Reserve(snap.Dir, sb.stateSize(), "a snapshot of sandbox "+string(sb.id))
	if err != nil {
		os.RemoveAll(snap.Dir)
		return nil, began, false, err
	}
	defer release()
	log := sb.log.With(logging.SnapshotID, snap.ID)
	if err := sb.markCheckpoint(snap.Dir); err != nil {
		os.RemoveAll(snap.Dir)
		return nil, began, false, err
	}
	began = time.Now()
	info, serr := detachedSnapshot(ctx, sb, sn, snap.Ref())
	if serr != nil || !info.Stopped {
		sb.markCheckpoint("") //nolint:errcheck // the sandbox runs: nothing to bring back
	}
	if serr != nil {
		os.RemoveAll(snap.Dir)
		if info != nil && info.Stopped {
			// runsc kills a sandbox whose checkpoint failed: it is failed,
			// with the reason, until a stop removes it (never silently gone).
			log.Error("snapshot failed and stopped the sandbox", logging.Error, serr)
			sb.fail(context.WithoutCancel(ctx), "a snapshot failed and stopped it: "+serr.Error())
			return nil, began, false, errdefs.Wrap(errdefs.ErrUnavailable, serr, "snapshot %s failed and the backend stopped the sandbox", sb.id)
		}
		return nil, began, false, fmt.Errorf("snapshot %s: %w", sb.id, serr)
	}
	snap.SizeBytes = info.SizeBytes
	if err := snap.Save(); err != nil {
		os.RemoveAll(snap.Dir)
		return nil, began, info.Stopped, err
	}
	store.Add(snap)
	return snap, began, info.Stopped, nil
}

// detachedSnapshot has the backend snapshot sb into ref with the agent's
// link detached (the link stops listening and the agent lets go of its
// connection: a checkpoint must hold no host socket), and attaches it
// again whatever happened. Callers hold sb.mu.
func detachedSnapshot(ctx context.Context, sb *Sandbox, sn backend.Snapshotter, ref backend.SnapshotRef) (*backend.SnapshotInfo, error) {
	detach, cancel := context.WithTimeout(ctx, 5*time.Second)
	err := sb.link.Detach(detach)
	cancel()
	if err != nil {
		sb.link.Reattach() //nolint:errcheck // the agent dials again
		return nil, errdefs.Wrap(errdefs.ErrUnavailable, err, "the agent did not let go of its connection")
	}
	info, err := sn.Snapshot(ctx, sb.id, ref)
	if rerr := sb.link.Reattach(); rerr != nil && err == nil {
		err = rerr
	}
	return info, err
}

// bringBack restores a source that its snapshot stopped, from that
// snapshot, and returns how long the source did not run. Callers hold sb.mu.
func (sb *Sandbox) bringBack(ctx context.Context, snap *snapshots.Snapshot, began time.Time, stopped bool) (time.Duration, error) {
	log := sb.log.With(logging.SnapshotID, snap.ID)
	if stopped {
		if err := sb.restoreInPlace(ctx, snap.Ref()); err != nil {
			log.Error("could not bring the source back after its snapshot", logging.Error, err)
			sb.rec.Checkpoint = ""
			sb.fail(context.WithoutCancel(ctx), "it could not be restored after a snapshot: "+err.Error())
			return 0, errdefs.Wrap(errdefs.ErrUnavailable, err, "snapshot %s: the source could not be restored", sb.id)
		}
		if err := sb.markCheckpoint(""); err != nil {
			log.Warn("record that the source is back", logging.Error, err)
		}
	}
	paused := time.Since(began)
	log.Info("snapshot taken", "size", snap.SizeBytes, "source_paused", paused.Round(time.Millisecond))
	return paused, nil
}

func ctxTimeout(ctx context.Context, d time.Duration) context.Context {
	c, cancel := context.WithTimeout(ctx, d)
	context.AfterFunc(c, cancel)
	return c
}

// Snapshot checkpoints sb into store (called name, if not "") and brings
// it back if the checkpoint stopped it, running during(snap) meanwhile if
// it is not nil (a fork's copies start while their source comes back).
// It returns how long the source did not run. A source that cannot be
// brought back is failed with the reason and its snapshot dropped,
// unless during was given one (the copies have it: the fork reports the
// source's error beside them).
func (sb *Sandbox) Snapshot(ctx context.Context, store *snapshots.Store, name string, ephemeral bool, during func(*snapshots.Snapshot)) (snap *snapshots.Snapshot, paused time.Duration, err error) {
	sb.mu.Lock()
	if name != "" {
		release, err := store.ReserveName(sb.proj, name)
		if err != nil {
			sb.mu.Unlock()
			return nil, 0, err
		}
		defer release()
	}
	snap, began, stopped, err := sb.checkpoint(ctx, store, name, ephemeral)
	if err != nil {
		sb.mu.Unlock()
		return nil, 0, err
	}
	if during == nil {
		defer sb.mu.Unlock()
		if paused, err = sb.bringBack(ctx, snap, began, stopped); err != nil {
			store.Drop(snap) //nolint:errcheck // reporting the restore's error
			return nil, 0, err
		}
		return snap, paused, nil
	}
	// The source comes back while the copies start: in parallel, the whole
	// fork takes about one restore after the checkpoint. Its lock goes
	// once it is back, whether or not the copies are started.
	back := make(chan struct{})
	go func() {
		defer close(back)
		defer sb.mu.Unlock()
		paused, err = sb.bringBack(ctx, snap, began, stopped)
	}()
	during(snap)
	<-back
	return snap, paused, err
}

// RestoreInto starts a new sandbox from snap (a copy of its source),
// until its agent answers.
func (sb *Sandbox) RestoreInto(ctx context.Context, snap *snapshots.Snapshot, sn backend.Snapshotter) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	link, err := sb.prepareDir()
	if err != nil {
		return err
	}
	sb.link = link
	layers, cfg, err := sb.parts.snapshotLayers(ctx, snap)
	if err != nil {
		return err
	}
	// A copy of a sandbox with a network gets its own, with the source's
	// policy (the snapshot's spec holds it).
	if err := sb.attachNetwork(ctx); err != nil {
		return err
	}
	bspec := sb.parts.backendSpec(sb.rec, sb.dir, sb.runDir, layers, cfg)
	if sb.net != nil {
		bspec.NetNS = sb.net.NetNS
	}
	h, err := sn.Restore(ctx, snap.Ref(), bspec)
	if err != nil {
		return err
	}
	sb.guestNet = h.Network
	sb.rec.Handle = h
	if err := sb.save(); err != nil {
		return err
	}
	return sb.running(ctx, true)
}

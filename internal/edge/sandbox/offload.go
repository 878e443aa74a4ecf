package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/layerfs"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// Offload [paper: a preempted task's sandboxes pause together; ours: how].
// A frozen sandbox keeps its memory; an offloaded one has it written to
// the node's disk and given back. The edge checkpoints it as for a
// snapshot (the agent's link detached first), into offloadDir in the
// sandbox's own directory, and ends what still runs; the record keeps
// the checkpoint's id, so a restarted edge finds it again. The next call
// (or a resume) restores it in place: the same id, processes, open files,
// listening sockets and memory. A backend without memory snapshots (the
// container backend on this kernel) is frozen instead, and the answer
// says so.

// offloadDir is where a sandbox's offloaded memory goes.
func offloadDir(sb *Sandbox) string { return filepath.Join(sb.dir, "offload") }

// PauseAt pauses sb at depth and says what that gave back, and why it
// is shallower than asked if it is.
func (sb *Sandbox) PauseAt(ctx context.Context, depth sandboxv1.PauseDepth) (view *sandboxv1.Sandbox, released int64, note string, err error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	released, note, err = sb.pauseAtLocked(ctx, depth)
	if err != nil {
		return nil, 0, "", err
	}
	return sb.View(), released, note, nil
}

// pauseAtLocked pauses sb at depth. Callers hold sb.mu.
func (sb *Sandbox) pauseAtLocked(ctx context.Context, depth sandboxv1.PauseDepth) (released int64, note string, err error) {
	switch depth {
	case sandboxv1.PauseDepth_PAUSE_DEPTH_UNSPECIFIED, sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE:
		return 0, "", sb.freeze(ctx)
	case sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD:
	case sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM:
		if err := sb.shutDownLocked(ctx); err != nil {
			return 0, "", err
		}
	default:
		return 0, "", errdefs.InvalidArgument("depth %d: want FREEZE, OFFLOAD or FILESYSTEM", depth)
	}
	if sb.rec.Offloaded != "" {
		return 0, "", nil
	}
	if sb.rec.State == records.StateRunning || sb.rec.State == records.StatePaused {
		defer sb.beginPause()()
	}
	if why := sb.cannotOffload(); why != "" {
		return 0, why, sb.freeze(ctx)
	}
	released, note, err = sb.offloadLocked(ctx)
	if err != nil && (sb.rec.State == records.StateRunning || sb.rec.State == records.StatePaused) {
		// It still runs (or is frozen): a pause it still gets.
		if ferr := sb.freeze(ctx); ferr == nil {
			return 0, "frozen, not offloaded: " + err.Error(), nil
		}
	}
	if err != nil && sb.rec.FilesystemOnly && sb.rec.State == records.StateRunning {
		// Not paused after all: it runs on, started afresh (the pause's
		// error is the one to report).
		if serr := sb.startAfreshLocked(ctx); serr != nil {
			sb.log.Warn("image service not started again after a failed pause", logging.Error, serr)
		}
	}
	return released, note, err
}

// cannotOffload says why sb's memory cannot go to disk ("" if it can).
func (sb *Sandbox) cannotOffload() string {
	caps := sb.be.Capabilities()
	_, snaps := sb.be.(backend.Snapshotter)
	_, releases := sb.be.(backend.Releaser)
	switch {
	case !snaps || !caps.Snapshot:
		why := caps.SnapshotUnavailable
		if why == "" {
			why = "it has no memory snapshots"
		}
		return fmt.Sprintf("frozen, not offloaded: backend %q cannot write a sandbox's memory to disk on this node (%s); its memory stays allocated", sb.be.Name(), why)
	case sb.net != nil && !caps.SnapshotNetwork:
		return fmt.Sprintf("frozen, not offloaded: backend %q cannot checkpoint a sandbox with a network interface on this node; its memory stays allocated", sb.be.Name())
	case !releases:
		return fmt.Sprintf("frozen, not offloaded: backend %q cannot yet end a checkpointed sandbox and give its memory back; its memory stays allocated", sb.be.Name())
	}
	return ""
}

// offloadLocked writes sb's memory to disk and ends what runs of it.
// Callers hold sb.mu.
func (sb *Sandbox) offloadLocked(ctx context.Context) (int64, string, error) {
	if sb.rec.State == records.StatePaused {
		if err := sb.resumeLocked(ctx); err != nil {
			return 0, "", err
		}
	}
	if sb.rec.State != records.StateRunning || sb.link == nil {
		return 0, "", errdefs.FailedPrecondition("sandbox %s is %s; only a running or paused sandbox can be offloaded", sb.id, sb.rec.State)
	}
	sn := sb.be.(backend.Snapshotter)
	before := sb.heldMemory()
	ref := backend.SnapshotRef{ID: sandboxid.NewSnapshot(sb.node), Dir: offloadDir(sb)}
	release, err := sb.disk.Reserve(sb.dir, sb.stateSize(), "offloading sandbox "+string(sb.id))
	if err != nil {
		return 0, "", err
	}
	defer release()
	os.RemoveAll(ref.Dir) //nolint:errcheck // a leftover of a failed attempt
	if err := os.MkdirAll(ref.Dir, 0o700); err != nil {
		return 0, "", err
	}
	log := sb.log
	began := time.Now()
	// Once begun, a checkpoint is not cut by the caller going away (Debian's
	// runsc kills a sandbox whose checkpoint was cut).
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), offloadTimeout)
	defer cancel()
	if err := sb.markCheckpoint(ref.Dir); err != nil {
		return 0, "", err
	}
	info, err := detachedSnapshot(ctx, sb, sn, ref)
	note := ""
	if err == nil {
		// The checkpoint is whole: from here an edge that goes down
		// finishes the offload at its restart (recover.go) instead of
		// taking a sandbox the release is ending for running.
		sb.stopClock()
		sb.rec.Offloaded, sb.rec.State = string(ref.ID), records.StatePaused
		if serr := sb.save(); serr != nil {
			err = serr
		}
	}
	if err == nil {
		if rerr := sb.be.(backend.Releaser).Release(ctx, sb.id); rerr != nil {
			// The checkpoint is good: if nothing of the sandbox runs, it is
			// offloaded all the same; if it still runs, it stays as it was.
			if st, serr := sb.be.Status(ctx, sb.id); serr == nil && st.State == backend.StateStopped {
				note = "offloaded, but its memory may not all be given back: " + rerr.Error()
			} else {
				err = rerr
			}
		}
	}
	if err != nil {
		os.RemoveAll(ref.Dir)
		if sb.rec.Offloaded != "" {
			sb.startClock()
			sb.rec.Offloaded, sb.rec.State = "", records.StateRunning
		}
		sb.rec.Checkpoint = ""
		if info != nil && info.Stopped {
			sb.fail(ctx, "offloading it failed and stopped it: "+err.Error())
		} else if serr := sb.save(); serr != nil {
			log.Warn("record that the offload is over", logging.Error, serr)
		}
		return 0, "", errdefs.Wrap(errdefs.ErrUnavailable, err, "offload sandbox %s", sb.id)
	}
	sb.rec.Checkpoint = "" // Offloaded names it from now on
	sb.rec.Offloaded = string(ref.ID)
	sb.stopClock()
	sb.rec.State = records.StatePaused
	if err := sb.save(); err != nil {
		return 0, "", err
	}
	after := sb.heldMemory()
	released := max(before-after, 0)
	log.Info("sandbox offloaded", "took", time.Since(began).Round(time.Millisecond), "memory_released", released, "before", before, "after", after)
	return released, note, nil
}

// offloadTimeout bounds one offload once it has begun.
const offloadTimeout = 5 * time.Minute

// memory is sb's memory use as its backend reads it (0 if it cannot).
func (sb *Sandbox) memory() int64 {
	return sb.usage().MemoryBytes
}

// heldMemory is what of sb's memory the kernel cannot simply drop: its
// use less all page cache of files. What an offload gives back is the fall
// of it; the checkpoint the offload writes is page cache charged to the
// sandbox, and under a busy disk much of it is still there, recently used,
// when the offload ends.
func (sb *Sandbox) heldMemory() int64 {
	return sb.usage().HeldBytes()
}

// usage reads sb's use from its backend; zero if it cannot be read.
func (sb *Sandbox) usage() backend.Usage {
	ur, ok := sb.be.(backend.UsageReader)
	if !ok {
		return backend.Usage{}
	}
	u, err := ur.Usage(sb.id)
	if err != nil {
		return backend.Usage{}
	}
	return u
}

// stateSize bounds what a checkpoint of sb writes: its memory in use
// (a gVisor sandbox's root file system is in it) and what its writable
// layer holds, and a little for the checkpoint's own files.
func (sb *Sandbox) stateSize() int64 {
	need := sb.memory() + 16<<20
	if sb.rec.LayerDir != "" {
		if used, _, err := layerfs.Usage(sb.rec.LayerDir); err == nil {
			need += used
		}
	}
	return need
}

// restoreOffloaded brings an offloaded sandbox back in place: the same
// id, its memory read back from its checkpoint. Callers hold sb.mu.
func (sb *Sandbox) restoreOffloaded(ctx context.Context) error {
	ref := backend.SnapshotRef{ID: sandboxid.SnapshotID(sb.rec.Offloaded), Dir: offloadDir(sb)}
	if _, err := os.Stat(ref.Dir); err != nil {
		return errdefs.FailedPrecondition("offloaded sandbox %s: its checkpoint is gone: %v", sb.id, err)
	}
	began := time.Now()
	if err := sb.restoreInPlace(ctx, ref); err != nil {
		return errdefs.Wrap(errdefs.ErrUnavailable, err, "restore offloaded sandbox %s", sb.id)
	}
	// The record stops naming the checkpoint before it goes: a crash in
	// between must not find an offloaded sandbox without its memory.
	sb.rec.Offloaded = ""
	if err := sb.save(); err != nil {
		return err
	}
	if err := os.RemoveAll(ref.Dir); err != nil {
		sb.log.Warn("remove an offload checkpoint", logging.Error, err)
	}
	sb.log.Info("offloaded sandbox restored", "took", time.Since(began).Round(time.Millisecond))
	return nil
}

// stopClock starts a pause's lifetime: the time to live stands still
// (kept in TimeoutLeft) and the sandbox is removed if it stays paused for
// PausedLifetime. Callers hold sb.mu.
func (sb *Sandbox) stopClock() {
	if sb.rec.State == records.StatePaused {
		return // already stopped
	}
	sb.rec.TimeoutLeft = max(time.Until(sb.rec.ExpiresAt), 0)
	sb.rec.ExpiresAt = time.Now().Add(sb.pausedLifetime)
	sb.expiry.Poke()
}

// startClock ends a pause's lifetime: the time to live goes on from
// where it stopped, or, for a sandbox its time to live had paused, starts
// afresh from its spec's (else it would be paused again at once).
// Callers hold sb.mu.
func (sb *Sandbox) startClock() {
	left := sb.rec.TimeoutLeft
	if left <= 0 && sb.rec.Spec.GetOnTimeout() == sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE {
		left = time.Duration(sb.rec.Spec.GetTimeoutSeconds()) * time.Second
	}
	sb.rec.ExpiresAt = time.Now().Add(left)
	sb.rec.TimeoutLeft = 0
	sb.expiry.Poke()
}

// expiredBy reports whether sb's time (to live, or paused) ended by now,
// from its published view: without its lock, so that the expiry loop is
// never held up by another sandbox's long call (a checkpoint holds the
// lock for seconds). Expire checks again under the lock.
func (sb *Sandbox) expiredBy(now time.Time) bool {
	v := sb.View()
	return v.State != sandboxv1.SandboxState_SANDBOX_STATE_CREATING && v.ExpiresAt != nil && v.ExpiresAt.AsTime().Unix() > 0 && now.After(v.ExpiresAt.AsTime())
}

// Expire ends a sandbox the expiry loop picked, holding its lock from
// the deadline check to the end, so a new timeout that was answered is
// never undone by a removal already on its way. One whose deadline moved
// meanwhile (a pause, a resume, a new timeout) is kept; a running one
// whose spec says on_timeout PAUSE is paused (offloaded where the backend
// can, else frozen) instead of removed. A paused one whose paused
// lifetime ran out is removed as any other.
func (sb *Sandbox) Expire() error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.removed || time.Now().Before(sb.rec.ExpiresAt) {
		return nil
	}
	if sb.rec.State == records.StateRunning && sb.rec.Spec.GetOnTimeout() == sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE {
		depth := sb.rec.Spec.GetOnTimeoutDepth()
		if depth != sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM {
			depth = sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		_, note, err := sb.pauseAtLocked(ctx, depth)
		cancel()
		if err == nil {
			sb.log.Info("sandbox time to live ran out; paused", "depth", sb.rec.PauseDepth().String(), "note", note)
			return nil
		}
		sb.log.Error("pause a sandbox whose time to live ran out; removing it", logging.Error, err)
	}
	sb.log.Info("sandbox time to live ran out")
	return sb.destroyLocked(context.Background())
}

// PauseForTask pauses sb at depth for a task-wide pause, unless it is
// paused as deep already or is not running (acted is false then).
func (sb *Sandbox) PauseForTask(ctx context.Context, depth sandboxv1.PauseDepth) (released int64, note string, err error, acted bool) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	switch sb.rec.State {
	case records.StateRunning:
	case records.StatePaused:
		if depth != sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD || sb.rec.Offloaded != "" {
			return 0, "", nil, false // already as deep as asked
		}
	default:
		return 0, "", nil, false
	}
	released, note, err = sb.pauseAtLocked(ctx, depth)
	if err == nil {
		sb.rec.PausedTask = true
		err = sb.save()
	}
	return released, note, err, true
}

// ResumeForTask resumes sb for a task-wide resume if it is paused (acted
// is false if not).
func (sb *Sandbox) ResumeForTask(ctx context.Context) (err error, acted bool) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.rec.State != records.StatePaused {
		return nil, false
	}
	return sb.resumeLocked(ctx), true
}

package sandbox

import (
	"context"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// freeze stops sb's processes where they are (the backend's Pause) and
// starts its paused lifetime. Callers hold sb.mu.
func (sb *Sandbox) freeze(ctx context.Context) error {
	switch sb.rec.State {
	case records.StatePaused:
		return nil
	case records.StateRunning:
	default:
		return errdefs.FailedPrecondition("sandbox %s is %s; only a running sandbox can be paused", sb.id, sb.rec.State)
	}
	p, ok := sb.be.(backend.Pauser)
	if !ok || !sb.be.Capabilities().Pause {
		return errdefs.Unsupported("backend %q cannot pause sandboxes", sb.be.Name())
	}
	defer sb.beginPause()()
	if err := p.Pause(ctx, sb.id); err != nil {
		return errdefs.Wrap(errdefs.ErrUnavailable, err, "pause sandbox %s", sb.id)
	}
	sb.stopClock()
	sb.rec.State = records.StatePaused
	sb.log.Info("sandbox paused")
	return sb.save()
}

// Resume resumes sb if it is paused, and returns its view.
func (sb *Sandbox) Resume(ctx context.Context) (*sandboxv1.Sandbox, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if err := sb.resumeLocked(ctx); err != nil {
		return nil, err
	}
	return sb.View(), nil
}

// resumeLocked continues sb where its pause left it: an offloaded one
// read back from its checkpoint, a frozen one thawed. Callers hold sb.mu.
func (sb *Sandbox) resumeLocked(ctx context.Context) error {
	switch sb.rec.State {
	case records.StateRunning:
		return nil
	case records.StatePaused:
	default:
		return errdefs.FailedPrecondition("sandbox %s is %s; only a paused sandbox can be resumed", sb.id, sb.rec.State)
	}
	if sb.rec.Offloaded != "" {
		if err := sb.restoreOffloaded(ctx); err != nil {
			return err
		}
	} else {
		p, ok := sb.be.(backend.Pauser)
		if !ok {
			return errdefs.Unsupported("backend %q cannot resume sandboxes", sb.be.Name())
		}
		if err := p.Resume(ctx, sb.id); err != nil {
			return errdefs.Wrap(errdefs.ErrUnavailable, err, "resume sandbox %s", sb.id)
		}
		if err := sb.relinkLocked(ctx); err != nil {
			return err
		}
	}
	sb.startClock()
	sb.rec.State, sb.rec.PausedTask = records.StateRunning, false
	sb.log.Info("sandbox resumed")
	if sb.rec.FilesystemOnly {
		return sb.startAfreshLocked(ctx) // its processes ended at the pause
	}
	return sb.save()
}

// EnsureRunning resumes a paused sandbox before an agent call, unless
// resume is false or the sandbox resumes only when asked (explicit_resume;
// then a paused sandbox is an error), and returns its link.
// The call is counted (callStarted) under the sandbox's lock, so a
// compaction, which checks the count under it, never cuts a call that got
// this far; the caller ends it with CallEnded.
func (sb *Sandbox) EnsureRunning(ctx context.Context, resume bool) (*agentlink.Link, error) {
	if !resume && sb.pausing.Load() {
		// Not after the pause's lock: a checkpoint takes seconds, and a
		// probe (E2B's is_running) must hear "paused" from its start.
		return nil, errdefs.FailedPrecondition("sandbox %s is being paused; this call does not resume it", sb.id)
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	switch sb.rec.State {
	case records.StateRunning:
		// Past its time to live a sandbox is not running any more, even
		// before the expiry loop has got to it: on a busy node that can be
		// a second or more later. A call that may resume one that pauses
		// at its timeout goes on (it would wake it anyway).
		if !sb.rec.ExpiresAt.IsZero() && time.Now().After(sb.rec.ExpiresAt) {
			if sb.rec.Spec.GetOnTimeout() != sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE {
				return nil, errdefs.FailedPrecondition("sandbox %s: its time to live ran out; it is being removed", sb.id)
			}
			if !resume {
				return nil, errdefs.FailedPrecondition("sandbox %s: its time to live ran out; it is being paused and this call does not resume it", sb.id)
			}
		}
	case records.StatePaused:
		if !resume {
			return nil, errdefs.FailedPrecondition("sandbox %s is paused; this call does not resume it", sb.id)
		}
		if sb.rec.Spec.GetExplicitResume() {
			return nil, errdefs.FailedPrecondition("sandbox %s is paused and resumes only when asked (it was created with explicit_resume); resume it first", sb.id)
		}
		if err := sb.resumeLocked(ctx); err != nil {
			return nil, err
		}
	case records.StateFailed:
		return nil, errdefs.FailedPrecondition("sandbox %s failed: %s", sb.id, sb.rec.Message)
	default:
		return nil, errdefs.FailedPrecondition("sandbox %s is %s", sb.id, sb.rec.State)
	}
	if sb.link == nil {
		return nil, errdefs.Unavailable("sandbox %s: no agent link", sb.id)
	}
	sb.callStarted()
	return sb.link, nil
}

package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
)

// Liveness [ours]. A sandbox is running only while its agent is connected.
// The agent's connection ends the moment the agent, its sandbox or the
// runtime dies, so the health loop sees a dead sandbox within one tick: it
// asks the backend, and a sandbox whose backend reports it stopped (or whose
// agent stays away) is marked failed with the reason ("out of memory (limit
// 512 MiB)", ...). Its processes, mounts and cgroups are removed and its
// capacity freed at once; the record stays, so the reason can be read,
// until the sandbox is stopped or its time to live ends. Calls to it fail at
// once with the reason instead of waiting for an agent that will not come.

// An agent that is connected but does not answer (gVisor lets the
// sandbox's root stop its PID 1 with SIGSTOP; Linux does not) is found by a
// heartbeat: a Health call to every idle sandbox every heartbeatEvery. When
// it goes unanswered the edge sends the sandbox's first process SIGCONT
// from outside; after heartbeatStrikes unanswered in a row, and no answer
// for the backend's AgentWait (a guest under emulation), the sandbox is
// failed.

const (
	// HealthEvery is how often the loop looks.
	HealthEvery = 500 * time.Millisecond
	// agentAbsence is how long an agent may stay away while the backend
	// says its sandbox runs (it redials within milliseconds normally).
	agentAbsence     = 10 * time.Second
	heartbeatStrikes = 3
)

// heartbeatEvery is how long a sandbox may go without a call before the
// edge asks its agent; heartbeatTimeout bounds the answer. (Variables so
// tests can shorten them.)
var (
	heartbeatEvery   = 5 * time.Second
	heartbeatTimeout = 5 * time.Second
	// hostStopCheck is how long a check goes unanswered before the edge
	// asks the backend whether the runtime was stopped from the node.
	hostStopCheck = time.Second
)

// CheckHealth looks at a sandbox: it fails one whose agent and runtime
// are gone, asks an idle one's agent whether it answers (heartbeat), and
// starts a compaction of one that is due one (on its own goroutine, which
// wg counts; its checkpoint goes to store). A sandbox busy in a lifecycle
// change (its lock held: create, snapshot, stop) is left for the next
// tick.
func (sb *Sandbox) CheckHealth(now time.Time, wg *sync.WaitGroup, store *snapshots.Store) {
	if !sb.mu.TryLock() {
		return
	}
	defer sb.mu.Unlock()
	if sb.rec.State != records.StateRunning || sb.link == nil {
		sb.downSince = time.Time{}
		return
	}
	isDown, since := sb.link.Down()
	if !isDown {
		sb.downSince = time.Time{}
		if sb.heartbeat(now) {
			return
		}
		if ht, n := sb.compactionDue(now); ht != nil {
			sb.compactSoon(wg, store, ht, n)
		}
		return
	}
	if since.IsZero() { // the link cannot say: since the first tick that saw it
		if sb.downSince.IsZero() {
			sb.downSince = now
		}
		since = sb.downSince
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := sb.be.Status(ctx, sb.id)
	alive := err == nil && (st.State == backend.StateRunning || st.State == backend.StatePaused)
	if alive && now.Sub(since) < agentAbsence {
		return // the agent is redialling
	}
	sb.downSince = time.Time{}
	sb.fail(ctx, sb.whyDead(ctx, alive))
}

// whyDead says why a sandbox stopped answering, as precisely as the
// backend can tell.
func (sb *Sandbox) whyDead(ctx context.Context, backendAlive bool) string {
	if d, ok := sb.be.(backend.Diagnoser); ok {
		if why := d.Diagnose(ctx, sb.id); why != "" {
			return why
		}
	}
	if backendAlive {
		return fmt.Sprintf("its agent has not been connected for %s", agentAbsence) + sb.guestReport(ctx)
	}
	return "it ended: its agent and every process in it are gone"
}

// guestReport is what a VM backend's hypervisor says of the sandbox's
// guest, as "; " and the report, for a failure's reason; "" from other
// backends or when it does not answer.
func (sb *Sandbox) guestReport(ctx context.Context) string {
	r, ok := sb.be.(backend.GuestReporter)
	if !ok {
		return ""
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if report := r.GuestReport(ctx, sb.id); report != "" {
		return "; " + report
	}
	return ""
}

// fail marks a sandbox failed with reason, removes what it holds on
// the node (processes, mounts, cgroups, writable layer) and frees its
// capacity; the record stays for the reason to be read. Callers hold sb.mu.
func (sb *Sandbox) fail(ctx context.Context, reason string) {
	log := sb.log
	log.Warn("sandbox failed", "reason", reason)
	if sb.link != nil {
		sb.link.Fail(errdefs.FailedPrecondition("sandbox %s failed: %s", sb.id, reason))
	}
	// What it holds is given back only once it is really gone; otherwise
	// it stays counted until a stop removes it.
	if err := sb.be.Destroy(ctx, sb.id); err != nil {
		log.Error("remove a failed sandbox's processes and mounts", logging.Error, err)
		reason += "; removing what it left failed (stop it to retry): " + err.Error()
	} else {
		if err := sb.host.RemoveLayer(sb.rec.LayerDir); err != nil {
			log.Error("remove a failed sandbox's writable layer", logging.Error, err)
		}
		if err := sb.detachNetwork(ctx); err != nil {
			log.Error("detach a failed sandbox from the network", logging.Error, err)
		}
		sb.host.Release(sb)
	}
	sb.rec.State, sb.rec.Message = records.StateFailed, reason
	sb.end()
	if err := sb.save(); err != nil {
		log.Error("save a failed sandbox's record", logging.Error, err)
	}
}

// heartbeat asks an idle sandbox's agent whether it answers, acts on the
// answers so far, and reports whether it failed the sandbox. Callers hold
// sb.mu.
func (sb *Sandbox) heartbeat(now time.Time) bool {
	hb := &sb.hb
	// A runtime stopped from the node (SIGSTOP to gVisor's sentry or to
	// QEMU) answers nothing, SIGCONT from inside included: it is reported
	// as soon as a check has gone unanswered for hostStopCheck.
	if pid := hb.stoppedPid.Load(); pid != 0 {
		sb.fail(context.Background(), fmt.Sprintf("its runtime process (pid %d) was stopped by a signal on the node (SIGSTOP); nothing in it answers", pid))
		return true
	}
	last := max(hb.lastOK.Load(), sb.lastAnswered.Load(), sb.started.Load())
	if strikes := hb.strikes.Load(); strikes > 0 && !hb.running.Load() {
		// A guest under emulation on a busy node went unanswered for three
		// checks and was well (a fork's copy beside three test suites on 2
		// cores): its backend's AgentWait bounds the silence too.
		if silent := now.Sub(time.Unix(0, last)); strikes >= heartbeatStrikes && silent >= sb.silenceAllowed {
			ctx := context.Background()
			sb.fail(ctx, fmt.Sprintf("its agent stopped answering (%d health checks of %s went unanswered over %s, and SIGCONT did not help)", strikes, heartbeatTimeout, silent.Round(time.Second))+sb.guestReport(ctx))
			return true
		}
		if !hb.continued.Load() {
			hb.continued.Store(true)
			if c, ok := sb.be.(backend.Continuer); ok {
				sb.log.Warn("agent did not answer a health check; sending its sandbox's first process SIGCONT")
				c.Continue(context.Background(), sb.id) //nolint:errcheck // the next check tells
			}
		}
	}
	// Calls in flight do not excuse it: a long stream says nothing of the
	// agent, and a call to a stopped agent would wait for its deadline.
	if hb.running.Load() || now.Sub(time.Unix(0, last)) < heartbeatEvery {
		return false
	}
	hb.running.Store(true)
	link := sb.link
	go func() {
		defer hb.running.Store(false)
		ctx, cancel := context.WithTimeout(context.Background(), heartbeatTimeout)
		defer cancel()
		// Unanswered for a while: is the runtime stopped from the node?
		check := time.AfterFunc(hostStopCheck, func() {
			sctx, scancel := context.WithTimeout(context.Background(), heartbeatTimeout)
			defer scancel()
			if st, err := sb.be.Status(sctx, sb.id); err == nil && st.HostStopped {
				hb.stoppedPid.Store(int64(st.Pid))
			}
		})
		defer check.Stop()
		c := agentv1connect.NewAgentServiceClient(&http.Client{Transport: link}, "http://agent")
		resp, err := c.Health(ctx, connect.NewRequest(&agentv1.HealthRequest{}))
		switch {
		case err == nil:
			sb.limits.fromAgent(resp.Header())
			hb.lastOK.Store(time.Now().UnixNano())
			hb.strikes.Store(0)
			hb.continued.Store(false)
		case errors.Is(err, context.DeadlineExceeded) || connect.CodeOf(err) == connect.CodeDeadlineExceeded:
			hb.strikes.Add(1)
		}
	}()
	return false
}

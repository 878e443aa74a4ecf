package sandbox

import (
	"log/slog"
	"sync"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/logging"
)

// Expiry stops sandboxes whose time to live ran out, at the moment it runs
// out: it sleeps until the earliest deadline (at most a second, which also
// retries removals that failed), and a new deadline wakes it. Each removal
// runs on its own, so a slow one (gVisor's take seconds) holds back no
// other; the sandbox is marked stopping at once, so calls to it fail from
// its deadline on.
type Expiry struct {
	sandboxes func() []*Sandbox // the node's sandboxes (the registry's)
	log       *slog.Logger
	wake      chan struct{} // a deadline changed (poke)
}

// NewExpiry is the expiry loop of the sandboxes the function lists.
func NewExpiry(sandboxes func() []*Sandbox, log *slog.Logger) *Expiry {
	return &Expiry{sandboxes: sandboxes, log: log, wake: make(chan struct{}, 1)}
}

// Poke tells the loop that a deadline changed.
func (x *Expiry) Poke() {
	select {
	case x.wake <- struct{}{}:
	default:
	}
}

// Run is the loop, until stop is closed; removals it started are counted
// in wg.
func (x *Expiry) Run(stop <-chan struct{}, wg *sync.WaitGroup) {
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-stop:
			return
		case <-timer.C:
		case <-x.wake:
			if !timer.Stop() {
				select {
				case <-timer.C:
				default:
				}
			}
		}
		now := time.Now()
		for _, sb := range x.due(now) {
			if !sb.expiring.CompareAndSwap(false, true) {
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer sb.expiring.Store(false)
				if err := sb.Expire(); err != nil {
					x.log.Error("stop expired sandbox", logging.SandboxID, sb.ID(), logging.Error, err)
				}
			}()
		}
		timer.Reset(x.untilNext(now))
	}
}

// untilNext is how long until the earliest time to live of a running or
// paused sandbox runs out, at most a second.
func (x *Expiry) untilNext(now time.Time) time.Duration {
	wait := time.Second
	for _, sb := range x.sandboxes() {
		v := sb.View()
		if v.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING && v.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
			continue
		}
		if d := v.ExpiresAt.AsTime().Sub(now); d > 0 && d < wait {
			wait = d
		}
	}
	return wait
}

// due is the sandboxes whose time to live ran out by now. The list of
// sandboxes is taken before any sandbox's lock (the registry lets go of
// its lock first): removal holds a sandbox's lock while it takes the
// registry's, so the reverse order deadlocks.
func (x *Expiry) due(now time.Time) []*Sandbox {
	var out []*Sandbox
	for _, sb := range x.sandboxes() {
		if sb.expiredBy(now) {
			out = append(out, sb)
		}
	}
	return out
}

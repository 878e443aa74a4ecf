package sandbox

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// TestExpiryRemovesWhatRanOutAndWakesForTheNext: a sandbox whose time to
// live ran out is due and removed; one still being made is not, whatever
// its deadline; the loop sleeps no longer than the next deadline (here
// well under its one-second cap) and removes that one when it comes; a
// poke while it sleeps is taken at once, a second one is not queued.
func TestExpiryRemovesWhatRanOutAndWakesForTheNext(t *testing.T) {
	ran, rh, _, _ := hostedSandbox(t)
	soon, sh, _, _ := hostedSandbox(t)
	making, mh, _, _ := hostedSandbox(t)
	now := time.Now()
	set := func(sb *Sandbox, state string, at time.Time) {
		sb.mu.Lock()
		defer sb.mu.Unlock()
		sb.rec.State, sb.rec.ExpiresAt = state, at
		sb.publish()
	}
	set(ran, records.StateRunning, now.Add(-time.Second))
	set(soon, records.StateRunning, now.Add(300*time.Millisecond))
	set(making, records.StateCreating, now.Add(-time.Minute))
	x := NewExpiry(func() []*Sandbox { return []*Sandbox{ran, soon, making} }, ran.log)

	if due := x.due(now); len(due) != 1 || due[0] != ran {
		t.Fatalf("due now: %v, want only the sandbox that ran out", due)
	}
	if d := x.untilNext(now); d <= 0 || d > 300*time.Millisecond {
		t.Fatalf("until the next deadline: %v, want at most the 300ms left to the next", d)
	}
	x.Poke()
	x.Poke() // not queued behind the first
	if n := len(x.wake); n != 1 {
		t.Fatalf("%d wakes queued, want 1", n)
	}

	stop, done := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	go func() { defer close(done); x.Run(stop, &wg) }()
	removed := func(sb *Sandbox) bool { sb.mu.Lock(); defer sb.mu.Unlock(); return sb.removed }
	for deadline := time.Now().Add(time.Minute); !removed(ran) || !removed(soon); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after a minute: removed %v (ran out), %v (ran out 300ms in)", removed(ran), removed(soon))
		}
	}
	close(stop)
	<-done
	wg.Wait()
	if removed(making) || mh.forgotten != 0 {
		t.Fatal("the expiry loop removed a sandbox still being made")
	}
	if rh.forgotten != 1 || sh.forgotten != 1 {
		t.Fatalf("forgotten: %d and %d times, want once each", rh.forgotten, sh.forgotten)
	}
}

// Past its time to live a sandbox answers no call, even before the expiry
// loop has removed it (E2B's test_shorten_timeout asks is_running a second
// after the end, which a busy node may not have reached); one that pauses
// at its timeout still takes a call that may resume it.
func TestASandboxPastItsEndTakesNoCall(t *testing.T) {
	sb, _, _, _ := hostedSandbox(t)
	set := func(at time.Time, onTimeout sandboxv1.OnTimeout) {
		sb.mu.Lock()
		defer sb.mu.Unlock()
		sb.rec.State, sb.rec.ExpiresAt = records.StateRunning, at
		sb.rec.Spec.OnTimeout = onTimeout
	}
	ranOut := func(resume bool) bool {
		_, err := sb.EnsureRunning(context.Background(), resume)
		return errdefs.Code(err) == connect.CodeFailedPrecondition && strings.Contains(err.Error(), "time to live ran out")
	}
	set(time.Now().Add(time.Minute), sandboxv1.OnTimeout_ON_TIMEOUT_UNSPECIFIED)
	if ranOut(true) || ranOut(false) {
		t.Fatal("a sandbox with a minute left was refused as past its end")
	}
	set(time.Now().Add(-time.Millisecond), sandboxv1.OnTimeout_ON_TIMEOUT_UNSPECIFIED)
	if !ranOut(true) || !ranOut(false) {
		t.Fatal("a sandbox past its end took a call")
	}
	set(time.Now().Add(-time.Millisecond), sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE)
	if !ranOut(false) {
		t.Fatal("a probe of a sandbox pausing at its end was answered")
	}
	if ranOut(true) {
		t.Fatal("a call that may resume a sandbox pausing at its end was refused")
	}
}

// The expiry loop reads deadlines without taking sandboxes' locks: one
// sandbox held for seconds by a checkpoint must not delay another's end
// (E2B's auto-pause tests saw a sandbox still running 2 s after its end
// while another sandbox was being offloaded).
func TestExpiryIsNotHeldUpByABusySandbox(t *testing.T) {
	ran, _, _, _ := hostedSandbox(t)
	busy, _, _, _ := hostedSandbox(t)
	for sb, at := range map[*Sandbox]time.Time{ran: time.Now().Add(-time.Second), busy: time.Now().Add(time.Hour)} {
		sb.mu.Lock()
		sb.rec.State, sb.rec.ExpiresAt = records.StateRunning, at
		sb.publish()
		sb.mu.Unlock()
	}
	x := NewExpiry(func() []*Sandbox { return []*Sandbox{busy, ran} }, ran.log)
	busy.mu.Lock() // a long call holds it
	defer busy.mu.Unlock()
	got := make(chan []*Sandbox, 1)
	go func() { got <- x.due(time.Now()) }()
	select {
	case due := <-got:
		if len(due) != 1 || due[0] != ran {
			t.Fatalf("due: %v, want only the sandbox that ran out", due)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the expiry loop waited for a busy sandbox's lock")
	}
}

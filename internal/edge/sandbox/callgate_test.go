package sandbox

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// TestAQueuedCallWithLessTimeThanCallsTakeIsRefused: once calls take
// about a second, a call that waited for a slot and has less left of its
// deadline is refused at once instead of being served into its deadline.
func TestAQueuedCallWithLessTimeThanCallsTakeIsRefused(t *testing.T) {
	sb := &Sandbox{id: "n-1", slots: make(chan struct{}, 1)}
	sb.callTimes.observe(time.Second)
	hold, err := sb.AcquireCall(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(300 * time.Millisecond); hold() }()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	began := time.Now()
	_, err = sb.AcquireCall(ctx)
	if connect.CodeOf(errdefs.ToConnect(err)) != connect.CodeResourceExhausted || time.Since(began) > time.Second {
		t.Fatalf("after %v: %v, want resource-exhausted once the slot came free", time.Since(began), err)
	}
	if len(sb.slots) != 0 {
		t.Fatal("the refused call kept its slot")
	}
	// With time enough left, the queued call is served.
	hold, _ = sb.AcquireCall(context.Background())
	go func() { time.Sleep(100 * time.Millisecond); hold() }()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel2()
	release, err := sb.AcquireCall(ctx2)
	if err != nil {
		t.Fatalf("a queued call with time enough: %v", err)
	}
	release()
	// Calls get slower while a flood is refused around them, so twice the
	// typical time must be left: with calls at about 2 s, a queued call
	// with 2.9 s left is refused.
	slow := &Sandbox{id: "n-2", slots: make(chan struct{}, 1)}
	slow.callTimes.observe(2 * time.Second)
	hold, _ = slow.AcquireCall(context.Background())
	go func() { time.Sleep(100 * time.Millisecond); hold() }()
	ctx3, cancel3 := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel3()
	if _, err := slow.AcquireCall(ctx3); connect.CodeOf(errdefs.ToConnect(err)) != connect.CodeResourceExhausted {
		t.Fatalf("a queued call with 2.9 s left where calls take about 2 s: %v, want resource-exhausted", err)
	}
	var c callTimes
	c.observe(800 * time.Millisecond)
	c.observe(1600 * time.Millisecond)
	if got := c.typical(); got != 900*time.Millisecond {
		t.Fatalf("average %v, want 900ms", got)
	}
}

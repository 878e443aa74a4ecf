package edge

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// TestCallsBeyondTheBoundAreRefusedPromptly: with two call slots, two long
// calls run and three more are refused with resource-exhausted and a retry
// hint before their deadline, never left to run into it; once the slots
// are free, calls are served again.
func TestCallsBeyondTheBoundAreRefusedPromptly(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.ConcurrentCalls = 2
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	c := agentClient(t, f.edge, sb.Id, "root")
	run := func(ctx context.Context, cmd string) (*connect.Response[agentv1.RunResponse], error) {
		return c.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", cmd}}}))
	}
	var wg sync.WaitGroup
	long := make(chan error, 2)
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := run(context.Background(), "sleep 3")
			long <- err
		}()
	}
	time.Sleep(300 * time.Millisecond) // the long calls hold the slots
	type refusal struct {
		err   error
		retry string
	}
	refused := make(chan refusal, 3)
	for range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_, err := run(ctx, "true")
			var ce *connect.Error
			retry := ""
			if errors.As(err, &ce) {
				retry = ce.Meta().Get("Retry-After")
			}
			refused <- refusal{err, retry}
		}()
	}
	wg.Wait()
	close(long)
	close(refused)
	for err := range long {
		if err != nil {
			t.Errorf("a call within the bound: %v", err)
		}
	}
	for r := range refused {
		if connect.CodeOf(r.err) != connect.CodeResourceExhausted || r.retry != "1" {
			t.Errorf("a call beyond the bound: %v (Retry-After %q), want resource exhausted with a retry hint", r.err, r.retry)
		}
	}
	if _, err := run(context.Background(), "true"); err != nil {
		t.Errorf("a call once the slots are free: %v", err)
	}
}

// TestAQueuedCallWithLessTimeThanCallsTakeIsRefused: once calls take
// about a second, a call that waited for a slot and has less left of its
// deadline is refused at once instead of being served into its deadline.
func TestAQueuedCallWithLessTimeThanCallsTakeIsRefused(t *testing.T) {
	sb := &sandbox{id: "n-1", slots: make(chan struct{}, 1)}
	sb.callTimes.observe(time.Second)
	hold, err := sb.acquireCall(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	go func() { time.Sleep(300 * time.Millisecond); hold() }()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	began := time.Now()
	_, err = sb.acquireCall(ctx)
	if connect.CodeOf(errdefs.ToConnect(err)) != connect.CodeResourceExhausted || time.Since(began) > time.Second {
		t.Fatalf("after %v: %v, want resource-exhausted once the slot came free", time.Since(began), err)
	}
	if len(sb.slots) != 0 {
		t.Fatal("the refused call kept its slot")
	}
	// With time enough left, the queued call is served.
	hold, _ = sb.acquireCall(context.Background())
	go func() { time.Sleep(100 * time.Millisecond); hold() }()
	ctx2, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel2()
	release, err := sb.acquireCall(ctx2)
	if err != nil {
		t.Fatalf("a queued call with time enough: %v", err)
	}
	release()
	// Calls get slower while a flood is refused around them, so twice the
	// typical time must be left: with calls at about 2 s, a queued call
	// with 2.9 s left is refused.
	slow := &sandbox{id: "n-2", slots: make(chan struct{}, 1)}
	slow.callTimes.observe(2 * time.Second)
	hold, _ = slow.acquireCall(context.Background())
	go func() { time.Sleep(100 * time.Millisecond); hold() }()
	ctx3, cancel3 := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel3()
	if _, err := slow.acquireCall(ctx3); connect.CodeOf(errdefs.ToConnect(err)) != connect.CodeResourceExhausted {
		t.Fatalf("a queued call with 2.9 s left where calls take about 2 s: %v, want resource-exhausted", err)
	}
	var c callTimes
	c.observe(800 * time.Millisecond)
	c.observe(1600 * time.Millisecond)
	if got := c.typical(); got != 900*time.Millisecond {
		t.Fatalf("average %v, want 900ms", got)
	}
}

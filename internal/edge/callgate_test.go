package edge

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
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

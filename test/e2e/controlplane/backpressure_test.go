package controlplane

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestABurstPastTheNodeWaitsForRoom: a node that admits 2 sandboxes takes
// a burst of 6 creates, each of which runs a command and ends its sandbox.
// The apiserver answers the creates it has no room for with
// resource-exhausted and a Retry-After; the Go client waits that long and
// sends them again, so every create succeeds and none fails.
func TestABurstPastTheNodeWaitsForRoom(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Capacity.MaxSandboxes = 2
	}, "container")
	ctx := e2e.Ctx(t)
	spec := func() *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64}}
	}

	// The answer on the wire while the node is full.
	var held []func()
	for range 2 {
		sb, err := c.Client.Create(ctx, spec())
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, func() { sb.Stop(context.Background()) }) //nolint:errcheck // checked by the burst below
	}
	_, err := c.Client.Sandboxes.CreateSandbox(ctx, connect.NewRequest(&sandboxv1.CreateSandboxRequest{Spec: spec()}))
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeResourceExhausted || ce.Meta().Get("Retry-After") != "1" || ce.Meta().Get("Dsec-Retry") != "1" {
		t.Fatalf("a create on a full node: %v (meta %v); want resource_exhausted with Retry-After 1 and Dsec-Retry 1", err, metaOf(ce))
	}
	for _, stop := range held {
		stop()
	}

	c.Client.CreateWait = 3 * time.Minute
	var retries atomic.Int32
	c.Client.OnCreateRetry = func(err error, _ time.Duration) {
		if connect.CodeOf(err) != connect.CodeResourceExhausted {
			t.Errorf("a retry after %v", err)
		}
		retries.Add(1)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := c.Client.Create(ctx, spec())
			if err != nil {
				errs <- err
				return
			}
			defer sb.Stop(context.Background()) //nolint:errcheck // the next create waits for it
			if r, err := sb.Shell(ctx, "echo $((6*7))"); err != nil || string(r.Stdout) != "42\n" {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("a create or exec of the burst: %v", err)
	}
	if retries.Load() == 0 {
		t.Fatal("6 creates on a node for 2 were never told to wait: the node's limit did not hold")
	}
	t.Logf("6 creates on a node for 2: %d answers to wait", retries.Load())
}

func metaOf(ce *connect.Error) any {
	if ce == nil {
		return nil
	}
	return ce.Meta()
}

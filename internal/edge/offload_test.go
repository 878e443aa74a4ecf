package edge

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
)

// An offloaded sandbox keeps its checkpoint across an edge restart; a
// call restores it in place and the checkpoint goes, record first.
func TestOffloadSurvivesARestartAndACallRestoresIt(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	s := spec()
	s.Task = "t1"
	sb, err := f.edge.Create(ctx, s, "root")
	if err != nil {
		t.Fatal(err)
	}
	rs, err := f.edge.PauseTask(ctx, "t1", "root", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil || len(rs) != 1 || rs[0].Err != nil || rs[0].Note != "" {
		t.Fatalf("pause_task: %+v %v", rs, err)
	}
	got := rs[0].Sandbox
	if got.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED || got.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
		t.Fatalf("after offload: %v %v", got.State, got.PauseDepth)
	}
	dir := filepath.Join(f.edge.dirs.sandbox(sandboxIDOf(sb)), "offload")
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("no checkpoint: %v", err)
	}
	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	if got, err := e2.Get(sb.Id, "root"); err != nil || got.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
		t.Fatalf("after the restart: %v %v", got, err)
	}
	if out, err := echo(t, agentClient(t, e2, sb.Id, "root")); err != nil || out != "yes "+sb.Id {
		t.Fatalf("a call to the offloaded sandbox = %q, %v", out, err)
	}
	if got, _ := e2.Get(sb.Id, "root"); got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING || got.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_UNSPECIFIED {
		t.Fatalf("after the call: %v %v", got.State, got.PauseDepth)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("the checkpoint outlived the restore: %v", err)
	}
	// The other task's call and an empty label are refused or empty.
	if rs, err := e2.PauseTask(ctx, "t2", "root", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD); err != nil || len(rs) != 0 {
		t.Fatalf("another task: %v %v", rs, err)
	}
	if _, err := e2.PauseTask(ctx, "", "root", sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("no task: %v", err)
	}
	// Another project sees none of it.
	if rs, err := e2.PauseTask(ctx, "t1", "root/other", sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE); err != nil || len(rs) != 0 {
		t.Fatalf("another project's scope: %v %v", rs, err)
	}
}

// An offload whose release fails while the sandbox still runs leaves no
// checkpoint and freezes it instead, saying why.
func TestOffloadThatCannotReleaseFreezes(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.Knobs.FailRelease = errdefs.Unavailable("injected")
	out, err := f.edge.PauseAt(ctx, sb.Id, "root", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil {
		t.Fatal(err)
	}
	if out.Sandbox.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE || !strings.Contains(out.Note, "frozen, not offloaded") || !strings.Contains(out.Note, "injected") {
		t.Fatalf("depth %v, note %q", out.Sandbox.PauseDepth, out.Note)
	}
	if _, err := os.Stat(filepath.Join(f.edge.dirs.sandbox(sandboxIDOf(sb)), "offload")); !os.IsNotExist(err) {
		t.Fatalf("a checkpoint is left: %v", err)
	}
	if got, err := echo(t, agentClient(t, f.edge, sb.Id, "root")); err != nil || got != "yes "+sb.Id {
		t.Fatalf("a call = %q, %v", got, err)
	}
}

// A pause is seen from its start: while its checkpoint runs, readers see
// the sandbox paused and a call that must not resume it (E2B's
// is_running probe) is refused at once rather than waiting for the end.
func TestPauseUnderWayIsSeenPaused(t *testing.T) {
	f := newFixture(t, smallCapacity())
	gate := make(chan struct{})
	f.fake.Knobs.PauseGate = gate
	release := sync.OnceFunc(func() { close(gate) })
	t.Cleanup(release) // before the fixture's: a failed check must not leave the pause held
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := f.edge.PauseAt(ctx, sb.Id, "root", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
		done <- err
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := f.edge.Get(sb.Id, "root")
		if err != nil {
			t.Fatal(err)
		}
		if got.State == sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("while its checkpoint runs the sandbox is shown %v, want paused", got.State)
		}
		time.Sleep(10 * time.Millisecond)
	}
	srv := httptest.NewServer(f.edge.Handler())
	t.Cleanup(srv.Close)
	probe := agentv1connect.NewAgentServiceClient(&http.Client{Transport: headerRT{id: sb.Id, scope: "root"}}, srv.URL)
	req := connect.NewRequest(&agentv1.HealthRequest{})
	req.Header().Set(headers.NoResume, "1")
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := probe.Health(pctx, req); connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "being paused") {
		t.Fatalf("no-resume call during a pause: %v, want failed_precondition at once", err)
	}
	select {
	case err := <-done:
		t.Fatalf("the pause ended (%v) before its checkpoint was let go", err)
	default:
	}
	release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	got, _ := f.edge.Get(sb.Id, "root")
	if got.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED || got.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
		t.Fatalf("after the pause: %v %v", got.State, got.PauseDepth)
	}
	// A call that may resume it waits for nothing now and resumes it.
	if _, err := echo(t, agentClient(t, f.edge, sb.Id, "root")); err != nil {
		t.Fatal(err)
	}
	if got, _ := f.edge.Get(sb.Id, "root"); got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after a call: %v", got.State)
	}
}

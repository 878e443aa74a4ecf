package edge

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
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
	dir := offloadDir(f.edge.boxes[sandboxIDOf(sb)])
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
	if _, err := os.Stat(offloadDir(f.edge.boxes[sandboxIDOf(sb)])); !os.IsNotExist(err) {
		t.Fatalf("a checkpoint is left: %v", err)
	}
	if got, err := echo(t, agentClient(t, f.edge, sb.Id, "root")); err != nil || got != "yes "+sb.Id {
		t.Fatalf("a call = %q, %v", got, err)
	}
}

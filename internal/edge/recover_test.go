package edge

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// editRecord rewrites a sandbox's record.json while the edge is down.
func editRecord(t *testing.T, dir string, edit func(m map[string]any)) {
	t.Helper()
	p := filepath.Join(dir, records.File)
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	edit(m)
	data, _ = json.Marshal(m)
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

// A sandbox whose create or removal was interrupted is removed on restart:
// no record, directory, agent or capacity is left.
func TestRecoverRemovesHalfCreatedAndHalfRemoved(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	// Interrupted while being created, while being removed, and while being
	// created before the backend made anything (no handle yet).
	cases := []struct {
		state    string
		noHandle bool
	}{{records.StateCreating, false}, {records.StateStopping, false}, {records.StateCreating, true}}
	var dirs []string
	for range cases {
		sb, err := f.edge.Create(ctx, spec(), "root")
		if err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, f.edge.dirs.sandbox(sandboxIDOf(sb)))
	}
	f.edge.Close()
	for i, c := range cases {
		editRecord(t, dirs[i], func(m map[string]any) {
			m["state"] = c.state
			if c.noHandle {
				delete(m, "handle")
			}
		})
	}
	e2 := f.open(t, smallCapacity())
	if got := e2.List("root"); len(got) != 0 {
		t.Fatalf("after restart %d sandboxes listed, want the interrupted ones removed", len(got))
	}
	for _, d := range dirs {
		if exists(d) {
			t.Errorf("%s left behind", d)
		}
	}
	if st := e2.Status(); st.Allocated.Sandboxes != 0 || st.Allocated.CpuCores != 0 {
		t.Fatalf("capacity held after restart: %+v", st.Allocated)
	}
}

// A directory without a record (a crash before the first save) is removed.
func TestRecoverRemovesOrphanDirectory(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	orphan := f.edge.dirs.sandbox(sandboxid.New(f.edge.Node()))
	if err := os.MkdirAll(filepath.Join(orphan, "junk"), 0o700); err != nil {
		t.Fatal(err)
	}
	f.open(t, smallCapacity())
	if exists(orphan) {
		t.Fatal("orphan directory left behind")
	}
}

// Records the edge cannot act on are kept for an operator, and neither
// listed nor counted: one of another node (a state directory moved or
// shared by mistake) and one whose backend this node no longer offers.
func TestRecoverKeepsRecordsItCannotOwn(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	a, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	b, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.edge.Close()
	other := sandboxid.New(sandboxid.NewNodeID())
	foreign := f.edge.dirs.sandbox(other)
	if err := os.Rename(f.edge.dirs.sandbox(sandboxIDOf(a)), foreign); err != nil {
		t.Fatal(err)
	}
	editRecord(t, foreign, func(m map[string]any) { m["id"] = string(other) })
	gone := f.edge.dirs.sandbox(sandboxIDOf(b))
	editRecord(t, gone, func(m map[string]any) { m["handle"].(map[string]any)["backend"] = "retired" })

	e2 := f.open(t, smallCapacity())
	if got := e2.List("root"); len(got) != 0 {
		t.Fatalf("listed after restart: %v", got)
	}
	if st := e2.Status(); st.Allocated.Sandboxes != 0 {
		t.Fatalf("capacity counted for records this node cannot own: %+v", st.Allocated)
	}
	if !exists(filepath.Join(foreign, records.File)) || !exists(filepath.Join(gone, records.File)) {
		t.Fatal("a record the edge cannot act on was deleted")
	}
	f.fake.Destroy(ctx, sandboxIDOf(a)) //nolint:errcheck // stop the in-process agents
	f.fake.Destroy(ctx, sandboxIDOf(b)) //nolint:errcheck
}

// A sandbox that died while the edge was down (Recover fails) stays
// listed as failed with the reason, never disappears; what it held is
// freed.
func TestRecoverFailsSandboxesThatDied(t *testing.T) {
	f := newFixture(t, smallCapacity())
	sb, err := f.edge.Create(context.Background(), spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.edge.Close()
	f.fake.Knobs.FailRecover = errdefs.FailedPrecondition("sandbox process exited")
	e2 := f.open(t, smallCapacity())
	got, err := e2.Get(sb.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_FAILED || !strings.Contains(got.Message, "lost while the edge was down: sandbox process exited") {
		t.Fatalf("a sandbox that died: %v %v; want listed failed with the reason", got, err)
	}
	if e2.Status().Allocated.Sandboxes != 0 {
		t.Fatalf("a failed sandbox still holds capacity: %+v", e2.Status().Allocated)
	}
	f.fake.Knobs.FailRecover = nil
	if _, err := e2.Destroy(context.Background(), sb.Id, "root"); err != nil {
		t.Fatalf("stop the failed sandbox: %v", err)
	}
	if _, err := e2.Get(sb.Id, "root"); !errdefs.IsNotFound(err) {
		t.Fatalf("after its stop: %v", err)
	}
}

// A paused sandbox is still paused after a restart, and a call resumes it.
func TestRecoverKeepsPausedSandboxesPaused(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := freeze(ctx, f.edge, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	got, err := e2.Get(sb.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("after restart: %v, %v; want paused", got, err)
	}
	if out, err := echo(t, agentClient(t, e2, sb.Id, "root")); err != nil || out != "yes "+sb.Id {
		t.Fatalf("call after restart = %q, %v", out, err)
	}
	if got, _ := e2.Get(sb.Id, "root"); got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("state after the call: %v", got.State)
	}
}

// waitGone waits until the sandbox is removed, failing after limit.
func waitGone(t *testing.T, e *Edge, id string, limit time.Duration) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		if _, err := e.Get(id, "root"); errdefs.IsNotFound(err) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("sandbox %s outlived its time to live by more than %v", id, limit)
}

// Time to live holds across an edge restart, and for fork copies. A paused
// sandbox's time to live stands still (it resumes with what it had left),
// and it is removed when its paused lifetime runs out, also across a
// restart.
func TestTimeToLiveAcrossRestartPauseAndFork(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	f.pausedLifetime = 4 * time.Second
	f.edge = f.open(t, smallCapacity())
	ctx := context.Background()
	s := spec()
	s.TimeoutSeconds = 2
	s.Resources.CpuCores = 0.5
	restarted, err := f.edge.Create(ctx, s, "root")
	if err != nil {
		t.Fatal(err)
	}
	var paused []*sandboxv1.Sandbox
	for range 2 {
		sb, err := f.edge.Create(ctx, s, "root")
		if err != nil {
			t.Fatal(err)
		}
		if sb, err = freeze(ctx, f.edge, sb.Id, "root"); err != nil {
			t.Fatal(err)
		}
		if sb.TimeoutLeftSeconds < 1 || sb.TimeoutLeftSeconds > 2 || time.Until(sb.ExpiresAt.AsTime()) < 3*time.Second {
			t.Fatalf("a paused sandbox keeps %d s to live and expires in %v; want 1-2 s, and its 4 s paused lifetime", sb.TimeoutLeftSeconds, time.Until(sb.ExpiresAt.AsTime()))
		}
		paused = append(paused, sb)
	}
	pausedAt := time.Now()
	long := spec()
	long.TimeoutSeconds = 600
	src, err := f.edge.Create(ctx, long, "root")
	if err != nil {
		t.Fatal(err)
	}
	out, err := f.edge.Fork(ctx, src.Id, "root", ForkRequest{Count: 1, Timeout: 2})
	if err != nil || out.Results[0].Err != nil {
		t.Fatalf("fork: %v %+v", err, out)
	}
	forked := out.Results[0].Sandbox
	if d := time.Until(forked.ExpiresAt.AsTime()); d > 2*time.Second || d < 0 {
		t.Fatalf("fork copy expires in %v, want the fork's 2 s", d)
	}
	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	for _, id := range []string{restarted.Id, forked.Id} {
		waitGone(t, e2, id, 5*time.Second)
	}
	// Past their 2 s, the paused ones are still there: one resumed has its
	// time to live back; the other goes when its paused lifetime ends.
	back, err := e2.Resume(ctx, paused[0].Id, "root")
	if err != nil {
		t.Fatalf("resume a paused sandbox after its time to live would have run out: %v", err)
	}
	if d := time.Until(back.ExpiresAt.AsTime()); d > 2*time.Second || d < time.Second {
		t.Fatalf("resumed, it expires in %v; want the 1-2 s it had left", d)
	}
	if _, err := e2.Get(paused[1].Id, "root"); err != nil {
		t.Fatalf("the paused sandbox went before its paused lifetime ended: %v", err)
	}
	waitGone(t, e2, paused[1].Id, time.Until(pausedAt.Add(4*time.Second))+3*time.Second)
	waitGone(t, e2, paused[0].Id, 3*time.Second)
	if _, err := e2.Get(src.Id, "root"); err != nil {
		t.Fatalf("the source with 600 s went too: %v", err)
	}
}

// Every call on a sandbox or snapshot of another project is refused as if
// it did not exist, and nothing happens to it.
func TestOtherProjectsCannotTouchSandboxesOrSnapshots(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root/a")
	if err != nil {
		t.Fatal(err)
	}
	snap, err := f.edge.Snapshot(ctx, sb.Id, "root/a", "")
	if err != nil {
		t.Fatal(err)
	}
	notFound := func(what string, err error) {
		t.Helper()
		if !errdefs.IsNotFound(err) {
			t.Errorf("%s from root/b: %v, want not found", what, err)
		}
	}
	const other = "root/b"
	_, err = f.edge.Get(sb.Id, other)
	notFound("get", err)
	_, err = freeze(ctx, f.edge, sb.Id, other)
	notFound("pause", err)
	_, err = f.edge.Resume(ctx, sb.Id, other)
	notFound("resume", err)
	_, err = f.edge.Snapshot(ctx, sb.Id, other, "")
	notFound("snapshot", err)
	_, err = f.edge.Fork(ctx, sb.Id, other, ForkRequest{Count: 1, Timeout: 0})
	notFound("fork", err)
	_, err = f.edge.SetTimeout(sb.Id, other, 60)
	notFound("set timeout", err)
	_, err = f.edge.Restore(ctx, snap.Id, other, "", RestoreOptions{}, nil)
	notFound("restore", err)
	notFound("delete snapshot", f.edge.DeleteSnapshot(snap.Id, other))
	_, err = f.edge.Destroy(ctx, sb.Id, other)
	notFound("destroy", err)
	if n, err := f.edge.DestroyAll(ctx, other); n != 0 || err != nil {
		t.Errorf("destroy all from root/b removed %d: %v", n, err)
	}
	if l := f.edge.List(other); len(l) != 0 {
		t.Errorf("root/b lists %d sandboxes", len(l))
	}
	if l := listSnapshots(t, f.edge, other, ""); len(l) != 0 {
		t.Errorf("root/b lists %d snapshots", len(l))
	}
	// A parent's scope reaches it; a restore cannot move it out of scope.
	_, err = f.edge.Restore(ctx, snap.Id, "root/a", "root/b", RestoreOptions{}, nil)
	if !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("restore of root/a's snapshot into root/b: %v, want permission denied", err)
	}
	got, err := f.edge.Get(sb.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("the sandbox after the refused calls: %v, %v", got, err)
	}
	if l := listSnapshots(t, f.edge, "root/a", ""); len(l) != 1 {
		t.Fatalf("root/a has %d snapshots after the refused calls", len(l))
	}
}

// An edge that goes down after a checkpoint stopped its source and before
// it brought it back (kill -9 during a gVisor snapshot or fork) finds the
// source again at its restart, restored in place from that checkpoint.
func TestRecoverBringsBackASourceItsCheckpointStopped(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.SnapshotStops = true
	ctx := context.Background()
	created, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	sb, err := f.edge.lookup(created.Id, "root")
	if err != nil {
		t.Fatal(err)
	}
	stopped, err := sb.CheckpointOnlyForTest(ctx, f.edge.snaps)
	if err != nil || !stopped {
		t.Fatalf("checkpoint: stopped %v, %v", stopped, err)
	}
	// The edge goes down here, before bringBack.
	f.edge.Close()
	f.fake.Knobs.FailRecover = errdefs.FailedPrecondition("sandbox is stopped")
	e2 := f.open(t, smallCapacity())
	got, err := e2.Get(created.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after the restart: %v %v; want running", got, err)
	}
	if out, err := echo(t, agentClient(t, e2, created.Id, "root")); err != nil || out != "yes "+created.Id {
		t.Fatalf("exec after the restart: %q %v", out, err)
	}
}

// A time to live set to 0 ends the sandbox now, as its running out would:
// removed, or paused with on_timeout PAUSE. Below 0 is refused.
func TestTimeoutZeroEndsItNow(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	killed, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.SetTimeout(killed.Id, "root", -1); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "want 0") {
		t.Fatalf("timeout -1: %v", err)
	}
	s := spec()
	s.OnTimeout = sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE
	paused, err := f.edge.Create(ctx, s, "root")
	if err != nil {
		t.Fatal(err)
	}
	// Paused already, with on_timeout KILL: removed now too.
	pausedKill, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := freeze(ctx, f.edge, pausedKill.Id, "root"); err != nil {
		t.Fatal(err)
	}
	for _, sb := range []*sandboxv1.Sandbox{killed, paused, pausedKill} {
		if _, err := f.edge.SetTimeout(sb.Id, "root", 0); err != nil {
			t.Fatal(err)
		}
	}
	waitGone(t, f.edge, killed.Id, 5*time.Second)
	waitGone(t, f.edge, pausedKill.Id, 5*time.Second)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		got, err := f.edge.Get(paused.Id, "root")
		if err == nil && got.State == sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("on_timeout PAUSE with timeout 0: %v %v; want paused", got, err)
		}
	}
}

// expire decides on a sandbox's deadline under the same hold of its
// lock as the removal: one whose time to live was set again after the
// loop picked it is kept, and a new time to live asked while the removal
// runs waits for it and fails; it is never answered for a sandbox that is
// then removed. (The check and the removal once took the lock apart, and
// a timeout answered between them was undone.)
func TestExpireKeepsAMovedDeadline(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	made, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	sb, err := f.edge.lookup(made.Id, "root")
	if err != nil {
		t.Fatal(err)
	}
	// The loop picked it, and a new timeout was answered before the
	// removal took the lock.
	if _, err := f.edge.SetTimeout(made.Id, "root", 3600); err != nil {
		t.Fatal(err)
	}
	if err := sb.Expire(); err != nil {
		t.Fatal(err)
	}
	got, err := f.edge.Get(made.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after a new timeout: %v %v; want it running", got, err)
	}

	// Past its deadline, with its removal held open: a new timeout waits.
	gate := make(chan struct{})
	f.fake.Knobs.DestroyGate = gate
	sb.MoveDeadlineForTest(time.Now().Add(-time.Second))
	removed := make(chan error, 1)
	go func() { removed <- sb.Expire() }()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if v := sb.View(); v.State == sandboxv1.SandboxState_SANDBOX_STATE_STOPPING {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the removal did not start")
		}
	}
	answered := make(chan error, 1)
	go func() {
		_, err := f.edge.SetTimeout(made.Id, "root", 3600)
		answered <- err
	}()
	select {
	case err := <-answered:
		t.Fatalf("a new timeout was answered (%v) while the removal ran", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(gate)
	if err := <-removed; err != nil {
		t.Fatal(err)
	}
	if err := <-answered; err == nil {
		t.Fatal("a new timeout was answered OK for a sandbox that was removed")
	}
	waitGone(t, f.edge, made.Id, 5*time.Second)
}

// A source that its snapshot stopped and whose first restore fails (as a
// starved host's runsc did once) is restored on a second try, not failed.
func TestSourceBackAfterOneFailedRestore(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.SnapshotStops = true
	ctx := context.Background()
	created, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.Knobs.FailNextRestores = 1
	if _, err := f.edge.Snapshot(ctx, created.Id, "root", "once"); err != nil {
		t.Fatalf("snapshot with one failed restore of the source: %v", err)
	}
	if f.fake.Knobs.FailNextRestores != 0 {
		t.Fatal("the source was not restored at all")
	}
	got, err := f.edge.Get(created.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("the source after its snapshot: %v, %v; want running", got, err)
	}
	if out, err := echo(t, agentClient(t, f.edge, created.Id, "root")); err != nil || out != "yes "+created.Id {
		t.Fatalf("exec in the source: %q %v", out, err)
	}
}

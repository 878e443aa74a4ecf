package backendtest

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// RunSnapshot checks memory snapshots on a Snapshotter: state in memory
// (a running process and its counter) and files written before the snapshot
// are in the source and every copy afterwards; later writes stay private.
func RunSnapshot(t *testing.T, newBackend Factory, env Env) {
	b := newBackend(t, t.TempDir())
	sn, ok := b.(backend.Snapshotter)
	if !ok || !b.Capabilities().Snapshot {
		t.Skipf("backend %s cannot snapshot memory: %s", b.Name(), b.Capabilities().SnapshotUnavailable)
	}
	ctx := ctxFor(t, 3*time.Minute)
	src := Start(t, b, env)
	// A shell loop whose counter lives only in its memory.
	src.Sh(t, `echo before > /root/file; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) >/dev/null 2>&1 &`)
	src.counterAdvances(t, "source before the snapshot")

	ref := snapshotOf(ctx, t, sn, src, "the source")
	var copies []*Sandbox
	for i := 0; i < 2; i++ {
		spec := NewSpec(t, env, "aaaaaaaa")
		sb := Attach(t, b, spec)
		if _, err := sn.Restore(ctx, ref, spec); err != nil {
			t.Fatalf("restore copy %d: %v", i, err)
		}
		t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
		copies = append(copies, sb)
	}
	for i, sb := range append([]*Sandbox{src}, copies...) {
		if err := WaitAgent(ctx, b, sb.Link); err != nil {
			t.Fatalf("sandbox %d: agent did not reconnect: %v", i, err)
		}
		if got := sb.Sh(t, "cat /root/file"); got != "before\n" {
			t.Fatalf("sandbox %d: file written before the snapshot reads %q", i, got)
		}
		sb.counterAdvances(t, fmt.Sprintf("sandbox %d", i))
	}
	copies[0].Sh(t, "echo mine > /root/private")
	for i, sb := range []*Sandbox{src, copies[1]} {
		if out := sb.Sh(t, "cat /root/private 2>/dev/null || echo absent"); out != "absent\n" {
			t.Fatalf("sandbox %d sees a copy's later write: %q", i, out)
		}
	}
	// A copy is snapshotted in turn (its memory is mapped over its
	// snapshot's): its own copy has its files and memory, and it runs on.
	ref2 := snapshotOf(ctx, t, sn, copies[0], "a copy")
	spec2 := NewSpec(t, env, "aaaaaaaa")
	second := Attach(t, b, spec2)
	if _, err := sn.Restore(ctx, ref2, spec2); err != nil {
		t.Fatalf("restore a copy's snapshot: %v", err)
	}
	t.Cleanup(func() { b.Destroy(context.Background(), spec2.ID) })
	for who, sb := range map[string]*Sandbox{"the snapshotted copy": copies[0], "a copy of a copy": second} {
		if err := WaitAgent(ctx, b, sb.Link); err != nil {
			t.Fatalf("%s: agent: %v", who, err)
		}
		if got := sb.Sh(t, "cat /root/file /root/private"); got != "before\nmine\n" {
			t.Fatalf("%s reads %q", who, got)
		}
		sb.counterAdvances(t, who)
	}
	// A snapshot outlives its source: once the source is removed, a copy
	// still starts from it, with the files and memory of the moment.
	if err := b.Destroy(ctx, src.ID); err != nil {
		t.Fatalf("destroy the source: %v", err)
	}
	spec := NewSpec(t, env, "aaaaaaaa")
	late := Attach(t, b, spec)
	if _, err := sn.Restore(ctx, ref, spec); err != nil {
		t.Fatalf("restore after the source was removed: %v", err)
	}
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	if err := WaitAgent(ctx, b, late.Link); err != nil {
		t.Fatalf("a copy made after the source was removed: agent: %v", err)
	}
	if got := late.Sh(t, "cat /root/file; cat /root/private 2>/dev/null || echo absent"); got != "before\nabsent\n" {
		t.Fatalf("a copy made after the source was removed reads %q", got)
	}
	late.counterAdvances(t, "a copy made after the source was removed")
	testOffload(t, b, sn, env)
}

// testOffload checks a Releaser as the edge's offload uses it: a
// sandbox snapshotted with its link detached, then released (nothing of
// it runs), is restored in place from that snapshot with its files and
// the memory of its processes, and runs on once the snapshot is gone.
func testOffload(t *testing.T, b backend.Backend, sn backend.Snapshotter, env Env) {
	r, ok := b.(backend.Releaser)
	if !ok {
		t.Logf("backend %s cannot give a snapshotted sandbox's memory back (no Releaser): offload not checked", b.Name())
		return
	}
	ctx := ctxFor(t, 3*time.Minute)
	sb := Start(t, b, env)
	sb.Sh(t, `echo kept > /root/kept; (i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done) >/dev/null 2>&1 &`)
	sb.counterAdvances(t, "the sandbox before its offload")
	ref := backend.SnapshotRef{ID: sandboxid.NewSnapshot(sb.ID.Node()), Dir: filepath.Join(t.TempDir(), "offload")}
	if err := os.MkdirAll(ref.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := sb.Link.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sn.Snapshot(ctx, sb.ID, ref); err != nil {
		t.Fatalf("the offload's snapshot: %v", err)
	}
	if err := sb.Link.Reattach(); err != nil {
		t.Fatal(err)
	}
	if err := r.Release(ctx, sb.ID); err != nil {
		t.Fatalf("release: %v", err)
	}
	if st, err := b.Status(ctx, sb.ID); err != nil || st.State != backend.StateStopped {
		t.Fatalf("released, the sandbox is %v (%v), want stopped", st.State, err)
	}
	if _, err := sn.Restore(ctx, ref, sb.Spec); err != nil {
		t.Fatalf("restore in place: %v", err)
	}
	if err := os.RemoveAll(ref.Dir); err != nil { // as the edge does once it is back
		t.Fatal(err)
	}
	if err := WaitAgent(ctx, b, sb.Link); err != nil {
		t.Fatalf("restored in place: %v", err)
	}
	if got := sb.Sh(t, "cat /root/kept"); got != "kept\n" {
		t.Fatalf("restored in place, its file reads %q", got)
	}
	sb.counterAdvances(t, "the sandbox restored in place")
}

// snapshotOf snapshots sb into a new directory, as the edge does: its link
// detached, then attached again (and sb restored where the snapshot
// stopped it).
func snapshotOf(ctx context.Context, t *testing.T, sn backend.Snapshotter, sb *Sandbox, who string) backend.SnapshotRef {
	t.Helper()
	ref := backend.SnapshotRef{ID: sandboxid.NewSnapshot("aaaaaaaa"), Dir: filepath.Join(t.TempDir(), "snap")}
	if err := os.MkdirAll(ref.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := sb.Link.Detach(ctx); err != nil {
		t.Fatalf("detach %s: %v", who, err)
	}
	info, err := sn.Snapshot(ctx, sb.ID, ref)
	if err != nil {
		t.Fatalf("snapshot of %s: %v", who, err)
	}
	if info.SizeBytes == 0 {
		t.Fatalf("the snapshot of %s has no size", who)
	}
	if err := sb.Link.Reattach(); err != nil {
		t.Fatal(err)
	}
	if info.Stopped {
		if _, err := sn.Restore(ctx, ref, sb.Spec); err != nil {
			t.Fatalf("restore %s: %v", who, err)
		}
	}
	return ref
}

// counterAdvances waits until the loop's counter in /tmp/count moves past
// its first reading: the loop (memory state of a running process) is alive.
func (sb *Sandbox) counterAdvances(t *testing.T, who string) {
	t.Helper()
	first := ""
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		v := strings.TrimSpace(sb.Sh(t, "cat /tmp/count 2>/dev/null || true"))
		if first == "" {
			first = v
		} else if v != "" && v != first {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s: the background loop is not running (its counter stays at %q)", who, first)
}

package edge

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/fake"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

func TestSnapshotRestoreDelete(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	src, err := f.edge.Create(ctx, spec(), "root/a")
	if err != nil {
		t.Fatal(err)
	}
	snap, err := f.edge.Snapshot(ctx, src.Id, "root", "")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(snap.Id, "snap-"+string(f.edge.Node())) || snap.SourceSandboxId != src.Id || snap.Project != "root/a" {
		t.Fatalf("snapshot: %+v", snap)
	}
	if got := listSnapshots(t, f.edge, "root/a", ""); len(got) != 1 || got[0].Id != snap.Id {
		t.Fatalf("list: %v", got)
	}
	if got := listSnapshots(t, f.edge, "root/b", ""); len(got) != 0 {
		t.Fatalf("another project sees the snapshot: %v", got)
	}
	if got, err := f.edge.ListSnapshots("root/b", src.Id); !errdefs.IsNotFound(err) {
		t.Fatalf("another project's sandbox's snapshots: %v %v, want not found", got, err)
	}
	restored, err := f.edge.Restore(ctx, snap.Id, "root", "", RestoreOptions{Metadata: map[string]string{"k": "v"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if restored.Id == src.Id || restored.SourceSnapshotId != snap.Id || restored.Project != "root/a" || restored.Spec.Metadata["k"] != "v" {
		t.Fatalf("restored: %+v", restored)
	}
	if out, err := echo(t, agentClient(t, f.edge, restored.Id, "root")); err != nil || !strings.HasPrefix(out, "yes ") {
		t.Fatalf("restored sandbox does not answer: %q %v", out, err)
	}
	held, err := f.edge.snaps.Lookup(snap.Id, "root")
	if err != nil {
		t.Fatal(err)
	}
	dir := held.Dir
	if err := f.edge.DeleteSnapshot(snap.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("snapshot storage not freed: %v", err)
	}
	if _, err := f.edge.Restore(ctx, snap.Id, "root", "", RestoreOptions{}, nil); !errdefs.IsNotFound(err) {
		t.Fatalf("restore of a deleted snapshot: %v", err)
	}
}

func TestForkReportsEachCopy(t *testing.T) {
	f := newFixture(t, smallCapacity()) // 4 cores: the source and three 1-core copies fit
	ctx := context.Background()
	src, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	fo, err := f.edge.Fork(ctx, src.Id, "root", ForkRequest{Count: 4, Timeout: 0})
	if err != nil {
		t.Fatal(err)
	}
	results := fo.Results
	if len(results) != 4 || fo.SourcePaused <= 0 || fo.SourceErr != nil {
		t.Fatalf("%d results, paused %v, source error %v", len(results), fo.SourcePaused, fo.SourceErr)
	}
	var ok, exhausted int
	for _, r := range results {
		switch {
		case r.Err == nil:
			ok++
			if r.Sandbox.SourceSnapshotId == "" || r.Sandbox.Id == src.Id {
				t.Fatalf("copy: %+v", r.Sandbox)
			}
		case errors.Is(r.Err, errdefs.ErrResourceExhausted):
			exhausted++
		default:
			t.Fatalf("unexpected copy error: %v", r.Err)
		}
	}
	if ok != 3 || exhausted != 1 {
		t.Fatalf("%d copies started, %d refused for capacity; want 3 and 1", ok, exhausted)
	}
	// The fork's snapshot is gone; the source still answers.
	if len(listSnapshots(t, f.edge, "root", "")) != 0 || f.edge.snaps.Len() != 0 {
		t.Fatal("fork left its snapshot behind")
	}
	if _, err := echo(t, agentClient(t, f.edge, src.Id, "root")); err != nil {
		t.Fatalf("source after fork: %v", err)
	}
	if _, err := f.edge.Fork(ctx, src.Id, "root", ForkRequest{Count: 0, Timeout: 0}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("count 0: %v", err)
	}
	if _, err := f.edge.Fork(ctx, src.Id, "root", ForkRequest{Count: 101, Timeout: 0}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("count 101: %v", err)
	}
}

func TestForkFailureOfOneCopyLeavesNothing(t *testing.T) {
	f := newFixture(t, capacity.Node{CPUCores: 16, MemoryMB: 16384, MaxSandboxes: 20, HostCPUCores: 2, HostMemoryMB: 4096})
	ctx := context.Background()
	src, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.Knobs.FailRestoreAfter = 2
	fo, err := f.edge.Fork(ctx, src.Id, "root", ForkRequest{Count: 3, Timeout: 0})
	if err != nil {
		t.Fatal(err)
	}
	failed := 0
	for _, r := range fo.Results {
		if r.Err != nil {
			failed++
		}
	}
	if failed != 1 {
		t.Fatalf("%d copies failed, want 1", failed)
	}
	if st := f.edge.Status(); st.Allocated.Sandboxes != 3 {
		t.Fatalf("allocation %d; want the source and two copies", st.Allocated.Sandboxes)
	}
	ents, _ := os.ReadDir(f.edge.cfg.StateDir + "/sandboxes")
	if len(ents) != 3 {
		t.Fatalf("%d sandbox directories; the failed copy left one", len(ents))
	}
}

func TestSnapshotUnsupportedNamesTheReason(t *testing.T) {
	b, _ := container.New(context.Background(), backend.Config{StateDir: t.TempDir()})
	_, err := sandbox.Snapshotter(b)
	if !errors.Is(err, errdefs.ErrUnsupported) || !strings.Contains(err.Error(), `backend "container" cannot snapshot memory`) {
		t.Fatalf("container snapshot: %v", err)
	}
}

// TestCallCutBySnapshotSaysSo: a call in flight when a snapshot detaches
// the agent fails with an error that names the snapshot, not a broken agent.
func TestCallCutBySnapshotSaysSo(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	src, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	c := agentClient(t, f.edge, src.Id, "root")
	if _, err := echo(t, c); err != nil { // the agent is up
		t.Fatal(err)
	}
	done := make(chan error, 1)
	// The fake runs commands on the host: the command marks a file of this
	// test's own when it runs, so the call is known to be in flight.
	started := filepath.Join(t.TempDir(), "started")
	go func() {
		_, err := c.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", "touch " + started + "; exec sleep 5"}}}))
		done <- err
	}()
	for i := 0; ; i++ {
		if _, err := os.Stat(started); err == nil {
			break
		}
		if i == 1000 {
			t.Fatal("the long call never started")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := f.edge.Snapshot(ctx, src.Id, "root", ""); err != nil {
		t.Fatal(err)
	}
	err = <-done
	if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "snapshot or fork") {
		t.Fatalf("call cut by a snapshot: %v, want unavailable naming the snapshot", err)
	}
}

// A snapshot that stops its source (runsc kills a sandbox whose checkpoint
// failed) leaves the source failed with the reason, not silently gone; a
// stop removes it.
func TestSnapshotThatStopsTheSourceLeavesItFailed(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	src, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	f.fake.SetFailures(nil, errors.New("checkpoint: no space left"))
	if _, err := f.edge.Snapshot(ctx, src.Id, "root", ""); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("snapshot: %v", err)
	}
	got, err := f.edge.Get(src.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_FAILED || !strings.Contains(got.Message, "no space left") {
		t.Fatalf("source after the failed snapshot: %v %v", got, err)
	}
	if st := f.edge.Status(); st.Allocated.Sandboxes != 0 {
		t.Fatalf("a stopped source holds capacity: %+v", st.Allocated)
	}
	if _, err := f.edge.Destroy(ctx, src.Id, "root"); err != nil {
		t.Fatal(err)
	}
}

// A snapshot can be named: the name is checked, kept across a restart,
// and unique in its project on the node.
func TestNamedSnapshots(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	src, err := f.edge.Create(ctx, spec(), "root/a")
	if err != nil {
		t.Fatal(err)
	}
	idShaped := string(sandboxid.NewSnapshot(f.edge.Node()))
	for _, bad := range []string{"-x", idShaped, "a b", strings.Repeat("n", 129)} {
		if _, err := f.edge.Snapshot(ctx, src.Id, "root", bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("name %q: %v", bad, err)
		}
	}
	// E2B's suites name snapshots "snap-…": a name that is not an id is fine.
	if s, err := f.edge.Snapshot(ctx, src.Id, "root", "snap-nightly"); err != nil || s.Name != "snap-nightly" {
		t.Fatalf(`name "snap-nightly": %v %v`, s, err)
	}
	snap, err := f.edge.Snapshot(ctx, src.Id, "root", "my-state.v1")
	if err != nil || snap.Name != "my-state.v1" {
		t.Fatalf("named snapshot: %v %v", snap, err)
	}
	if _, err := f.edge.Snapshot(ctx, src.Id, "root", "my-state.v1"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("a second snapshot of the same name: %v", err)
	}
	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	names := map[string]bool{}
	for _, s := range listSnapshots(t, e2, "root/a", "") {
		names[s.Name] = true
	}
	if len(names) != 2 || !names["my-state.v1"] || !names["snap-nightly"] {
		t.Fatalf("after a restart: %v", names)
	}
}

func listSnapshots(t *testing.T, e *Edge, scope, sandbox string) []*sandboxv1.Snapshot {
	t.Helper()
	out, err := e.ListSnapshots(scope, sandbox)
	if err != nil {
		t.Fatalf("list snapshots of %q in %q: %v", sandbox, scope, err)
	}
	return out
}

// With no room left on the state disk, a snapshot is refused up front with
// the reason, an offload becomes a freeze that says why, and the sandbox
// runs on as it was.
func TestSnapshotAndOffloadWithoutDiskRoomAreRefused(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root/a")
	if err != nil {
		t.Fatal(err)
	}
	f.edge.disk.SetKeepFree(1 << 60) // more than any disk has
	_, err = f.edge.Snapshot(ctx, sb.Id, "root", "")
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node disk full: a snapshot of sandbox "+sb.Id) {
		t.Fatalf("snapshot on a full disk: %v, want resource exhausted naming the disk", err)
	}
	// An offload without room is a freeze, and says why.
	out, err := f.edge.PauseAt(ctx, sb.Id, "root", sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil || out.Sandbox.PauseDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE || !strings.Contains(out.Note, "node disk full: offloading sandbox "+sb.Id) {
		t.Fatalf("offload on a full disk: %+v %v, want a freeze whose note names the disk", out, err)
	}
	if _, err := f.edge.Resume(ctx, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(filepath.Join(f.dir, "edge", "snapshots")); len(ents) != 0 {
		t.Fatalf("a refused snapshot left %d entries", len(ents))
	}
	if out, err := echo(t, agentClient(t, f.edge, sb.Id, "root")); err != nil || !strings.HasPrefix(out, "yes ") {
		t.Fatalf("the sandbox does not answer after the refusals: %q %v", out, err)
	}
	f.edge.disk.SetKeepFree(0)
	if _, err := f.edge.Snapshot(ctx, sb.Id, "root", ""); err != nil {
		t.Fatalf("snapshot with room: %v", err)
	}
}

// A VM's disk (a backend with DiskFile) is admitted against the state
// disk's room like a layer: past it, a create is refused with the reason
// and nothing is left; within it, it is made.
func TestAVMsDiskIsAdmittedAgainstTheStateDisk(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.DiskFile = true
	var st unix.Statfs_t
	if err := unix.Statfs(f.dir, &st); err != nil {
		t.Fatal(err)
	}
	free := int64(st.Bavail) * st.Bsize >> 20
	big := spec()
	big.Resources.DiskMb = free + 1024
	if _, err := f.edge.Create(context.Background(), big, "root/a"); !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node disk full") {
		t.Fatalf("a %d MiB disk on %d MiB free: %v, want refused naming the disk", big.Resources.DiskMb, free, err)
	}
	small := spec()
	small.Resources.DiskMb = 64
	if _, err := f.edge.Create(context.Background(), small, "root/a"); err != nil {
		t.Fatalf("a 64 MiB disk: %v", err)
	}
}

// Two edges on one disk (the edges of one `dsec up --edges N`) count each
// other's promise through the disk ledger: what one admitted is not
// promised again by the other, the refusal says so, and what one gives
// back the other can have.
func TestEdgesSharingADiskCountEachOthersPromise(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.fake.Knobs.DiskFile = true
	ledger := filepath.Join(f.dir, "ledger")
	open := func(name string, be *fake.Backend) *Edge {
		e, err := New(context.Background(), Config{
			StateDir: filepath.Join(f.dir, name), AgentPath: filepath.Join(f.dir, "aether"), RunBase: f.runBase,
			Capacity: smallCapacity(), AgentTimeout: 5 * time.Second, DiskLedgerDir: ledger,
		}, Deps{Store: f.store, Backends: []backend.Backend{be}, Log: testutil.Logger(t)})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(e.Close)
		e.disk.SetKeepFree(0)
		return e
	}
	other, _ := fake.New(context.Background(), backend.Config{})
	other.(*fake.Backend).Knobs.DiskFile = true
	a, b := open("edge-a", f.fake), open("edge-b", other.(*fake.Backend))
	var st unix.Statfs_t
	if err := unix.Statfs(f.dir, &st); err != nil {
		t.Fatal(err)
	}
	free := int64(st.Bavail) * st.Bsize >> 20
	sized := func(mb int64) *sandboxv1.SandboxSpec {
		s := spec()
		s.Resources.DiskMb = mb
		return s
	}
	big, err := a.Create(context.Background(), sized(free*6/10), "root/a")
	if err != nil {
		t.Fatalf("%d MiB of %d free on edge a: %v", free*6/10, free, err)
	}
	_, err = b.Create(context.Background(), sized(free*6/10), "root/a")
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "to other edges' sandboxes on this disk") {
		t.Fatalf("the same again on edge b: %v, want refused naming the other edges' promise", err)
	}
	if _, err := b.Create(context.Background(), sized(free*3/10), "root/a"); err != nil {
		t.Fatalf("%d MiB on edge b beside a's %d: %v", free*3/10, free*6/10, err)
	}
	if _, err := a.Destroy(context.Background(), big.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Create(context.Background(), sized(free*6/10), "root/a"); err != nil {
		t.Fatalf("%d MiB on edge b once a's sandbox is gone: %v", free*6/10, err)
	}
}

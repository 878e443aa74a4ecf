package apiserver

import (
	"errors"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edgeclient/edgefake"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/watcher"
)

// The node placement ranks first declines (its edge has the final say):
// the create lands on the next, and the quota entry is the sandbox's.
func TestTheEdgeHasTheFinalSay(t *testing.T) {
	t.Parallel()
	roomy, small := edgefake.New("10.0.0.1:7000", usage(16)), edgefake.New("10.0.0.2:7000", usage(2))
	roomy.Decline(errdefs.ResourceExhausted("node full: its memory is promised"))
	f := newFixture(t, roomy, small)
	sb, err := f.create(ctxFor(t), "")
	if err != nil {
		t.Fatal(err)
	}
	if sb.NodeId != string(small.Node) || !small.Has(sb.Id) {
		t.Fatalf("created on %s; want the node that admitted it, %s", sb.NodeId, small.Node)
	}
	if _, node, _ := sandboxid.Parse(sb.Id); node != small.Node {
		t.Fatalf("the id %s does not name its node %s", sb.Id, small.Node)
	}
	if roomy.Creates() != 1 {
		t.Fatalf("the least loaded node was asked %d times; want once, first", roomy.Creates())
	}
	got := f.entries()
	if len(got) != 1 || got[sb.Id].Res.Sandboxes != 1 || got[sb.Id].Res.CPUCores != 1 {
		t.Fatalf("ledger %v; want the one sandbox's entry and no reservation", got)
	}
}

// When every node declines, the error names each with its reason and
// keeps the class, and the reservation is given back. A refusal that is
// not about room (a bad request) is answered at once: no other node is
// asked.
func TestEveryNodeDeclines(t *testing.T) {
	t.Parallel()
	// a is the less loaded: placement asks it first.
	a, b := edgefake.New("10.0.0.1:7000", usage(32)), edgefake.New("10.0.0.2:7000", usage(16))
	a.Decline(errdefs.RetryAfter(errdefs.ResourceExhausted("node full"), time.Second))
	b.Decline(errdefs.Unavailable("node draining"))
	f := newFixture(t, a, b)
	_, err := f.create(ctxFor(t), "")
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "node "+string(a.Node)+": node full") || !strings.Contains(err.Error(), "node "+string(b.Node)+": node draining") {
		t.Fatalf("every node declined: %v", err)
	}
	if d, ok := errdefs.RetryDelay(err); !ok || d != capacityRetryAfter {
		t.Fatalf("a create every node declined asks for no pause before it is sent again (%v %v): a burst past the fleet would fail instead of waiting", d, ok)
	}
	if got := f.entries(); len(got) != 0 {
		t.Fatalf("ledger after a failed create: %v; want empty", got)
	}

	a.Decline(errdefs.InvalidArgument("image: a layer is missing on this node"))
	b.Decline(nil)
	before := b.Creates()
	_, err = f.create(ctxFor(t), "")
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "a layer is missing") || b.Creates() != before {
		t.Fatalf("a refusal not about room: %v, and the next node was asked %d times", err, b.Creates()-before)
	}
	if _, ok := errdefs.RetryDelay(err); ok {
		t.Fatalf("a bad request is marked to be sent again: %v", err)
	}

	// A node out of disk is out of room that ending sandboxes seldom
	// give back: the refusal comes back at once, unmarked.
	a.Decline(errdefs.ResourceExhausted("node disk full: 100 MiB free, 600 asked"))
	b.Decline(errdefs.RetryAfter(errdefs.ResourceExhausted("node full"), time.Second))
	_, err = f.create(ctxFor(t), "")
	if !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("a disk refusal: %v", err)
	}
	if _, ok := errdefs.RetryDelay(err); ok {
		t.Fatalf("a create one node refused for disk is marked to be sent again: %v", err)
	}
}

// A create refused for room and sent again with its idempotency key, as
// the clients do after the pause, makes its sandbox once a node has room.
func TestACreateRefusedForRoomSucceedsWhenSentAgain(t *testing.T) {
	t.Parallel()
	e := edgefake.New("10.0.0.1:7000", usage(16))
	e.Decline(errdefs.ResourceExhausted("node full: 16 sandboxes, its limit is 16"))
	f := newFixture(t, e)
	if _, err := f.create(ctxFor(t), "burst-1"); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("create on a full node: %v", err)
	}
	e.Decline(nil)
	sb, err := f.create(ctxFor(t), "burst-1")
	if err != nil || !e.Has(sb.Id) {
		t.Fatalf("the same create once the node has room: %v", err)
	}
	if got := f.entries(); len(got) != 1 {
		t.Fatalf("ledger %v; want the one sandbox", got)
	}
}

// A create retried with its idempotency key answers the sandbox the first
// made, without a second create on any node; another key makes another.
func TestCreateReplaysItsIdempotencyKey(t *testing.T) {
	t.Parallel()
	e := edgefake.New("10.0.0.1:7000", usage(16))
	f := newFixture(t, e)
	first, err := f.create(ctxFor(t), "rollout-7-step-3")
	if err != nil {
		t.Fatal(err)
	}
	again, err := f.create(ctxFor(t), "rollout-7-step-3")
	if err != nil {
		t.Fatal(err)
	}
	if again.Id != first.Id || e.Creates() != 1 {
		t.Fatalf("retry: %s (first %s), %d creates on the node; want the same sandbox, one create", again.Id, first.Id, e.Creates())
	}
	other, err := f.create(ctxFor(t), "rollout-7-step-4")
	if err != nil || other.Id == first.Id {
		t.Fatalf("another key: %v %v", other, err)
	}
}

// A create retried after its apiserver died (its reservation's holder is
// gone) is taken over: the nodes are fenced against the old create, the
// sandbox it made is found and bound, and nothing is made twice.
func TestATakeOverFindsTheDepartedCreatesSandbox(t *testing.T) {
	t.Parallel()
	e := edgefake.New("10.0.0.1:7000", usage(16))
	f := newFixture(t, e)
	ctx := ctxFor(t)
	rsv, err := f.iam.Reserve(ctx, "root", fsm.Resources{Sandboxes: 1, CPUCores: 1, MemoryMB: 256}, "rollout-9")
	if err != nil {
		t.Fatal(err)
	}
	made := &sandboxv1.Sandbox{Id: string(sandboxid.New(e.Node)), Project: "root", NodeId: string(e.Node), State: sandboxv1.SandboxState_SANDBOX_STATE_RUNNING,
		Spec: &sandboxv1.SandboxSpec{Backend: "fake", Image: "root/tiny:1", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}}, CreatedAt: timestamppb.Now()}
	e.Put(made, rsv)
	// The replica that held the reservation restarts: the holder is gone.
	f.iam.Close()
	f.openIAM(t)
	f.newServer(t)

	got, err := f.create(ctx, "rollout-9")
	if err != nil {
		t.Fatal(err)
	}
	if got.Id != made.Id || e.Creates() != 0 {
		t.Fatalf("take-over answered %s (the departed create made %s) after %d creates; want its sandbox, none made", got.Id, made.Id, e.Creates())
	}
	entries := f.entries()
	if _, ok := entries[made.Id]; !ok || len(entries) != 1 {
		t.Fatalf("ledger %v; want the sandbox bound in the reservation's place", entries)
	}
}

// The reconciler releases the entry of a sandbox its node no longer
// lists, counts a running sandbox that has none, and keeps the entries of
// a node that does not answer (its sandboxes may run).
func TestReconcileQuota(t *testing.T) {
	t.Parallel()
	a, down := edgefake.New("10.0.0.1:7000", usage(16)), edgefake.New("10.0.0.2:7000", usage(16))
	f := newFixture(t, a, down)
	f.view.v.Store(watcher.NewView([]*watcher.NodeView{a.NodeView(true), down.NodeView(false)}))
	ctx := ctxFor(t)
	long := time.Now().Add(-time.Minute)
	res := fsm.Resources{Sandboxes: 1, CPUCores: 1, MemoryMB: 256}
	vanished, onDown := string(sandboxid.New(a.Node)), string(sandboxid.New(down.Node))
	if err := f.iam.Adopt(ctx, []fsm.Entry{{ID: vanished, Project: "root", Res: res, At: long}, {ID: onDown, Project: "root", Res: res, At: long}}); err != nil {
		t.Fatal(err)
	}
	uncounted := &sandboxv1.Sandbox{Id: string(sandboxid.New(a.Node)), Project: "root/team", NodeId: string(a.Node), State: sandboxv1.SandboxState_SANDBOX_STATE_RUNNING,
		Spec: &sandboxv1.SandboxSpec{Resources: &sandboxv1.Resources{CpuCores: 2, MemoryMb: 512}}, CreatedAt: timestamppb.New(long)}
	a.Put(uncounted, "")

	f.s.reconcileQuota(ctx)
	got := f.entries()
	if _, ok := got[vanished]; ok {
		t.Errorf("the entry of a sandbox its node no longer lists was kept")
	}
	if _, ok := got[onDown]; !ok {
		t.Errorf("the entry of a sandbox on a node that does not answer was released")
	}
	if e, ok := got[uncounted.Id]; !ok || e.Project != "root/team" || e.Res.CPUCores != 2 || e.Res.MemoryMB != 512 {
		t.Errorf("a running sandbox without an entry: %+v (counted %v); want it counted at its size", e, ok)
	}
}

// A fork larger than the source's node can hold runs its first copies
// there and the rest on another node, which pulls the snapshot straight
// from the source's edge with the export's token; the export is released
// after, and every copy is counted once.
func TestForkAcrossNodes(t *testing.T) {
	t.Parallel()
	holder, other := edgefake.New("10.0.0.1:7000", usage(3)), edgefake.New("10.0.0.2:7000", usage(16))
	f := newFixture(t, holder, other)
	ctx := ctxFor(t)
	src := &sandboxv1.Sandbox{Id: string(sandboxid.New(holder.Node)), Project: "root", NodeId: string(holder.Node), State: sandboxv1.SandboxState_SANDBOX_STATE_RUNNING,
		Spec: &sandboxv1.SandboxSpec{Backend: "fake", Image: "root/tiny:1", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}}, CreatedAt: timestamppb.Now()}
	holder.Put(src, "")
	f.view.v.Store(edgefake.View(holder, other)) // the source counted on its node

	resp, err := (&sandboxService{f.s}).ForkSandbox(asRoot(ctx), connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.Id, Count: 5}))
	if err != nil {
		t.Fatal(err)
	}
	on := map[string]int{}
	for _, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			t.Fatalf("a copy failed: %s %s", r.ErrorCode, r.ErrorMessage)
		}
		on[r.Sandbox.NodeId]++
	}
	if on[string(holder.Node)] != 2 || on[string(other.Node)] != 3 {
		t.Fatalf("copies per node %v; want 2 beside the source (its room) and 3 on the other", on)
	}
	pulls := other.Pulls()
	if len(pulls) != 3 || !strings.HasPrefix(pulls[0], holder.Addr+" token-") {
		t.Fatalf("the other node's restores pulled from %v; want the source's edge, with the export's token", pulls)
	}
	if live := holder.Exporting(); len(live) != 0 {
		t.Fatalf("exports left open: %v", live)
	}
	entries := f.entries()
	for _, r := range resp.Msg.Results {
		if _, ok := entries[r.Sandbox.Id]; !ok {
			t.Errorf("copy %s is not counted", r.Sandbox.Id)
		}
	}
	if len(entries) != 5 {
		t.Errorf("ledger %v; want the 5 copies and no reservation", entries)
	}
	if got := valueOf(t, f.s.placeStats.copies.WithLabelValues("fork", "ok")); got != 5 {
		t.Errorf("fork copies counted ok: %v, want 5", got)
	}
}

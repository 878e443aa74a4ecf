package apiserver

import (
	"context"
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/edgeclient/edgefake"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/iam/fsm"
)

// setPool is `dsec pool set root/tiny:1 --backend fake --memory MB --size N`.
func (f *fixture) setPool(t *testing.T, ctx context.Context, memory int64, size int32) *imagev1.SetPoolResponse {
	t.Helper()
	resp, err := (&imageService{f.s}).SetPool(asRoot(ctx), connect.NewRequest(&imagev1.SetPoolRequest{Name: "root/tiny:1", Backend: "fake", CpuCores: 1, MemoryMb: memory, Size: size}))
	if err != nil {
		t.Fatalf("set a pool of %d MiB, size %d: %v", memory, size, err)
	}
	return resp.Msg
}

// sizes are an edge's pools' sizes by memory.
func sizes(e *edgefake.Edge) map[int64]int32 {
	out := map[int64]int32{}
	for _, p := range e.Pools() {
		out[p.MemoryMb] = p.Size
	}
	return out
}

func TestPoolsReachNodesThatJoinLaterOrMissedTheCall(t *testing.T) {
	a, b := edgefake.New("10.0.0.1:7000", usage(16)), edgefake.New("10.0.0.2:7000", usage(16))
	f := newFixture(t, a, b)
	ctx := ctxFor(t)
	f.view.v.Store(edgefake.View(a)) // b has not joined yet
	f.setPool(t, ctx, 256, 2)
	if got := sizes(a); got[256] != 2 || len(sizes(b)) != 0 {
		t.Fatalf("after the call: a has %v, b %v; want the pool on a only", got, sizes(b))
	}

	// b joins. A fresh setting is left to its call for poolSettle.
	f.view.v.Store(edgefake.View(a, b))
	now := time.Now()
	f.s.syncPools(ctx, now)
	if len(sizes(b)) != 0 {
		t.Fatalf("a setting younger than %v was pushed: %v", f.s.poolSettle(), sizes(b))
	}
	f.s.syncPools(ctx, now.Add(f.s.poolSettle()+time.Second))
	if got := sizes(b); got[256] != 2 {
		t.Fatalf("b after a pass: %v, want the pool of size 2", got)
	}
	// A pass over nodes that hold the setting asks nothing of them.
	before := a.PoolSets() + b.PoolSets()
	f.s.syncPools(ctx, now.Add(f.s.poolSettle()+2*time.Second))
	if after := a.PoolSets() + b.PoolSets(); after != before {
		t.Fatalf("a pass over nodes in step made %d SetPool calls", after-before)
	}

	// b loses its state directory: the next pass gives the pool back.
	b.LosePools()
	f.s.syncPools(ctx, now.Add(f.s.poolSettle()+3*time.Second))
	if got := sizes(b); got[256] != 2 {
		t.Fatalf("b after losing its pools and a pass: %v", got)
	}

	// The pool is removed while b is away; b drops it when it is back.
	f.view.v.Store(edgefake.View(a))
	f.setPool(t, ctx, 256, 0)
	f.view.v.Store(edgefake.View(a, b))
	f.s.syncPools(ctx, time.Now().Add(f.s.poolSettle()+time.Second))
	if len(sizes(a)) != 0 || len(sizes(b)) != 0 {
		t.Fatalf("after a removal b missed and a pass: a %v, b %v", sizes(a), sizes(b))
	}

	// A node that refuses a setting is asked again each pass, and takes
	// it once it can.
	b.RefusePools(errdefs.Unavailable("the node's pools are being drained"))
	f.view.v.Store(edgefake.View(a))
	f.setPool(t, ctx, 512, 1)
	f.view.v.Store(edgefake.View(a, b))
	later := time.Now().Add(f.s.poolSettle() + time.Second)
	asked := b.PoolSets()
	f.s.syncPools(ctx, later)
	f.s.syncPools(ctx, later)
	if n := b.PoolSets() - asked; len(sizes(b)) != 0 || n != 2 {
		t.Fatalf("a refusing node: pools %v after %d calls in two passes, want 2", sizes(b), n)
	}
	b.RefusePools(nil)
	f.s.syncPools(ctx, later)
	if got := sizes(b); got[512] != 1 {
		t.Fatalf("b once it takes pools again: %v", got)
	}
}

func TestKeptPoolsAreListedAndSurviveRestarts(t *testing.T) {
	a := edgefake.New("10.0.0.1:7000", usage(16))
	f := newFixture(t, a)
	ctx := ctxFor(t)
	f.setPool(t, ctx, 256, 2)
	f.setPool(t, ctx, 512, 1)
	f.setPool(t, ctx, 512, 0)
	list := func() *imagev1.ListPoolsResponse {
		t.Helper()
		resp, err := (&imageService{f.s}).ListPools(asRoot(ctx), connect.NewRequest(&imagev1.ListPoolsRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Msg
	}
	check := func(when string) {
		t.Helper()
		got := list()
		if len(got.Cluster) != 1 || got.Cluster[0].MemoryMb != 256 || got.Cluster[0].Size != 2 || got.Cluster[0].Source != "cluster" || got.Cluster[0].Project != "root" {
			t.Fatalf("%s: the cluster's pools %v, want the 256 MiB pool of 2 only (the 512 MiB one is removed)", when, got.Cluster)
		}
	}
	check("listed")
	// An apiserver and its IAM replica restart: the setting is still kept.
	f.iam.Close()
	f.openIAM(t)
	f.newServer(t)
	check("after a restart")
	// A node that lost its pools meanwhile takes the kept one back.
	a.LosePools()
	f.s.syncPools(context.Background(), time.Now().Add(f.s.poolSettle()+time.Second))
	if got := sizes(a); got[256] != 2 || len(got) != 1 {
		t.Fatalf("a after the restart and a pass: %v", got)
	}
}

func TestPoolSettingsOnlyFromRootAdmins(t *testing.T) {
	a := edgefake.New("10.0.0.1:7000", usage(16))
	f := newFixture(t, a)
	ctx := ctxFor(t)
	team := withPrincipal(ctx, iam.Principal{KeyID: "key-team", Project: "root/team", Role: fsm.RoleAdmin})
	_, err := (&imageService{f.s}).SetPool(team, connect.NewRequest(&imagev1.SetPoolRequest{Name: "root/tiny:1", Backend: "fake", Size: 1}))
	if !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("a sub-project's admin set a pool: %v", err)
	}
	if len(f.iam.State().Pools()) != 0 || a.PoolSets() != 0 {
		t.Fatalf("a refused call kept %v or reached the node (%d calls)", f.iam.State().Pools(), a.PoolSets())
	}
	// Bad input is refused before anything is kept.
	for _, req := range []*imagev1.SetPoolRequest{
		{Name: "root/tiny:1", Backend: "fake", Size: -1},
		{Name: "root/no-such:1", Backend: "fake", Size: 1},
		{Name: "root/tiny:1", Backend: "no-such", Size: 1},
	} {
		if _, err := (&imageService{f.s}).SetPool(asRoot(ctx), connect.NewRequest(req)); err == nil {
			t.Fatalf("%v: taken", req)
		}
	}
	if len(f.iam.State().Pools()) != 0 || a.PoolSets() != 0 {
		t.Fatalf("refused calls kept %v or reached the node (%d calls)", f.iam.State().Pools(), a.PoolSets())
	}
}

// An apiserver whose replica lags pushes the setting it holds; the node,
// which holds a newer one, ignores it, and the apiserver does not push it
// again until its setting changes.
func TestAnOlderPoolSizeIsNotPushedOverANewerOne(t *testing.T) {
	a := edgefake.New("10.0.0.1:7000", usage(16))
	f := newFixture(t, a)
	ctx := ctxFor(t)
	f.setPool(t, ctx, 256, 2)
	stale := f.iam.State().Pools()[0]
	f.setPool(t, ctx, 256, 5)
	if got := sizes(a); got[256] != 5 {
		t.Fatalf("after the second call: %v", got)
	}
	now := time.Now().Add(f.s.poolSettle() + time.Second)
	node := f.view.View().Nodes[0]
	f.s.syncPoolsOn(ctx, node, []fsm.PoolSetting{stale}, now)
	if got := sizes(a); got[256] != 5 {
		t.Fatalf("a lagging view's older size reached the node: %v", got)
	}
	asked := a.PoolSets()
	f.s.syncPoolsOn(ctx, node, []fsm.PoolSetting{stale}, now)
	if a.PoolSets() != asked {
		t.Fatal("the setting the node ignored was pushed again")
	}
	// The replica's own state, now current, agrees with the node.
	f.s.syncPools(ctx, now)
	if a.PoolSets() != asked || sizes(a)[256] != 5 {
		t.Fatalf("a pass in step: %d calls, pools %v", a.PoolSets()-asked, sizes(a))
	}
}

// A removal names a kept pool by what it gives: without the shape's
// fields, or with the pool's backend gone from every node, it still
// removes the one pool that matches, and asks for the shape when several
// do.
func TestARemovalFindsTheKeptPoolByWhatItGives(t *testing.T) {
	a := edgefake.New("10.0.0.1:7000", usage(16))
	other := edgefake.New("10.0.0.2:7000", usage(16), "other")
	f := newFixture(t, a, other)
	f.view.v.Store(edgefake.View(a))
	ctx := ctxFor(t)
	// Shapes other than a create's default, which a removal without a
	// shape normalises to.
	f.setPool(t, ctx, 300, 2)
	f.setPool(t, ctx, 400, 1)
	remove := func(req *imagev1.SetPoolRequest) error {
		_, err := (&imageService{f.s}).SetPool(asRoot(ctx), connect.NewRequest(req))
		return err
	}
	if err := remove(&imagev1.SetPoolRequest{Name: "root/tiny:1", Backend: "fake"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("a removal that matches two kept pools: %v, want a request for the shape", err)
	}
	if err := remove(&imagev1.SetPoolRequest{Name: "root/tiny:1", Backend: "fake", MemoryMb: 400}); err != nil {
		t.Fatal(err)
	}
	// Only a node without the pool's backend is left in the view.
	f.view.v.Store(edgefake.View(other))
	if err := remove(&imagev1.SetPoolRequest{Name: "root/tiny:1", Backend: "fake"}); err != nil {
		t.Fatalf("removing the last pool of a backend no node has now: %v", err)
	}
	for _, st := range f.iam.State().Pools() {
		if st.Size != 0 {
			t.Fatalf("a pool is still kept after both removals: %+v", st)
		}
	}
}

package edgefake

import (
	"context"
	"fmt"
	"sort"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
)

// SetPool keeps (size 0: removes) a pool set through the API, as a real
// edge lists it: source "api", every sandbox ready; a setting older than
// the one held (SetPoolRequest.Generation) is ignored.
func (e *Edge) SetPool(ctx context.Context, req *connect.Request[edgev1.SetPoolRequest]) (*connect.Response[edgev1.SetPoolResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.poolSets++
	if e.poolRefusal != nil {
		return nil, e.poolRefusal
	}
	spec, r := req.Msg.Spec, req.Msg.Spec.GetResources()
	p := &imagev1.Pool{Image: spec.GetImage(), Project: req.Msg.Project, Backend: spec.GetBackend(), CpuCores: r.GetCpuCores(), MemoryMb: r.GetMemoryMb(), DiskMb: r.GetDiskMb(),
		Pids: r.GetPids(), OpenFiles: r.GetOpenFiles(), Network: spec.GetNetwork() != nil, Size: req.Msg.Size, Ready: req.Msg.Size, Source: "api"}
	id := fmt.Sprint(p.Project, p.Image, p.Backend, p.CpuCores, p.MemoryMb, p.DiskMb, p.Pids, p.OpenFiles, p.Network)
	if e.pools == nil {
		e.pools, e.poolGen = map[string]*imagev1.Pool{}, map[string]int64{}
	}
	if g := req.Msg.Generation; g != 0 && e.poolGen[id] > g {
		// Older than the setting held, as a real edge ignores it.
		return connect.NewResponse(&edgev1.SetPoolResponse{Pools: e.poolsLocked()}), nil
	}
	e.poolGen[id] = req.Msg.Generation
	if p.Size == 0 {
		delete(e.pools, id)
	} else {
		e.pools[id] = p
	}
	return connect.NewResponse(&edgev1.SetPoolResponse{Pools: e.poolsLocked()}), nil
}

// ListPools lists the pools set through SetPool.
func (e *Edge) ListPools(ctx context.Context, req *connect.Request[edgev1.ListPoolsRequest]) (*connect.Response[edgev1.ListPoolsResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return connect.NewResponse(&edgev1.ListPoolsResponse{Pools: e.poolsLocked()}), nil
}

// Pools are the pools the edge keeps, by image.
func (e *Edge) Pools() []*imagev1.Pool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.poolsLocked()
}

// PoolSets is how many SetPool calls the edge was asked, taken or not.
func (e *Edge) PoolSets() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.poolSets
}

// RefusePools makes every SetPool fail with err (nil: take them again).
func (e *Edge) RefusePools(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.poolRefusal = err
}

// LosePools forgets every pool, as a node that lost its state directory.
func (e *Edge) LosePools() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.pools, e.poolGen = nil, nil
}

func (e *Edge) poolsLocked() []*imagev1.Pool {
	out := make([]*imagev1.Pool, 0, len(e.pools))
	for _, p := range e.pools {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool {
		return out[i].Image < out[j].Image || out[i].Image == out[j].Image && out[i].MemoryMb < out[j].MemoryMb
	})
	return out
}

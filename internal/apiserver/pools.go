package apiserver

import (
	"context"
	"sort"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/edge/v1/edgev1connect"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// SetPool sets a warm pool on every node, and keeps it in IAM for nodes
// that do not answer now or join later. An operator's call (root admin
// keys): a pool's sandboxes run on every node and no quota counts them.
func (h *imageService) SetPool(ctx context.Context, req *connect.Request[imagev1.SetPoolRequest]) (*connect.Response[imagev1.SetPoolResponse], error) {
	p := principalFrom(ctx)
	if err := admin(p, project.Root); err != nil {
		return nil, err
	}
	m := req.Msg
	if m.Size < 0 || m.Size > sandboxspec.MaxPoolSize {
		return nil, errdefs.InvalidArgument("size %d: want 0 (remove the pool) to %d sandboxes per node", m.Size, sandboxspec.MaxPoolSize)
	}
	spec := &sandboxv1.SandboxSpec{Backend: m.Backend, Image: m.Name, Resources: &sandboxv1.Resources{CpuCores: m.CpuCores, MemoryMb: m.MemoryMb, DiskMb: m.DiskMb, Pids: m.Pids, OpenFiles: m.OpenFiles}}
	if m.Network {
		spec.Network = &sandboxv1.NetworkPolicy{} // nothing out until a claim
	}
	lim, backends := h.s.limits()
	nerr := sandboxspec.Normalize(spec, lim, backends)
	if m.Size == 0 {
		// A removal names a kept pool by what it gives: its shape's
		// defaults, or a backend and node gone since, must not keep it.
		if kept, err := h.s.keptPoolNamed(p.Project, m, spec, nerr); err != nil {
			return nil, err
		} else if kept != nil {
			spec, nerr = kept, nil
		}
	}
	if nerr != nil {
		return nil, nerr
	}
	if m.Size > 0 { // a pool is removed also when its image is gone
		if err := h.s.checkImage(spec.Image, p.Project); err != nil {
			return nil, err
		}
	}
	// Kept first, then pushed: a node that misses the push (away, or
	// joining later) takes it from the reconciler (poolsync.go).
	generation, err := h.s.keepPool(ctx, p.Project, spec, m.Size)
	if err != nil {
		return nil, err
	}
	nodes := h.s.poolsOnEveryEdge(func(edge edgev1connect.EdgeServiceClient) ([]*imagev1.Pool, error) {
		resp, err := edge.SetPool(ctx, connect.NewRequest(&edgev1.SetPoolRequest{Spec: proto.Clone(spec).(*sandboxv1.SandboxSpec), Project: p.Project, Size: m.Size, Generation: generation}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.Pools, nil
	})
	h.s.log.Info("pool set", "image", spec.Image, "backend", spec.Backend, "size", m.Size, "nodes", len(nodes))
	return connect.NewResponse(&imagev1.SetPoolResponse{Nodes: nodes}), nil
}

// ListPools is every node's warm pools (root admin keys).
func (h *imageService) ListPools(ctx context.Context, _ *connect.Request[imagev1.ListPoolsRequest]) (*connect.Response[imagev1.ListPoolsResponse], error) {
	if err := admin(principalFrom(ctx), project.Root); err != nil {
		return nil, err
	}
	nodes := h.s.poolsOnEveryEdge(func(edge edgev1connect.EdgeServiceClient) ([]*imagev1.Pool, error) {
		resp, err := edge.ListPools(ctx, connect.NewRequest(&edgev1.ListPoolsRequest{}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.Pools, nil
	})
	return connect.NewResponse(&imagev1.ListPoolsResponse{Nodes: nodes, Cluster: h.s.clusterPools()}), nil
}

// poolsOnEveryEdge makes call on every node at once and answers each
// node's pools or its error, by node.
func (s *Server) poolsOnEveryEdge(call func(edgev1connect.EdgeServiceClient) ([]*imagev1.Pool, error)) []*imagev1.NodePools {
	var (
		mu  sync.Mutex
		out []*imagev1.NodePools
	)
	s.onEveryEdge(func(node string, edge edgev1connect.EdgeServiceClient) {
		pools, err := call(edge)
		np := &imagev1.NodePools{Node: node, Pools: pools}
		if err != nil {
			np.Error = errdefs.Clip(err.Error(), 300)
		}
		mu.Lock()
		out = append(out, np)
		mu.Unlock()
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Node < out[j].Node })
	return out
}

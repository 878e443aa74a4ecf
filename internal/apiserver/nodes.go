package apiserver

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/project"
)

// ListNodes shows the edges as the watcher last saw them (dsec nodes).
func (h *sandboxService) ListNodes(ctx context.Context, _ *connect.Request[sandboxv1.ListNodesRequest]) (*connect.Response[sandboxv1.ListNodesResponse], error) {
	if err := admin(principalFrom(ctx), project.Root); err != nil {
		return nil, err
	}
	out := &sandboxv1.ListNodesResponse{}
	for _, n := range h.s.watcher.View().Nodes {
		node := &sandboxv1.Node{Id: n.ID, Address: n.Addr, Healthy: n.Healthy, Error: n.Err, Backends: map[string]string{}, BackendDetails: map[string]string{}}
		if !n.PolledAt.IsZero() {
			node.PolledAt = timestamppb.New(n.PolledAt)
		}
		if st := n.Status; st != nil {
			node.Capacity, node.Allocated = amount(st.Capacity), amount(st.Allocated)
			node.Cgroup, node.Version = st.Cgroup, st.Version
			for _, b := range st.Backends {
				node.Backends[b.Name] = b.UnavailableReason
				if b.Detail != "" {
					node.BackendDetails[b.Name] = b.Detail
				}
			}
		}
		out.Nodes = append(out.Nodes, node)
	}
	return connect.NewResponse(out), nil
}

func amount(u *edgev1.Usage) *sandboxv1.NodeAmount {
	if u == nil {
		return nil
	}
	return &sandboxv1.NodeAmount{Sandboxes: u.Sandboxes, CpuCores: u.CpuCores, MemoryMb: u.MemoryMb}
}

package apiserver

import (
	"context"
	"sort"
	"sync"
	"time"

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

// WarmImage asks every node at once to prepare for the first sandbox of
// an image and shape. It is an operator's call (root admin keys): each
// shape warmed costs every node a guest's boot and its snapshot on disk,
// which no quota counts.
func (h *imageService) WarmImage(ctx context.Context, req *connect.Request[imagev1.WarmImageRequest]) (*connect.Response[imagev1.WarmImageResponse], error) {
	p := principalFrom(ctx)
	if err := admin(p, project.Root); err != nil {
		return nil, err
	}
	m := req.Msg
	spec := &sandboxv1.SandboxSpec{Backend: m.Backend, Image: m.Name, Resources: &sandboxv1.Resources{CpuCores: m.CpuCores, MemoryMb: m.MemoryMb, DiskMb: m.DiskMb}}
	if m.Network {
		spec.Network = &sandboxv1.NetworkPolicy{}
	}
	lim, backends := h.s.limits()
	if err := sandboxspec.Normalize(spec, lim, backends); err != nil {
		return nil, err
	}
	if err := h.s.checkImage(spec.Image, p.Project); err != nil {
		return nil, err
	}
	var (
		mu  sync.Mutex
		out = &imagev1.WarmImageResponse{}
	)
	h.s.onEveryEdge(func(node string, edge edgev1connect.EdgeServiceClient) {
		began := time.Now()
		resp, err := edge.WarmImage(ctx, connect.NewRequest(&edgev1.WarmImageRequest{Spec: proto.Clone(spec).(*sandboxv1.SandboxSpec), Project: p.Project}))
		w := &imagev1.NodeWarmth{Node: node, TookMs: time.Since(began).Milliseconds()}
		if err != nil {
			w.Error = errdefs.Clip(err.Error(), 300)
		} else {
			w.Prepared, w.Note = resp.Msg.Prepared, resp.Msg.Note
		}
		mu.Lock()
		out.Nodes = append(out.Nodes, w)
		mu.Unlock()
	})
	sort.Slice(out.Nodes, func(i, j int) bool { return out.Nodes[i].Node < out.Nodes[j].Node })
	h.s.log.Info("image warmed", "image", spec.Image, "backend", spec.Backend, "nodes", len(out.Nodes))
	return connect.NewResponse(out), nil
}

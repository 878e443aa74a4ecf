package apiserver

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/placement"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// maxForkCount bounds one fork call.
const maxForkCount = 100

func (s *Server) snapshotEdge(id string) (*edgeclient.Conn, error) {
	_, node, err := sandboxid.ParseSnapshot(id)
	if err != nil {
		return nil, err
	}
	return s.edgeFor(node)
}

// reserve holds the quota for n sandboxes of r in project (the ledger in
// IAM) and counts them in flight on node until the edge reports them;
// done binds the reservation to the sandboxes made, or releases it.
func (s *Server) reserve(ctx context.Context, node, project string, r *sandboxv1.Resources, n int64) (done func(made []string, stamp *edgev1.UsageStamp), err error) {
	need := placement.Resources{Sandboxes: n, CPUCores: r.GetCpuCores() * float64(n), MemoryMB: r.GetMemoryMb() * n}
	rsv, err := s.holdQuota(ctx, project, need, "")
	if err != nil {
		return nil, err
	}
	id := s.inflight.add(node, project, need)
	return func(made []string, stamp *edgev1.UsageStamp) {
		s.inflight.finish(id, len(made) > 0, stamp)
		s.settleQuota(rsv, made)
	}, nil
}

func (h *sandboxService) SnapshotSandbox(ctx context.Context, req *connect.Request[sandboxv1.SnapshotSandboxRequest]) (*connect.Response[sandboxv1.SnapshotSandboxResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.SnapshotSandbox(ctx, connect.NewRequest(&edgev1.SnapshotSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project, Name: req.Msg.Name}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.SnapshotSandboxResponse{Snapshot: resp.Msg.Snapshot}), nil
}

func (h *sandboxService) RestoreSnapshot(ctx context.Context, req *connect.Request[sandboxv1.RestoreSnapshotRequest]) (*connect.Response[sandboxv1.RestoreSnapshotResponse], error) {
	m := req.Msg
	scope := principalFrom(ctx).Project
	c, err := h.s.snapshotEdge(m.SnapshotId)
	if err != nil {
		return nil, err
	}
	list, err := c.Edge.ListSnapshots(ctx, connect.NewRequest(&edgev1.ListSnapshotsRequest{Scope: scope}))
	if err != nil {
		return nil, err
	}
	var snap *sandboxv1.Snapshot
	for _, sn := range list.Msg.Snapshots {
		if sn.Id == m.SnapshotId {
			snap = sn
		}
	}
	if snap == nil {
		return nil, errdefs.NotFound("snapshot %s: no such snapshot", m.SnapshotId)
	}
	done, err := h.s.reserve(ctx, snap.NodeId, snap.Project, snap.Spec.GetResources(), 1)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.RestoreSnapshot(ctx, connect.NewRequest(&edgev1.RestoreSnapshotRequest{
		SnapshotId: m.SnapshotId, Scope: scope, TimeoutSeconds: m.TimeoutSeconds, Metadata: m.Metadata,
	}))
	if err != nil {
		done(nil, nil)
		return nil, err
	}
	done([]string{resp.Msg.Sandbox.GetId()}, resp.Msg.Usage)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.RestoreSnapshotResponse{Sandbox: resp.Msg.Sandbox}), nil
}

func (h *sandboxService) ForkSandbox(ctx context.Context, req *connect.Request[sandboxv1.ForkSandboxRequest]) (*connect.Response[sandboxv1.ForkSandboxResponse], error) {
	m := req.Msg
	if m.Count < 1 || m.Count > maxForkCount {
		return nil, errdefs.InvalidArgument("count %d: want 1 to %d", m.Count, maxForkCount)
	}
	scope := principalFrom(ctx).Project
	c, err := h.s.sandboxEdge(m.SandboxId)
	if err != nil {
		return nil, err
	}
	src, err := c.Edge.GetSandbox(ctx, connect.NewRequest(&edgev1.GetSandboxRequest{SandboxId: m.SandboxId, Scope: scope}))
	if err != nil {
		return nil, err
	}
	sb := src.Msg.Sandbox
	done, err := h.s.reserve(ctx, sb.NodeId, sb.Project, sb.Spec.GetResources(), int64(m.Count))
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.ForkSandbox(ctx, connect.NewRequest(&edgev1.ForkSandboxRequest{
		SandboxId: m.SandboxId, Scope: scope, Count: m.Count, TimeoutSeconds: m.TimeoutSeconds, Metadata: m.Metadata,
	}))
	if err != nil {
		done(nil, nil)
		return nil, err
	}
	var made []string
	for _, r := range resp.Msg.Results {
		if r.Sandbox != nil {
			made = append(made, r.Sandbox.Id)
		}
	}
	done(made, resp.Msg.Usage)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.ForkSandboxResponse{Results: resp.Msg.Results, SourcePauseUs: resp.Msg.SourcePauseUs, SourceError: resp.Msg.SourceError}), nil
}

func (h *sandboxService) ListSnapshots(ctx context.Context, req *connect.Request[sandboxv1.ListSnapshotsRequest]) (*connect.Response[sandboxv1.ListSnapshotsResponse], error) {
	scope := principalFrom(ctx).Project
	var conns []*edgeclient.Conn
	if req.Msg.SandboxId != "" {
		c, err := h.s.sandboxEdge(req.Msg.SandboxId)
		if err != nil {
			return nil, err
		}
		conns = append(conns, c)
	} else {
		for _, n := range h.s.watcher.View().Healthy() {
			conns = append(conns, h.s.edges.Get(n.Addr))
		}
	}
	var (
		mu   sync.Mutex
		wg   sync.WaitGroup
		out  []*sandboxv1.Snapshot
		errs []error
	)
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := c.Edge.ListSnapshots(ctx, connect.NewRequest(&edgev1.ListSnapshotsRequest{Scope: scope, SandboxId: req.Msg.SandboxId}))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, fmt.Errorf("edge %s: %w", c.Addr, err))
				return
			}
			out = append(out, resp.Msg.Snapshots...)
		}()
	}
	wg.Wait()
	if len(errs) > 0 && len(errs) == len(conns) {
		return nil, errdefs.Unavailable("list snapshots: %v", errors.Join(errs...))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.AsTime().Before(out[j].CreatedAt.AsTime()) })
	return connect.NewResponse(&sandboxv1.ListSnapshotsResponse{Snapshots: out}), nil
}

func (h *sandboxService) DeleteSnapshot(ctx context.Context, req *connect.Request[sandboxv1.DeleteSnapshotRequest]) (*connect.Response[sandboxv1.DeleteSnapshotResponse], error) {
	c, err := h.s.snapshotEdge(req.Msg.SnapshotId)
	if err != nil {
		return nil, err
	}
	if _, err := c.Edge.DeleteSnapshot(ctx, connect.NewRequest(&edgev1.DeleteSnapshotRequest{SnapshotId: req.Msg.SnapshotId, Scope: principalFrom(ctx).Project})); err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.DeleteSnapshotResponse{}), nil
}

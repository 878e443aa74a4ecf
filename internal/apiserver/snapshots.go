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
	"github.com/opendsec/opendsec/internal/sandboxid"
)

func (s *Server) snapshotEdge(id string) (*edgeclient.Conn, error) {
	_, node, err := sandboxid.ParseSnapshot(id)
	if err != nil {
		return nil, err
	}
	return s.edgeFor(node)
}

func (h *sandboxService) SnapshotSandbox(ctx context.Context, req *connect.Request[sandboxv1.SnapshotSandboxRequest]) (*connect.Response[sandboxv1.SnapshotSandboxResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	scope := principalFrom(ctx).Project
	sb, err := c.Edge.GetSandbox(ctx, connect.NewRequest(&edgev1.GetSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: scope}))
	if err != nil {
		return nil, err
	}
	budget, err := h.s.storageBudgetFor(ctx, sb.Msg.Sandbox.Project)
	if err != nil {
		return nil, err
	}
	defer budget.done()
	if err := budget.take(1); err != nil {
		return nil, err
	}
	resp, err := c.Edge.SnapshotSandbox(ctx, connect.NewRequest(&edgev1.SnapshotSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: scope, Name: req.Msg.Name}))
	if err != nil {
		return nil, err
	}
	if snap := resp.Msg.Snapshot; budget.limited() {
		// Its size is known only once written: past the room, it goes.
		if over := budget.take(snap.SizeBytes); over != nil {
			if _, err := c.Edge.DeleteSnapshot(ctx, connect.NewRequest(&edgev1.DeleteSnapshotRequest{SnapshotId: snap.Id, Scope: scope})); err != nil {
				return nil, fmt.Errorf("%w; removing the snapshot again failed: %v", over, err)
			}
			return nil, over
		}
	}
	return connect.NewResponse(&sandboxv1.SnapshotSandboxResponse{Snapshot: resp.Msg.Snapshot}), nil
}

func (h *sandboxService) ListSnapshots(ctx context.Context, req *connect.Request[sandboxv1.ListSnapshotsRequest]) (*connect.Response[sandboxv1.ListSnapshotsResponse], error) {
	scope := principalFrom(ctx).Project
	if req.Msg.SandboxId != "" {
		// One sandbox's snapshots are on its edge, whose answer (not found,
		// for another project's sandbox) is the call's.
		c, err := h.s.sandboxEdge(req.Msg.SandboxId)
		if err != nil {
			return nil, err
		}
		resp, err := c.Edge.ListSnapshots(ctx, connect.NewRequest(&edgev1.ListSnapshotsRequest{Scope: scope, SandboxId: req.Msg.SandboxId}))
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&sandboxv1.ListSnapshotsResponse{Snapshots: resp.Msg.Snapshots}), nil
	}
	out, err := h.s.snapshotsIn(ctx, scope, false)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.ListSnapshotsResponse{Snapshots: out}), nil
}

// snapshotsIn lists the snapshots of scope's subtree on every healthy
// edge, oldest first; it fails only if no edge answers. Strict, it asks
// every edge the watcher knows and fails unless all answer (a count for a
// quota must not miss an edge's).
func (s *Server) snapshotsIn(ctx context.Context, scope string, strict bool) ([]*sandboxv1.Snapshot, error) {
	view := s.watcher.View()
	nodes := view.Healthy()
	if strict {
		nodes = view.Nodes
	}
	var conns []*edgeclient.Conn
	for _, n := range nodes {
		conns = append(conns, s.edges.Get(n.Addr))
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
			resp, err := c.Edge.ListSnapshots(ctx, connect.NewRequest(&edgev1.ListSnapshotsRequest{Scope: scope}))
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
	if len(errs) > 0 && (strict || len(errs) == len(conns)) {
		return nil, errdefs.Unavailable("list snapshots: %v", errors.Join(errs...))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CreatedAt.AsTime().Before(out[j].CreatedAt.AsTime()) })
	return out, nil
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

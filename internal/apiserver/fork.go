package apiserver

import (
	"context"
	"errors"
	"sync"
	"time"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/placement"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// Cross-node fork and restore [ours]. The copies' nodes are chosen by
// placement.SplitFork. The source's edge makes the copies it runs itself
// from its snapshot as before; when other nodes run copies, it also
// exports the snapshot, and each of those edges pulls it straight from the
// source's edge (once for all its copies) and restores from it. The
// apiserver passes only the holder's address and the export's token, then
// releases the export.

// copyPlan is where a fork's or restore's copies go.
type copyPlan struct {
	local  int64               // on the holder's node
	remote []placement.Share   // on other nodes
	need   placement.Resources // of one copy
}

func (s *Server) planCopies(holder string, r *sandboxv1.Resources, backend string, count int64, spread bool) (copyPlan, error) {
	req := placement.Request{Backend: backend, CPUCores: r.GetCpuCores(), MemoryMB: r.GetMemoryMb(), Count: 1}
	view := s.watcher.View()
	byNode := s.inflight.overlay(marksOf(view))
	s.rngMu.Lock()
	shares, err := placement.SplitFork(view.Placement(), byNode, holder, req, count, spread, s.cfg.K, s.rng)
	s.rngMu.Unlock()
	if err != nil {
		return copyPlan{}, err
	}
	p := copyPlan{need: placement.Resources{Sandboxes: 1, CPUCores: req.CPUCores, MemoryMB: req.MemoryMB}}
	for _, sh := range shares {
		if sh.Node == holder {
			p.local = sh.Count
		} else {
			p.remote = append(p.remote, sh)
		}
	}
	return p, nil
}

// copyRun counts one fork's or restore's copies in flight per node and
// settles the quota reservation with the copies made.
type copyRun struct {
	s   *Server
	rsv string
	mu  sync.Mutex
	ids map[string]uint64 // inflight entry per node
	ok  map[string]bool   // the node made a copy
	st  map[string]*edgev1.UsageStamp
	out []string
}

func (s *Server) startCopies(ctx context.Context, project, holder string, p copyPlan) (*copyRun, error) {
	total := p.local
	for _, sh := range p.remote {
		total += sh.Count
	}
	need := placement.Resources{Sandboxes: total, CPUCores: p.need.CPUCores * float64(total), MemoryMB: p.need.MemoryMB * total}
	rsv, err := s.holdQuota(ctx, project, need, "")
	if err != nil {
		return nil, err
	}
	run := &copyRun{s: s, rsv: rsv, ids: map[string]uint64{}, ok: map[string]bool{}, st: map[string]*edgev1.UsageStamp{}}
	add := func(node string, n int64) {
		run.ids[node] = s.inflight.add(node, project, placement.Resources{Sandboxes: n, CPUCores: p.need.CPUCores * float64(n), MemoryMB: p.need.MemoryMB * n})
	}
	if p.local > 0 {
		add(holder, p.local)
	}
	for _, sh := range p.remote {
		add(sh.Node, sh.Count)
	}
	return run, nil
}

func (r *copyRun) made(node string, ids []string, stamp *edgev1.UsageStamp) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(ids) > 0 {
		r.ok[node] = true
		r.out = append(r.out, ids...)
	}
	if stamp != nil {
		r.st[node] = stamp
	}
}

func (r *copyRun) finish() {
	for node, id := range r.ids {
		r.s.inflight.finish(id, r.ok[node], r.st[node])
	}
	r.s.settleQuota(r.rsv, r.out)
}

// restoreElsewhere starts count copies on node from a snapshot that src's
// edge exported, and reports each.
func (s *Server) restoreElsewhere(ctx context.Context, node string, count int64, x *edgev1.SnapshotExport, src *edgeclient.Conn, req *edgev1.RestoreSnapshotRequest, run *copyRun) []*sandboxv1.ForkResult {
	out := make([]*sandboxv1.ForkResult, count)
	c, err := s.edgeFor(sandboxid.NodeID(node))
	var wg sync.WaitGroup
	for i := range out {
		if err != nil {
			out[i] = forkError(errdefs.OnNode(node, err))
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &edgev1.RestoreSnapshotRequest{
				SnapshotId: x.SnapshotId, Scope: req.Scope, Project: req.Project, TimeoutSeconds: req.TimeoutSeconds, Metadata: req.Metadata,
				OnTimeout: req.OnTimeout, ExplicitResume: req.ExplicitResume,
				Source: &edgev1.SnapshotSource{Addr: src.Addr, Token: x.Token},
			}
			resp, err := c.Edge.RestoreSnapshot(ctx, connect.NewRequest(r))
			if err != nil {
				out[i] = forkError(errdefs.OnNode(node, errdefs.FromConnect(err)))
				return
			}
			run.made(node, []string{resp.Msg.Sandbox.GetId()}, resp.Msg.Usage)
			out[i] = &sandboxv1.ForkResult{Sandbox: resp.Msg.Sandbox}
		}()
	}
	wg.Wait()
	return out
}

// restoreAcross runs the remote shares of a plan in parallel.
func (s *Server) restoreAcross(ctx context.Context, p copyPlan, x *edgev1.SnapshotExport, src *edgeclient.Conn, req *edgev1.RestoreSnapshotRequest, run *copyRun) []*sandboxv1.ForkResult {
	parts := make([][]*sandboxv1.ForkResult, len(p.remote))
	var wg sync.WaitGroup
	for i, sh := range p.remote {
		wg.Add(1)
		go func() {
			defer wg.Done()
			parts[i] = s.restoreElsewhere(ctx, sh.Node, sh.Count, x, src, req, run)
		}()
	}
	wg.Wait()
	var out []*sandboxv1.ForkResult
	for _, part := range parts {
		out = append(out, part...)
	}
	return out
}

func (s *Server) releaseExport(src *edgeclient.Conn, x *edgev1.SnapshotExport) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := src.Edge.ReleaseExport(ctx, connect.NewRequest(&edgev1.ReleaseExportRequest{SnapshotId: x.SnapshotId, Token: x.Token})); err != nil {
		// Its lease ends it.
		s.log.Warn("release a snapshot export", logging.SnapshotID, x.SnapshotId, logging.Error, err)
	}
}

func forkError(err error) *sandboxv1.ForkResult {
	code, msg := errdefs.ItemError(err)
	return &sandboxv1.ForkResult{ErrorCode: code, ErrorMessage: msg}
}

func (h *sandboxService) ForkSandbox(ctx context.Context, req *connect.Request[sandboxv1.ForkSandboxRequest]) (*connect.Response[sandboxv1.ForkSandboxResponse], error) {
	m := req.Msg
	if m.Count < 1 || m.Count > sandboxspec.MaxForkCount {
		return nil, errdefs.InvalidArgument("count %d: want 1 to %d", m.Count, sandboxspec.MaxForkCount)
	}
	if _, ok := sandboxv1.ForkPlacement_name[int32(m.Placement)]; !ok {
		return nil, errdefs.InvalidArgument("placement %d: want FORK_PLACEMENT_UNSPECIFIED (the source's node first) or FORK_PLACEMENT_SPREAD", m.Placement)
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
	plan, err := h.s.planCopies(sb.NodeId, sb.Spec.GetResources(), sb.Spec.GetBackend(), int64(m.Count), m.Placement == sandboxv1.ForkPlacement_FORK_PLACEMENT_SPREAD)
	if err != nil {
		return nil, err
	}
	run, err := h.s.startCopies(ctx, sb.Project, sb.NodeId, plan)
	if err != nil {
		return nil, err
	}
	defer run.finish()
	resp, err := c.Edge.ForkSandbox(ctx, connect.NewRequest(&edgev1.ForkSandboxRequest{
		SandboxId: m.SandboxId, Scope: scope, Count: int32(plan.local), TimeoutSeconds: m.TimeoutSeconds, Metadata: m.Metadata,
		Export: len(plan.remote) > 0,
	}))
	if err != nil {
		return nil, err
	}
	var made []string
	for _, r := range resp.Msg.Results {
		if r.Sandbox != nil {
			made = append(made, r.Sandbox.Id)
		}
	}
	run.made(sb.NodeId, made, resp.Msg.Usage)
	results := resp.Msg.Results
	if x := resp.Msg.Export; x != nil {
		results = append(results, h.s.restoreAcross(ctx, plan, x, c, &edgev1.RestoreSnapshotRequest{
			Scope: scope, Project: sb.Project, TimeoutSeconds: m.TimeoutSeconds, Metadata: m.Metadata,
		}, run)...)
		h.s.releaseExport(c, x)
	} else if len(plan.remote) > 0 {
		why := errdefs.Unavailable("the source's node %s could not export its snapshot to other nodes: %s", sb.NodeId, resp.Msg.ExportError)
		for _, sh := range plan.remote {
			for range sh.Count {
				results = append(results, forkError(why))
			}
		}
	}
	h.s.placeStats.copied("fork", results)
	return connect.NewResponse(&sandboxv1.ForkSandboxResponse{Results: results, SourcePauseUs: resp.Msg.SourcePauseUs, SourceError: resp.Msg.SourceError}), nil
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
	plan, err := h.s.planCopies(snap.NodeId, snap.Spec.GetResources(), snap.Spec.GetBackend(), 1, false)
	if err != nil {
		return nil, err
	}
	run, err := h.s.startCopies(ctx, snap.Project, snap.NodeId, plan)
	if err != nil {
		return nil, err
	}
	defer run.finish()
	edgeReq := &edgev1.RestoreSnapshotRequest{SnapshotId: m.SnapshotId, Scope: scope, TimeoutSeconds: m.TimeoutSeconds, Metadata: m.Metadata, OnTimeout: m.OnTimeout, ExplicitResume: m.ExplicitResume}
	if plan.local == 1 {
		resp, err := c.Edge.RestoreSnapshot(ctx, connect.NewRequest(edgeReq))
		if err != nil {
			h.s.placeStats.copied("restore", []*sandboxv1.ForkResult{forkError(err)})
			return nil, err
		}
		h.s.placeStats.copied("restore", []*sandboxv1.ForkResult{{Sandbox: resp.Msg.Sandbox}})
		run.made(snap.NodeId, []string{resp.Msg.Sandbox.GetId()}, resp.Msg.Usage)
		return connect.NewResponse(&sandboxv1.RestoreSnapshotResponse{Sandbox: resp.Msg.Sandbox}), nil
	}
	// The holder has no room: another node pulls the snapshot.
	xr, err := c.Edge.ExportSnapshot(ctx, connect.NewRequest(&edgev1.ExportSnapshotRequest{SnapshotId: m.SnapshotId, Scope: scope}))
	if err != nil {
		return nil, err
	}
	defer h.s.releaseExport(c, xr.Msg.Export)
	edgeReq.Project = snap.Project
	res := h.s.restoreAcross(ctx, plan, xr.Msg.Export, c, edgeReq, run)
	h.s.placeStats.copied("restore", res)
	if len(res) != 1 || res[0].Sandbox == nil {
		code, msg := "unavailable", "no node took the copy"
		if len(res) == 1 {
			code, msg = res[0].ErrorCode, res[0].ErrorMessage
		}
		var cc connect.Code
		cc.UnmarshalText([]byte(code)) //nolint:errcheck // unknown stays 0, reported as unknown
		return nil, connect.NewError(cc, errors.New(msg))
	}
	return connect.NewResponse(&sandboxv1.RestoreSnapshotResponse{Sandbox: res[0].Sandbox}), nil
}

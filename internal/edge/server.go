package edge

import (
	"context"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/edge/v1/edgev1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/inbound"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/rpcopts"
	"github.com/opendsec/opendsec/internal/snapxfer"
)

// Handler serves EdgeService, the agent proxy and exported snapshots. It
// must be served over mutual TLS that admits the apiserver, the watcher and
// other edges; an edge's certificate reaches only exported snapshots.
func (e *Edge) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(&server{e: e}, rpcopts.Handler(connect.WithInterceptors(e.prom.rpc.Interceptor(), errdefs.Interceptor()))...))
	ports := inbound.Ports(e.lookup, e.reg.lookupAny, e.log)
	proxy := inbound.AgentCalls(e.lookup, e.log)
	snaps := e.prom.countExported(snapxfer.Handler(e.snaps.ExportedFile)) // exported snapshots
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, snapxfer.Prefix) {
			snaps.ServeHTTP(w, r)
			return
		}
		if r.TLS != nil && !pki.PeerHasRole(r.TLS, pki.RoleAPIServer, pki.RoleWatcher) {
			errdefs.WriteHTTP(w, errdefs.PermissionDenied("path %q: this certificate's role may only pull exported snapshots (%s)", errdefs.Clip(r.URL.Path, 140), snapxfer.Prefix))
			return
		}
		if r.Header.Get(headers.SandboxPort) != "" {
			ports.ServeHTTP(w, r)
			return
		}
		if headers.IsAgentPath(r.URL.Path) {
			proxy.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

// server adapts EdgeService to the Edge.
type server struct {
	e *Edge
}

var _ edgev1connect.EdgeServiceHandler = (*server)(nil)

func (s *server) CreateSandbox(ctx context.Context, req *connect.Request[edgev1.CreateSandboxRequest]) (*connect.Response[edgev1.CreateSandboxResponse], error) {
	sb, err := s.e.CreateFor(ctx, req.Msg.Spec, req.Msg.Project, req.Msg.Reservation)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.CreateSandboxResponse{Sandbox: sb, Usage: s.e.AdmissionStamp(sb.Id)}), nil
}

func (s *server) GetSandbox(ctx context.Context, req *connect.Request[edgev1.GetSandboxRequest]) (*connect.Response[edgev1.GetSandboxResponse], error) {
	sb, err := s.e.Get(req.Msg.SandboxId, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.GetSandboxResponse{Sandbox: sb}), nil
}

func (s *server) ListSandboxes(ctx context.Context, req *connect.Request[edgev1.ListSandboxesRequest]) (*connect.Response[edgev1.ListSandboxesResponse], error) {
	return connect.NewResponse(&edgev1.ListSandboxesResponse{Sandboxes: s.e.List(req.Msg.Scope)}), nil
}

func (s *server) DestroySandbox(ctx context.Context, req *connect.Request[edgev1.DestroySandboxRequest]) (*connect.Response[edgev1.DestroySandboxResponse], error) {
	sb, err := s.e.Destroy(ctx, req.Msg.SandboxId, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.DestroySandboxResponse{Sandbox: sb}), nil
}

func (s *server) CollectGarbage(ctx context.Context, _ *connect.Request[edgev1.CollectGarbageRequest]) (*connect.Response[edgev1.CollectGarbageResponse], error) {
	freed, removed := s.e.CollectGarbage()
	return connect.NewResponse(&edgev1.CollectGarbageResponse{FreedBytes: freed, Removed: removed}), nil
}

func (s *server) WarmImage(ctx context.Context, req *connect.Request[edgev1.WarmImageRequest]) (*connect.Response[edgev1.WarmImageResponse], error) {
	prepared, note, err := s.e.WarmImage(ctx, req.Msg.Spec, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.WarmImageResponse{Prepared: prepared, Note: note}), nil
}

func (s *server) SetPool(ctx context.Context, req *connect.Request[edgev1.SetPoolRequest]) (*connect.Response[edgev1.SetPoolResponse], error) {
	pools, err := s.e.SetClusterPool(req.Msg.Spec, req.Msg.Project, int(req.Msg.Size), req.Msg.Generation)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.SetPoolResponse{Pools: pools}), nil
}

func (s *server) ListPools(ctx context.Context, _ *connect.Request[edgev1.ListPoolsRequest]) (*connect.Response[edgev1.ListPoolsResponse], error) {
	return connect.NewResponse(&edgev1.ListPoolsResponse{Pools: s.e.ListPools()}), nil
}

func (s *server) CommitSandbox(ctx context.Context, req *connect.Request[edgev1.CommitSandboxRequest]) (*connect.Response[edgev1.CommitSandboxResponse], error) {
	im, err := s.e.Commit(ctx, req.Msg.SandboxId, req.Msg.Scope, req.Msg.Name, req.Msg.Exclude, req.Msg.Config)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.CommitSandboxResponse{Image: im}), nil
}

func (s *server) SetSandboxTimeout(ctx context.Context, req *connect.Request[edgev1.SetSandboxTimeoutRequest]) (*connect.Response[edgev1.SetSandboxTimeoutResponse], error) {
	sb, err := s.e.SetTimeout(req.Msg.SandboxId, req.Msg.Scope, req.Msg.TimeoutSeconds)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.SetSandboxTimeoutResponse{Sandbox: sb}), nil
}

func (s *server) GetSandboxMetrics(ctx context.Context, req *connect.Request[edgev1.GetSandboxMetricsRequest]) (*connect.Response[edgev1.GetSandboxMetricsResponse], error) {
	var start, end time.Time
	if req.Msg.Start != nil {
		start = req.Msg.Start.AsTime()
	}
	if req.Msg.End != nil {
		end = req.Msg.End.AsTime()
	}
	samples, err := s.e.Metrics(req.Msg.SandboxId, req.Msg.Scope, start, end)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.GetSandboxMetricsResponse{Samples: samples}), nil
}

func (s *server) PauseSandbox(ctx context.Context, req *connect.Request[edgev1.PauseSandboxRequest]) (*connect.Response[edgev1.PauseSandboxResponse], error) {
	out, err := s.e.PauseAt(ctx, req.Msg.SandboxId, req.Msg.Scope, req.Msg.Depth)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.PauseSandboxResponse{Sandbox: out.Sandbox, MemoryReleasedBytes: out.Released, Note: out.Note}), nil
}

func (s *server) PauseTask(ctx context.Context, req *connect.Request[edgev1.PauseTaskRequest]) (*connect.Response[edgev1.PauseTaskResponse], error) {
	rs, err := s.e.PauseTask(ctx, req.Msg.Task, req.Msg.Scope, req.Msg.Depth)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.PauseTaskResponse{Results: s.taskResults(rs)}), nil
}

func (s *server) ResumeTask(ctx context.Context, req *connect.Request[edgev1.ResumeTaskRequest]) (*connect.Response[edgev1.ResumeTaskResponse], error) {
	rs, err := s.e.ResumeTask(ctx, req.Msg.Task, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.ResumeTaskResponse{Results: s.taskResults(rs)}), nil
}

// taskResults are a task-wide call's results as the API gives them.
func (s *server) taskResults(rs []TaskResult) []*sandboxv1.TaskSandboxResult {
	out := make([]*sandboxv1.TaskSandboxResult, 0, len(rs))
	for _, r := range rs {
		res := &sandboxv1.TaskSandboxResult{SandboxId: r.ID, NodeId: string(s.e.node), Sandbox: r.Sandbox,
			MemoryReleasedBytes: r.Released, Note: r.Note, TookUs: r.Took.Microseconds()}
		res.ErrorCode, res.ErrorMessage = errdefs.ItemError(r.Err)
		out = append(out, res)
	}
	return out
}

func (s *server) ResumeSandbox(ctx context.Context, req *connect.Request[edgev1.ResumeSandboxRequest]) (*connect.Response[edgev1.ResumeSandboxResponse], error) {
	sb, err := s.e.Resume(ctx, req.Msg.SandboxId, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.ResumeSandboxResponse{Sandbox: sb}), nil
}

func (s *server) SnapshotSandbox(ctx context.Context, req *connect.Request[edgev1.SnapshotSandboxRequest]) (*connect.Response[edgev1.SnapshotSandboxResponse], error) {
	snap, err := s.e.Snapshot(ctx, req.Msg.SandboxId, req.Msg.Scope, req.Msg.Name)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.SnapshotSandboxResponse{Snapshot: snap}), nil
}

func (s *server) RestoreSnapshot(ctx context.Context, req *connect.Request[edgev1.RestoreSnapshotRequest]) (*connect.Response[edgev1.RestoreSnapshotResponse], error) {
	m := req.Msg
	sb, err := s.e.Restore(ctx, m.SnapshotId, m.Scope, m.Project, RestoreOptions{Timeout: m.TimeoutSeconds, Metadata: m.Metadata, OnTimeout: m.OnTimeout, ExplicitResume: m.ExplicitResume}, m.Source)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.RestoreSnapshotResponse{Sandbox: sb, Usage: s.e.AdmissionStamp(sb.Id)}), nil
}

func (s *server) ForkSandbox(ctx context.Context, req *connect.Request[edgev1.ForkSandboxRequest]) (*connect.Response[edgev1.ForkSandboxResponse], error) {
	m := req.Msg
	fo, err := s.e.Fork(ctx, m.SandboxId, m.Scope, ForkRequest{Count: int(m.Count), Timeout: m.TimeoutSeconds, Metadata: m.Metadata, Export: m.Export})
	if err != nil {
		return nil, err
	}
	out := &edgev1.ForkSandboxResponse{SourcePauseUs: fo.SourcePaused.Microseconds(), Export: fo.Export}
	if fo.ExportErr != nil {
		out.ExportError = fo.ExportErr.Error()
	}
	if fo.SourceErr != nil {
		out.SourceError = fo.SourceErr.Error()
	}
	var ids []string // the copies made, for the stamp
	for _, r := range fo.Results {
		res := &sandboxv1.ForkResult{Sandbox: r.Sandbox}
		res.ErrorCode, res.ErrorMessage = errdefs.ItemError(r.Err)
		if r.Sandbox != nil {
			ids = append(ids, r.Sandbox.Id)
		}
		out.Results = append(out.Results, res)
	}
	out.Usage = s.e.AdmissionStamp(ids...)
	return connect.NewResponse(out), nil
}

func (s *server) ListSnapshots(ctx context.Context, req *connect.Request[edgev1.ListSnapshotsRequest]) (*connect.Response[edgev1.ListSnapshotsResponse], error) {
	snaps, err := s.e.ListSnapshots(req.Msg.Scope, req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.ListSnapshotsResponse{Snapshots: snaps}), nil
}

func (s *server) DeleteSnapshot(ctx context.Context, req *connect.Request[edgev1.DeleteSnapshotRequest]) (*connect.Response[edgev1.DeleteSnapshotResponse], error) {
	if err := s.e.DeleteSnapshot(req.Msg.SnapshotId, req.Msg.Scope); err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.DeleteSnapshotResponse{}), nil
}

func (s *server) ExportSnapshot(ctx context.Context, req *connect.Request[edgev1.ExportSnapshotRequest]) (*connect.Response[edgev1.ExportSnapshotResponse], error) {
	x, err := s.e.Export(req.Msg.SnapshotId, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.ExportSnapshotResponse{Export: x}), nil
}

func (s *server) ReleaseExport(ctx context.Context, req *connect.Request[edgev1.ReleaseExportRequest]) (*connect.Response[edgev1.ReleaseExportResponse], error) {
	if err := s.e.ReleaseExport(req.Msg.SnapshotId, req.Msg.Token); err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.ReleaseExportResponse{}), nil
}

func (s *server) FenceReservation(ctx context.Context, req *connect.Request[edgev1.FenceReservationRequest]) (*connect.Response[edgev1.FenceReservationResponse], error) {
	out, err := s.e.Fence(req.Msg.Reservation)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.FenceReservationResponse{Sandboxes: out}), nil
}

func (s *server) GetNodeStatus(ctx context.Context, req *connect.Request[edgev1.GetNodeStatusRequest]) (*connect.Response[edgev1.GetNodeStatusResponse], error) {
	return connect.NewResponse(&edgev1.GetNodeStatusResponse{Status: s.e.Status()}), nil
}

func (s *server) UpdateNetwork(ctx context.Context, req *connect.Request[edgev1.UpdateNetworkRequest]) (*connect.Response[edgev1.UpdateNetworkResponse], error) {
	if req.Msg.Update == nil {
		return nil, errdefs.InvalidArgument("update: missing")
	}
	sb, err := s.e.UpdateNetwork(ctx, req.Msg.Update, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.UpdateNetworkResponse{Sandbox: sb}), nil
}

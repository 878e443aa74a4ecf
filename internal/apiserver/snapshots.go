package apiserver

import (
	"context"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

func (h *sandboxService) SnapshotSandbox(ctx context.Context, req *connect.Request[sandboxv1.SnapshotSandboxRequest]) (*connect.Response[sandboxv1.SnapshotSandboxResponse], error) {
	return nil, errdefs.Unsupported("snapshots are not implemented yet")
}

func (h *sandboxService) RestoreSnapshot(ctx context.Context, req *connect.Request[sandboxv1.RestoreSnapshotRequest]) (*connect.Response[sandboxv1.RestoreSnapshotResponse], error) {
	return nil, errdefs.Unsupported("snapshots are not implemented yet")
}

func (h *sandboxService) ForkSandbox(ctx context.Context, req *connect.Request[sandboxv1.ForkSandboxRequest]) (*connect.Response[sandboxv1.ForkSandboxResponse], error) {
	return nil, errdefs.Unsupported("fork is not implemented yet")
}

func (h *sandboxService) ListSnapshots(ctx context.Context, req *connect.Request[sandboxv1.ListSnapshotsRequest]) (*connect.Response[sandboxv1.ListSnapshotsResponse], error) {
	return connect.NewResponse(&sandboxv1.ListSnapshotsResponse{}), nil
}

func (h *sandboxService) DeleteSnapshot(ctx context.Context, req *connect.Request[sandboxv1.DeleteSnapshotRequest]) (*connect.Response[sandboxv1.DeleteSnapshotResponse], error) {
	return nil, errdefs.NotFound("snapshot %s: no such snapshot", req.Msg.SnapshotId)
}

// Package edgefake is an edge in memory, for the tests of what talks to
// edges (the apiserver): it admits sandboxes against its capacity, keeps
// them, lists and removes them, and can be told to decline every create
// (a node that is full, or going away), as a real edge has the final say.
// A call it does not serve panics, naming the method.
package edgefake

import (
	"context"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/edge/v1/edgev1connect"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/watcher"
)

// Edge is one node's edge in memory.
type Edge struct {
	// EdgeServiceClient is nil: the methods Edge does not define panic.
	edgev1connect.EdgeServiceClient

	Node     sandboxid.NodeID
	Addr     string
	Backends []string

	mu       sync.Mutex
	capacity *edgev1.Usage
	boxes    map[string]*sandboxv1.Sandbox
	reserved map[string]string // sandbox id -> the reservation its create settled
	fenced   map[string]bool   // reservations another apiserver took over
	decline  error
	creates  int
	seq      uint64
	// exports are the snapshots this edge exported, by token; released
	// ones are false.
	exports map[string]bool
	// pulls are the sources restores pulled from ("addr token").
	pulls []string
	// pools are the pools set through SetPool, by identity (pools.go).
	pools       map[string]*imagev1.Pool
	poolGen     map[string]int64 // the generation of each pool's setting
	poolRefusal error
	poolSets    int
}

var _ edgev1connect.EdgeServiceClient = (*Edge)(nil)

// New is an edge at addr admitting up to capacity, serving the backends
// named (default "fake").
func New(addr string, capacity *edgev1.Usage, backends ...string) *Edge {
	if len(backends) == 0 {
		backends = []string{"fake"}
	}
	return &Edge{Node: sandboxid.NewNodeID(), Addr: addr, Backends: backends, capacity: capacity,
		boxes: map[string]*sandboxv1.Sandbox{}, reserved: map[string]string{}, fenced: map[string]bool{}, exports: map[string]bool{}}
}

// Decline makes every create fail with err (nil: admit again).
func (e *Edge) Decline(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.decline = err
}

// Creates is how many creates were asked of this edge, admitted or not.
func (e *Edge) Creates() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.creates
}

// Put adds a sandbox the edge runs, made by the create that held
// reservation (another apiserver's, a run before a restart).
func (e *Edge) Put(sb *sandboxv1.Sandbox, reservation string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.boxes[sb.Id] = proto.Clone(sb).(*sandboxv1.Sandbox)
	e.reserved[sb.Id] = reservation
}

// Forget drops a sandbox as if it ended without the apiserver's word.
func (e *Edge) Forget(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.boxes, id)
	delete(e.reserved, id)
}

// Has reports whether the edge holds sandbox id.
func (e *Edge) Has(id string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	_, ok := e.boxes[id]
	return ok
}

// allocated sums the sandboxes held. Callers hold e.mu.
func (e *Edge) allocated() *edgev1.Usage {
	u := &edgev1.Usage{}
	for _, sb := range e.boxes {
		u.Sandboxes++
		u.CpuCores += sb.Spec.GetResources().GetCpuCores()
		u.MemoryMb += sb.Spec.GetResources().GetMemoryMb()
	}
	return u
}

// Status is the node status the edge reports.
func (e *Edge) Status() *edgev1.NodeStatus {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := &edgev1.NodeStatus{NodeId: string(e.Node), Capacity: e.capacity, Allocated: e.allocated(),
		Host: &edgev1.Usage{CpuCores: e.capacity.CpuCores, MemoryMb: e.capacity.MemoryMb}}
	for _, b := range e.Backends {
		st.Backends = append(st.Backends, &edgev1.BackendStatus{Name: b, CanPause: true, CanSnapshot: true})
	}
	return st
}

// NodeView is the edge as a watcher sees it, healthy or not.
func (e *Edge) NodeView(healthy bool) *watcher.NodeView {
	nv := &watcher.NodeView{ID: string(e.Node), Addr: e.Addr, Healthy: healthy, PolledAt: time.Now(), Status: e.Status()}
	if !healthy {
		nv.Err = "connection refused"
	}
	return nv
}

// CreateSandbox admits the sandbox if it fits and the edge does not
// decline.
func (e *Edge) CreateSandbox(ctx context.Context, req *connect.Request[edgev1.CreateSandboxRequest]) (*connect.Response[edgev1.CreateSandboxResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.creates++
	if e.decline != nil {
		return nil, errdefs.ToConnect(e.decline)
	}
	if rsv := req.Msg.Reservation; rsv != "" && e.fenced[rsv] {
		return nil, errdefs.ToConnect(errdefs.FailedPrecondition("reservation %s: another apiserver took its create over (the client retried there)", rsv))
	}
	if err := e.admit(req.Msg.Spec.GetResources()); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	sb, stamp := e.start(req.Msg.Project, req.Msg.Spec, req.Msg.Reservation)
	return connect.NewResponse(&edgev1.CreateSandboxResponse{Sandbox: sb, Usage: stamp}), nil
}

// admit refuses a sandbox of r that does not fit. Callers hold e.mu.
func (e *Edge) admit(r *sandboxv1.Resources) error {
	a := e.allocated()
	if a.Sandboxes+1 > e.capacity.Sandboxes || a.CpuCores+r.GetCpuCores() > e.capacity.CpuCores || a.MemoryMb+r.GetMemoryMb() > e.capacity.MemoryMb {
		return errdefs.ResourceExhausted("node full: %d of %d sandboxes, %.2f of %.2f cpu cores, %d of %d MiB held",
			a.Sandboxes, e.capacity.Sandboxes, a.CpuCores, e.capacity.CpuCores, a.MemoryMb, e.capacity.MemoryMb)
	}
	return nil
}

// start runs a new sandbox and stamps the usage change. Callers hold e.mu
// and admitted it.
func (e *Edge) start(proj string, spec *sandboxv1.SandboxSpec, reservation string) (*sandboxv1.Sandbox, *edgev1.UsageStamp) {
	now := time.Now()
	sb := &sandboxv1.Sandbox{Id: string(sandboxid.New(e.Node)), Project: proj, NodeId: string(e.Node), Spec: proto.Clone(spec).(*sandboxv1.SandboxSpec),
		State: sandboxv1.SandboxState_SANDBOX_STATE_RUNNING, CreatedAt: timestamppb.New(now),
		ExpiresAt: timestamppb.New(now.Add(time.Duration(spec.GetTimeoutSeconds()) * time.Second))}
	e.boxes[sb.Id] = sb
	e.reserved[sb.Id] = reservation
	e.seq++
	return proto.Clone(sb).(*sandboxv1.Sandbox), &edgev1.UsageStamp{Epoch: string(e.Node), Seq: e.seq}
}

// ForkSandbox makes count copies of a sandbox here, each admitted on its
// own, and exports its snapshot when asked (for other nodes' copies).
func (e *Edge) ForkSandbox(ctx context.Context, req *connect.Request[edgev1.ForkSandboxRequest]) (*connect.Response[edgev1.ForkSandboxResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	src, err := e.lookup(req.Msg.SandboxId, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	out := &edgev1.ForkSandboxResponse{}
	for range req.Msg.Count {
		if err := e.admit(src.Spec.GetResources()); err != nil {
			code, msg := errdefs.ItemError(err)
			out.Results = append(out.Results, &sandboxv1.ForkResult{ErrorCode: code, ErrorMessage: msg})
			continue
		}
		sb, stamp := e.start(src.Project, src.Spec, "")
		out.Results, out.Usage = append(out.Results, &sandboxv1.ForkResult{Sandbox: sb}), stamp
	}
	if req.Msg.Export {
		tok := fmt.Sprintf("token-%s-%d", e.Node, len(e.exports))
		e.exports[tok] = true
		out.Export = &edgev1.SnapshotExport{SnapshotId: string(sandboxid.NewSnapshot(e.Node)), Token: tok}
	}
	return connect.NewResponse(out), nil
}

// RestoreSnapshot starts a copy of 1 core and 256 MiB (the fake keeps no
// snapshots: a copy's size is the one tests use); one of another node's
// snapshot records the source it pulled from (Pulls).
func (e *Edge) RestoreSnapshot(ctx context.Context, req *connect.Request[edgev1.RestoreSnapshotRequest]) (*connect.Response[edgev1.RestoreSnapshotResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.decline != nil {
		return nil, errdefs.ToConnect(e.decline)
	}
	if src := req.Msg.Source; src != nil {
		e.pulls = append(e.pulls, src.Addr+" "+src.Token)
	}
	spec := &sandboxv1.SandboxSpec{Backend: e.Backends[0], Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}}
	if err := e.admit(spec.Resources); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	sb, stamp := e.start(req.Msg.Project, spec, "")
	return connect.NewResponse(&edgev1.RestoreSnapshotResponse{Sandbox: sb, Usage: stamp}), nil
}

// ReleaseExport ends an export.
func (e *Edge) ReleaseExport(ctx context.Context, req *connect.Request[edgev1.ReleaseExportRequest]) (*connect.Response[edgev1.ReleaseExportResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.exports[req.Msg.Token] {
		return nil, errdefs.ToConnect(errdefs.NotFound("export %s: none", req.Msg.SnapshotId))
	}
	e.exports[req.Msg.Token] = false
	return connect.NewResponse(&edgev1.ReleaseExportResponse{}), nil
}

// ListSnapshots answers that the fake keeps no snapshots.
func (e *Edge) ListSnapshots(context.Context, *connect.Request[edgev1.ListSnapshotsRequest]) (*connect.Response[edgev1.ListSnapshotsResponse], error) {
	return connect.NewResponse(&edgev1.ListSnapshotsResponse{}), nil
}

// Exporting lists the exports not yet released.
func (e *Edge) Exporting() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for tok, live := range e.exports {
		if live {
			out = append(out, tok)
		}
	}
	return out
}

// Pulls are the sources this edge's restores pulled from, "addr token".
func (e *Edge) Pulls() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.pulls...)
}

// lookup finds a sandbox the scope may see. Callers hold e.mu.
func (e *Edge) lookup(id, scope string) (*sandboxv1.Sandbox, error) {
	sb, ok := e.boxes[id]
	if !ok || !project.Within(sb.Project, scope) {
		return nil, errdefs.ToConnect(errdefs.NotFound("sandbox %s: no such sandbox", id))
	}
	return sb, nil
}

// GetSandbox describes a sandbox.
func (e *Edge) GetSandbox(ctx context.Context, req *connect.Request[edgev1.GetSandboxRequest]) (*connect.Response[edgev1.GetSandboxResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, err := e.lookup(req.Msg.SandboxId, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.GetSandboxResponse{Sandbox: proto.Clone(sb).(*sandboxv1.Sandbox)}), nil
}

// ListSandboxes lists the sandboxes in scope.
func (e *Edge) ListSandboxes(ctx context.Context, req *connect.Request[edgev1.ListSandboxesRequest]) (*connect.Response[edgev1.ListSandboxesResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := &edgev1.ListSandboxesResponse{}
	for _, sb := range e.boxes {
		if project.Within(sb.Project, req.Msg.Scope) {
			out.Sandboxes = append(out.Sandboxes, proto.Clone(sb).(*sandboxv1.Sandbox))
		}
	}
	return connect.NewResponse(out), nil
}

// DestroySandbox removes a sandbox and returns it as it was.
func (e *Edge) DestroySandbox(ctx context.Context, req *connect.Request[edgev1.DestroySandboxRequest]) (*connect.Response[edgev1.DestroySandboxResponse], error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, err := e.lookup(req.Msg.SandboxId, req.Msg.Scope)
	if err != nil {
		return nil, err
	}
	delete(e.boxes, sb.Id)
	delete(e.reserved, sb.Id)
	return connect.NewResponse(&edgev1.DestroySandboxResponse{Sandbox: sb}), nil
}

// FenceReservation refuses later creates that settle reservation and
// answers the sandboxes earlier ones made, as the edge does when another
// apiserver takes a create over.
func (e *Edge) FenceReservation(ctx context.Context, req *connect.Request[edgev1.FenceReservationRequest]) (*connect.Response[edgev1.FenceReservationResponse], error) {
	if req.Msg.Reservation == "" {
		return nil, errdefs.ToConnect(errdefs.InvalidArgument("reservation: empty"))
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.fenced[req.Msg.Reservation] = true
	out := &edgev1.FenceReservationResponse{}
	for id, rsv := range e.reserved {
		if rsv == req.Msg.Reservation {
			out.Sandboxes = append(out.Sandboxes, proto.Clone(e.boxes[id]).(*sandboxv1.Sandbox))
		}
	}
	return connect.NewResponse(out), nil
}

// GetNodeStatus reports Status.
func (e *Edge) GetNodeStatus(ctx context.Context, req *connect.Request[edgev1.GetNodeStatusRequest]) (*connect.Response[edgev1.GetNodeStatusResponse], error) {
	return connect.NewResponse(&edgev1.GetNodeStatusResponse{Status: e.Status()}), nil
}

// Dialer hands out connections to fake edges by address; an address it
// does not have panics (the caller dialled a node the test did not make).
type Dialer map[string]*Edge

// NewDialer is a dialer of edges.
func NewDialer(edges ...*Edge) Dialer {
	d := Dialer{}
	for _, e := range edges {
		d[e.Addr] = e
	}
	return d
}

// Get implements the apiserver's EdgeDialer.
func (d Dialer) Get(addr string) *edgeclient.Conn {
	e, ok := d[addr]
	if !ok {
		panic(fmt.Sprintf("edgefake: no edge at %s", addr))
	}
	return &edgeclient.Conn{Addr: addr, BaseURL: "https://" + addr, Edge: e}
}

// View is the watcher's view of edges, all healthy.
func View(edges ...*Edge) *watcher.View {
	nodes := make([]*watcher.NodeView, 0, len(edges))
	for _, e := range edges {
		nodes = append(nodes, e.NodeView(true))
	}
	return watcher.NewView(nodes)
}

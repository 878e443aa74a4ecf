package apiserver

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1/sandboxv1connect"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/placement"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

type sandboxService struct{ s *Server }

var _ sandboxv1connect.SandboxServiceHandler = (*sandboxService)(nil)

// limits returns the request limits lowered to the largest node.
func (s *Server) limits() (sandboxspec.Limits, []string) {
	lim := s.cfg.Limits
	var maxCPU float64
	var maxMem int64
	names := map[string]bool{}
	for _, n := range s.watcher.View().Nodes {
		if n.Status == nil {
			continue
		}
		if n.Status.Host != nil {
			maxCPU, maxMem = max(maxCPU, n.Status.Host.CpuCores), max(maxMem, n.Status.Host.MemoryMb)
		}
		for _, b := range n.Status.Backends {
			names[b.Name] = true
		}
	}
	if maxCPU > 0 {
		lim.MaxCPUCores = min(lim.MaxCPUCores, maxCPU)
		lim.MaxMemoryMB = min(lim.MaxMemoryMB, maxMem)
	}
	backends := make([]string, 0, len(names))
	for n := range names {
		backends = append(backends, n)
	}
	sort.Strings(backends)
	return lim, backends
}

// edgeFor routes a sandbox or snapshot id to its edge.
func (s *Server) edgeFor(node sandboxid.NodeID) (*edgeclient.Conn, error) {
	c, _, err := s.nodeEdge(node, 0)
	return c, err
}

// callEdge is the edge for a call into sandbox id, and until when the
// call may wait for it to accept connections: an edge that went
// unreachable less than edgeRestartWait ago may be restarting (an
// upgrade), and only it can serve the sandbox.
func (s *Server) callEdge(id string) (*edgeclient.Conn, time.Time, error) {
	_, node, err := sandboxid.Parse(id)
	if err != nil {
		return nil, time.Time{}, err
	}
	return s.nodeEdge(node, edgeRestartWait)
}

// nodeEdge is node's edge and until when a call may wait for it: a
// healthy node for up to grace from now, one unreachable for less than
// grace until grace after it went; others are refused.
func (s *Server) nodeEdge(node sandboxid.NodeID, grace time.Duration) (*edgeclient.Conn, time.Time, error) {
	n, ok := s.watcher.View().Node(string(node))
	switch {
	case !ok:
		return nil, time.Time{}, errdefs.NotFound("node %s: not known to this cluster", node)
	case n.Healthy:
		return s.edges.Get(n.Addr), time.Now().Add(grace), nil
	case !n.UnhealthySince.IsZero() && time.Since(n.UnhealthySince) < grace:
		return s.edges.Get(n.Addr), n.UnhealthySince.Add(grace), nil
	}
	return nil, time.Time{}, errdefs.Unavailable("node %s: unreachable (%s)", node, n.Err)
}

func (s *Server) sandboxEdge(id string) (*edgeclient.Conn, error) {
	_, node, err := sandboxid.Parse(id)
	if err != nil {
		return nil, err
	}
	return s.edgeFor(node)
}

// checkInternet refuses the internet shorthand in a project subtree whose
// operator switched it off (Quota.NoInternet on it or an ancestor).
func (s *Server) checkInternet(proj string, internet bool) error {
	if !internet {
		return nil
	}
	state := s.iam.State()
	for _, p := range project.Ancestry(proj) {
		if pr, ok := state.Project(p); ok && pr.Quota.NoInternet {
			return errdefs.PermissionDenied("network.internet: project %s does not allow the internet shorthand (its quota sets no_internet); name the destinations in network rules instead", p)
		}
	}
	return nil
}

func (h *sandboxService) CreateSandbox(ctx context.Context, req *connect.Request[sandboxv1.CreateSandboxRequest]) (*connect.Response[sandboxv1.CreateSandboxResponse], error) {
	s := h.s
	p := principalFrom(ctx)
	proj, err := actingProject(p, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	spec := req.Msg.Spec
	lim, backends := s.limits()
	if err := sandboxspec.Normalize(spec, lim, backends); err != nil {
		return nil, err
	}
	if err := s.checkImage(spec.Image, proj); err != nil {
		return nil, err
	}
	if err := s.checkInternet(proj, spec.GetNetwork().GetInternet()); err != nil {
		return nil, err
	}
	key, err := idempotencyKey(req.Header())
	if err != nil {
		return nil, err
	}
	sb, err := s.place(ctx, proj, key, placement.Request{Backend: spec.Backend, CPUCores: spec.Resources.CpuCores, MemoryMB: spec.Resources.MemoryMb, Count: 1},
		func(ctx context.Context, c *edgeclient.Conn, rsv string) (*sandboxv1.Sandbox, *edgev1.UsageStamp, error) {
			resp, err := c.Edge.CreateSandbox(ctx, connect.NewRequest(&edgev1.CreateSandboxRequest{Spec: spec, Project: proj, Reservation: rsv}))
			if err != nil {
				return nil, nil, err
			}
			return resp.Msg.Sandbox, resp.Msg.Usage, nil
		})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.CreateSandboxResponse{Sandbox: sb}), nil
}

// checkImage fails early, before any node is asked, on a missing or foreign image.
func (s *Server) checkImage(name, proj string) error {
	ref, err := image.ParseRef(name)
	if err != nil {
		return err
	}
	if !project.Within(proj, ref.Project) {
		return errdefs.PermissionDenied("image %q: belongs to project %q, not visible to project %q", name, ref.Project, proj)
	}
	_, err = s.images.Resolve(ref)
	return err
}

// place checks the quota, ranks nodes and runs create on them in order
// until one admits: an edge's ResourceExhausted or Unavailable answer moves
// on to the next node [paper: the edge has the final say].
func (s *Server) place(ctx context.Context, proj, key string, r placement.Request, create func(context.Context, *edgeclient.Conn, string) (*sandboxv1.Sandbox, *edgev1.UsageStamp, error)) (*sandboxv1.Sandbox, error) {
	need := placement.Resources{Sandboxes: r.Count, CPUCores: r.CPUCores * float64(r.Count), MemoryMB: r.MemoryMB * r.Count}
	var rsv string
	for try := 0; ; try++ {
		if key != "" {
			if sb, ok, err := s.replay(ctx, proj, key); ok {
				return sb, err
			}
		}
		var err error
		rsv, err = s.holdQuota(ctx, proj, need, key)
		if err == nil {
			break
		}
		// Another create with the key got there first: replay it once this
		// replica has seen it.
		if !errors.Is(err, errdefs.ErrAlreadyExists) || key == "" || try == 20 {
			return nil, err
		}
		time.Sleep(50 * time.Millisecond)
	}
	var made []string
	defer func() { s.settleQuota(rsv, made) }()
	view := s.watcher.View()
	byNode := s.inflight.overlay(marksOf(view))
	s.rngMu.Lock()
	ranked, err := placement.Place(view.Placement(), byNode, r, s.cfg.K, s.rng)
	s.rngMu.Unlock()
	if err != nil {
		s.placeStats.placed(placedNoNode)
		return nil, err
	}
	var errs []error
	// waitable stays true while every node declined for room that ends
	// sandboxes give back (marked so by the edge) or was away.
	waitable := true
	for i, node := range ranked {
		if i >= s.cfg.MaxTries {
			break
		}
		nv, _ := view.Node(node)
		id := s.inflight.add(node, proj, need)
		sb, stamp, err := create(ctx, s.edges.Get(nv.Addr), rsv)
		s.inflight.finish(id, err == nil, stamp)
		if err == nil {
			made = []string{sb.Id}
			s.placeStats.placed(map[bool]string{true: placedFirst, false: placedAfter}[i == 0])
			return sb, nil
		}
		marked := marksRetry(err)
		err = errdefs.FromConnect(err)
		waitable = waitable && (marked || errors.Is(err, errdefs.ErrUnavailable))
		if !errors.Is(err, errdefs.ErrResourceExhausted) && !errors.Is(err, errdefs.ErrUnavailable) {
			s.placeStats.placed(placedErrorOut)
			return nil, err
		}
		s.log.Info("edge declined; trying the next node", logging.NodeID, node, logging.Error, err)
		s.placeStats.moved(err)
		errs = append(errs, errdefs.OnNode(node, err))
	}
	s.placeStats.placed(placedNone)
	if !waitable {
		return nil, errors.Join(errs...)
	}
	// Every node tried was full or away: backpressure, not a failure. The
	// clients send the create again after the pause (and keep its
	// idempotency key), so a burst past the fleet waits for room.
	return nil, errdefs.RetryAfter(errors.Join(errs...), capacityRetryAfter)
}

// capacityRetryAfter is the pause a create refused by every node it tried
// asks its client for: about how long a sandbox takes to end and give its
// room back (capacity.RoomRetryAfter).
const capacityRetryAfter = time.Second

// marksRetry reports an edge's answer marked to be sent again (a node
// full for its count, CPU or memory: errdefs.RetryHeader).
func marksRetry(err error) bool {
	var ce *connect.Error
	return errors.As(err, &ce) && ce.Meta().Get(errdefs.RetryHeader) == "1"
}

func (h *sandboxService) GetSandbox(ctx context.Context, req *connect.Request[sandboxv1.GetSandboxRequest]) (*connect.Response[sandboxv1.GetSandboxResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.GetSandbox(ctx, connect.NewRequest(&edgev1.GetSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.GetSandboxResponse{Sandbox: resp.Msg.Sandbox}), nil
}

const (
	defaultPageSize = 100
	maxPageSize     = 1000
)

func (h *sandboxService) ListSandboxes(ctx context.Context, req *connect.Request[sandboxv1.ListSandboxesRequest]) (*connect.Response[sandboxv1.ListSandboxesResponse], error) {
	m := req.Msg
	scope, err := actingProject(principalFrom(ctx), m.Project)
	if err != nil {
		return nil, err
	}
	if m.PageSize < 0 || m.PageSize > maxPageSize {
		return nil, errdefs.InvalidArgument("page_size %d: want 1 to %d (0 = %d)", m.PageSize, maxPageSize, defaultPageSize)
	}
	size := int(m.PageSize)
	if size == 0 {
		size = defaultPageSize
	}
	after, err := decodeToken(m.PageToken)
	if err != nil {
		return nil, err
	}
	all, err := h.s.listAll(ctx, scope)
	if err != nil {
		return nil, err
	}
	states := map[sandboxv1.SandboxState]bool{}
	for _, st := range m.States {
		states[st] = true
	}
	var match []*sandboxv1.Sandbox
	for _, sb := range all {
		if m.Task != "" && sb.Spec.GetTask() != m.Task {
			continue
		}
		if len(states) > 0 && !states[sb.State] {
			continue
		}
		if !hasMetadata(sb.Spec.GetMetadata(), m.Metadata) {
			continue
		}
		match = append(match, sb)
	}
	sort.Slice(match, func(i, j int) bool { return sortKey(match[i]) < sortKey(match[j]) })
	out := &sandboxv1.ListSandboxesResponse{}
	for _, sb := range match {
		if after != "" && sortKey(sb) <= after {
			continue
		}
		if len(out.Sandboxes) == size {
			out.NextPageToken = encodeToken(sortKey(out.Sandboxes[len(out.Sandboxes)-1]))
			break
		}
		out.Sandboxes = append(out.Sandboxes, sb)
	}
	return connect.NewResponse(out), nil
}

// sortKey orders sandboxes by creation time, then id; page tokens hold it.
func sortKey(sb *sandboxv1.Sandbox) string {
	return fmt.Sprintf("%020d/%s", sb.CreatedAt.AsTime().UnixNano(), sb.Id)
}

func encodeToken(k string) string { return base64.RawURLEncoding.EncodeToString([]byte(k)) }

func decodeToken(t string) (string, error) {
	if t == "" {
		return "", nil
	}
	b, err := base64.RawURLEncoding.DecodeString(t)
	if err != nil || len(b) < 22 || b[20] != '/' {
		return "", errdefs.InvalidArgument("page_token: not a token from a previous response")
	}
	return string(b), nil
}

func hasMetadata(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}

// listAll asks every healthy edge for the sandboxes in scope.
func (s *Server) listAll(ctx context.Context, scope string) ([]*sandboxv1.Sandbox, error) {
	nodes := s.watcher.View().Healthy()
	var (
		mu   sync.Mutex
		all  []*sandboxv1.Sandbox
		errs []error
		wg   sync.WaitGroup
	)
	for _, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := s.edges.Get(n.Addr).Edge.ListSandboxes(ctx, connect.NewRequest(&edgev1.ListSandboxesRequest{Scope: scope}))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, errdefs.OnNode(n.ID, err))
				return
			}
			all = append(all, resp.Msg.Sandboxes...)
		}()
	}
	wg.Wait()
	if len(errs) > 0 && len(all) == 0 && len(errs) == len(nodes) {
		return nil, errdefs.Unavailable("list sandboxes: %v", errors.Join(errs...))
	}
	return all, nil
}

func (h *sandboxService) StopSandbox(ctx context.Context, req *connect.Request[sandboxv1.StopSandboxRequest]) (*connect.Response[sandboxv1.StopSandboxResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.DestroySandbox(ctx, connect.NewRequest(&edgev1.DestroySandboxRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project}))
	if err != nil {
		return nil, err
	}
	if sb := resp.Msg.Sandbox; sb != nil {
		r := sb.Spec.GetResources()
		h.s.inflight.released(sb.NodeId, sb.Project, placement.Resources{Sandboxes: 1, CPUCores: r.GetCpuCores(), MemoryMB: r.GetMemoryMb()})
		h.s.releaseQuota(req.Msg.SandboxId)
	}
	return connect.NewResponse(&sandboxv1.StopSandboxResponse{}), nil
}

func (h *sandboxService) CommitSandbox(ctx context.Context, req *connect.Request[sandboxv1.CommitSandboxRequest]) (*connect.Response[sandboxv1.CommitSandboxResponse], error) {
	ref, err := image.ParseRef(req.Msg.Name)
	if err != nil {
		return nil, err
	}
	p := principalFrom(ctx)
	if !p.CanAccess(ref.Project) {
		return nil, errdefs.PermissionDenied("image %q: project %q is outside your key's project %q", ref.String(), ref.Project, p.Project)
	}
	if _, err := image.ParseExclude(req.Msg.Exclude); err != nil {
		return nil, err
	}
	budget, err := h.s.storageBudgetFor(ctx, ref.Project)
	if err != nil {
		return nil, err
	}
	defer budget.done()
	if err := budget.take(1); err != nil {
		return nil, err
	}
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.CommitSandbox(ctx, connect.NewRequest(&edgev1.CommitSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: p.Project, Name: ref.String(), Exclude: req.Msg.Exclude, Config: req.Msg.Config}))
	if err != nil {
		return nil, err
	}
	h.s.log.Info("sandbox committed", logging.SandboxID, req.Msg.SandboxId, logging.Image, ref.String(), "digest", resp.Msg.Image.GetDigest())
	return connect.NewResponse(&sandboxv1.CommitSandboxResponse{Image: resp.Msg.Image}), nil
}

func (h *sandboxService) SetSandboxTimeout(ctx context.Context, req *connect.Request[sandboxv1.SetSandboxTimeoutRequest]) (*connect.Response[sandboxv1.SetSandboxTimeoutResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.SetSandboxTimeout(ctx, connect.NewRequest(&edgev1.SetSandboxTimeoutRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project, TimeoutSeconds: req.Msg.TimeoutSeconds}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.SetSandboxTimeoutResponse{Sandbox: resp.Msg.Sandbox}), nil
}

func (h *sandboxService) GetSandboxMetrics(ctx context.Context, req *connect.Request[sandboxv1.GetSandboxMetricsRequest]) (*connect.Response[sandboxv1.GetSandboxMetricsResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.GetSandboxMetrics(ctx, connect.NewRequest(&edgev1.GetSandboxMetricsRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project, Start: req.Msg.Start, End: req.Msg.End}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.GetSandboxMetricsResponse{Samples: resp.Msg.Samples}), nil
}

func (h *sandboxService) UpdateNetwork(ctx context.Context, req *connect.Request[sandboxv1.UpdateNetworkRequest]) (*connect.Response[sandboxv1.UpdateNetworkResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	if req.Msg.GetInternet() {
		// The switch is the sandbox's own project's (or an ancestor's).
		got, err := c.Edge.GetSandbox(ctx, connect.NewRequest(&edgev1.GetSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project}))
		if err != nil {
			return nil, err
		}
		if err := h.s.checkInternet(got.Msg.Sandbox.Project, true); err != nil {
			return nil, err
		}
	}
	resp, err := c.Edge.UpdateNetwork(ctx, connect.NewRequest(&edgev1.UpdateNetworkRequest{Scope: principalFrom(ctx).Project, Update: req.Msg}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.UpdateNetworkResponse{Sandbox: resp.Msg.Sandbox}), nil
}

func (h *sandboxService) PauseSandbox(ctx context.Context, req *connect.Request[sandboxv1.PauseSandboxRequest]) (*connect.Response[sandboxv1.PauseSandboxResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.PauseSandbox(ctx, connect.NewRequest(&edgev1.PauseSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project, Depth: req.Msg.Depth}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.PauseSandboxResponse{Sandbox: resp.Msg.Sandbox, MemoryReleasedBytes: resp.Msg.MemoryReleasedBytes, Note: resp.Msg.Note}), nil
}

func (h *sandboxService) ResumeSandbox(ctx context.Context, req *connect.Request[sandboxv1.ResumeSandboxRequest]) (*connect.Response[sandboxv1.ResumeSandboxResponse], error) {
	c, err := h.s.sandboxEdge(req.Msg.SandboxId)
	if err != nil {
		return nil, err
	}
	resp, err := c.Edge.ResumeSandbox(ctx, connect.NewRequest(&edgev1.ResumeSandboxRequest{SandboxId: req.Msg.SandboxId, Scope: principalFrom(ctx).Project}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&sandboxv1.ResumeSandboxResponse{Sandbox: resp.Msg.Sandbox}), nil
}

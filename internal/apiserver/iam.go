package apiserver

import (
	"context"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/iam/v1/iamv1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/project"
)

type iamService struct{ s *Server }

var _ iamv1connect.IAMServiceHandler = (*iamService)(nil)

func keyProto(k fsm.Key) *iamv1.APIKey {
	return &iamv1.APIKey{Id: k.ID, Project: k.Project, Name: k.Name, Role: iamv1.Role(k.Role), CreatedAt: timestamppb.New(k.CreatedAt)}
}

func projectProto(p fsm.Project, u fsm.Resources) *iamv1.Project {
	return &iamv1.Project{Path: p.Path, CreatedAt: timestamppb.New(p.CreatedAt), Quota: &iamv1.Quota{
		MaxSandboxes: p.Quota.MaxSandboxes, CpuCores: p.Quota.CPUCores, MemoryMb: p.Quota.MemoryMB, NoInternet: p.Quota.NoInternet, StorageMb: p.Quota.StorageMB,
	}, Usage: &iamv1.Usage{Sandboxes: u.Sandboxes, CpuCores: u.CPUCores, MemoryMb: u.MemoryMB}}
}

func quotaFrom(q *iamv1.Quota) fsm.Quota {
	if q == nil {
		return fsm.Quota{}
	}
	return fsm.Quota{MaxSandboxes: q.MaxSandboxes, CPUCores: q.CpuCores, MemoryMB: q.MemoryMb, NoInternet: q.NoInternet, StorageMB: q.StorageMb}
}

// admin checks that the caller is an admin reaching project.
func admin(p iam.Principal, project string) error {
	if p.Role != fsm.RoleAdmin {
		return errdefs.PermissionDenied("needs an ADMIN key; this one is a MEMBER key of %q", p.Project)
	}
	if !p.CanAccess(project) {
		return errdefs.PermissionDenied("project %q: outside %q, the key's project", project, p.Project)
	}
	return nil
}

func (h *iamService) WhoAmI(ctx context.Context, req *connect.Request[iamv1.WhoAmIRequest]) (*connect.Response[iamv1.WhoAmIResponse], error) {
	p := principalFrom(ctx)
	k, ok := h.s.iam.State().Key(p.KeyID)
	if !ok {
		return nil, errdefs.Unauthenticated("key was revoked")
	}
	return connect.NewResponse(&iamv1.WhoAmIResponse{Key: keyProto(k)}), nil
}

func (h *iamService) CreateProject(ctx context.Context, req *connect.Request[iamv1.CreateProjectRequest]) (*connect.Response[iamv1.CreateProjectResponse], error) {
	if err := admin(principalFrom(ctx), req.Msg.Parent); err != nil {
		return nil, err
	}
	p, err := h.s.iam.CreateProject(ctx, req.Msg.Parent, req.Msg.Name, quotaFrom(req.Msg.Quota))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&iamv1.CreateProjectResponse{Project: projectProto(p, h.s.iam.State().Usage(p.Path))}), nil
}

func (h *iamService) GetProject(ctx context.Context, req *connect.Request[iamv1.GetProjectRequest]) (*connect.Response[iamv1.GetProjectResponse], error) {
	path, err := actingProject(principalFrom(ctx), req.Msg.Path)
	if err != nil {
		return nil, err
	}
	p, ok := h.s.iam.State().Project(path)
	if !ok {
		return nil, errdefs.NotFound("project %q: no such project", path)
	}
	out := projectProto(p, h.s.iam.State().Usage(p.Path))
	h.addStorage(ctx, path, out)
	h.addUsed(out)
	return connect.NewResponse(&iamv1.GetProjectResponse{Project: out}), nil
}

func (h *iamService) ListProjects(ctx context.Context, req *connect.Request[iamv1.ListProjectsRequest]) (*connect.Response[iamv1.ListProjectsResponse], error) {
	path, err := actingProject(principalFrom(ctx), req.Msg.Path)
	if err != nil {
		return nil, err
	}
	out := &iamv1.ListProjectsResponse{}
	for _, p := range h.s.iam.State().Subtree(path) {
		out.Projects = append(out.Projects, projectProto(p, h.s.iam.State().Usage(p.Path)))
	}
	h.addStorage(ctx, path, out.Projects...)
	h.addUsed(out.Projects...)
	return connect.NewResponse(out), nil
}

// addUsed fills what each project's subtree used (CPU-seconds, memory
// GB-seconds) from the watcher's view of the edges: each edge keeps its
// totals by group; a node the watcher no longer sees is not counted.
func (h *iamService) addUsed(ps ...*iamv1.Project) {
	nodes := h.s.watcher.View().Nodes
	for _, p := range ps {
		if p.Usage == nil {
			p.Usage = &iamv1.Usage{}
		}
		for _, n := range nodes {
			for _, g := range n.Status.GetGroups() {
				if project.Within(g.Project, p.Path) {
					p.Usage.CpuSeconds += g.CpuSeconds
					p.Usage.MemoryGbSeconds += g.MemoryGbSeconds
				}
			}
		}
	}
}

// addStorage fills what each project's subtree stores (storage.go), read
// once for scope. Without an edge that answers, it stays 0 (and is logged).
func (h *iamService) addStorage(ctx context.Context, scope string, ps ...*iamv1.Project) {
	st, err := h.s.storageIn(ctx, scope)
	if err != nil {
		h.s.log.Warn("count the projects' storage", logging.Error, err)
		return
	}
	for _, p := range ps {
		p.Usage.StorageMb = (st.usedBy(p.Path) + 1<<20 - 1) >> 20
	}
}

func (h *iamService) SetQuota(ctx context.Context, req *connect.Request[iamv1.SetQuotaRequest]) (*connect.Response[iamv1.SetQuotaResponse], error) {
	p := principalFrom(ctx)
	if err := admin(p, req.Msg.Path); err != nil {
		return nil, err
	}
	// A quota is delegated from above: a key cannot raise its own project's.
	if req.Msg.Path == p.Project && p.Project != project.Root {
		return nil, errdefs.PermissionDenied("project %q: its quota is set by an admin of its parent", p.Project)
	}
	pr, err := h.s.iam.SetQuota(ctx, req.Msg.Path, quotaFrom(req.Msg.Quota))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&iamv1.SetQuotaResponse{Project: projectProto(pr, h.s.iam.State().Usage(pr.Path))}), nil
}

func (h *iamService) DeleteProject(ctx context.Context, req *connect.Request[iamv1.DeleteProjectRequest]) (*connect.Response[iamv1.DeleteProjectResponse], error) {
	if err := admin(principalFrom(ctx), req.Msg.Path); err != nil {
		return nil, err
	}
	// IAM refuses a project that still holds sandboxes, from the quota
	// ledger: exact, and released as soon as a sandbox is removed (the
	// watcher's view lagged a stop by up to a poll).
	if err := h.s.iam.DeleteProject(ctx, req.Msg.Path); err != nil {
		return nil, err
	}
	return connect.NewResponse(&iamv1.DeleteProjectResponse{}), nil
}

func (h *iamService) CreateAPIKey(ctx context.Context, req *connect.Request[iamv1.CreateAPIKeyRequest]) (*connect.Response[iamv1.CreateAPIKeyResponse], error) {
	p := principalFrom(ctx)
	proj, err := actingProject(p, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	if err := admin(p, proj); err != nil {
		return nil, err
	}
	role := fsm.Role(req.Msg.Role)
	if role == 0 {
		role = fsm.RoleMember
	}
	format := iam.FormatDsec
	if req.Msg.Format == iamv1.KeyFormat_KEY_FORMAT_E2B {
		format = iam.FormatE2B
	}
	k, secret, err := h.s.iam.CreateKey(ctx, proj, req.Msg.Name, role, format)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&iamv1.CreateAPIKeyResponse{Key: keyProto(k), Secret: secret}), nil
}

func (h *iamService) ListAPIKeys(ctx context.Context, req *connect.Request[iamv1.ListAPIKeysRequest]) (*connect.Response[iamv1.ListAPIKeysResponse], error) {
	p := principalFrom(ctx)
	proj, err := actingProject(p, req.Msg.Project)
	if err != nil {
		return nil, err
	}
	if err := admin(p, proj); err != nil {
		return nil, err
	}
	out := &iamv1.ListAPIKeysResponse{}
	for _, k := range h.s.iam.State().Keys(proj) {
		out.Keys = append(out.Keys, keyProto(k))
	}
	return connect.NewResponse(out), nil
}

func (h *iamService) RevokeAPIKey(ctx context.Context, req *connect.Request[iamv1.RevokeAPIKeyRequest]) (*connect.Response[iamv1.RevokeAPIKeyResponse], error) {
	p := principalFrom(ctx)
	k, ok := h.s.iam.State().Key(req.Msg.Id)
	if !ok || !p.CanAccess(k.Project) {
		return nil, errdefs.NotFound("api key %q: no such key", req.Msg.Id)
	}
	if err := admin(p, k.Project); err != nil {
		return nil, err
	}
	if err := h.s.iam.RevokeKey(ctx, req.Msg.Id); err != nil {
		return nil, err
	}
	return connect.NewResponse(&iamv1.RevokeAPIKeyResponse{}), nil
}

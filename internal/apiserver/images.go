package apiserver

import (
	"context"
	"encoding/json"
	"net/http"

	"connectrpc.com/connect"
	"github.com/opencontainers/go-digest"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/image/v1/imagev1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/imageproto"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/project"
)

type imageService struct{ s *Server }

var _ imagev1connect.ImageServiceHandler = (*imageService)(nil)

// readable reports whether p may use images of project: its own project's,
// an ancestor's, or a descendant's.
func readable(p iam.Principal, path string) bool { return project.Related(p.Project, path) }

func (h *imageService) ListImages(ctx context.Context, req *connect.Request[imagev1.ListImagesRequest]) (*connect.Response[imagev1.ListImagesResponse], error) {
	p := principalFrom(ctx)
	if req.Msg.Project != "" && !readable(p, req.Msg.Project) {
		return nil, errdefs.PermissionDenied("project %q: not visible to your key of %q", req.Msg.Project, p.Project)
	}
	all, err := h.s.images.List(req.Msg.Project)
	if err != nil {
		return nil, err
	}
	out := &imagev1.ListImagesResponse{}
	for _, im := range all {
		if readable(p, im.Ref.Project) && (req.Msg.Project == "" || im.Ref.Project == req.Msg.Project) {
			out.Images = append(out.Images, imageproto.Image(im))
		}
	}
	return connect.NewResponse(out), nil
}

func (h *imageService) GetImage(ctx context.Context, req *connect.Request[imagev1.GetImageRequest]) (*connect.Response[imagev1.GetImageResponse], error) {
	ref, err := image.ParseRef(req.Msg.Name)
	if err != nil {
		return nil, err
	}
	if !readable(principalFrom(ctx), ref.Project) {
		return nil, errdefs.NotFound("image %q: not in the image store", req.Msg.Name)
	}
	im, err := h.s.images.Resolve(ref)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&imagev1.GetImageResponse{Image: imageproto.Image(im)}), nil
}

func (h *imageService) CollectGarbage(ctx context.Context, _ *connect.Request[imagev1.CollectGarbageRequest]) (*connect.Response[imagev1.CollectGarbageResponse], error) {
	if err := admin(principalFrom(ctx), project.Root); err != nil {
		return nil, err
	}
	out := &imagev1.CollectGarbageResponse{}
	freed, err := h.s.pruneImages(ctx)
	if err != nil {
		return nil, err
	}
	out.StoreFreedBytes = freed
	// Each node after the store: layers of blobs freed there go too.
	for _, n := range h.s.watcher.View().Nodes {
		ng := &imagev1.NodeGarbage{Node: n.ID}
		resp, err := h.s.edges.Get(n.Addr).Edge.CollectGarbage(ctx, connect.NewRequest(&edgev1.CollectGarbageRequest{}))
		if err != nil {
			ng.Error = errdefs.Clip(err.Error(), 300)
		} else {
			ng.FreedBytes, ng.Removed = resp.Msg.FreedBytes, resp.Msg.Removed
		}
		out.Nodes = append(out.Nodes, ng)
	}
	h.s.log.Info("garbage collected", "store_freed_bytes", out.StoreFreedBytes, "nodes", len(out.Nodes))
	return connect.NewResponse(out), nil
}

func (h *imageService) TagImage(ctx context.Context, req *connect.Request[imagev1.TagImageRequest]) (*connect.Response[imagev1.TagImageResponse], error) {
	src, err := image.ParseRef(req.Msg.Source)
	if err != nil {
		return nil, err
	}
	dst, err := image.ParseRef(req.Msg.Name)
	if err != nil {
		return nil, err
	}
	p := principalFrom(ctx)
	if !readable(p, src.Project) {
		return nil, errdefs.NotFound("image %q: not in the image store", req.Msg.Source)
	}
	if !p.CanAccess(dst.Project) {
		return nil, errdefs.PermissionDenied("image %q: project %q is outside your key's project %q", dst.String(), dst.Project, p.Project)
	}
	im, err := h.s.images.Resolve(src)
	if err != nil {
		return nil, err
	}
	if err := h.s.images.Tag(dst, im.Digest); err != nil {
		return nil, err
	}
	if im, err = h.s.images.Resolve(dst); err != nil {
		return nil, err
	}
	return connect.NewResponse(&imagev1.TagImageResponse{Image: imageproto.Image(im)}), nil
}

func (h *imageService) DeleteImage(ctx context.Context, req *connect.Request[imagev1.DeleteImageRequest]) (*connect.Response[imagev1.DeleteImageResponse], error) {
	ref, err := image.ParseRef(req.Msg.Name)
	if err != nil {
		return nil, err
	}
	if !principalFrom(ctx).CanAccess(ref.Project) {
		return nil, errdefs.PermissionDenied("image %q: belongs to %q, outside your key's project", req.Msg.Name, ref.Project)
	}
	if err := h.s.images.Delete(ref); err != nil {
		return nil, err
	}
	freed, err := h.s.pruneImages(ctx)
	if err != nil {
		h.s.log.Warn("free the blobs of a deleted image", logging.Image, req.Msg.Name, logging.Error, err)
	}
	return connect.NewResponse(&imagev1.DeleteImageResponse{FreedBytes: freed}), nil
}

// pruneImages frees the store's blobs that no name, no sandbox and no
// snapshot uses (image.Store.Prune), and only when every edge the watcher
// knows answered: a blob an unreachable edge's sandbox needs (to fork it
// to another node, or to restore its snapshot there) is never removed.
func (s *Server) pruneImages(ctx context.Context) (int64, error) {
	var keep []digest.Digest
	for _, n := range s.watcher.View().Nodes {
		c := s.edges.Get(n.Addr)
		sbs, err := c.Edge.ListSandboxes(ctx, connect.NewRequest(&edgev1.ListSandboxesRequest{Scope: project.Root}))
		if err != nil {
			return 0, errdefs.Unavailable("edge %s did not list its sandboxes, so no blob is freed: %v", n.Addr, err)
		}
		for _, sb := range sbs.Msg.Sandboxes {
			keep = append(keep, digest.Digest(sb.ImageDigest))
		}
		snaps, err := c.Edge.ListSnapshots(ctx, connect.NewRequest(&edgev1.ListSnapshotsRequest{Scope: project.Root}))
		if err != nil {
			return 0, errdefs.Unavailable("edge %s did not list its snapshots, so no blob is freed: %v", n.Addr, err)
		}
		for _, sn := range snaps.Msg.Snapshots {
			keep = append(keep, digest.Digest(sn.ImageDigest))
		}
	}
	return s.images.Prune(keep, image.PruneGrace)
}

// importImage takes an image archive as the request body:
// POST /v1/images:import?name=project/name:tag
func (s *Server) importImage(w http.ResponseWriter, r *http.Request) {
	fail := func(err error) { errdefs.WriteHTTP(w, err) }
	p, err := s.authenticate(r.Header)
	if err != nil {
		fail(err)
		return
	}
	ref, err := image.ParseRef(r.URL.Query().Get("name"))
	if err != nil {
		fail(err)
		return
	}
	if !p.CanAccess(ref.Project) {
		fail(errdefs.PermissionDenied("image %q: project %q is outside your key's project %q", ref.String(), ref.Project, p.Project))
		return
	}
	budget, err := s.storageBudgetFor(r.Context(), ref.Project)
	if err != nil {
		fail(err)
		return
	}
	defer budget.done()
	if err := budget.take(1); err != nil {
		fail(err)
		return
	}
	opts := image.ImportOptions{Size: r.ContentLength}
	if budget.limited() {
		opts.Room = budget.take
	}
	im, err := s.images.Import(r.Context(), r.Body, ref, opts)
	if err != nil {
		fail(err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]any{"name": im.Ref.String(), "digest": im.Digest.String(), "size_bytes": im.Size(), "layers": len(im.Manifest.Layers)}) //nolint:errcheck // the client went away
}

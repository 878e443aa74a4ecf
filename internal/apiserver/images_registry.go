package apiserver

import (
	"context"
	"sync"
	"time"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/imageproto"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/registry"
)

// RegistryConfig is how the apiserver reaches OCI registries.
type RegistryConfig struct {
	// Insecure lists registries ("host" or "host:port") reached over plain
	// HTTP besides loopback ones.
	Insecure []string
	// Allowed, if set, lists the only registries pulls and pushes may name
	// (registry.Options.Allowed).
	Allowed []string
	// DockerConfig is a docker config file with the apiserver's own logins
	// (and credential helpers), used when a request brings none. It is read
	// at each pull, so a rotated login needs no restart.
	DockerConfig string
}

func (s *Server) registryOptions(ctx context.Context, cr *imagev1.RegistryCredentials, progress image.Progress) (registry.Options, error) {
	o := registry.Options{Insecure: s.cfg.Registries.Insecure, Allowed: s.cfg.Registries.Allowed, Progress: progress, UserAgent: "opendsec-apiserver"}
	if cr != nil {
		o.Credentials = registry.Credentials{Username: cr.Username, Password: cr.Password, IdentityToken: cr.IdentityToken}
	}
	if o.Credentials.Empty() && s.cfg.Registries.DockerConfig != "" {
		c, err := registry.LoadDockerConfig(s.cfg.Registries.DockerConfig)
		if err != nil {
			return o, errdefs.FailedPrecondition("the apiserver's registry logins: %v", err)
		}
		o.Config = c
	}
	return o, nil
}

// progressSender sends progress at most every 200 ms per stage, and every
// stage's first and last report, so that a fast pull does not flood its
// caller and a slow one shows movement.
type progressSender struct {
	mu    sync.Mutex
	send  func(*imagev1.Progress) error
	stage string
	last  time.Time
	err   error
}

func (p *progressSender) report(stage string, done, total int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	if p.err != nil || (stage == p.stage && now.Sub(p.last) < 200*time.Millisecond && (total == 0 || done < total)) {
		return
	}
	p.stage, p.last = stage, now
	p.err = p.send(&imagev1.Progress{Stage: stage, Done: done, Total: total})
}

func (h *imageService) PullImage(ctx context.Context, req *connect.Request[imagev1.PullImageRequest], stream *connect.ServerStream[imagev1.PullImageResponse]) error {
	p := principalFrom(ctx)
	src, err := registry.ParseReference(req.Msg.Source)
	if err != nil {
		return err
	}
	var as image.Ref
	if req.Msg.Name != "" {
		as, err = image.ParseRef(req.Msg.Name)
	} else {
		as, err = registry.DefaultName(src, p.Project)
	}
	if err != nil {
		return err
	}
	if !p.CanAccess(as.Project) {
		return errdefs.PermissionDenied("image %q: project %q is outside your key's project %q", as.String(), as.Project, p.Project)
	}
	budget, err := h.s.storageBudgetFor(ctx, as.Project)
	if err != nil {
		return err
	}
	defer budget.done()
	ps := &progressSender{send: func(pr *imagev1.Progress) error { return stream.Send(&imagev1.PullImageResponse{Progress: pr}) }}
	o, err := h.s.registryOptions(ctx, req.Msg.Credentials, ps.report)
	if err != nil {
		return err
	}
	if budget.limited() {
		o.Room = budget.take
	}
	start := time.Now()
	im, err := registry.Pull(ctx, h.s.images, req.Msg.Source, as, o)
	if err != nil {
		return err
	}
	h.s.log.Info("image pulled", logging.Image, im.Ref.String(), "source", req.Msg.Source, "digest", im.Digest.String(), "bytes", im.Size(), "took", time.Since(start).Round(time.Millisecond))
	return stream.Send(&imagev1.PullImageResponse{Image: imageproto.Image(im)})
}

func (h *imageService) PushImage(ctx context.Context, req *connect.Request[imagev1.PushImageRequest], stream *connect.ServerStream[imagev1.PushImageResponse]) error {
	ref, err := image.ParseRef(req.Msg.Name)
	if err != nil {
		return err
	}
	if !readable(principalFrom(ctx), ref.Project) {
		return errdefs.NotFound("image %q: not in the image store", req.Msg.Name)
	}
	im, err := h.s.images.Resolve(ref)
	if err != nil {
		return err
	}
	ps := &progressSender{send: func(pr *imagev1.Progress) error { return stream.Send(&imagev1.PushImageResponse{Progress: pr}) }}
	o, err := h.s.registryOptions(ctx, req.Msg.Credentials, ps.report)
	if err != nil {
		return err
	}
	d, err := registry.Push(ctx, h.s.images, im, req.Msg.Destination, o)
	if err != nil {
		return err
	}
	h.s.log.Info("image pushed", logging.Image, im.Ref.String(), "destination", req.Msg.Destination, "digest", d.String())
	return stream.Send(&imagev1.PushImageResponse{Digest: d.String()})
}

package edge

import (
	"context"
	"fmt"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// WarmImage prepares the node for the first sandbox of spec's image and
// shape (only its image, backend, resources and network are read), as
// project sees images. prepared says whether it made something now; note
// says what, or why nothing was needed.
func (e *Edge) WarmImage(ctx context.Context, spec *sandboxv1.SandboxSpec, project string) (prepared bool, note string, err error) {
	if project == "" {
		return false, "", errdefs.InvalidArgument("project: empty")
	}
	if err := sandboxspec.Normalize(spec, e.cfg.Limits, e.backends.known()); err != nil {
		return false, "", err
	}
	be, err := e.backendFor(spec)
	if err != nil {
		return false, "", err
	}
	w, ok := be.(backend.Warmer)
	if !ok {
		return false, fmt.Sprintf("backend %q has nothing to prepare: its first sandbox of an image costs what the others do", be.Name()), nil
	}
	im, err := e.parts.Resolve(spec.Image, project)
	if err != nil {
		return false, "", err
	}
	rec := &records.Record{ID: sandboxid.New(e.node), Project: project}
	if err := rec.SetSpec(spec); err != nil {
		return false, "", err
	}
	began := time.Now()
	prepared, err = e.parts.Warm(ctx, w, rec, im)
	if err != nil {
		return false, "", err
	}
	if !prepared {
		return false, fmt.Sprintf("backend %q had it prepared already", be.Name()), nil
	}
	e.log.Info("image warmed", "image", spec.Image, "backend", be.Name(), "took", time.Since(began).Round(time.Millisecond))
	return true, fmt.Sprintf("backend %q prepared it", be.Name()), nil
}

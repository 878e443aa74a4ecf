package edge

import (
	"context"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/imageproto"
)

// Commit names a new image made of sandbox id's image and what the sandbox
// changed in it (sandbox.Sandbox.Commit), in the shared store.
func (e *Edge) Commit(ctx context.Context, id, scope, name string, exclude []string, cfg *imagev1.ImageConfig) (*imagev1.Image, error) {
	ref, err := image.ParseRef(name)
	if err != nil {
		return nil, err
	}
	if _, err := image.ParseExclude(exclude); err != nil {
		return nil, err
	}
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	var config func(ocispec.ImageConfig) ocispec.ImageConfig
	if cfg != nil {
		config = func(base ocispec.ImageConfig) ocispec.ImageConfig { return imageproto.OCIConfig(base, cfg) }
	}
	im, err := sb.Commit(ctx, e.parts.Store, ref, exclude, config)
	if err != nil {
		return nil, err
	}
	return imageproto.Image(im), nil
}

package edge

import (
	"context"

	"google.golang.org/protobuf/types/known/timestamppb"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/image"
)

// Commit names a new image made of sandbox id's image and what the sandbox
// changed in it (sandbox.Sandbox.Commit), in the shared store.
func (e *Edge) Commit(ctx context.Context, id, scope, name string, exclude []string) (*imagev1.Image, error) {
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
	im, err := sb.Commit(ctx, e.parts.Store, ref, exclude)
	if err != nil {
		return nil, err
	}
	return &imagev1.Image{Name: im.Ref.String(), Digest: im.Digest.String(), SizeBytes: im.Size(), Layers: int32(len(im.Manifest.Layers)), CreatedAt: timestamppb.New(im.Created)}, nil
}

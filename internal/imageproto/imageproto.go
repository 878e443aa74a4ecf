// Package imageproto converts the image store's images and configs to and
// from the API's messages (opendsec.image.v1), for the apiserver and the
// edge alike.
package imageproto

import (
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"google.golang.org/protobuf/types/known/timestamppb"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/image"
)

// Image is im as the API shows it.
func Image(im *image.Image) *imagev1.Image {
	return &imagev1.Image{
		Name: im.Ref.String(), Digest: im.Digest.String(), SizeBytes: im.Size(), Layers: int32(len(im.Manifest.Layers)),
		CreatedAt: timestamppb.New(im.Created), Config: Config(im.Config.Config),
	}
}

// Config is an OCI image config as the API shows it.
func Config(c ocispec.ImageConfig) *imagev1.ImageConfig {
	return &imagev1.ImageConfig{Env: c.Env, WorkingDir: c.WorkingDir, User: c.User, Entrypoint: c.Entrypoint, Cmd: c.Cmd, Labels: c.Labels}
}

// OCIConfig is base with what c sets: c replaces the fields the API
// carries, and base's others (exposed ports, volumes, stop signal) stay.
func OCIConfig(base ocispec.ImageConfig, c *imagev1.ImageConfig) ocispec.ImageConfig {
	base.Env, base.WorkingDir, base.User = c.Env, c.WorkingDir, c.User
	base.Entrypoint, base.Cmd, base.Labels = c.Entrypoint, c.Cmd, c.Labels
	return base
}

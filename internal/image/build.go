package image

import (
	"runtime"
	"time"

	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

var time0 time.Time

// Commit writes a config and manifest for layers (lowest first) on top of
// base (nil for none) and names the result ref.
func (s *Store) Commit(ref Ref, base *Image, layers []Layer, cfg ocispec.ImageConfig) (*Image, error) {
	created := time.Now().UTC()
	img := ocispec.Image{
		Created:  &created,
		Platform: ocispec.Platform{OS: "linux", Architecture: runtime.GOARCH},
		Config:   cfg,
		RootFS:   ocispec.RootFS{Type: "layers"},
	}
	var descs []ocispec.Descriptor
	if base != nil {
		img.RootFS.DiffIDs = append(img.RootFS.DiffIDs, base.Config.RootFS.DiffIDs...)
		descs = append(descs, base.Manifest.Layers...)
		img.History = append(img.History, base.Config.History...)
	}
	for _, l := range layers {
		img.RootFS.DiffIDs = append(img.RootFS.DiffIDs, l.DiffID)
		descs = append(descs, l.Desc)
		img.History = append(img.History, ocispec.History{Created: &created, CreatedBy: "opendsec"})
	}
	cd, cn, err := s.PutJSON(img)
	if err != nil {
		return nil, err
	}
	m := ocispec.Manifest{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageManifest,
		Config:    ocispec.Descriptor{MediaType: ocispec.MediaTypeImageConfig, Digest: cd, Size: cn},
		Layers:    descs,
	}
	md, _, err := s.PutJSON(m)
	if err != nil {
		return nil, err
	}
	if err := s.Tag(ref, md); err != nil {
		return nil, err
	}
	return s.Resolve(ref)
}

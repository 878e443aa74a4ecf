package registry

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// Push uploads a stored image to dst (a registry reference with a tag or
// the image's own digest). Blobs the registry has are not sent again (it
// is asked first), as docker and skopeo do; the manifest goes last, byte
// for byte as stored, so the image keeps its digest.
func Push(ctx context.Context, s *image.Store, im *image.Image, dst string, o Options) (digest.Digest, error) {
	ref, err := ParseReference(dst)
	if err != nil {
		return "", err
	}
	reg := ref.Context().RegistryStr()
	if err := o.checkAllowed(reg); err != nil {
		return "", err
	}
	raw, err := s.ReadBlob(im.Digest, 4<<20)
	if err != nil {
		return "", err
	}
	img, err := partial.CompressedToImage(&storeImage{s: s, raw: raw, m: im.Manifest})
	if err != nil {
		return "", err
	}
	auth, err := o.authenticator(ctx, ref.Context().Registry)
	if err != nil {
		return "", err
	}
	ropts := o.remoteOptions(ctx, auth)
	updates := make(chan v1.Update, 16)
	done := make(chan struct{})
	stage := fmt.Sprintf("pushing %d layers to %s", len(im.Manifest.Layers), ref)
	go func() {
		defer close(done)
		for u := range updates {
			o.Progress.Report(stage, u.Complete, u.Total)
		}
	}()
	err = remote.Write(ref, img, append(ropts, remote.WithProgress(updates), remote.WithJobs(4))...)
	<-done // remote.Write closes updates
	if err != nil {
		return "", classify(reg, "push of "+ref.String(), err)
	}
	return im.Digest, nil
}

// storeImage is a stored image as go-containerregistry reads one: its
// manifest as stored and its blobs from the store's files.
type storeImage struct {
	s   *image.Store
	raw []byte
	m   ocispec.Manifest
}

func (i *storeImage) RawManifest() ([]byte, error) { return i.raw, nil }

func (i *storeImage) MediaType() (types.MediaType, error) {
	if i.m.MediaType == "" {
		return types.OCIManifestSchema1, nil
	}
	return types.MediaType(i.m.MediaType), nil
}

func (i *storeImage) RawConfigFile() ([]byte, error) {
	return i.s.ReadBlob(i.m.Config.Digest, maxConfigSize)
}

func (i *storeImage) LayerByDigest(h v1.Hash) (partial.CompressedLayer, error) {
	for _, l := range append([]ocispec.Descriptor{i.m.Config}, i.m.Layers...) {
		if l.Digest.String() == h.String() {
			return &storeBlob{s: i.s, d: l}, nil
		}
	}
	return nil, errdefs.NotFound("blob %s: not in the image's manifest", h)
}

type storeBlob struct {
	s *image.Store
	d ocispec.Descriptor
}

func (b *storeBlob) Digest() (v1.Hash, error) { return v1.NewHash(b.d.Digest.String()) }
func (b *storeBlob) Size() (int64, error)     { return b.d.Size, nil }
func (b *storeBlob) MediaType() (types.MediaType, error) {
	return types.MediaType(b.d.MediaType), nil
}

func (b *storeBlob) Compressed() (io.ReadCloser, error) {
	if b.d.Digest == "" {
		return io.NopCloser(bytes.NewReader(nil)), nil
	}
	f, err := os.Open(b.s.BlobPath(b.d.Digest))
	if err != nil {
		return nil, errdefs.NotFound("blob %s of the image: %v", b.d.Digest, err)
	}
	return f, nil
}

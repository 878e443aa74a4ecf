package image

import (
	"archive/tar"
	"encoding/json"
	"io"
	"os"

	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Export writes im as an OCI image layout tar, importable by Import here or
// by any OCI tool.
func (s *Store) Export(im *Image, w io.Writer) error {
	tw := tar.NewWriter(w)
	add := func(name string, data []byte) error {
		if err := tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	layout, _ := json.Marshal(ocispec.ImageLayout{Version: ocispec.ImageLayoutVersion})
	if err := add(ocispec.ImageLayoutFile, layout); err != nil {
		return err
	}
	index, _ := json.Marshal(ocispec.Index{
		Versioned: specs.Versioned{SchemaVersion: 2},
		MediaType: ocispec.MediaTypeImageIndex,
		Manifests: []ocispec.Descriptor{{
			MediaType:   ocispec.MediaTypeImageManifest,
			Digest:      im.Digest,
			Size:        blobSize(s, im.Digest),
			Annotations: map[string]string{ocispec.AnnotationRefName: im.Ref.Tag},
		}},
	})
	if err := add("index.json", index); err != nil {
		return err
	}
	blobs := []digest.Digest{im.Digest, im.Manifest.Config.Digest}
	for _, l := range im.Manifest.Layers {
		blobs = append(blobs, l.Digest)
	}
	for _, d := range blobs {
		f, err := os.Open(s.BlobPath(d))
		if err != nil {
			return err
		}
		fi, _ := f.Stat()
		if err := tw.WriteHeader(&tar.Header{Name: "blobs/sha256/" + d.Encoded(), Mode: 0o644, Size: fi.Size(), Typeflag: tar.TypeReg}); err != nil {
			f.Close()
			return err
		}
		_, err = io.Copy(tw, f)
		f.Close()
		if err != nil {
			return err
		}
	}
	return tw.Close()
}

func blobSize(s *Store, d digest.Digest) int64 {
	fi, err := os.Stat(s.BlobPath(d))
	if err != nil {
		return 0
	}
	return fi.Size()
}

package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// Platform is the one platform sandboxes run.
var Platform = v1.Platform{OS: "linux", Architecture: "amd64"}

// maxConfigSize bounds an image config (a few KiB; history can make it
// larger).
const maxConfigSize = 8 << 20

// blobAttempts is how many times in a row a layer download may fail
// without moving on before the pull gives up (the next pull continues it).
const blobAttempts = 4

// Pull copies src (a registry reference) into the store and names it as.
// A multi-platform index is resolved to linux/amd64; layers the store holds
// are not fetched; a layer whose download breaks continues where it
// stopped, within this pull (a few attempts) or in the next one. The name
// is set last, once every blob is stored and checked: a pull that fails
// leaves no name, and no blob that is not what its digest says.
func Pull(ctx context.Context, s *image.Store, src string, as image.Ref, o Options) (*image.Image, error) {
	ref, err := ParseReference(src)
	if err != nil {
		return nil, err
	}
	reg := ref.Context().RegistryStr()
	if err := o.checkAllowed(reg); err != nil {
		return nil, err
	}
	auth, err := o.authenticator(ctx, ref.Context().Registry)
	if err != nil {
		return nil, err
	}
	ropts := o.remoteOptions(ctx, auth)
	o.Progress.Report("resolving "+ref.String(), 0, 0)
	desc, err := remote.Get(ref, append(ropts, remote.WithPlatform(Platform))...)
	if err != nil {
		return nil, classify(reg, "manifest of "+ref.String(), err)
	}
	switch desc.MediaType {
	case types.DockerManifestSchema1, types.DockerManifestSchema1Signed:
		return nil, errdefs.Unsupported("registry %s: %s is a Docker schema 1 image (deprecated since 2017); push it again with a current docker or skopeo", reg, ref)
	}
	img, err := desc.Image() // an index resolves to its linux/amd64 image
	if err != nil {
		if desc.MediaType.IsIndex() {
			return nil, errdefs.NotFound("registry %s: %s has no linux/amd64 image: %v", reg, ref, err)
		}
		return nil, classify(reg, "image "+ref.String(), err)
	}
	raw, err := img.RawManifest()
	if err != nil {
		return nil, classify(reg, "manifest of "+ref.String(), err)
	}
	mdig, err := img.Digest()
	if err != nil {
		return nil, err
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, errdefs.InvalidArgument("registry %s: manifest of %s: %v", reg, ref, err)
	}
	if err := image.CheckManifest(m); err != nil {
		return nil, fmt.Errorf("registry %s: %s: %w", reg, ref, err)
	}
	var need int64
	for _, l := range m.Layers {
		if !s.HasBlob(l.Digest) {
			need += l.Size
		}
	}
	if o.Room != nil {
		if err := o.Room(need); err != nil {
			return nil, err
		}
	}
	if m.Config.Size > maxConfigSize {
		return nil, errdefs.InvalidArgument("registry %s: config of %s is %d bytes, more than %d", reg, ref, m.Config.Size, maxConfigSize)
	}
	f, err := newFetcher(ctx, ref.Context(), auth, &o)
	if err != nil {
		return nil, classify(reg, "log in", err)
	}
	if err := f.fetch(ctx, s, m.Config, "config "+m.Config.Digest.Encoded()[:12]); err != nil {
		return nil, err
	}
	// Each layer's EROFS form is made while the next ones download.
	forms := s.StartEROFS(ctx)
	defer forms.Wait()
	for i, l := range m.Layers {
		stage := fmt.Sprintf("layer %d/%d %s", i+1, len(m.Layers), l.Digest.Encoded()[:12])
		if err := f.fetch(ctx, s, l, stage); err != nil {
			return nil, err
		}
		forms.Add(l)
	}
	forms.Wait()
	if _, _, err := s.PutBlob(strings.NewReader(string(raw)), digest.Digest(mdig.String())); err != nil {
		return nil, err
	}
	if err := s.Tag(as, digest.Digest(mdig.String())); err != nil {
		return nil, err
	}
	return s.Resolve(as)
}

// fetcher downloads blobs of one repository over an authenticated
// transport.
type fetcher struct {
	repo   name.Repository
	scheme string
	client *http.Client
	o      *Options
}

func newFetcher(ctx context.Context, repo name.Repository, auth authn.Authenticator, o *Options) (*fetcher, error) {
	base := o.transport()
	rt, err := transport.NewWithContext(ctx, repo.Registry, auth, base, []string{repo.Scope(transport.PullScope)})
	if err != nil {
		return nil, err
	}
	return &fetcher{repo: repo, scheme: scheme(ctx, repo.RegistryStr(), base, o.Insecure), client: &http.Client{Transport: rt}, o: o}, nil
}

// scheme is https unless the registry may be reached over plain HTTP and
// does not answer TLS.
func scheme(ctx context.Context, host string, rt http.RoundTripper, insecure []string) string {
	if !plainHTTPAllowed(host, insecure) {
		return "https"
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+host+"/v2/", nil)
	resp, err := rt.RoundTrip(req)
	if err != nil {
		return "http"
	}
	resp.Body.Close()
	return "https"
}

// fetch stores one layer unless the store holds it, continuing a partial
// download and retrying a broken one.
func (f *fetcher) fetch(ctx context.Context, s *image.Store, l ocispec.Descriptor, stage string) error {
	reg := f.repo.RegistryStr()
	p, err := s.OpenPartialBlob(l.Digest)
	if errors.Is(err, image.ErrBlobPresent) {
		f.o.Progress.Report(stage+" (in the store)", l.Size, l.Size)
		return nil
	}
	if err != nil {
		return err
	}
	defer p.Close()
	var last error
	// An attempt that moved the download on does not count: a connection
	// that keeps breaking but keeps progressing gets there.
	for fails := 0; fails < blobAttempts; {
		before := p.Offset
		last = f.download(ctx, p, l, stage)
		if last == nil {
			return p.Commit()
		}
		if !retryable(last) {
			break
		}
		if p.Offset > before {
			continue
		}
		fails++
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(fails) * 500 * time.Millisecond):
		}
	}
	return classify(reg, "layer "+l.Digest.String(), last)
}

type permanent struct{ error }

func (p permanent) Unwrap() error { return p.error }

func retryable(err error) bool {
	var perm permanent
	return !errors.As(err, &perm) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded)
}

// download appends the rest of the blob to p: a range request from
// p.Offset, or the whole blob again if the registry does not serve ranges.
func (f *fetcher) download(ctx context.Context, p *image.PartialBlob, l ocispec.Descriptor, stage string) error {
	if p.Offset > l.Size {
		if err := p.Restart(); err != nil {
			return permanent{err}
		}
	}
	if p.Offset == l.Size && l.Size > 0 {
		return nil // all there; Commit checks it
	}
	url := fmt.Sprintf("%s://%s/v2/%s/blobs/%s", f.scheme, f.repo.RegistryStr(), f.repo.RepositoryStr(), l.Digest)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return permanent{err}
	}
	if p.Offset > 0 {
		// A closed range: some registries (go-containerregistry's) read
		// only that form.
		req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", p.Offset, l.Size-1))
	}
	resp, err := f.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusPartialContent && contentRangeStart(resp.Header.Get("Content-Range")) == p.Offset:
	case resp.StatusCode == http.StatusOK:
		if err := p.Restart(); err != nil {
			return permanent{err}
		}
	case resp.StatusCode == http.StatusRequestedRangeNotSatisfiable || resp.StatusCode == http.StatusPartialContent:
		if err := p.Restart(); err != nil {
			return permanent{err}
		}
		return errors.New("the registry could not continue the download; starting over")
	default:
		terr := transport.CheckError(resp, http.StatusOK)
		if resp.StatusCode >= 500 || resp.StatusCode == http.StatusTooManyRequests {
			return terr
		}
		return permanent{terr}
	}
	// One byte past the declared size is read, to catch a longer blob.
	body := io.LimitReader(resp.Body, l.Size-p.Offset+1)
	buf := make([]byte, 256<<10)
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			if _, err := p.Write(buf[:n]); err != nil {
				return permanent{err}
			}
			f.o.Progress.Report(stage, p.Offset, l.Size)
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return rerr
		}
	}
	if p.Offset != l.Size {
		if p.Offset > l.Size {
			p.Restart() //nolint:errcheck // reported below
			return permanent{errdefs.InvalidArgument("layer %s: the registry sent more than the %d bytes its manifest declares", l.Digest, l.Size)}
		}
		return io.ErrUnexpectedEOF
	}
	return nil
}

func contentRangeStart(h string) int64 {
	// "bytes START-END/SIZE"
	h = strings.TrimPrefix(h, "bytes ")
	start, _, ok := strings.Cut(h, "-")
	if !ok {
		return -1
	}
	n, err := strconv.ParseInt(start, 10, 64)
	if err != nil {
		return -1
	}
	return n
}

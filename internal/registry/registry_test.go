package registry

import (
	"context"
	"errors"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	ggcr "github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/opencontainers/go-digest"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// testRegistry is go-containerregistry's in-process registry behind a
// handler the test can bend (cut a blob short, corrupt it, ask a login).
type testRegistry struct {
	host string
	mu   sync.Mutex
	// blobGets counts GETs of each blob; ranges records Range headers.
	blobGets map[string]int
	ranges   []string
	// cut, if set, ends a blob GET after this many bytes.
	cut atomic.Int64
	// corrupt flips a byte of blob bodies.
	corrupt atomic.Bool
	// user:password required, if set.
	login string
	// all counts every request.
	all atomic.Int64
}

func newTestRegistry(t *testing.T) *testRegistry {
	t.Helper()
	tr := &testRegistry{blobGets: map[string]int{}}
	inner := ggcr.New(ggcr.Logger(log.New(io.Discard, "", 0)))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tr.all.Add(1)
		if tr.login != "" {
			u, p, ok := r.BasicAuth()
			if !ok || u+":"+p != tr.login {
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				w.WriteHeader(http.StatusUnauthorized)
				w.Write([]byte(`{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`))
				return
			}
		}
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/sha256:") {
			d := r.URL.Path[strings.LastIndex(r.URL.Path, "/")+1:]
			tr.mu.Lock()
			tr.blobGets[d]++
			if rg := r.Header.Get("Range"); rg != "" {
				tr.ranges = append(tr.ranges, rg)
			}
			tr.mu.Unlock()
			w = &bentWriter{ResponseWriter: w, left: tr.cut.Load(), corrupt: tr.corrupt.Load()}
		}
		inner.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	tr.host = strings.TrimPrefix(srv.URL, "http://")
	return tr
}

func (tr *testRegistry) requests() int64 { return tr.all.Load() }

func (tr *testRegistry) gets(d string) int {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	return tr.blobGets[d]
}

type bentWriter struct {
	http.ResponseWriter
	left    int64 // 0: no cut
	corrupt bool
}

func (b *bentWriter) Write(p []byte) (int, error) {
	if b.corrupt && len(p) > 0 {
		q := append([]byte(nil), p...)
		q[0] ^= 0xff
		p, b.corrupt = q, false
	}
	if b.left > 0 {
		if int64(len(p)) >= b.left {
			b.ResponseWriter.Write(p[:b.left])
			b.ResponseWriter.(http.Flusher).Flush()
			panic(http.ErrAbortHandler) // the connection breaks mid-blob
		}
		b.left -= int64(len(p))
	}
	return b.ResponseWriter.Write(p)
}

func (b *bentWriter) Flush() { b.ResponseWriter.(http.Flusher).Flush() }

func pushRandom(t *testing.T, tr *testRegistry, repo string, size, layers int64) v1.Image {
	t.Helper()
	img, err := random.Image(size, layers)
	if err != nil {
		t.Fatal(err)
	}
	ref, err := name.ParseReference(tr.host + "/" + repo)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	return img
}

func newStore(t *testing.T) *image.Store {
	t.Helper()
	s, err := image.OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustRef(t *testing.T, s string) image.Ref {
	t.Helper()
	r, err := image.ParseRef(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func digestOf(t *testing.T, img v1.Image) digest.Digest {
	t.Helper()
	h, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return digest.Digest(h.String())
}

func TestPullStoresTheImageByteForByte(t *testing.T) {
	tr := newTestRegistry(t)
	img := pushRandom(t, tr, "team/app:1.0", 64<<10, 3)
	s := newStore(t)
	var stages []string
	o := Options{Progress: func(stage string, done, total int64) {
		if len(stages) == 0 || stages[len(stages)-1] != stage {
			stages = append(stages, stage)
		}
	}}
	im, err := Pull(context.Background(), s, tr.host+"/team/app:1.0", mustRef(t, "root/app:1.0"), o)
	if err != nil {
		t.Fatal(err)
	}
	if im.Digest != digestOf(t, img) || len(im.Manifest.Layers) != 3 {
		t.Fatalf("pulled %s with %d layers; pushed %s with 3", im.Digest, len(im.Manifest.Layers), digestOf(t, img))
	}
	for _, l := range im.Manifest.Layers {
		if _, err := s.ReadBlob(l.Digest, 1<<20); err != nil {
			t.Fatalf("layer %s: %v", l.Digest, err)
		}
	}
	if n := strings.Count(strings.Join(stages, "\n"), "layer "); n != 3 {
		t.Fatalf("want a progress stage per layer, got %q", stages)
	}
}

func TestPullResolvesAnIndexToLinuxAMD64(t *testing.T) {
	tr := newTestRegistry(t)
	arm, _ := random.Image(1024, 1)
	amd, _ := random.Image(1024, 1)
	idx := mutate.AppendManifests(empty.Index,
		mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}},
		mutate.IndexAddendum{Add: amd, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "amd64"}}},
	)
	ref, _ := name.ParseReference(tr.host + "/multi:latest")
	if err := remote.WriteIndex(ref, idx); err != nil {
		t.Fatal(err)
	}
	im, err := Pull(context.Background(), newStore(t), tr.host+"/multi", mustRef(t, "root/multi:latest"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if im.Digest != digestOf(t, amd) {
		t.Fatalf("pulled %s; the amd64 image is %s (arm64 %s)", im.Digest, digestOf(t, amd), digestOf(t, arm))
	}

	onlyArm := mutate.AppendManifests(empty.Index, mutate.IndexAddendum{Add: arm, Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: "arm64"}}})
	ref2, _ := name.ParseReference(tr.host + "/armonly:latest")
	if err := remote.WriteIndex(ref2, onlyArm); err != nil {
		t.Fatal(err)
	}
	_, err = Pull(context.Background(), newStore(t), tr.host+"/armonly", mustRef(t, "root/armonly:latest"), Options{})
	if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), "linux/amd64") {
		t.Fatalf("an index without linux/amd64: %v", err)
	}
}

func TestPullSkipsLayersTheStoreHas(t *testing.T) {
	tr := newTestRegistry(t)
	img := pushRandom(t, tr, "app:1", 32<<10, 2)
	s := newStore(t)
	if _, err := Pull(context.Background(), s, tr.host+"/app:1", mustRef(t, "root/app:1"), Options{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Pull(context.Background(), s, tr.host+"/app:1", mustRef(t, "root/other:1"), Options{}); err != nil {
		t.Fatal(err)
	}
	layers, _ := img.Layers()
	for _, l := range layers {
		h, _ := l.Digest()
		if n := tr.gets(h.String()); n != 1 {
			t.Fatalf("layer %s fetched %d times over two pulls; want once", h, n)
		}
	}
}

func TestPullContinuesABrokenDownload(t *testing.T) {
	tr := newTestRegistry(t)
	pushRandom(t, tr, "big:1", 1<<20, 1)
	s := newStore(t)
	tr.cut.Store(100 << 10) // every GET breaks after 100 KiB: each attempt moves on
	im, err := Pull(context.Background(), s, tr.host+"/big:1", mustRef(t, "root/big:1"), Options{})
	if err != nil {
		t.Fatalf("a download that breaks but progresses: %v", err)
	}
	if len(tr.ranges) == 0 || !strings.HasPrefix(tr.ranges[0], "bytes=102400-") {
		t.Fatalf("want a range request from 100 KiB, got %q", tr.ranges)
	}
	if _, err := s.ReadBlob(im.Manifest.Layers[0].Digest, 4<<20); err != nil {
		t.Fatal(err)
	}
}

func TestPullResumesInTheNextPull(t *testing.T) {
	tr := newTestRegistry(t)
	pushRandom(t, tr, "big:1", 4<<20, 1)
	s := newStore(t)
	ctx, cancel := context.WithCancel(context.Background())
	o := Options{Progress: func(stage string, done, total int64) {
		if strings.HasPrefix(stage, "layer") && done > 1<<20 {
			cancel() // the caller goes away mid-layer
		}
	}}
	if _, err := Pull(ctx, s, tr.host+"/big:1", mustRef(t, "root/big:1"), o); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled pull: %v", err)
	}
	if _, err := s.Resolve(mustRef(t, "root/big:1")); !errdefs.IsNotFound(err) {
		t.Fatalf("a failed pull must leave no name: %v", err)
	}
	if _, err := Pull(context.Background(), s, tr.host+"/big:1", mustRef(t, "root/big:1"), Options{}); err != nil {
		t.Fatal(err)
	}
	if len(tr.ranges) != 1 || strings.HasPrefix(tr.ranges[0], "bytes=0-") {
		t.Fatalf("the second pull should continue the first one's layer, ranges %q", tr.ranges)
	}
	left, _ := filepath.Glob(filepath.Join(s.Dir(), "tmp", "partial-*"))
	if len(left) != 0 {
		t.Fatalf("partial files left: %v", left)
	}
}

func TestPullRefusesContentThatIsNotItsDigest(t *testing.T) {
	tr := newTestRegistry(t)
	img := pushRandom(t, tr, "app:1", 32<<10, 1)
	s := newStore(t)
	tr.corrupt.Store(true)
	_, err := Pull(context.Background(), s, tr.host+"/app:1", mustRef(t, "root/app:1"), Options{})
	if errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) || !strings.Contains(err.Error(), "digest") {
		t.Fatalf("corrupt layer: %v", err)
	}
	layers, _ := img.Layers()
	h, _ := layers[0].Digest()
	if s.HasBlob(digest.Digest(h.String())) {
		t.Fatal("a corrupt layer reached the store")
	}
	if _, err := s.Resolve(mustRef(t, "root/app:1")); !errdefs.IsNotFound(err) {
		t.Fatalf("name set after a failed pull: %v", err)
	}
}

func TestPullLogsIn(t *testing.T) {
	tr := newTestRegistry(t)
	pushRandom(t, tr, "private:1", 1024, 1)
	tr.login = "alice:s3cret"
	s := newStore(t)
	as := mustRef(t, "root/private:1")
	_, err := Pull(context.Background(), s, tr.host+"/private:1", as, Options{})
	if errdefs.Code(err) != errdefs.Code(errdefs.Unauthenticated("x")) {
		t.Fatalf("anonymous pull of a private image: %v", err)
	}
	_, err = Pull(context.Background(), s, tr.host+"/private:1", as, Options{Credentials: Credentials{Username: "alice", Password: "wrong"}})
	if errdefs.Code(err) != errdefs.Code(errdefs.Unauthenticated("x")) || !strings.Contains(err.Error(), tr.host) {
		t.Fatalf("wrong password: %v", err)
	}
	cfg, err := ParseDockerConfig([]byte(`{"auths":{"http://` + tr.host + `/v2/":{"auth":"YWxpY2U6czNjcmV0"}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Pull(context.Background(), s, tr.host+"/private:1", as, Options{Config: cfg}); err != nil {
		t.Fatalf("login from a docker config: %v", err)
	}
}

func TestPullOfWhatIsNotThere(t *testing.T) {
	tr := newTestRegistry(t)
	pushRandom(t, tr, "app:1", 1024, 1)
	s := newStore(t)
	for _, src := range []string{tr.host + "/app:2", tr.host + "/nothing:1"} {
		_, err := Pull(context.Background(), s, src, mustRef(t, "root/x:1"), Options{})
		if !errdefs.IsNotFound(err) || !strings.Contains(err.Error(), tr.host) {
			t.Fatalf("%s: %v", src, err)
		}
	}
	_, err := Pull(context.Background(), s, "127.0.0.1:1/app:1", mustRef(t, "root/x:1"), Options{})
	if errdefs.Code(err) != errdefs.Code(errdefs.Unavailable("x")) {
		t.Fatalf("a registry that does not answer: %v", err)
	}
}

func TestTwoPullersOfOneImageIntoOneStore(t *testing.T) {
	tr := newTestRegistry(t)
	img := pushRandom(t, tr, "app:1", 2<<20, 3)
	dir := t.TempDir()
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := image.OpenStore(dir) // each its own handle, as two apiservers
			if err == nil {
				_, err = Pull(context.Background(), s, tr.host+"/app:1", mustRef(t, "root/app:1"), Options{})
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	s, _ := image.OpenStore(dir)
	im, err := s.Resolve(mustRef(t, "root/app:1"))
	if err != nil || im.Digest != digestOf(t, img) {
		t.Fatalf("resolve: %v %v", im, err)
	}
	for _, l := range im.Manifest.Layers {
		if _, err := s.ReadBlob(l.Digest, 8<<20); err != nil {
			t.Fatalf("layer %s: %v", l.Digest, err)
		}
		if n := tr.gets(l.Digest.String()); n != 1 {
			t.Fatalf("layer %s fetched %d times by two pullers; want once", l.Digest, n)
		}
	}
	left, _ := os.ReadDir(filepath.Join(dir, "tmp"))
	if len(left) != 0 {
		t.Fatalf("left in tmp: %v", left)
	}
}

func TestPushThenPullUnderAnotherName(t *testing.T) {
	tr := newTestRegistry(t)
	img := pushRandom(t, tr, "src:1", 16<<10, 2)
	s := newStore(t)
	im, err := Pull(context.Background(), s, tr.host+"/src:1", mustRef(t, "root/src:1"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	var last int64
	d, err := Push(context.Background(), s, im, tr.host+"/copies/dst:2", Options{Progress: func(_ string, done, _ int64) { last = done }})
	if err != nil {
		t.Fatal(err)
	}
	if d != digestOf(t, img) || last == 0 {
		t.Fatalf("pushed %s (progress %d); the image is %s", d, last, digestOf(t, img))
	}
	ref, _ := name.ParseReference(tr.host + "/copies/dst:2")
	desc, err := remote.Head(ref)
	if err != nil || desc.Digest.String() != d.String() {
		t.Fatalf("registry has %v (%v); want %s", desc, err, d)
	}
}

func TestTLSGuard(t *testing.T) {
	for _, c := range []struct {
		host     string
		insecure []string
		want     bool
	}{
		{"127.0.0.1:5000", nil, true},
		{"localhost:5000", nil, true},
		{"[::1]:5000", nil, true},
		{"10.0.0.5:5000", nil, false},
		{"192.168.1.2", nil, false},
		{"registry.local:5000", nil, false},
		{"10.0.0.5:5000", []string{"10.0.0.5:5000"}, true},
		{"10.0.0.5:5000", []string{"10.0.0.5"}, true},
		{"10.0.0.5:5001", []string{"10.0.0.5:5000"}, false},
		{"example.com", nil, false},
	} {
		if got := plainHTTPAllowed(c.host, c.insecure); got != c.want {
			t.Errorf("plainHTTPAllowed(%q, %q) = %v", c.host, c.insecure, got)
		}
	}
	_, err := Pull(context.Background(), newStore(t), "10.255.255.1:5000/app:1", mustRef(t, "root/x:1"), Options{Transport: refuseAll{}})
	if errdefs.Code(err) != errdefs.Code(errdefs.PermissionDenied("x")) && !strings.Contains(err.Error(), "plain HTTP refused") {
		t.Fatalf("a private address over plain HTTP: %v", err)
	}
}

// refuseAll answers every TLS attempt with an error, as an unreachable
// registry would, without sending anything anywhere.
type refuseAll struct{}

func (refuseAll) RoundTrip(r *http.Request) (*http.Response, error) {
	return nil, errors.New("test: no network")
}

func TestParseReference(t *testing.T) {
	for _, bad := range []string{"", "http://127.0.0.1:5000/app", "UPPER/app", "app:bad tag", "app@sha256:123", strings.Repeat("a", 2000)} {
		if _, err := ParseReference(bad); errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
			t.Errorf("ParseReference(%q) = %v; want invalid argument", bad, err)
		}
	}
	for in, want := range map[string]string{
		"python:3.12":             "root/python:3.12",
		"127.0.0.1:5000/team/app": "root/app:latest",
		"ghcr.io/o/r/tool:v1.2":   "root/tool:v1.2",
		"127.0.0.1:5000/app@sha256:" + strings.Repeat("ab", 32): "root/app:sha256-abababababab",
	} {
		r, err := ParseReference(in)
		if err != nil {
			t.Fatalf("%s: %v", in, err)
		}
		n, err := DefaultName(r, "root")
		if err != nil || n.String() != want {
			t.Errorf("DefaultName(%s) = %v, %v; want %s", in, n, err, want)
		}
	}
}

func TestDockerConfigFor(t *testing.T) {
	c, err := ParseDockerConfig([]byte(`{"auths":{
		"https://index.docker.io/v1/":{"auth":"` + "aHViOnB3" + `"},
		"http://127.0.0.1:5000/v2/":{"username":"u","password":"p"},
		"ghcr.io":{"identitytoken":"tok"}}}`))
	if err != nil {
		t.Fatal(err)
	}
	for host, want := range map[string]Credentials{
		"docker.io":          {Username: "hub", Password: "pw"},
		"index.docker.io":    {Username: "hub", Password: "pw"},
		"127.0.0.1:5000":     {Username: "u", Password: "p"},
		"ghcr.io":            {IdentityToken: "tok"},
		"registry.other:443": {},
	} {
		got, err := c.For(context.Background(), host)
		if err != nil || got != want {
			t.Errorf("For(%s) = %+v, %v; want %+v", host, got, err, want)
		}
	}
	if _, err := ParseDockerConfig([]byte(`{"auths":{"x":{"auth":"bm9jb2xvbg=="}}}`)); err == nil || !strings.Contains(err.Error(), `auths["x"].auth`) {
		t.Fatalf("an auth without a colon: %v", err)
	}
}

// An operator's allow-list keeps pulls and pushes to the registries it
// names (docker.io meaning Docker Hub); a registry it lacks is refused
// before anything is sent to it.
func TestOnlyAllowedRegistriesAreReached(t *testing.T) {
	tr := newTestRegistry(t)
	pushRandom(t, tr, "team/app:1", 1024, 1)
	s := newStore(t)
	before := tr.requests()
	_, err := Pull(context.Background(), s, tr.host+"/team/app:1", mustRef(t, "root/app:1"), Options{Allowed: []string{"registry.example.com", "docker.io"}})
	if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "registry.example.com, docker.io") {
		t.Fatalf("a pull from a registry not allowed: %v", err)
	}
	if tr.requests() != before {
		t.Fatal("the refused registry was sent requests")
	}
	im, err := Pull(context.Background(), s, tr.host+"/team/app:1", mustRef(t, "root/app:1"), Options{Allowed: []string{tr.host}})
	if err != nil {
		t.Fatalf("a pull from an allowed registry: %v", err)
	}
	if _, err := Push(context.Background(), s, im, "registry.example.com/x:1", Options{Allowed: []string{tr.host}}); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("a push to a registry not allowed: %v", err)
	}
	hub := Options{Allowed: []string{"docker.io"}}
	if err := hub.checkAllowed(name.DefaultRegistry); err != nil {
		t.Fatalf("docker.io does not allow Docker Hub: %v", err)
	}
}

// No registry, and no redirect of one, reaches a link-local address:
// cloud metadata services answer there.
func TestLinkLocalAddressesAreNeverDialled(t *testing.T) {
	for addr, refused := range map[string]bool{"169.254.169.254:80": true, "[fe80::1]:443": true, "127.0.0.1:5000": false, "10.0.0.1:443": false, "[::1]:5000": false} {
		err := refuseLinkLocal("tcp", addr, nil)
		if refused != (err != nil) {
			t.Errorf("%s: %v; refused %v", addr, err, refused)
		}
	}
	resp, err := guardedTransport.RoundTrip(httptestRequest(t, "http://169.254.169.254/latest/meta-data/"))
	if err == nil {
		resp.Body.Close()
		t.Fatal("the transport reached a link-local address")
	}
	if !strings.Contains(err.Error(), "link-local") {
		t.Fatalf("refused for another reason: %v", err)
	}
}

func httptestRequest(t *testing.T, url string) *http.Request {
	t.Helper()
	r, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

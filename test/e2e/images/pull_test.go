// Package images tests images as users bring them: pulled from and pushed
// to a real registry (Debian's docker-registry on loopback), built and
// inspected by tools independent of ours (skopeo), run on every backend.
package images

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// cuttingProxy stands between the apiserver and the registry and breaks
// every blob download after cut bytes, recording the Range headers the
// puller sends to continue.
type cuttingProxy struct {
	host      string
	cut       int64
	mu        sync.Mutex
	ranges    []string
	blobGets  atomic.Int64
	cutsTaken atomic.Int64
}

func newCuttingProxy(t *testing.T, registry string, cut int64) *cuttingProxy {
	p := &cuttingProxy{cut: cut}
	target, _ := url.Parse("http://" + registry)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.ModifyResponse = func(resp *http.Response) error {
		if resp.Request.Method == http.MethodGet && strings.Contains(resp.Request.URL.Path, "/blobs/sha256:") && resp.ContentLength > p.cut {
			resp.Body = &cutBody{ReadCloser: resp.Body, left: p.cut, taken: &p.cutsTaken}
		}
		return nil
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/blobs/sha256:") {
			p.blobGets.Add(1)
			if rg := r.Header.Get("Range"); rg != "" {
				p.mu.Lock()
				p.ranges = append(p.ranges, rg)
				p.mu.Unlock()
			}
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	p.host = strings.TrimPrefix(srv.URL, "http://")
	return p
}

type cutBody struct {
	io.ReadCloser
	left  int64
	taken *atomic.Int64
}

func (c *cutBody) Read(b []byte) (int, error) {
	if c.left <= 0 {
		c.taken.Add(1)
		return 0, errors.New("test proxy: connection cut")
	}
	if int64(len(b)) > c.left {
		b = b[:c.left]
	}
	n, err := c.ReadCloser.Read(b)
	c.left -= int64(n)
	return n, err
}

func pullCluster(t *testing.T) *e2e.Cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "busybox")
	vm := e2e.MicrovmOptions(t)
	return e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.Backends["microvm"] = vm }, "container", "gvisor", "microvm")
}

// TestPullRunPush: an image skopeo pushed to a real registry is pulled
// through the API over a connection that keeps breaking (each layer
// continues with a range request), runs on every backend with exactly its
// files, whiteouts, links, modes, owners, ENV and WORKDIR, is pulled again
// under another name without fetching a layer, and pushed back: skopeo
// reads the same manifest.
func TestPullRunPush(t *testing.T) {
	c := pullCluster(t)
	reg := e2e.StartRegistry(t)
	fx := writeRichLayout(t, c.Images, 1, 24<<20)
	skopeoCopy(t, "oci:"+fx.layout+":rich", "docker://"+reg+"/team/rich:1")
	ctx := e2e.Ctx(t)

	proxy := newCuttingProxy(t, reg, 4<<20)
	var stages []string
	im, err := c.Client.PullImage(ctx, proxy.host+"/team/rich:1", "root/rich:1", nil, func(stage string, done, total int64) {
		if len(stages) == 0 || stages[len(stages)-1] != stage {
			stages = append(stages, stage)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if im.Layers != 3 || proxy.cutsTaken.Load() == 0 || len(proxy.ranges) == 0 {
		t.Fatalf("pulled %d layers; the proxy cut %d downloads and saw ranges %q", im.Layers, proxy.cutsTaken.Load(), proxy.ranges)
	}
	if n := strings.Count(strings.Join(stages, "\n"), "layer "); n < 3 {
		t.Fatalf("want progress for each layer, got %q", stages)
	}
	var want digest.Digest
	if err := json.Unmarshal(skopeoInspectDigest(t, reg+"/team/rich:1"), &want); err != nil || im.Digest != want.String() {
		t.Fatalf("pulled %s; skopeo says the registry's is %s (%v)", im.Digest, want, err)
	}
	t.Logf("pulled %s through a proxy that cut %d downloads; ranges %q", im.Digest, proxy.cutsTaken.Load(), proxy.ranges)

	for _, backend := range []string{"container", "gvisor", "microvm"} {
		t.Run(backend, func(t *testing.T) { checkRichSandbox(t, c, backend, fx) })
	}
	// Nothing of it was unpacked on the node: each layer is its EROFS
	// form, made by the pull, mounted from the store.
	if image.CanMakeEROFS() {
		stored, err := c.Images.Resolve(image.Ref{Project: "root", Name: "rich", Tag: "1"})
		if err != nil {
			t.Fatal(err)
		}
		// The microvm's root disk of it is one EROFS image in the store,
		// for every node (where the guest kernel has the module).
		var short []string
		for _, l := range stored.Manifest.Layers {
			short = append(short, l.Digest.Encoded()[:16])
		}
		if _, err := os.Stat(filepath.Join(testutil.GuestKernelDir(t), "modules", "erofs.ko")); err == nil {
			if _, err := os.Stat(filepath.Join(c.Images.VMRootDir(), image.VMRootKey(short)+".erofs")); err != nil {
				t.Errorf("the microvm root of the image is not shared through the store: %v", err)
			}
		}
		mounts, _ := os.ReadFile("/proc/self/mountinfo")
		for _, l := range stored.Manifest.Layers {
			mounted := regexp.MustCompile(` ` + regexp.QuoteMeta(c.Cfg.StateDir) + `/\S*/` + l.Digest.Encoded()[:16] + `/fs .* - erofs `)
			if !c.Images.HasEROFS(l.Digest) || !mounted.Match(mounts) {
				t.Errorf("layer %s: EROFS form %v, mounted on the node %v", l.Digest, c.Images.HasEROFS(l.Digest), mounted.Match(mounts))
			}
		}
	}

	gets := proxy.blobGets.Load()
	again, err := c.Client.PullImage(ctx, proxy.host+"/team/rich:1", "root/rich-again:1", nil, nil)
	if err != nil || again.Digest != im.Digest {
		t.Fatalf("second pull: %v %v", again, err)
	}
	if n := proxy.blobGets.Load() - gets; n != 0 {
		t.Fatalf("a second pull of stored layers fetched %d blobs", n)
	}

	pushed, err := c.Client.PushImage(ctx, "root/rich:1", reg+"/copies/rich:2", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if pushed != im.Digest || string(skopeoInspect(t, reg+"/copies/rich:2", true)) != string(skopeoInspect(t, reg+"/team/rich:1", true)) {
		t.Fatalf("pushed %s; skopeo reads back another manifest", pushed)
	}
}

func skopeoInspectDigest(t *testing.T, ref string) []byte {
	var out struct{ Digest string }
	if err := json.Unmarshal(skopeoInspect(t, ref, false), &out); err != nil {
		t.Fatal(err)
	}
	b, _ := json.Marshal(out.Digest)
	return b
}

func checkRichSandbox(t *testing.T, c *e2e.Cluster, backend string, fx richFixture) {
	ctx := e2e.Ctx(t)
	res := &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256, DiskMb: 256}
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: "root/rich:1", Resources: res})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(ctx)
	checks := []struct{ cmd, want string }{
		{"cat /etc/rich/kept /etc/rich/new", "kept\nnew\n"},
		{"test -e /etc/rich/deleted && echo present || echo whited-out", "whited-out\n"},
		{"ls /opt/data | tr '\\n' ' '", "c "},
		{"readlink /etc/rich/link; cat /etc/rich/link", "kept\nkept\n"},
		{"stat -c '%h %i' /etc/rich/kept | cut -d' ' -f1; [ $(stat -c %i /etc/rich/kept) = $(stat -c %i /etc/rich/hard) ] && echo same-inode", "2\nsame-inode\n"},
		{"stat -c '%a' /usr/local/bin/suid", "4755\n"},
		{"stat -c '%u:%g %a' /etc/rich/owned", "1234:5678 640\n"},
		{"sha256sum /opt/big | cut -d' ' -f1", fx.bigSum + "\n"},
		{"echo $RICH_FROM_IMAGE; pwd", "yes\n/work\n"},
	}
	for _, ch := range checks {
		r := e2e.Shell(t, sb, ch.cmd)
		if string(r.Stdout) != ch.want || r.ExitCode != 0 {
			t.Errorf("%s: %q: got %q (exit %d, stderr %q); want %q", backend, ch.cmd, r.Stdout, r.ExitCode, r.Stderr, ch.want)
		}
	}
}

// TestPullIndexAndTwoAtOnce: skopeo pushes a multi-platform index; two
// pulls of it at once (as two apiservers of one shared store would) end
// with one correct copy of the linux/amd64 image.
func TestPullIndexAndTwoAtOnce(t *testing.T) {
	c := e2e.ContainerCluster(t)
	reg := e2e.StartRegistry(t)
	fx := writeRichLayout(t, c.Images, 2, 8<<20)
	skopeoCopy(t, "oci:"+fx.layout+":multi", "docker://"+reg+"/team/multi:1", "--all")
	ctx := e2e.Ctx(t)
	var raw struct{ Manifests []ocispec.Descriptor }
	if err := json.Unmarshal(skopeoInspect(t, reg+"/team/multi:1", true), &raw); err != nil || len(raw.Manifests) != 2 {
		t.Fatalf("the registry's index: %+v %v", raw, err)
	}
	var amd64 string
	for _, m := range raw.Manifests {
		if m.Platform != nil && m.Platform.Architecture == "amd64" {
			amd64 = m.Digest.String()
		}
	}
	var wg sync.WaitGroup
	got := make([]*imagev1.Image, 2)
	errs := make([]error, 2)
	for i := range got {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], errs[i] = c.Client.PullImage(ctx, reg+"/team/multi:1", fmt.Sprintf("root/multi-%d:1", i), nil, nil)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if got[0].Digest != amd64 || got[1].Digest != amd64 {
		t.Fatalf("pulled %s and %s; the index's linux/amd64 image is %s", got[0].Digest, got[1].Digest, amd64)
	}
	ref, _ := image.ParseRef("root/multi-0:1")
	im, err := c.Images.Resolve(ref)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range im.Manifest.Layers {
		f, err := os.Open(c.Images.BlobPath(l.Digest))
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.New()
		io.Copy(h, f)
		f.Close()
		if "sha256:"+hex.EncodeToString(h.Sum(nil)) != l.Digest.String() {
			t.Fatalf("layer %s: the store's copy does not match", l.Digest)
		}
	}
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/multi-1:1"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(ctx)
	if r := e2e.Shell(t, sb, "uname -m; sha256sum /opt/big | cut -d' ' -f1"); string(r.Stdout) != "x86_64\n"+fx.bigSum+"\n" {
		t.Fatalf("sandbox of the pulled index: %q", r.Stdout)
	}
}

// TestPullErrors: each bad pull is refused with a clear error naming what
// is at fault, and leaves no name.
func TestPullErrors(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	reg := e2e.StartRegistry(t)
	ctx := e2e.Ctx(t)
	for _, tc := range []struct {
		src, name string
		code      connect.Code
		say       string
	}{
		{reg + "/nothing:1", "root/x:1", connect.CodeNotFound, reg},
		{"Bad Reference", "root/x:1", connect.CodeInvalidArgument, "registry reference"},
		{"http://" + reg + "/x:1", "root/x:1", connect.CodeInvalidArgument, "no scheme"},
		{"127.0.0.1:1/x:1", "root/x:1", connect.CodeUnavailable, "unreachable"},
		{reg + "/x:1", "no-project", connect.CodeInvalidArgument, "project"},
		{reg + "/x:1", "other/x:1", connect.CodeInvalidArgument, "root"},
	} {
		_, err := c.Client.PullImage(ctx, tc.src, tc.name, nil, nil)
		if connect.CodeOf(err) != tc.code || !strings.Contains(err.Error(), tc.say) {
			t.Errorf("pull %q as %q: %v; want %v saying %q", tc.src, tc.name, err, tc.code, tc.say)
		}
	}
	list, err := c.Client.Images.ListImages(ctx, connect.NewRequest(&imagev1.ListImagesRequest{}))
	if err != nil || len(list.Msg.Images) != 1 {
		t.Fatalf("after failed pulls the store lists %v (%v); want busybox only", list, err)
	}
	if _, err := c.Client.PushImage(ctx, "root/missing:1", reg+"/x:1", nil, nil); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("push of a missing image: %v", err)
	}
}

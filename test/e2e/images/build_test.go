package images

import (
	"archive/zip"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// writeWheel writes a pure-Python wheel of package hello_dsec (whose
// GREETING is greeting), with the RECORD pip reads.
func writeWheel(t *testing.T, path, greeting string) {
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zw := zip.NewWriter(f)
	files := [][2]string{
		{"hello_dsec/__init__.py", fmt.Sprintf("GREETING = %q\n", greeting)},
		{"hello_dsec-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: hello-dsec\nVersion: 1.0\n"},
		{"hello_dsec-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: opendsec-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"},
	}
	var record strings.Builder
	for _, fl := range files {
		w, _ := zw.Create(fl[0])
		w.Write([]byte(fl[1]))
		sum := sha256.Sum256([]byte(fl[1]))
		fmt.Fprintf(&record, "%s,sha256=%s,%d\n", fl[0], base64.RawURLEncoding.EncodeToString(sum[:]), len(fl[1]))
	}
	record.WriteString("hello_dsec-1.0.dist-info/RECORD,,\n")
	w, _ := zw.Create("hello_dsec-1.0.dist-info/RECORD")
	w.Write([]byte(record.String()))
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
}

const wheelDockerfile = `# A Python package from a local wheel, a user and a directory of its own.
FROM root/py:3.11
ARG VERSION=1.0
COPY hello_dsec-${VERSION}-py3-none-any.whl /tmp/wheels/
RUN python3 -m pip install --no-index --no-cache-dir --break-system-packages \
      /tmp/wheels/hello_dsec-${VERSION}-py3-none-any.whl
USER user
WORKDIR /home/user/work
ENV GREETING_FROM=dockerfile
RUN python3 -c 'import hello_dsec; print(hello_dsec.GREETING)' > made-by-run.txt
CMD ["python3"]
`

// TestDockerfileBuild: dsec image build of a Dockerfile that installs a
// Python package from a local wheel and sets USER and WORKDIR; the image
// runs as that user in that directory with the package; a rebuild runs no
// step again.
func TestDockerfileBuild(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	c := e2e.StartClusterWithStore(t, e2e.PyStore(t), "container")
	ctx := e2e.Ctx(t)
	dir := t.TempDir()
	writeWheel(t, filepath.Join(dir, "hello_dsec-1.0-py3-none-any.whl"), "hi from a wheel")
	os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(wheelDockerfile), 0o644)
	bin := e2e.DsecBinary(t)
	tag := fmt.Sprintf("root/built-%d:1", os.Getpid())
	t.Cleanup(func() { deleteBuildImages(t, c, tag) })
	build := func() (string, string) {
		cmd := exec.Command(bin, "image", "build", "-t", tag, dir)
		cmd.Env = append(os.Environ(), "DSEC_API_URL="+c.APIURL, "DSEC_API_KEY="+c.Key)
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("dsec image build: %v\n%s\n%s", err, out.String(), errb.String())
		}
		return out.String(), errb.String()
	}
	out, _ := build()
	if !strings.Contains(out, "STEP 4/9: RUN python3 -m pip install") || !strings.Contains(out, "Successfully installed hello-dsec-1.0") || !strings.Contains(out, "(9 steps, 0 cached)") {
		t.Fatalf("first build's log:\n%s", out)
	}
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: tag})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(ctx)
	r := e2e.Shell(t, sb, `whoami; pwd; cat made-by-run.txt; echo $GREETING_FROM; python3 -c 'import hello_dsec; print(hello_dsec.GREETING)'`)
	if want := "user\n/home/user/work\nhi from a wheel\ndockerfile\nhi from a wheel\n"; string(r.Stdout) != want {
		t.Fatalf("a sandbox of the built image: %q (stderr %q); want %q", r.Stdout, r.Stderr, want)
	}
	im, err := c.Client.Images.GetImage(ctx, connect.NewRequest(&imagev1.GetImageRequest{Name: tag}))
	if err != nil || im.Msg.Image.Config.User != "user" || im.Msg.Image.Config.Cmd[0] != "python3" {
		t.Fatalf("the built image's config: %+v %v", im.Msg.GetImage().GetConfig(), err)
	}

	out, _ = build()
	if !strings.Contains(out, "(9 steps, 3 cached)") || strings.Contains(out, "Successfully installed") {
		t.Fatalf("a rebuild ran steps again:\n%s", out)
	}
}

// deleteBuildImages removes what a build left in the shared image store:
// its image and its steps' cache entries.
func deleteBuildImages(t *testing.T, c *e2e.Cluster, tag string) {
	ctx := e2e.Ctx(t)
	list, err := c.Client.Images.ListImages(ctx, connect.NewRequest(&imagev1.ListImagesRequest{Project: "root"}))
	if err != nil {
		t.Log(err)
		return
	}
	for _, im := range list.Msg.Images {
		if im.Name == tag || strings.HasPrefix(im.Name, "root/build-cache:") {
			c.Client.Images.DeleteImage(ctx, connect.NewRequest(&imagev1.DeleteImageRequest{Name: im.Name}))
		}
	}
}

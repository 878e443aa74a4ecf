package build

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

func mustParse(t *testing.T, s string) []Instruction {
	t.Helper()
	ins, err := Parse(strings.NewReader(s))
	if err != nil {
		t.Fatal(err)
	}
	return ins
}

func TestParse(t *testing.T) {
	ins := mustParse(t, `# syntax comment
ARG BASE=root/py:3.11
FROM $BASE
RUN apt-get update && \
    # a comment inside
    apt-get install -y x
COPY --chown=user ["a b", "/dst/"]
CMD ["python3", "-m", "app"]
`)
	if len(ins) != 5 || ins[2].Cmd != "RUN" || ins[2].Line != 4 || !strings.Contains(ins[2].Text, "apt-get update &&     apt-get install") {
		t.Fatalf("parsed %+v", ins)
	}
	if ins[3].Flags["chown"] != "user" || len(ins[3].JSON) != 2 || ins[4].JSON[2] != "app" {
		t.Fatalf("flags and exec form: %+v %+v", ins[3], ins[4])
	}
	for src, want := range map[string]string{
		"FROM a\nVOLUME /x\n":         "Dockerfile:2: VOLUME is not supported",
		"RUN x\n":                     "Dockerfile:1: the first instruction (after ARGs) must be FROM",
		"FROM a\nFROM b\n":            "Dockerfile:2: a second FROM",
		"FROM a\nCOPY --from=x a b\n": "Dockerfile:2: COPY --from",
		"FROM a\nRUN x \\\n":          "Dockerfile:2: the file ends inside a continued line",
		"FROM a\nCOPY --mode=1 a b\n": `Dockerfile:2: COPY: flag "--mode=1" is not supported`,
		"# escape=`\nFROM a\n":        "Dockerfile:1: the escape directive",
		"":                            "no instructions",
		"FROM a\nRUN\n":               "Dockerfile:2: RUN needs arguments",
	} {
		_, err := Parse(strings.NewReader(src))
		if err == nil || !strings.Contains(err.Error(), want) || errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
			t.Errorf("Parse(%q) = %v; want %q", src, err, want)
		}
	}
}

func TestExpandAndWords(t *testing.T) {
	vars := map[string]string{"A": "1", "EMPTY": "", "PATH": "/bin"}
	for in, want := range map[string]string{
		"$A-${A}":          "1-1",
		"${B:-dflt}":       "dflt",
		"${EMPTY:-d}":      "d",
		"${A:+alt}${B:+x}": "alt",
		`\$A`:              "$A",
		"$PATH:/usr/bin":   "/bin:/usr/bin",
		"cost $5":          "cost $5",
		"${A}b":            "1b",
	} {
		if got, err := expand(in, vars); err != nil || got != want {
			t.Errorf("expand(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"${A", "${A:?x}", "${}"} {
		if _, err := expand(bad, vars); err == nil {
			t.Errorf("expand(%q): no error", bad)
		}
	}
	ws, err := words(`a "b c" 'd e' f\ g KEY="v w"`)
	if err != nil || fmt.Sprint(ws) != "[a b c d e f g KEY=v w]" {
		t.Fatalf("words = %q, %v", ws, err)
	}
}

// fakeTarget is a cluster in memory: images are file trees with configs,
// a box applies RUN steps written in a tiny language ("write PATH TEXT",
// "fail") and counts what it did.
type fakeTarget struct {
	images map[string]*fakeImage
	runs   []string
	starts int
}

type fakeImage struct {
	im    *imagev1.Image
	files map[string]string
}

func newFake() *fakeTarget {
	return &fakeTarget{images: map[string]*fakeImage{
		"root/base:1": {im: &imagev1.Image{Name: "root/base:1", Digest: "sha256:base", Config: &imagev1.ImageConfig{Env: []string{"PATH=/bin"}}}, files: map[string]string{"/etc/os": "base"}},
	}}
}

func (f *fakeTarget) Image(_ context.Context, name string) (*imagev1.Image, error) {
	if im, ok := f.images[name]; ok {
		return im.im, nil
	}
	if !strings.Contains(name, "/") {
		return nil, errdefs.InvalidArgument("image %q: no project", name)
	}
	return nil, errdefs.NotFound("image %q", name)
}

func (f *fakeTarget) Pull(_ context.Context, source, _ string) (*imagev1.Image, error) {
	return nil, errdefs.NotFound("registry: %s not found", source)
}

func (f *fakeTarget) Tag(_ context.Context, source, name string) (*imagev1.Image, error) {
	src := f.images[source]
	im := proto.Clone(src.im).(*imagev1.Image)
	im.Name = name
	f.images[name] = &fakeImage{im: im, files: src.files}
	return im, nil
}

func (f *fakeTarget) Start(_ context.Context, image string) (Box, error) {
	f.starts++
	src := f.images[image]
	files := map[string]string{}
	for k, v := range src.files {
		files[k] = v
	}
	return &fakeBox{t: f, parent: src, files: files}, nil
}

type fakeBox struct {
	t      *fakeTarget
	parent *fakeImage
	files  map[string]string
}

func (b *fakeBox) Run(_ context.Context, args, env []string, cwd, user string, out io.Writer) (int, error) {
	vars := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		vars[k] = v
	}
	cmd, _ := expand(args[len(args)-1], vars) // as the shell would
	b.t.runs = append(b.t.runs, fmt.Sprintf("%s|%s|%s|%s", cmd, strings.Join(env, ","), cwd, user))
	fmt.Fprintf(out, "ran %s\n", cmd)
	if f := strings.Fields(cmd); len(f) == 3 && f[0] == "write" {
		b.files[f[1]] = f[2]
	} else if cmd == "fail" {
		return 3, nil
	}
	return 0, nil
}

func (b *fakeBox) MakeDir(_ context.Context, p, _ string) error { b.files[p+"/"] = ""; return nil }

func (b *fakeBox) WriteFile(_ context.Context, p string, r io.Reader, perm uint32, user string) error {
	data, _ := io.ReadAll(r)
	b.files[p] = fmt.Sprintf("%s|%o|%s", data, perm, user)
	return nil
}

func (b *fakeBox) Commit(_ context.Context, name string, cfg *imagev1.ImageConfig) (*imagev1.Image, error) {
	im := &imagev1.Image{Name: name, Digest: fmt.Sprintf("sha256:%x", len(b.t.images)), Config: proto.Clone(cfg).(*imagev1.ImageConfig)}
	b.t.images[name] = &fakeImage{im: im, files: b.files}
	return im, nil
}

func (b *fakeBox) Stop(context.Context) error { return nil }

const testDockerfile = `FROM root/base:1
ARG GREETING=hello
ENV APP=/app LEVEL=2
WORKDIR $APP
COPY app.txt ./
RUN write /app/out ${GREETING}
USER builder
LABEL org.opendsec.ready="true"
CMD ["run"]
`

func TestBuildRunsStepsAndCachesThem(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "app.txt"), []byte("v1"), 0o640)
	ft := newFake()
	var log bytes.Buffer
	o := Options{Context: dir, Tag: "root/app:1", CacheProject: "root", Log: &log}
	res, err := Build(context.Background(), ft, mustParse(t, testDockerfile), o)
	if err != nil {
		t.Fatal(err)
	}
	got := ft.images["root/app:1"]
	if got.files["/app/app.txt"] != "v1|640|" || got.files["/app/out"] != "hello" || got.files["/etc/os"] != "base" {
		t.Fatalf("files: %v", got.files)
	}
	cfg := got.im.Config
	if cfg.WorkingDir != "/app" || cfg.User != "builder" || cfg.Cmd[0] != "run" || cfg.Labels["org.opendsec.ready"] != "true" || strings.Join(cfg.Env, " ") != "PATH=/bin APP=/app LEVEL=2" {
		t.Fatalf("config: %+v", cfg)
	}
	if len(ft.runs) != 1 || ft.runs[0] != "write /app/out hello|PATH=/bin,APP=/app,LEVEL=2,GREETING=hello|/app|" {
		t.Fatalf("RUN as: %q", ft.runs)
	}
	if res.Cached != 0 || !strings.Contains(log.String(), "ran write /app/out hello") {
		t.Fatalf("first build: %d cached; log %s", res.Cached, log.String())
	}

	starts := ft.starts
	res, err = Build(context.Background(), ft, mustParse(t, testDockerfile), o)
	if err != nil || res.Cached != 2 || ft.starts != starts || len(ft.runs) != 1 {
		t.Fatalf("rebuild: %+v %v; %d sandboxes started, %d runs (want none)", res, err, ft.starts-starts, len(ft.runs)-1)
	}

	// A changed file runs its COPY and every step after it again.
	os.WriteFile(filepath.Join(dir, "app.txt"), []byte("v2"), 0o640)
	res, err = Build(context.Background(), ft, mustParse(t, testDockerfile), o)
	if err != nil || res.Cached != 0 || len(ft.runs) != 2 || ft.images["root/app:1"].files["/app/app.txt"] != "v2|640|" {
		t.Fatalf("after a change: %+v %v, runs %d", res, err, len(ft.runs))
	}
	// A build arg changes the RUN.
	o.BuildArgs = map[string]string{"GREETING": "hi"}
	if _, err := Build(context.Background(), ft, mustParse(t, testDockerfile), o); err != nil || ft.images["root/app:1"].files["/app/out"] != "hi" {
		t.Fatalf("build arg: %v %v", err, ft.images["root/app:1"].files)
	}
}

func TestBuildErrorsNameTheLine(t *testing.T) {
	dir := t.TempDir()
	for src, want := range map[string]string{
		"FROM root/base:1\nRUN fail\n":               "Dockerfile:2: RUN fail: exit code 3",
		"FROM root/base:1\nCOPY missing /x\n":        "Dockerfile:2: COPY missing: no such file",
		"FROM root/base:1\nCOPY ../etc/passwd /x\n":  "outside the build context",
		"FROM nowhere.example/x:1\n":                 "Dockerfile:1: FROM nowhere.example/x:1: neither in the image store nor pulled",
		"FROM root/base:1\nADD https://x/y /y\n":     "URLs are not supported",
		"FROM root/base:1\nENV\tA\n":                 "Dockerfile:2: ENV",
		"FROM root/base:1\nCOPY --chown=1000 a /a\n": "",
	} {
		os.WriteFile(filepath.Join(dir, "a"), []byte("a"), 0o644)
		ins, err := Parse(strings.NewReader(src))
		if err == nil {
			_, err = Build(context.Background(), newFake(), ins, Options{Context: dir, Tag: "root/x:1", CacheProject: "root"})
		}
		if want == "" {
			if err == nil || !strings.Contains(err.Error(), "user name") {
				t.Errorf("%q: %v", src, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v; want %q", src, err, want)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add(testDockerfile)
	f.Add("FROM a\nRUN x \\\n y\nENV A=\"b c\" D=e\nCOPY [\"a\", \"b\"]\n")
	f.Add("# escape=\\\nARG X\nFROM ${X:-a}\nLABEL a='b' \"c\"=d\n")
	f.Fuzz(func(t *testing.T, src string) {
		ins, err := Parse(strings.NewReader(src))
		if err != nil {
			if errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
				t.Fatalf("refusal is not invalid argument: %v", err)
			}
			return
		}
		vars := map[string]string{"A": "1"}
		for _, in := range ins {
			expand(in.Text, vars) //nolint:errcheck // never panics
			words(in.Text)        //nolint:errcheck
			if in.Cmd == "ENV" || in.Cmd == "LABEL" {
				pairs(in, vars, in.Cmd == "ENV") //nolint:errcheck
			}
		}
	})
}

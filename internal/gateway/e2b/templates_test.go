package e2b

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/iam/v1/iamv1connect"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/image/v1/imagev1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1/sandboxv1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
)

// fakeIAM answers WhoAmI with one project for every key.
type fakeIAM struct {
	iamv1connect.IAMServiceClient
	project string
}

func (f fakeIAM) WhoAmI(context.Context, *connect.Request[iamv1.WhoAmIRequest]) (*connect.Response[iamv1.WhoAmIResponse], error) {
	return connect.NewResponse(&iamv1.WhoAmIResponse{Key: &iamv1.APIKey{Project: f.project}}), nil
}

// fakeImages is a store holding the images named.
type fakeImages struct {
	imagev1connect.ImageServiceClient
	names []string
}

func (f *fakeImages) TagImage(_ context.Context, r *connect.Request[imagev1.TagImageRequest]) (*connect.Response[imagev1.TagImageResponse], error) {
	if _, err := f.GetImage(context.Background(), connect.NewRequest(&imagev1.GetImageRequest{Name: r.Msg.Source})); err != nil {
		return nil, err
	}
	f.names = append(f.names, r.Msg.Name)
	return connect.NewResponse(&imagev1.TagImageResponse{Image: &imagev1.Image{Name: r.Msg.Name}}), nil
}

func (f *fakeImages) DeleteImage(_ context.Context, r *connect.Request[imagev1.DeleteImageRequest]) (*connect.Response[imagev1.DeleteImageResponse], error) {
	for i, n := range f.names {
		if n == r.Msg.Name {
			f.names = append(f.names[:i], f.names[i+1:]...)
			return connect.NewResponse(&imagev1.DeleteImageResponse{}), nil
		}
	}
	return nil, errdefs.ToConnect(errdefs.NotFound("image %q", r.Msg.Name))
}

func (f *fakeImages) GetImage(_ context.Context, r *connect.Request[imagev1.GetImageRequest]) (*connect.Response[imagev1.GetImageResponse], error) {
	for _, n := range f.names {
		if n == r.Msg.Name {
			return connect.NewResponse(&imagev1.GetImageResponse{Image: &imagev1.Image{Name: n}}), nil
		}
	}
	return nil, errdefs.ToConnect(errdefs.NotFound("image %q", r.Msg.Name))
}

func (f *fakeImages) ListImages(context.Context, *connect.Request[imagev1.ListImagesRequest]) (*connect.Response[imagev1.ListImagesResponse], error) {
	out := &imagev1.ListImagesResponse{}
	for _, n := range f.names {
		out.Images = append(out.Images, &imagev1.Image{Name: n})
	}
	return connect.NewResponse(out), nil
}

// noSnapshots is an apiserver without snapshots.
type noSnapshots struct {
	sandboxv1connect.SandboxServiceClient
}

func (noSnapshots) ListSnapshots(context.Context, *connect.Request[sandboxv1.ListSnapshotsRequest]) (*connect.Response[sandboxv1.ListSnapshotsResponse], error) {
	return connect.NewResponse(&sandboxv1.ListSnapshotsResponse{}), nil
}

// templateGateway is a gateway whose apiserver is fakes, and nothing at
// APIURL: a build it starts fails at its base.
func templateGateway(t testing.TB, images ...string) *httptest.Server {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	g := &Gateway{
		cfg:    Config{APIURL: "http://127.0.0.1:1", TokenSecret: bytes.Repeat([]byte("s"), 32), TemplateDir: t.TempDir(), MaxUpload: 1 << 20, BaseImage: "root/py:3.11", BuildBackend: "container"},
		log:    logging.OrDiscard(nil),
		iam:    fakeIAM{project: "root/team"},
		images: &fakeImages{names: images}, sandbox: noSnapshots{},
		builds: newTemplateBuilds(), projects: map[string]knownProject{}, ctx: ctx, cancel: cancel, watchers: newWatchers(),
	}
	srv := httptest.NewServer(g.Handler())
	t.Cleanup(func() { srv.Close(); g.Close() })
	return srv
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func call(t testing.TB, method, url string, body io.Reader, hdr ...string) answer {
	t.Helper()
	req, _ := http.NewRequest(method, url, body)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return answer{resp.StatusCode, resp.Header, data}
}

func keys(t *testing.T, data []byte) map[string]json.RawMessage {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatalf("not a JSON object: %s", data)
	}
	return m
}

var apiKey = []string{"X-API-Key", "e2b_00", "Content-Type", "application/json"}

// TestTemplateBuildWireContract walks E2B's build calls as the SDKs make
// them (docs/e2b-templates.md): the status codes, the keys the Python SDK
// pops, signed uploads without a key, a 202 with no body, the status's
// paginated log and a reason only when there is one, and errors as
// {code, message}.
func TestTemplateBuildWireContract(t *testing.T) {
	srv := templateGateway(t, "root/team/e2b-old:default")
	u := srv.URL

	a := call(t, "POST", u+"/v3/templates", strings.NewReader(`{"name":"team/my-tpl:v1","tags":["stable","v1"],"cpuCount":1,"memoryMB":512,"minFreeDiskMb":10}`), apiKey...)
	if a.status != 202 {
		t.Fatalf("request: %d %s", a.status, a.body)
	}
	m := keys(t, a.body)
	for _, k := range []string{"templateID", "buildID", "public", "names", "tags", "aliases"} {
		if _, ok := m[k]; !ok {
			t.Errorf("request answer lacks %q: %s", k, a.body)
		}
	}
	var req requestedJSON
	json.Unmarshal(a.body, &req)
	if req.TemplateID != "my-tpl" || strings.Join(req.Tags, ",") != "v1,stable" || req.Names[0] != "my-tpl" {
		t.Fatalf("request answer: %s", a.body)
	}
	for body, want := range map[string]string{
		`{"name":"My Tpl"}`:                 "the alias must be",
		`{"name":"ok:bad tag"}`:             "tag",
		`{}`:                                "name: required",
		`{"name":"ok","cpuCount":0}`:        "cpuCount",
		`{"name":"ok","memoryMB":"a lot"}`:  "not the expected JSON",
		`{"alias":"legacy","cpuCount":100}`: "cpuCount",
	} {
		a := call(t, "POST", u+"/v3/templates", strings.NewReader(body), apiKey...)
		var e apiError
		if a.status != 400 || json.Unmarshal(a.body, &e) != nil || e.Code != 400 || !strings.Contains(e.Message, want) {
			t.Errorf("request %s: %d %s; want 400 saying %q", body, a.status, a.body, want)
		}
	}
	if a := call(t, "POST", u+"/v3/templates", strings.NewReader(`{"name":"x"}`)); a.status != 401 {
		t.Errorf("no key: %d", a.status)
	}

	hash := strings.Repeat("ab", 32)
	if a := call(t, "GET", u+"/templates/my-tpl/files/"+strings.ToUpper(hash), nil, apiKey...); a.status != 400 {
		t.Errorf("upper-case hash: %d %s", a.status, a.body)
	}
	if a := call(t, "GET", u+"/templates/nobody/files/"+hash, nil, apiKey...); a.status != 404 {
		t.Errorf("a template never requested: %d %s", a.status, a.body)
	}
	link := func() fileLinkJSON {
		a := call(t, "GET", u+"/templates/my-tpl/files/"+hash, nil, apiKey...)
		var l fileLinkJSON
		if a.status != 201 || json.Unmarshal(a.body, &l) != nil || l.URL == "" {
			t.Fatalf("file link: %d %s", a.status, a.body)
		}
		return l
	}
	if l := link(); l.Present {
		t.Fatal("present before any upload")
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(make([]byte, 1024))
	zw.Close()
	up := link().URL
	if a := call(t, "PUT", strings.Replace(up, "signature=", "signature=0", 1), bytes.NewReader(gz.Bytes())); a.status != 401 {
		t.Errorf("a changed signature: %d %s", a.status, a.body)
	}
	if a := call(t, "PUT", strings.Replace(up, "/my-tpl/", "/other/", 1), bytes.NewReader(gz.Bytes())); a.status != 401 {
		t.Errorf("another template's path: %d %s", a.status, a.body)
	}
	if a := call(t, "PUT", up, bytes.NewReader(gz.Bytes())); a.status != 200 {
		t.Fatalf("upload: %d %s", a.status, a.body)
	}
	if l := link(); !l.Present || l.URL == "" {
		t.Fatalf("after the upload: %+v; want present, and a URL still (forceUpload)", l)
	}

	// A build whose files were not uploaded is refused, naming the step.
	other := strings.Repeat("cd", 32)
	steps := `{"fromImage":"e2bdev/base","force":false,"steps":[{"type":"COPY","args":["folder/*","folder","",""],"filesHash":"` + other + `","force":false}]}`
	a = call(t, "POST", u+"/v2/templates/my-tpl/builds/"+req.BuildID, strings.NewReader(steps), apiKey...)
	if a.status != 400 || !strings.Contains(string(a.body), "steps[0] (COPY)") || !strings.Contains(string(a.body), "not uploaded") {
		t.Fatalf("a COPY of files never uploaded: %d %s", a.status, a.body)
	}
	if a := call(t, "POST", u+"/v2/templates/my-tpl/builds/nope", strings.NewReader(`{"fromTemplate":"base"}`), apiKey...); a.status != 404 {
		t.Errorf("an unknown build: %d %s", a.status, a.body)
	}
	steps = strings.Replace(steps, other, hash, 1)
	steps = strings.Replace(steps, `"steps":[`, `"steps":[{"type":"RUN","args":["echo hi","root"],"extra":1},{"type":"ENV","args":["A","1","B","x \"y\""]},{"type":"WORKDIR","args":["/app"]},{"type":"USER","args":["root"]},`, 1)
	a = call(t, "POST", u+"/v2/templates/my-tpl/builds/"+req.BuildID, strings.NewReader(steps), apiKey...)
	if a.status != 202 || len(a.body) != 0 || a.header.Get("Content-Length") != "0" {
		t.Fatalf("trigger: %d %q Content-Length %q; want 202 with no body and Content-Length 0", a.status, a.body, a.header.Get("Content-Length"))
	}
	if a := call(t, "POST", u+"/v2/templates/my-tpl/builds/"+req.BuildID, strings.NewReader(steps), apiKey...); a.status != 400 {
		t.Errorf("a second trigger: %d %s", a.status, a.body)
	}

	// Nothing answers at APIURL: the build fails at its base.
	status := func(q string) (buildStatusJSON, map[string]json.RawMessage) {
		a := call(t, "GET", u+"/templates/my-tpl/builds/"+req.BuildID+"/status"+q, nil, apiKey...)
		var s buildStatusJSON
		if a.status != 200 || json.Unmarshal(a.body, &s) != nil {
			t.Fatalf("status%s: %d %s", q, a.status, a.body)
		}
		return s, keys(t, a.body)
	}
	var s buildStatusJSON
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var raw map[string]json.RawMessage
		s, raw = status("?logsOffset=0")
		if s.Status == buildError {
			break
		}
		if s.Status != buildBuilding || raw["reason"] != nil || raw["logs"] == nil || raw["logEntries"] == nil {
			t.Fatalf("while building: %+v %v", s, raw)
		}
		if time.Now().After(deadline) {
			t.Fatal("the build never ended")
		}
	}
	if s.Reason == nil || s.Reason.Step != "base" || s.Reason.Message == "" || strings.HasPrefix(s.Reason.Message, "Dockerfile:") {
		t.Fatalf("reason: %+v", s.Reason)
	}
	all := s.LogEntries
	if len(all) < 2 || all[len(all)-1].Level != "error" {
		t.Fatalf("log: %+v", all)
	}
	for _, e := range all {
		if _, err := time.Parse(time.RFC3339Nano, e.Timestamp); err != nil || e.Step == "" {
			t.Errorf("entry %+v: timestamp %v", e, err)
		}
	}
	if got, _ := status("?logsOffset=1&limit=1"); len(got.LogEntries) != 1 || got.LogEntries[0] != all[1] {
		t.Errorf("one entry from offset 1: %+v; want %+v", got.LogEntries, all[1])
	}
	if got, raw := status("?logsOffset=" + itoa(len(all))); len(got.LogEntries) != 0 || string(raw["logEntries"]) != "[]" {
		t.Errorf("past the end: %s", raw["logEntries"])
	}
	for _, q := range []string{"?limit=101", "?logsOffset=-1", "?logsOffset=x"} {
		if a := call(t, "GET", u+"/templates/my-tpl/builds/"+req.BuildID+"/status"+q, nil, apiKey...); a.status != 400 {
			t.Errorf("status%s: %d", q, a.status)
		}
	}

	// A build not yet triggered waits, with no reason.
	a = call(t, "POST", u+"/v3/templates", strings.NewReader(`{"name":"my-tpl"}`), apiKey...)
	json.Unmarshal(a.body, &req)
	if got, raw := status(""); got.Status != buildWaiting || raw["reason"] != nil || string(raw["logs"]) != "[]" || req.TemplateID != "my-tpl" || strings.Join(req.Tags, ",") != "default" {
		t.Errorf("waiting: %+v %v %+v", got, raw, req)
	}

	for alias, want := range map[string]int{"base": 200, "old": 200, "my-tpl": 404, "Bad!": 404} {
		if a := call(t, "GET", u+"/templates/aliases/"+alias, nil, apiKey...); a.status != want {
			t.Errorf("alias %s: %d %s; want %d", alias, a.status, a.body, want)
		}
	}

	// Tags: assigned to a build, listed with one build id, removed; the
	// template deleted with all its tags.
	a = call(t, "POST", u+"/templates/tags", strings.NewReader(`{"target":"old:default","tags":["prod","v2"]}`), apiKey...)
	var assigned assignedTagsJSON
	if a.status != 201 || json.Unmarshal(a.body, &assigned) != nil || len(assigned.Tags) != 2 || len(assigned.BuildID) != 36 {
		t.Fatalf("assign: %d %s", a.status, a.body)
	}
	if a := call(t, "POST", u+"/templates/tags", strings.NewReader(`{"target":"old:none","tags":["x"]}`), apiKey...); a.status != 404 {
		t.Errorf("assign to a missing build: %d %s", a.status, a.body)
	}
	if a := call(t, "POST", u+"/templates/tags", strings.NewReader(`{"target":"old","tags":[":x"]}`), apiKey...); a.status != 400 {
		t.Errorf("assign a bad tag: %d %s", a.status, a.body)
	}
	a = call(t, "GET", u+"/templates/old/tags", nil, apiKey...)
	var tags []templateTagJSON
	if a.status != 200 || json.Unmarshal(a.body, &tags) != nil || len(tags) != 3 {
		t.Fatalf("tags: %d %s", a.status, a.body)
	}
	if a := call(t, "DELETE", u+"/templates/tags", strings.NewReader(`{"name":"old","tags":["prod"]}`), apiKey...); a.status != 204 {
		t.Fatalf("remove: %d %s", a.status, a.body)
	}
	if a := call(t, "DELETE", u+"/templates/tags", strings.NewReader(`{"name":"old","tags":["prod"]}`), apiKey...); a.status != 404 {
		t.Errorf("remove again: %d %s", a.status, a.body)
	}
	if a := call(t, "DELETE", u+"/templates/old", nil, apiKey...); a.status != 204 {
		t.Fatalf("delete: %d %s", a.status, a.body)
	}
	if a := call(t, "GET", u+"/templates/old/tags", nil, apiKey...); a.status != 404 {
		t.Errorf("tags after the delete: %d %s", a.status, a.body)
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

func TestPlanBuildMakesE2BStepsInstructions(t *testing.T) {
	t.Parallel()
	start, ready := `python -m http.server "$PORT"`, "[ -f /tmp/x ]"
	req := &buildStartJSON{Steps: []stepJSON{
		{Type: "RUN", Args: []string{"apt-get install -y vim", "root"}},
		{Type: "COPY", Args: []string{"src/*.py", "app/", "user:user", "0644"}, FilesHash: strings.Repeat("a", 64)},
		{Type: "ENV", Args: []string{"A", `x "y" $HOME`}},
		{Type: "WORKDIR", Args: []string{"/srv/app"}},
		{Type: "USER", Args: []string{"web"}},
	}, StartCmd: &start, ReadyCmd: &ready}
	plan, err := planBuild(req, "root/py:3.11", false, "", func(h string) (string, error) { return "/uploads/" + h, nil })
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range plan {
		got = append(got, p.step+":"+p.in.Cmd)
	}
	want := "base:FROM base:RUN base:USER base:WORKDIR 1:RUN 2:COPY 3:ENV 4:RUN 4:WORKDIR 5:RUN 5:USER finalize:LABEL"
	if strings.Join(got, " ") != want {
		t.Fatalf("plan: %s\nwant  %s", strings.Join(got, " "), want)
	}
	if p := plan[4].in; p.User != "root" || p.JSON[len(p.JSON)-1] != "apt-get install -y vim" {
		t.Errorf("RUN as root: %+v", p)
	}
	if p := plan[5].in; p.Archive != "/uploads/"+strings.Repeat("a", 64) || p.JSON[0] != "src" || p.JSON[1] != "app/" || p.Flags["chown"] != "user:user" || p.Flags["chmod"] != "0644" {
		t.Errorf("COPY: %+v", p)
	}
	if p := plan[11].in; !strings.Contains(p.Text, `org.opendsec.start="python -m http.server \"\\$PORT\""`) || !strings.Contains(p.Text, `org.opendsec.start.user="web"`) {
		t.Errorf("LABEL: %s", p.Text)
	}
	for _, tc := range []struct {
		req  buildStartJSON
		want string
	}{
		{buildStartJSON{Steps: []stepJSON{{Type: "VOLUME"}}}, "steps[0] (VOLUME): type: unknown"},
		{buildStartJSON{Steps: []stepJSON{{Type: "RUN"}}}, "steps[0] (RUN): args"},
		{buildStartJSON{Steps: []stepJSON{{Type: "ENV", Args: []string{"A"}}}}, "pairs"},
		{buildStartJSON{Steps: []stepJSON{{Type: "COPY", Args: []string{"a", "b"}, FilesHash: "x"}}}, "filesHash"},
		{buildStartJSON{Steps: []stepJSON{{Type: "COPY", Args: []string{"../a", "b"}, FilesHash: strings.Repeat("a", 64)}}}, "outside"},
		{buildStartJSON{Steps: []stepJSON{{Type: "USER", Args: []string{"Root; rm"}}}}, "user name"},
		{buildStartJSON{ReadyCmd: &ready}, "readyCmd: given without startCmd"},
	} {
		_, err := planBuild(&tc.req, "b", false, "", func(string) (string, error) { return "/x", nil })
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v; want %q", tc.req, err, tc.want)
		}
	}
	// On a template of ours, its user goes on: no implicit user, and the
	// start command runs as the template's.
	plan, err = planBuild(&buildStartJSON{Steps: []stepJSON{{Type: "WORKDIR", Args: []string{"/w"}}}, StartCmd: &start}, "root/e2b-x:default", true, "user", func(string) (string, error) { return "", nil })
	if err != nil || len(plan) != 4 || plan[1].in.User != "root" || !strings.Contains(plan[3].in.Text, `org.opendsec.start.user="user"`) {
		t.Fatalf("from a template: %+v %v", plan, err)
	}
	for src, want := range map[string]string{"folder/*": "folder", "*.txt": ".", "a.txt": "a.txt", ".": ".", "./foo": "foo", "a/b*/c": "a", "a/{x,y}": "a"} {
		if got, err := copyBase(src); err != nil || got != want {
			t.Errorf("copyBase(%q) = %q, %v; want %q", src, got, err, want)
		}
	}
}

// FuzzTemplateBuildRequests: whatever E2B's build calls carry, the
// gateway's reading of them answers or refuses with an invalid argument.
func FuzzTemplateBuildRequests(f *testing.F) {
	f.Add(`{"fromImage":"e2bdev/base","steps":[{"type":"COPY","args":["a/*","b","u","0755"],"filesHash":"`+strings.Repeat("0", 64)+`"},{"type":"RUN","args":["x","root"]}],"startCmd":"s","readyCmd":"r"}`, "ns/a-b:t1")
	f.Add(`{"steps":[{"type":"ENV","args":["A","$B","C"]},{"type":"USER","args":["x"]},{"type":"WORKDIR","args":[""]}]}`, "a:")
	f.Add(`{"name":"t:1","tags":["a","b"],"cpuCount":1,"memoryMB":128}`, "logsOffset=1&limit=100")
	f.Add(`{"target":"old:default","tags":["x"]}`, "project=root&expires=1&signature=00")
	srv := templateGateway(f, "root/team/e2b-old:default")
	f.Fuzz(func(t *testing.T, body, name string) {
		// Through the routes, as a client would send them: never a 5xx.
		q := strings.Map(func(r rune) rune {
			if r <= ' ' || r == '#' || r == 0x7f || r > 0x7e {
				return '_'
			}
			return r
		}, name)
		for _, c := range []struct{ method, path string }{
			{"POST", "/v3/templates"}, {"POST", "/templates/tags"}, {"DELETE", "/templates/tags"},
			{"POST", "/v2/templates/old/builds/x"}, {"GET", "/templates/old/builds/x/status?" + q},
			{"PUT", "/e2b-uploads/old/" + strings.Repeat("a", 64) + "?" + q}, {"GET", "/templates/old/files/" + q},
		} {
			if _, err := url.ParseRequestURI(srv.URL + c.path); err != nil {
				continue // not a URL a client could send
			}
			if a := call(t, c.method, srv.URL+c.path, strings.NewReader(body), apiKey...); a.status >= 500 && a.status != 501 {
				t.Fatalf("%s %s with %q: %d %s", c.method, c.path, body, a.status, a.body)
			}
		}
		var req buildStartJSON
		if json.Unmarshal([]byte(body), &req) == nil {
			_, err := planBuild(&req, "root/b:1", len(name)%2 == 0, name, func(string) (string, error) { return "/x", nil })
			if err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("planBuild: %v", err)
			}
		}
		if _, _, err := parseTemplateName(name); err != nil && !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Fatalf("parseTemplateName: %v", err)
		}
	})
}

package network

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	envdprocess "github.com/opendsec/opendsec/api/gen/e2b/process"
	"github.com/opendsec/opendsec/api/gen/e2b/process/envdprocessconnect"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/test/e2e"
)

// The gateway's own behaviour on the fake backend: wire shapes, errors,
// isolation. E2B's real SDKs run against it on gVisor in test/e2b.

func TestGatewayControlPlane(t *testing.T) {
	c, gw, key := e2e.GatewayCluster(t)
	auth := map[string]string{"X-API-Key": key}

	e2e.Do(t, "GET", gw+"/v2/sandboxes", nil, nil).ErrorBody(t, 401, "missing API key")
	e2e.Do(t, "GET", gw+"/v2/sandboxes", map[string]string{"X-API-Key": "e2b_" + strings.Repeat("0", 40)}, nil).ErrorBody(t, 401, "")
	e2e.Do(t, "POST", gw+"/v2/sandboxes", auth, strings.NewReader("{not json")).ErrorBody(t, 400, "request body")
	e2e.Do(t, "POST", gw+"/v2/sandboxes", auth, strings.NewReader(`{}`)).ErrorBody(t, 400, "templateID: required")
	e2e.Do(t, "POST", gw+"/v2/sandboxes", auth, strings.NewReader(`{"templateID":"Not A Template"}`)).ErrorBody(t, 400, "templateID")
	e2e.Do(t, "POST", gw+"/v2/sandboxes", auth, strings.NewReader(`{"templateID":"base","metadata":{"e2b.x":"1"}}`)).ErrorBody(t, 400, `"e2b." is reserved`)
	e2e.Do(t, "POST", gw+"/v2/sandboxes", auth, strings.NewReader(`{"templateID":"base","autoResume":{"policy":"sometimes"}}`)).ErrorBody(t, 400, "autoResume.policy")
	e2e.Do(t, "POST", gw+"/v2/sandboxes", auth, strings.NewReader(`{"templateID":"base","autoResume":{"enabled":true,"policy":"off"}}`)).ErrorBody(t, 400, "disagree")
	e2e.Do(t, "POST", gw+"/templates", auth, strings.NewReader(`{}`)).ErrorBody(t, 501, "template call")
	e2e.Do(t, "POST", gw+"/v3/templates", auth, strings.NewReader(`{"name":"Bad Name"}`)).ErrorBody(t, 400, "alias")
	e2e.Do(t, "GET", gw+"/volumes", auth, nil).ErrorBody(t, 501, "volumes")
	e2e.Do(t, "GET", gw+"/nope", auth, nil).ErrorBody(t, 404, "no such API route")

	// Both create forms; the template is remembered, our metadata hidden.
	a := e2e.CreateE2B(t, gw, key, `{"templateID":"base","metadata":{"group":"g1"},"timeout":120}`)
	r := e2e.Do(t, "POST", gw+"/sandboxes", auth, strings.NewReader(`{"templateID":"base","metadata":{"group":"g1"}}`))
	if r.Status != 201 {
		t.Fatalf("v1 create: %d %s", r.Status, r.Body)
	}
	var b e2e.E2BSandbox
	r.JSON(t, &b)
	cc := e2e.CreateE2B(t, gw, key, `{"templateID":"base","metadata":{"group":"g2"}}`)

	var detail map[string]any
	e2e.Do(t, "GET", gw+"/sandboxes/"+a.SandboxID, auth, nil).JSON(t, &detail)
	for _, f := range []string{"templateID", "sandboxID", "clientID", "startedAt", "endAt", "envdVersion", "cpuCount", "memoryMB", "diskSizeMB", "state"} {
		if _, ok := detail[f]; !ok {
			t.Fatalf("detail lacks %s: %v", f, detail)
		}
	}
	if disk, _ := detail["diskSizeMB"].(float64); disk <= 0 {
		t.Fatalf("diskSizeMB %v, want the sandbox's disk_mb", detail["diskSizeMB"])
	}
	if detail["templateID"] != "base" || detail["state"] != "running" || len(detail["metadata"].(map[string]any)) != 1 {
		t.Fatalf("detail: %v", detail)
	}

	// Paging: one per page, each once, newest first.
	var seen []string
	token := ""
	for range 5 {
		q := url.Values{"limit": {"1"}}
		if token != "" {
			q.Set("nextToken", token)
		}
		r := e2e.Do(t, "GET", gw+"/v2/sandboxes?"+q.Encode(), auth, nil)
		var page []map[string]any
		r.JSON(t, &page)
		for _, s := range page {
			seen = append(seen, s["sandboxID"].(string))
		}
		if token = r.Header.Get("X-Next-Token"); token == "" {
			break
		}
	}
	if len(seen) != 3 || seen[0] != cc.SandboxID || seen[2] != a.SandboxID {
		t.Fatalf("pages: %v (want %s, %s, %s)", seen, cc.SandboxID, b.SandboxID, a.SandboxID)
	}
	var g1 []map[string]any
	e2e.Do(t, "GET", gw+"/v2/sandboxes?metadata="+url.QueryEscape("group=g1"), auth, nil).JSON(t, &g1)
	if len(g1) != 2 {
		t.Fatalf("metadata filter: %v", g1)
	}
	e2e.Do(t, "GET", gw+"/v2/sandboxes?limit=0", auth, nil).ErrorBody(t, 400, "limit")
	e2e.Do(t, "GET", gw+"/v2/sandboxes?state=sleeping", auth, nil).ErrorBody(t, 400, "state")
	e2e.Do(t, "GET", gw+"/v2/sandboxes?nextToken=zz", auth, nil).ErrorBody(t, 400, "nextToken")

	// Timeout and refresh answer 204; connect to a running sandbox is 200.
	if r := e2e.Do(t, "POST", gw+"/sandboxes/"+a.SandboxID+"/timeout", auth, strings.NewReader(`{"timeout":600}`)); r.Status != 204 {
		t.Fatalf("timeout: %d %s", r.Status, r.Body)
	}
	e2e.Do(t, "POST", gw+"/sandboxes/"+a.SandboxID+"/timeout", auth, strings.NewReader(`{}`)).ErrorBody(t, 400, "timeout: required")
	if r := e2e.Do(t, "POST", gw+"/v2/sandboxes/"+a.SandboxID+"/connect", auth, strings.NewReader(`{"timeout":60}`)); r.Status != 200 {
		t.Fatalf("connect: %d %s", r.Status, r.Body)
	}

	// Idempotent create.
	idem := map[string]string{"X-API-Key": key, "Idempotency-Key": "k-1"}
	r1 := e2e.Do(t, "POST", gw+"/v2/sandboxes", idem, strings.NewReader(`{"templateID":"base"}`))
	r2 := e2e.Do(t, "POST", gw+"/v2/sandboxes", idem, strings.NewReader(`{"templateID":"base"}`))
	var s1, s2 e2e.E2BSandbox
	r1.JSON(t, &s1)
	r2.JSON(t, &s2)
	if s1.SandboxID == "" || s1.SandboxID != s2.SandboxID {
		t.Fatalf("idempotent create made %q and %q", s1.SandboxID, s2.SandboxID)
	}
	// Retries that race each other still make one sandbox.
	race := map[string]string{"X-API-Key": key, "Idempotency-Key": "k-race"}
	ids := make([]string, 4)
	var wg sync.WaitGroup
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("POST", gw+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`))
			for k, v := range race {
				req.Header.Set(k, v)
			}
			resp, err := e2e.HTTPClient.Do(req) // not do: no t.Fatal off the test goroutine
			if err != nil {
				return // an empty id fails below
			}
			defer resp.Body.Close()
			var sb e2e.E2BSandbox
			if resp.StatusCode == 201 {
				json.NewDecoder(resp.Body).Decode(&sb) //nolint:errcheck // an empty id fails below
			}
			ids[i] = sb.SandboxID
		}()
	}
	wg.Wait()
	for _, id := range ids {
		if id == "" || id != ids[0] {
			t.Fatalf("concurrent creates with one Idempotency-Key made %q", ids)
		}
	}

	// Kill is 204, then the sandbox is gone: 404 with E2B's body.
	if r := e2e.Do(t, "DELETE", gw+"/sandboxes/"+a.SandboxID, auth, nil); r.Status != 204 {
		t.Fatalf("kill: %d %s", r.Status, r.Body)
	}
	e2e.Do(t, "GET", gw+"/sandboxes/"+a.SandboxID, auth, nil).ErrorBody(t, 404, a.SandboxID)
	e2e.Do(t, "DELETE", gw+"/sandboxes/"+a.SandboxID, auth, nil).ErrorBody(t, 404, "")

	// The gateway's metrics count these by route and status.
	fams, err := c.Metrics.Gather()
	if err != nil {
		t.Fatal(err)
	}
	counted := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != "opendsec_gateway_requests_total" {
			continue
		}
		for _, m := range f.Metric {
			key := ""
			for _, l := range m.Label {
				key += l.GetName() + "=" + l.GetValue() + " "
			}
			counted[strings.TrimSpace(key)] = m.Counter.GetValue()
		}
	}
	for _, want := range []string{"route=DELETE /sandboxes/{id} status=204", "route=DELETE /sandboxes/{id} status=404", "route=GET /v2/sandboxes status=401"} {
		if counted[want] < 1 {
			t.Errorf("opendsec_gateway_requests_total{%s} not counted; counted: %v", want, counted)
		}
	}
}

// envdClient makes envd Connect calls the way E2B's SDKs do.
type envdTransport struct {
	id, token string
}

func (e envdTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", e.id)
	r.Header.Set("E2b-Sandbox-Port", "49983")
	r.Header.Set("X-Access-Token", e.token)
	return http.DefaultTransport.RoundTrip(r)
}

func TestGatewayEnvdFilesProcessesAndIsolation(t *testing.T) {
	c, gw, key := e2e.GatewayCluster(t)
	sb := e2e.CreateE2B(t, gw, key, `{"templateID":"base"}`)
	envd := map[string]string{"E2b-Sandbox-Id": sb.SandboxID, "X-Access-Token": sb.EnvdAccessToken}
	with := func(extra map[string]string) map[string]string {
		out := map[string]string{}
		for k, v := range envd {
			out[k] = v
		}
		for k, v := range extra {
			out[k] = v
		}
		return out
	}
	dir := t.TempDir()
	target := filepath.Join(dir, "sub", "a.bin")
	q := "?path=" + url.QueryEscape(target)

	// octet-stream upload, then download: same bytes, through chunks.
	payload := bytes.Repeat([]byte("0123456789abcdef"), (5<<20)/16+7)
	r := e2e.Do(t, "POST", gw+"/files"+q, with(map[string]string{"Content-Type": "application/octet-stream"}), bytes.NewReader(payload))
	var infos []map[string]string
	r.JSON(t, &infos)
	if r.Status != 200 || len(infos) != 1 || infos[0]["path"] != target || infos[0]["type"] != "file" || infos[0]["name"] != "a.bin" {
		t.Fatalf("upload: %d %s", r.Status, r.Body)
	}
	if got := e2e.Do(t, "GET", gw+"/files"+q, envd, nil); got.Status != 200 || !bytes.Equal(got.Body, payload) {
		t.Fatalf("download: %d, %d bytes, want %d", got.Status, len(got.Body), len(payload))
	}
	// No temporary file is left next to it.
	if ents, _ := os.ReadDir(filepath.Dir(target)); len(ents) != 1 {
		t.Fatalf("upload left %v", ents)
	}

	// gzip upload.
	var zb bytes.Buffer
	zw := gzip.NewWriter(&zb)
	zw.Write([]byte("compressed"))
	zw.Close()
	e2e.Do(t, "POST", gw+"/files"+q, with(map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}), &zb)
	if got, _ := os.ReadFile(target); string(got) != "compressed" {
		t.Fatalf("gzip upload wrote %q", got)
	}

	// multipart with two files, each named by its part's full path.
	var mb bytes.Buffer
	mw := multipart.NewWriter(&mb)
	for _, name := range []string{filepath.Join(dir, "m", "x"), filepath.Join(dir, "m", "y")} {
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", `form-data; name="file"; filename="`+name+`"`)
		w, _ := mw.CreatePart(h)
		w.Write([]byte(filepath.Base(name)))
	}
	mw.Close()
	r = e2e.Do(t, "POST", gw+"/files", with(map[string]string{"Content-Type": mw.FormDataContentType()}), &mb)
	if r.Status != 200 {
		t.Fatalf("multipart: %d %s", r.Status, r.Body)
	}
	if got, _ := os.ReadFile(filepath.Join(dir, "m", "y")); string(got) != "y" {
		t.Fatalf("multipart wrote %q", got)
	}

	// Errors E2B's SDKs map: 400, 404, 401, 502.
	e2e.Do(t, "GET", gw+"/files", envd, nil).ErrorBody(t, 400, "path: required")
	e2e.Do(t, "GET", gw+"/files?path="+url.QueryEscape(dir), envd, nil).ErrorBody(t, 400, "directory")
	e2e.Do(t, "GET", gw+"/files?path="+url.QueryEscape(filepath.Join(dir, "nope")), envd, nil).ErrorBody(t, 404, "")
	e2e.Do(t, "POST", gw+"/files"+q, with(map[string]string{"Content-Type": "text/plain"}), strings.NewReader("x")).ErrorBody(t, 400, "Content-Type")
	e2e.Do(t, "POST", gw+"/files"+q, with(map[string]string{"Content-Type": "application/octet-stream", "X-Metadata-Owner": "caf\xe9"}), strings.NewReader("x")).ErrorBody(t, 400, `invalid metadata: metadata value of key "owner"`)
	// File metadata: X-Metadata-* headers, keys lowercased, read back.
	r = e2e.Do(t, "POST", gw+"/files"+q, with(map[string]string{"Content-Type": "application/octet-stream", "X-Metadata-Owner": "me"}), strings.NewReader("x"))
	var written []map[string]any
	r.JSON(t, &written)
	if r.Status != 200 || len(written) != 1 || fmt.Sprint(written[0]["metadata"]) != "map[owner:me]" {
		t.Fatalf("an upload with metadata: %d %s", r.Status, r.Body)
	}
	e2e.Do(t, "GET", gw+"/files"+q, with(map[string]string{"X-Access-Token": "wrong"}), nil).ErrorBody(t, 401, "X-Access-Token")
	e2e.Do(t, "GET", gw+"/files"+q, with(map[string]string{"E2b-Sandbox-Port": "8080"}), nil).ErrorBody(t, 400, "has no network")

	// A command through envd's process service: streamed output and exit.
	proc := envdprocessconnect.NewProcessClient(&http.Client{Transport: envdTransport{sb.SandboxID, sb.EnvdAccessToken}}, gw)
	stream, err := proc.Start(e2e.Ctx(t), connect.NewRequest(&envdprocess.StartRequest{Process: &envdprocess.ProcessConfig{
		Cmd: "/bin/sh", Args: []string{"-c", "echo out; echo err >&2; exit 4"}, Cwd: &dir,
	}}))
	if err != nil {
		t.Fatal(err)
	}
	var stdout, stderr string
	var end *envdprocess.ProcessEvent_EndEvent
	started := false
	for stream.Receive() {
		ev := stream.Msg().Event
		switch {
		case ev.GetStart() != nil:
			started = ev.GetStart().Pid > 0
		case ev.GetData() != nil:
			stdout += string(ev.GetData().GetStdout())
			stderr += string(ev.GetData().GetStderr())
		case ev.GetEnd() != nil:
			end = ev.GetEnd()
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if !started || stdout != "out\n" || stderr != "err\n" || end == nil || end.ExitCode != 4 || !end.Exited {
		t.Fatalf("start: started=%v stdout=%q stderr=%q end=%v", started, stdout, stderr, end)
	}

	// Another project's key sees nothing of this sandbox, and its own
	// sandbox's token opens nothing here.
	other := otherProjectE2BKey(t, c)
	e2e.Do(t, "GET", gw+"/sandboxes/"+sb.SandboxID, map[string]string{"X-API-Key": other}, nil).ErrorBody(t, 404, "")
	e2e.Do(t, "DELETE", gw+"/sandboxes/"+sb.SandboxID, map[string]string{"X-API-Key": other}, nil).ErrorBody(t, 404, "")
	theirs := e2e.CreateE2B(t, gw, other, `{"templateID":"base"}`)
	e2e.Do(t, "GET", gw+"/files"+q, with(map[string]string{"X-Access-Token": theirs.EnvdAccessToken}), nil).ErrorBody(t, 401, "X-Access-Token")

	// Once killed, envd calls say the sandbox was not found, as E2B's proxy
	// does (the SDKs raise "not running" from that).
	if r := e2e.Do(t, "GET", gw+"/health", envd, nil); r.Status != 204 {
		t.Fatalf("health of a running sandbox: %d %s", r.Status, r.Body)
	}
	e2e.Do(t, "DELETE", gw+"/sandboxes/"+sb.SandboxID, map[string]string{"X-API-Key": key}, nil)
	e2e.Do(t, "GET", gw+"/health", envd, nil).ErrorBody(t, 502, "was not found")
	e2e.Do(t, "GET", gw+"/files"+q, envd, nil).ErrorBody(t, 502, "was not found")
	gone, err := proc.Start(e2e.Ctx(t), connect.NewRequest(&envdprocess.StartRequest{Process: &envdprocess.ProcessConfig{Cmd: "/bin/true"}}))
	if err == nil {
		for gone.Receive() {
		}
		err = gone.Err()
	}
	if connect.CodeOf(err) != connect.CodeUnavailable || !strings.Contains(err.Error(), "was not found") {
		t.Fatalf("start in a killed sandbox: %v", err)
	}
}

// otherProjectE2BKey makes project "other" under root and an E2B key in it.
func otherProjectE2BKey(t *testing.T, c *e2e.Cluster) string {
	ctx := e2e.Ctx(t)
	if _, err := c.Client.IAM.CreateProject(ctx, connect.NewRequest(&iamv1.CreateProjectRequest{Parent: "root", Name: "other"})); err != nil {
		t.Fatal(err)
	}
	resp, err := c.Client.IAM.CreateAPIKey(ctx, connect.NewRequest(&iamv1.CreateAPIKeyRequest{
		Project: "root/other", Name: "e2b", Role: iamv1.Role_ROLE_MEMBER, Format: iamv1.KeyFormat_KEY_FORMAT_E2B,
	}))
	if err != nil {
		t.Fatal(err)
	}
	return resp.Msg.Secret
}

package hostile

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"strings"
	"testing"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/test/e2e"
	"google.golang.org/protobuf/encoding/protojson"
)

// FuzzAPIRequests sends arbitrary bodies to the request-decoding paths of
// the apiserver (and through it the edge and the agent): every answer must
// be a success or a classified client error, never a 5xx, and the cluster
// must keep working.
func FuzzAPIRequests(f *testing.F) {
	methods := []string{
		"/opendsec.sandbox.v1.SandboxService/CreateSandbox",
		"/opendsec.sandbox.v1.SandboxService/ListSandboxes",
		"/opendsec.sandbox.v1.SandboxService/GetSandbox",
		"/opendsec.sandbox.v1.SandboxService/SetSandboxTimeout",
		"/opendsec.iam.v1.IAMService/CreateProject",
		"/opendsec.image.v1.ImageService/GetImage",
		"/opendsec.agent.v1.ProcessService/Run",
		"/opendsec.agent.v1.FilesystemService/WriteFile",
		"/opendsec.agent.v1.FilesystemService/ReadFile",
		"/opendsec.agent.v1.SessionService/RunInSession",
		"/opendsec.sandbox.v1.SandboxService/UpdateNetwork",
		"/opendsec.sandbox.v1.SandboxService/GetSandboxMetrics",
		"/opendsec.sandbox.v1.SandboxService/ListNodes",
		"/opendsec.sandbox.v1.SandboxService/PauseTask",
		"/opendsec.sandbox.v1.SandboxService/ResumeTask",
		"/opendsec.sandbox.v1.SandboxService/PauseSandbox",
		"/opendsec.image.v1.ImageService/PullImage",
		"/opendsec.image.v1.ImageService/PushImage",
		"/opendsec.image.v1.ImageService/TagImage",
		"/opendsec.sandbox.v1.SandboxService/CommitSandbox",
		"/opendsec.image.v1.ImageService/CollectGarbage",
		"/opendsec.image.v1.ImageService/WarmImage",
		"/opendsec.image.v1.ImageService/SetPool",
		"/opendsec.image.v1.ImageService/ListPools",
	}
	f.Add(uint8(0), []byte(`{"spec":{"backend":"fake","image":"root/busybox:latest","resources":{"cpuCores":0.1,"memoryMb":"16"}}}`))
	f.Add(uint8(1), []byte(`{"pageSize":-1,"pageToken":"%%%"}`))
	f.Add(uint8(2), []byte(`{"sandboxId":"../../etc"}`))
	f.Add(uint8(3), []byte(`{"sandboxId":"aaaaaaaa-aaaaaaaaaaaaaaaa","timeoutSeconds":"99999999999"}`))
	f.Add(uint8(4), []byte(`{"parent":"root","name":"a-b","quota":{"cpuCores":-1}}`))
	f.Add(uint8(5), []byte(`{"name":"root/../x:1"}`))
	f.Add(uint8(6), []byte(`{"process":{"args":["true"],"timeoutMs":100,"env":{"A=":"x"}}}`))
	scratch := f.TempDir()
	f.Add(uint8(7), []byte(`{"path":"`+scratch+`/x","data":"aGk=","mode":"WRITE_MODE_APPEND"}`))
	f.Add(uint8(8), []byte(`{"path":"","offset":"-5"}`))
	f.Add(uint8(9), []byte(`{"sessionId":"nope","command":"true"}`))
	f.Add(uint8(10), []byte(`{"add":[{"domain":"*.*.example.org","ports":["0","70000","5-1"]}],"remove":[{"cidr":"::1/128"}],"internet":true}`))
	f.Add(uint8(0), []byte(`{"spec":{"backend":"fake","image":"root/busybox:latest","network":{"rules":[{"domain":"a..b"},{"cidr":"10.0.0.0/33","protocol":"icmp"},{}]}}}`))
	f.Add(uint8(11), []byte(`{"sandboxId":"aaaaaaaa-aaaaaaaaaaaaaaaa","start":"2030-01-01T00:00:00Z","end":"1970-01-01T00:00:00Z"}`))
	f.Add(uint8(11), []byte(`{"start":"0001-01-01T00:00:00Z","end":"9999-12-31T23:59:59.999999999Z"}`))
	f.Add(uint8(13), []byte(`{"task":"","depth":"PAUSE_DEPTH_OFFLOAD"}`))
	f.Add(uint8(13), []byte(`{"task":"fuzz","depth":99,"project":"root/../x"}`))
	f.Add(uint8(14), []byte(`{"task":"`+strings.Repeat("t", 300)+`"}`))
	f.Add(uint8(15), []byte(`{"sandboxId":"aaaaaaaa-aaaaaaaaaaaaaaaa","depth":"PAUSE_DEPTH_OFFLOAD"}`))
	f.Add(uint8(16), []byte(`{"source":"team/app:1@sha256:`+strings.Repeat("0", 64)+`","name":"root/../x:1","credentials":{"username":"u"}}`))
	f.Add(uint8(17), []byte(`{"name":"root/busybox:latest","destination":"x:1"}`))
	f.Add(uint8(18), []byte(`{"source":"root/busybox:latest","name":"root/../etc:1"}`))
	f.Add(uint8(19), []byte(`{"sandboxId":"aaaaaaaa-aaaaaaaaaaaaaaaa","name":"root/c:1","exclude":["/","[","a/b"],"config":{"env":["A"],"labels":{"":""}}}`))
	f.Add(uint8(20), []byte(`{}`))
	f.Add(uint8(21), []byte(`{"name":"root/busybox:latest","backend":"fake","cpuCores":-1,"memoryMb":"99999999999"}`))
	f.Add(uint8(21), []byte(`{"name":"root/../x:1","backend":"microvm","network":true}`))
	f.Add(uint8(22), []byte(`{"name":"root/busybox:latest","backend":"fake","size":2000000000,"memoryMb":"-1"}`))
	f.Add(uint8(22), []byte(`{"name":"root/busybox:latest","backend":"fake","size":1}`))
	f.Add(uint8(22), []byte(`{"name":"root/busybox:latest","backend":"fake","size":0}`))
	f.Add(uint8(23), []byte(`{}`))
	c := e2e.StartCluster(f, "fake")
	sb, err := c.Client.Create(e2e.CtxTB(f), e2e.FakeSpec())
	if err != nil {
		f.Fatal(err)
	}
	auth := map[string]string{"Authorization": "Bearer " + c.Key, "Dsec-Sandbox-Id": sb.ID}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		m := methods[int(which)%len(methods)]
		if strings.Contains(m, "ProcessService/Run") && strings.Contains(string(body), "args") {
			// Arbitrary commands would run on the host with the fake backend.
			return
		}
		if strings.HasSuffix(m, "FilesystemService/WriteFile") {
			// The fake backend's agent writes to the host as root: keep
			// every write that would decode inside the scratch directory.
			body = confineWrite(body, scratch)
		}
		if strings.HasSuffix(m, "/PullImage") || strings.HasSuffix(m, "/PushImage") {
			// Streams; every registry they name is the closed loopback
			// port 1, so no request leaves the machine.
			if code := streamPost(t, c.APIURL+m, auth, confineRegistry(body)); code == "internal" || code == "unknown" {
				t.Fatalf("%s with %q: %s", m, body, code)
			}
			return
		}
		resp, out := e2e.RawPost(t, c.APIURL+m, auth, string(body))
		if resp.StatusCode >= 500 {
			t.Fatalf("%s with %q: %d %s", m, body, resp.StatusCode, out)
		}
		if strings.HasSuffix(m, "/SetPool") && resp.StatusCode == 200 {
			// A pool set keeps fake sandboxes (host processes) started:
			// the same pool at size 0 removes it.
			var set map[string]any
			if json.Unmarshal(body, &set) == nil {
				set["size"] = 0
				undo, _ := json.Marshal(set)
				if r, out := e2e.RawPost(t, c.APIURL+m, auth, string(undo)); r.StatusCode != 200 {
					t.Fatalf("removing the pool %s set: %d %s", body, r.StatusCode, out)
				}
			}
		}
		if strings.HasSuffix(m, "CreateSandbox") && resp.StatusCode == 200 {
			var created struct{ Sandbox struct{ Id string } }
			json.Unmarshal(out, &created)
			c.Client.Sandbox(created.Sandbox.Id).Stop(e2e.CtxTB(t))
		}
	})
}

// FuzzGatewayRequests sends arbitrary bodies and queries to the E2B
// gateway's decoding paths (control-plane JSON, /files uploads in both
// encodings, envd's Connect services): every answer must be a success or
// an E2B-shaped client error, never a 5xx other than 501 for what is not
// supported. Routes that would run commands or change files outside a
// temporary directory on the host (the fake backend has no isolation) are
// left out; the gVisor suites cover them.
func FuzzGatewayRequests(f *testing.F) {
	f.Add(uint8(0), []byte(`{"templateID":"base","timeout":-5,"metadata":{"a":"b"},"envVars":{"A":"1"}}`))
	f.Add(uint8(1), []byte(`state=running,paused&limit=1001&metadata=a%3D%ZZ&nextToken=o-1&startedAfter=yesterday`))
	f.Add(uint8(2), []byte(`{"timeout":99999999999999}`))
	f.Add(uint8(3), []byte(`{"timeout":"ten"}`))
	f.Add(uint8(2), []byte(`{"timeout":1}`)) // once ended the shared sandbox under later inputs
	f.Add(uint8(2), []byte(`{"timeout":0}`)) // ends it now, by design
	f.Add(uint8(4), []byte("--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"x\"\r\n\r\nhi\r\n--b--\r\n"))
	f.Add(uint8(5), []byte{0x1f, 0x8b, 0x08, 0x00, 0x00})
	f.Add(uint8(6), []byte(`{"path":"/proc/self/status","depth":4294967295}`))
	f.Add(uint8(7), []byte(`{"watcherId":"w../../x"}`))
	f.Add(uint8(8), []byte(`{"count":0}`))
	f.Add(uint8(9), []byte(`path=/etc/passwd&signature=v1_AAAA&signature_expiration=99999999999&username=root`))
	c, gw, key := e2e.GatewayCluster(f)
	sb := e2e.CreateE2B(f, gw, key, `{"templateID":"base"}`)
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		ctl := map[string]string{"X-API-Key": key, "Content-Type": "application/json"}
		envd := map[string]string{"E2b-Sandbox-Id": sb.SandboxID, "X-Access-Token": sb.EnvdAccessToken}
		var r e2e.HTTPResult
		switch which % 10 {
		case 0:
			r = e2e.Do(t, "POST", gw+"/v2/sandboxes", ctl, bytes.NewReader(body))
			if r.Status == 201 {
				var made e2e.E2BSandbox
				r.JSON(t, &made)
				e2e.Do(t, "DELETE", gw+"/sandboxes/"+made.SandboxID, ctl, nil)
			}
		case 1:
			q := strings.Map(func(r rune) rune {
				if r <= ' ' || r == '#' || r == 0x7f {
					return '_'
				}
				return r
			}, string(body))
			if _, err := url.Parse(gw + "/v2/sandboxes?" + q); err != nil {
				return // not a URL a client could send
			}
			r = e2e.Do(t, "GET", gw+"/v2/sandboxes?"+q, ctl, nil)
		case 2:
			r = e2e.Do(t, "POST", gw+"/sandboxes/"+sb.SandboxID+"/timeout", ctl, bytes.NewReader(body))
			if endsNow(body) {
				// Its time to live ends now: the shared sandbox goes,
				// and the next inputs get a new one.
				if r.Status != 204 {
					t.Fatalf("timeout 0 (%q): %d %s; want 204", body, r.Status, r.Body)
				}
				e2e.WaitE2BGone(t, gw, key, sb.SandboxID)
				sb = e2e.CreateE2B(t, gw, key, `{"templateID":"base"}`)
				return
			}
		case 3:
			r = e2e.Do(t, "POST", gw+"/v2/sandboxes/"+sb.SandboxID+"/connect", ctl, bytes.NewReader(body))
		case 4:
			envd["Content-Type"] = "multipart/form-data; boundary=b"
			r = e2e.Do(t, "POST", gw+"/files?path="+url.QueryEscape(filepath.Join(dir, "up")), envd, bytes.NewReader(body))
		case 5:
			envd["Content-Type"] = "application/octet-stream"
			envd["Content-Encoding"] = "gzip"
			r = e2e.Do(t, "POST", gw+"/files?path="+url.QueryEscape(filepath.Join(dir, "gz")), envd, bytes.NewReader(body))
		case 6:
			envd["Content-Type"] = "application/json"
			r = e2e.Do(t, "POST", gw+"/filesystem.Filesystem/Stat", envd, bytes.NewReader(body))
		case 7:
			envd["Content-Type"] = "application/json"
			r = e2e.Do(t, "POST", gw+"/filesystem.Filesystem/GetWatcherEvents", envd, bytes.NewReader(body))
		case 8:
			r = e2e.Do(t, "POST", gw+"/sandboxes/"+sb.SandboxID+"/refreshes", ctl, bytes.NewReader(body))
		case 9:
			// A signed file URL names no sandbox; a signature no sandbox's
			// token makes is refused before anything is read.
			q := strings.Map(func(r rune) rune {
				if r <= ' ' || r == '#' || r == 0x7f {
					return '_'
				}
				return r
			}, string(body))
			if _, err := url.Parse(gw + "/files?" + q); err != nil {
				return
			}
			r = e2e.Do(t, "GET", gw+"/files?"+q, nil, nil)
			if r.Status == 200 {
				t.Fatalf("a signed URL no sandbox signed was served: %q", q)
			}
		}
		if r.Status >= 500 && r.Status != 501 {
			t.Fatalf("route %d with %q: %d %s", which%10, body, r.Status, r.Body)
		}
		switch which % 10 {
		case 2, 3, 8:
			// These may have set the shared sandbox's time to live to a
			// second ({"timeout":1}): it would end under the next inputs,
			// whose calls E2B answers 502 then. Give it its hour back.
			if r := e2e.Do(t, "POST", gw+"/sandboxes/"+sb.SandboxID+"/timeout", ctl, strings.NewReader(`{"timeout":3600}`)); r.Status != 204 {
				t.Fatalf("restore the shared sandbox's timeout after route %d with %q: %d %s", which%9, body, r.Status, r.Body)
			}
		}
	})
	_ = c
}

// endsNow reports whether body is a timeout request the gateway reads as
// 0 seconds: the sandbox's time to live ends at once.
func endsNow(body []byte) bool {
	var req struct {
		Timeout *int64 `json:"timeout"`
	}
	return json.Unmarshal(body, &req) == nil && req.Timeout != nil && *req.Timeout == 0
}

// confineWrite decodes body as the server will; if it is a WriteFileRequest
// whose path leaves dir, the path is moved into dir. A body that does not
// decode is sent as it is: the server refuses it without writing.
func confineWrite(body []byte, dir string) []byte {
	var req agentv1.WriteFileRequest
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(body, &req); err != nil {
		return body
	}
	if p := filepath.Clean(req.Path); filepath.IsAbs(p) && strings.HasPrefix(p, dir+"/") {
		return body
	}
	req.Path = filepath.Join(dir, "confined")
	out, err := protojson.Marshal(&req)
	if err != nil {
		return nil
	}
	return out
}

// confineRegistry points a pull's source or a push's destination at
// 127.0.0.1:1 (closed): the first path part of a reference is its registry.
func confineRegistry(body []byte) []byte {
	var req struct {
		Source      *string         `json:"source,omitempty"`
		Destination *string         `json:"destination,omitempty"`
		Name        json.RawMessage `json:"name,omitempty"`
		Credentials json.RawMessage `json:"credentials,omitempty"`
	}
	if err := json.Unmarshal(body, &req); err != nil {
		return []byte("{}") // an empty reference: refused, nothing fetched
	}
	for _, p := range []*string{req.Source, req.Destination} {
		if p != nil {
			*p = "127.0.0.1:1/" + strings.TrimLeft(*p, "/")
		}
	}
	out, _ := json.Marshal(req)
	return out
}

// streamPost calls a server-streaming Connect method with one JSON message
// and returns the error code its end of stream carries ("" for none).
func streamPost(t *testing.T, url string, hdr map[string]string, body []byte) string {
	t.Helper()
	env := make([]byte, 5+len(body))
	binary.BigEndian.PutUint32(env[1:5], uint32(len(body)))
	copy(env[5:], body)
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(env))
	req.Header.Set("Content-Type", "application/connect+json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		if resp.StatusCode >= 500 {
			return "internal"
		}
		return "http"
	}
	data, _ := io.ReadAll(resp.Body)
	for len(data) >= 5 {
		n := int(binary.BigEndian.Uint32(data[1:5]))
		if 5+n > len(data) {
			break
		}
		if data[0]&0x02 != 0 {
			var end struct{ Error *struct{ Code string } }
			json.Unmarshal(data[5:5+n], &end)
			if end.Error != nil {
				return end.Error.Code
			}
			return ""
		}
		data = data[5+n:]
	}
	return "unknown" // no end of stream
}

func TestConfineRegistry(t *testing.T) {
	for in, want := range map[string]string{
		`{"source":"evil.example.com/x:1"}`:   `{"source":"127.0.0.1:1/evil.example.com/x:1"}`,
		`{"destination":"//10.0.0.1:5000/x"}`: `{"destination":"127.0.0.1:1/10.0.0.1:5000/x"}`,
		`{"source":"a","name":"root/x:1"}`:    `{"source":"127.0.0.1:1/a","name":"root/x:1"}`,
	} {
		if got := string(confineRegistry([]byte(in))); got != want {
			t.Errorf("confineRegistry(%s) = %s; want %s", in, got, want)
		}
	}
}

func TestConfineWrite(t *testing.T) {
	dir := "/scratch/d"
	for body, wantPath := range map[string]string{
		`{"path":"/scratch/d/x","data":"aGk="}`: "/scratch/d/x",
		`{"path":"/etc/passwd","data":"aGk="}`:  "/scratch/d/confined",
		`{"path":"/scratch/d/../../etc/x"}`:     "/scratch/d/confined",
		`{"path":"relative/x"}`:                 "/scratch/d/confined",
		`{"path":"/scratch/dx/y"}`:              "/scratch/d/confined",
		`{"unknown":1,"path":"/root/.bashrc"}`:  "/scratch/d/confined",
	} {
		var req agentv1.WriteFileRequest
		out := confineWrite([]byte(body), dir)
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(out, &req); err != nil {
			t.Fatalf("%s: confined body does not decode: %v", body, err)
		}
		if req.Path != wantPath {
			t.Fatalf("%s: path %q, want %q", body, req.Path, wantPath)
		}
	}
	// Bodies protojson refuses (the server uses it too) are left alone.
	for _, body := range []string{`{"path":`, `{"path":"/etc/x","path":"/scratch/d/x"}`} {
		if got := confineWrite([]byte(body), dir); string(got) != body {
			t.Fatalf("a body that does not decode changed: %q", got)
		}
	}
}

// FuzzPortRequests sends arbitrary methods, paths and credentials to the
// route to sandboxes' ports: every answer is a classified client error
// (the fake backend's sandbox has no network), never a 5xx but 503, and
// never a success without a key.
func FuzzPortRequests(f *testing.F) {
	f.Add("GET", "x", "", "", "")
	f.Add("POST", "../../../v1/images:import", "dsec_bogus", "Bearer x", "dsec-tcp")
	f.Add("GET", "%2e%2e/%00", "", "Basic YTpi", "websocket")
	c := e2e.StartCluster(f, "fake")
	sb, err := c.Client.Create(e2e.CtxTB(f), e2e.FakeSpec())
	if err != nil {
		f.Fatal(err)
	}
	ports := []string{"0", "1", "65535", "65536", "-1", "x", "80"}
	f.Fuzz(func(t *testing.T, method, path, key, authz, upgrade string) {
		if !validMethod(method) {
			return
		}
		for _, port := range ports {
			raw := c.APIURL + "/v1/sandboxes/" + sb.ID + "/ports/" + port + "/" + path
			req, err := http.NewRequest(method, raw, nil)
			if err != nil {
				return // not a URL a client could send
			}
			for k, v := range map[string]string{"X-API-Key": key, "Authorization": authz, "Upgrade": upgrade} {
				if v != "" {
					req.Header.Set(k, v)
				}
			}
			if upgrade != "" {
				req.Header.Set("Connection", "Upgrade")
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return // a header net/http will not send
			}
			resp.Body.Close()
			if (resp.StatusCode >= 500 && resp.StatusCode != 503) || resp.StatusCode < 400 {
				t.Fatalf("%s %s (key %q, authorization %q, upgrade %q): %d", method, raw, key, authz, upgrade, resp.StatusCode)
			}
		}
	})
}

func validMethod(m string) bool {
	if m == "" || len(m) > 16 {
		return false
	}
	for _, r := range m {
		if r < 'A' || r > 'Z' {
			return false
		}
	}
	return true
}

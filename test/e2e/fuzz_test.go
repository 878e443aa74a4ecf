package e2e

import (
	"encoding/json"
	"strings"
	"testing"
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
	}
	f.Add(uint8(0), []byte(`{"spec":{"backend":"fake","image":"root/busybox:latest","resources":{"cpuCores":0.1,"memoryMb":"16"}}}`))
	f.Add(uint8(1), []byte(`{"pageSize":-1,"pageToken":"%%%"}`))
	f.Add(uint8(2), []byte(`{"sandboxId":"../../etc"}`))
	f.Add(uint8(3), []byte(`{"sandboxId":"aaaaaaaa-aaaaaaaaaaaaaaaa","timeoutSeconds":"99999999999"}`))
	f.Add(uint8(4), []byte(`{"parent":"root","name":"a-b","quota":{"cpuCores":-1}}`))
	f.Add(uint8(5), []byte(`{"name":"root/../x:1"}`))
	f.Add(uint8(6), []byte(`{"process":{"args":["true"],"timeoutMs":100,"env":{"A=":"x"}}}`))
	f.Add(uint8(7), []byte(`{"path":"/tmp/fuzz/x","data":"aGk=","mode":"WRITE_MODE_APPEND"}`))
	f.Add(uint8(8), []byte(`{"path":"","offset":"-5"}`))
	f.Add(uint8(9), []byte(`{"sessionId":"nope","command":"true"}`))
	c := startCluster(f, "fake")
	sb, err := c.client.Create(ctxTB(f), fakeSpec())
	if err != nil {
		f.Fatal(err)
	}
	auth := map[string]string{"Authorization": "Bearer " + c.key, "Dsec-Sandbox-Id": sb.ID}
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		m := methods[int(which)%len(methods)]
		if strings.Contains(m, "ProcessService/Run") && strings.Contains(string(body), "args") {
			// Arbitrary commands would run on the host with the fake backend.
			return
		}
		resp, out := rawPost(t, c.APIURL+m, auth, string(body))
		if resp.StatusCode >= 500 {
			t.Fatalf("%s with %q: %d %s", m, body, resp.StatusCode, out)
		}
		if strings.HasSuffix(m, "CreateSandbox") && resp.StatusCode == 200 {
			var created struct{ Sandbox struct{ Id string } }
			json.Unmarshal(out, &created)
			c.client.Sandbox(created.Sandbox.Id).Stop(ctxTB(t))
		}
	})
}

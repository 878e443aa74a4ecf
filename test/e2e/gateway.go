package e2e

import (
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/gateway/e2b"
)

// GatewayCluster runs a cluster with its gateway; the fake backend runs
// processes on the host as root, so E2B's default user is root here.
func GatewayCluster(t testing.TB) (*Cluster, string, string) {
	return GatewayClusterWith(t, nil)
}

// GatewayClusterWith is GatewayCluster after adjust has seen the
// configuration.
func GatewayClusterWith(t testing.TB, adjust func(*embed.Config)) (*Cluster, string, string) {
	c := StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.GatewayListen = "127.0.0.1:0"
		cfg.Gateway = e2b.Config{Backend: "fake", BaseImage: "root/busybox:latest", DefaultUser: "root"}
		if adjust != nil {
			adjust(cfg)
		}
	}, "fake")
	var key string
	data, err := os.ReadFile(c.ClientEnv)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "export E2B_API_KEY="); ok {
			key = v
		}
	}
	if !strings.HasPrefix(key, "e2b_") || len(key) != 44 {
		t.Fatalf("client.env has no E2B key in E2B's format: %q", key)
	}
	return c, c.GatewayURL, key
}

// HTTPClient bounds every call: a gateway that hangs fails the test.
var HTTPClient = &http.Client{Timeout: time.Minute}

type HTTPResult struct {
	Status int
	Body   []byte
	Header http.Header
}

func (r HTTPResult) JSON(t testing.TB, v any) {
	t.Helper()
	if err := json.Unmarshal(r.Body, v); err != nil {
		t.Fatalf("%d %s: %v", r.Status, r.Body, err)
	}
}

// ErrorBody checks E2B's {code, message} error body.
func (r HTTPResult) ErrorBody(t testing.TB, status int, msg string) {
	t.Helper()
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if r.Status != status {
		t.Fatalf("status %d, want %d: %s", r.Status, status, r.Body)
	}
	r.JSON(t, &e)
	if e.Code != status || !strings.Contains(e.Message, msg) {
		t.Fatalf("error body %s: want code %d and a message with %q", r.Body, status, msg)
	}
}

func Do(t testing.TB, method, u string, hdr map[string]string, body io.Reader) HTTPResult {
	t.Helper()
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := HTTPClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, u, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return HTTPResult{resp.StatusCode, b, resp.Header}
}

type E2BSandbox struct {
	TemplateID      string `json:"templateID"`
	SandboxID       string `json:"sandboxID"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken"`
}

func CreateE2B(t testing.TB, gw, key, body string) E2BSandbox {
	t.Helper()
	r := Do(t, "POST", gw+"/v2/sandboxes", map[string]string{"X-API-Key": key, "Content-Type": "application/json"}, strings.NewReader(body))
	if r.Status != http.StatusCreated {
		t.Fatalf("create: %d %s", r.Status, r.Body)
	}
	var sb E2BSandbox
	r.JSON(t, &sb)
	if sb.SandboxID == "" || sb.ClientID == "" || sb.EnvdVersion == "" || sb.EnvdAccessToken == "" {
		t.Fatalf("create answer lacks a field E2B's SDKs require: %s", r.Body)
	}
	return sb
}

// WaitE2BGone waits until the gateway no longer knows sandbox id.
func WaitE2BGone(t testing.TB, gw, key, id string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		r := Do(t, "GET", gw+"/sandboxes/"+id, map[string]string{"X-API-Key": key}, nil)
		if r.Status == http.StatusNotFound {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s still there a minute after its end: %d %s", id, r.Status, r.Body)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

package controlplane

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestClientAPIOverTLS: with TLS, the client API is HTTPS under a
// certificate of the cluster's CA, which client.env names: the Go client,
// the CLI and the Python SDK verify it with that CA and work; a client
// without the CA refuses the certificate, and plain HTTP is not served.
// The E2B gateway likewise serves HTTPS.
func TestClientAPIOverTLS(t *testing.T) {
	c, gw, e2bKey := e2e.GatewayClusterWith(t, func(cfg *embed.Config) { cfg.TLS = true })
	if !strings.HasPrefix(c.APIURL, "https://") || c.CAFile == "" {
		t.Fatalf("API %s, CA %q", c.APIURL, c.CAFile)
	}
	env, _ := os.ReadFile(c.ClientEnv)
	if !strings.Contains(string(env), "export DSEC_CA_FILE="+c.CAFile+"\n") || !strings.Contains(string(env), "export DSEC_API_URL=https://") {
		t.Fatalf("client.env: %s", env)
	}
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, e2e.FakeSpec())
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(ctx)
	if r := e2e.Shell(t, sb, "echo over tls"); string(r.Stdout) != "over tls\n" {
		t.Fatalf("an exec through the TLS API: %q %q", r.Stdout, r.Stderr)
	}

	untrusting, _ := client.New(c.APIURL, c.Key)
	if _, err := untrusting.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{})); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a client without the CA: %v", err)
	}
	resp, err := http.Get("http://" + strings.TrimPrefix(c.APIURL, "https://") + "/healthz")
	if err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Fatal("plain HTTP is served beside TLS")
		}
	}

	// The E2B gateway serves HTTPS too, under a certificate of the CA, and
	// reaches the apiserver over TLS, with the CA.
	if !strings.HasPrefix(gw, "https://") || !strings.Contains(string(env), "export E2B_API_URL="+gw+"\n") {
		t.Fatalf("gateway %s; client.env: %s", gw, env)
	}
	pem, err := os.ReadFile(c.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, ForceAttemptHTTP2: true}}
	e2bCall := func(method, path, body string) (*http.Response, []byte) {
		t.Helper()
		req, _ := http.NewRequest(method, gw+path, strings.NewReader(body))
		req.Header.Set("X-API-Key", e2bKey)
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("%s %s over TLS: %v", method, path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, b
	}
	resp, body := e2bCall("POST", "/v2/sandboxes", `{"templateID":"base"}`)
	var made e2e.E2BSandbox
	if err := json.Unmarshal(body, &made); resp.StatusCode != http.StatusCreated || err != nil || resp.ProtoMajor != 2 {
		t.Fatalf("create through the gateway over TLS: %s %s %s", resp.Proto, resp.Status, body)
	}
	if resp, body := e2bCall("DELETE", "/sandboxes/"+made.SandboxID, ""); resp.StatusCode != 204 {
		t.Fatalf("kill through the gateway: %s %s", resp.Status, body)
	}
	// A sandbox host name (PORT-ID.localhost) is in the certificate.
	conn, err := tls.Dial("tcp", strings.TrimPrefix(gw, "https://"), &tls.Config{RootCAs: roots, ServerName: "49999-" + made.SandboxID + ".localhost"})
	if err != nil {
		t.Fatalf("TLS to the gateway as a sandbox host: %v", err)
	}
	conn.Close()
	if _, err := http.Get(gw); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("a client without the CA at the gateway: %v", err)
	}

	// The CLI, with client.env's variables.
	envVars := []string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key, "DSEC_CA_FILE=" + c.CAFile}
	if out, errOut, code := e2e.RunCLI(t, e2e.DsecBinary(t), envVars, "", "ls"); code != 0 || !strings.Contains(out, sb.ID) {
		t.Fatalf("dsec ls over TLS: %q %q exit %d", out, errOut, code)
	}
	if _, errOut, code := e2e.RunCLI(t, e2e.DsecBinary(t), envVars[:2], "", "ls"); code == 0 || !strings.Contains(errOut, "certificate") {
		t.Fatalf("dsec ls without the CA: %q exit %d", errOut, code)
	}

	// The Python SDK, sync, with DSEC_CA_FILE and without.
	py := filepath.Join(testutil.RepoRoot(t), ".cache", "venv", "bin", "python")
	if _, err := os.Stat(py); err != nil {
		testutil.Missing(t, "the Python SDK's venv is not built (make venv)")
	}
	script := `
import sys
from opendsec.sync import DSecClient
c = DSecClient()
print(len(c.list_sandboxes()))
`
	run := func(extra ...string) (string, error) {
		cmd := exec.Command(py, "-c", script)
		cmd.Env = append(os.Environ(), append([]string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key}, extra...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run("DSEC_CA_FILE=" + c.CAFile); err != nil || strings.TrimSpace(out) != "1" {
		t.Fatalf("the Python SDK with the CA: %q %v", out, err)
	}
	if out, err := run("DSEC_CA_FILE="); err == nil || !strings.Contains(out, "CERTIFICATE_VERIFY_FAILED") {
		t.Fatalf("the Python SDK without the CA: %q %v", out, err)
	}
}

// TestClientAPIWithMutualTLS: with client certificates required (dsec up
// --tls --client-certs), the Go client, the CLI and the Python SDK that
// present client.env's certificate work, and each refuses to work, saying
// a certificate is missing, with the CA alone; the E2B gateway presents
// its own to reach the apiserver.
func TestClientAPIWithMutualTLS(t *testing.T) {
	c, gw, e2bKey := e2e.GatewayClusterWith(t, func(cfg *embed.Config) { cfg.TLS, cfg.ClientCerts = true, true })
	env, _ := os.ReadFile(c.ClientEnv)
	if c.ClientCert == "" || !strings.Contains(string(env), "export DSEC_CLIENT_CERT="+c.ClientCert+"\n") || !strings.Contains(string(env), "export DSEC_CLIENT_KEY="+c.ClientKey+"\n") {
		t.Fatalf("client.env names no client certificate: %s", env)
	}
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, e2e.FakeSpec())
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(ctx)
	if r := e2e.Shell(t, sb, "echo mutual"); string(r.Stdout) != "mutual\n" {
		t.Fatalf("an exec through the mutual-TLS API: %q %q", r.Stdout, r.Stderr)
	}
	caOnly, err := client.NewWithCA(c.APIURL, c.Key, c.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := caOnly.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{})); err == nil || !strings.Contains(err.Error(), "set DSEC_CLIENT_CERT and DSEC_CLIENT_KEY") {
		t.Fatalf("a client without a certificate: %v, want a refusal naming the missing certificate", err)
	}
	if _, err := client.NewWithTLS(c.APIURL, c.Key, client.TLSFiles{CA: c.CAFile, Cert: c.ClientCert}); err == nil || !strings.Contains(err.Error(), "DSEC_CLIENT_KEY") {
		t.Fatalf("a certificate without its key: %v", err)
	}

	// The CLI, with client.env's variables and without the certificate's.
	envVars := []string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key, "DSEC_CA_FILE=" + c.CAFile, "DSEC_CLIENT_CERT=" + c.ClientCert, "DSEC_CLIENT_KEY=" + c.ClientKey}
	if out, errOut, code := e2e.RunCLI(t, e2e.DsecBinary(t), envVars, "", "ls"); code != 0 || !strings.Contains(out, sb.ID) {
		t.Fatalf("dsec ls over mutual TLS: %q %q exit %d", out, errOut, code)
	}
	if _, errOut, code := e2e.RunCLI(t, e2e.DsecBinary(t), envVars[:3], "", "ls"); code == 0 || !strings.Contains(errOut, "set DSEC_CLIENT_CERT and DSEC_CLIENT_KEY") {
		t.Fatalf("dsec ls without a client certificate: %q exit %d", errOut, code)
	}

	// The E2B gateway reaches the apiserver with its own certificate.
	pem, err := os.ReadFile(c.CAFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}, ForceAttemptHTTP2: true}}
	req, _ := http.NewRequest("POST", gw+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req.Header.Set("X-API-Key", e2bKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("a create through the gateway: %s %s", resp.Status, body)
	}

	// The Python SDK, with the certificate and without (the refusal is
	// the TLS alert, or a closed connection with the hint, as the alert
	// and the request race).
	py := filepath.Join(testutil.RepoRoot(t), ".cache", "venv", "bin", "python")
	if _, err := os.Stat(py); err != nil {
		testutil.Missing(t, "the Python SDK's venv is not built (make venv)")
	}
	script := `
from opendsec.sync import DSecClient
c = DSecClient()
print(len(c.list_sandboxes()))
`
	run := func(env ...string) (string, error) {
		cmd := exec.Command(py, "-c", script)
		cmd.Env = append(os.Environ(), env...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := run(envVars...); err != nil || strings.TrimSpace(out) != "2" {
		t.Fatalf("the Python SDK with the client certificate: %q %v", out, err)
	}
	if out, err := run(append(envVars[:3:3], "DSEC_CLIENT_CERT=", "DSEC_CLIENT_KEY=")...); err == nil || !(strings.Contains(out, "set DSEC_CLIENT_CERT and DSEC_CLIENT_KEY") || strings.Contains(out, "alert certificate required")) {
		t.Fatalf("the Python SDK without a client certificate: %q %v", out, err)
	}
}

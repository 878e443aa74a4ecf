package controlplane

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
)

// prometheus is Debian's Prometheus server, run by a test on loopback.
type prometheus struct {
	url string
}

func startPrometheus(t *testing.T, dir string, targets []string, rules string) *prometheus {
	t.Helper()
	testutil.RequireBinary(t, "prometheus")
	quoted := make([]string, len(targets))
	for i, tg := range targets {
		quoted[i] = fmt.Sprintf("%q", tg)
	}
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [%q]
scrape_configs:
  - job_name: opendsec
    scrape_timeout: 1s
    static_configs:
      - targets: [%s]
`, rules, strings.Join(quoted, ", "))
	cfgFile := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgFile, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	logf, _ := os.Create(filepath.Join(dir, "prometheus.log"))
	cmd := exec.Command("prometheus", "--config.file="+cfgFile, "--storage.tsdb.path="+filepath.Join(dir, "tsdb"), "--web.listen-address="+addr)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill() //nolint:errcheck // may be gone
		cmd.Wait()         //nolint:errcheck // killed
		logf.Close()
		if t.Failed() {
			data, _ := os.ReadFile(filepath.Join(dir, "prometheus.log"))
			t.Logf("prometheus log:\n%s", data)
		}
	})
	return &prometheus{url: "http://" + addr}
}

// query runs PromQL and returns each series' labels and value.
func (p *prometheus) query(q string) ([]map[string]string, error) {
	resp, err := http.Get(p.url + "/api/v1/query?query=" + url.QueryEscape(q))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out struct {
		Status string
		Error  string
		Data   struct {
			Result []struct {
				Metric map[string]string
				Value  []any
			}
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, err
	}
	if out.Status != "success" {
		return nil, fmt.Errorf("%s: %s", q, out.Error)
	}
	var rows []map[string]string
	for _, r := range out.Data.Result {
		r.Metric["__value__"] = fmt.Sprint(r.Value[1])
		rows = append(rows, r.Metric)
	}
	return rows, nil
}

// until waits for a query to give what ok accepts.
func (p *prometheus) until(t *testing.T, q string, wait time.Duration, ok func([]map[string]string) bool) []map[string]string {
	t.Helper()
	var rows []map[string]string
	var err error
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		if rows, err = p.query(q); err == nil && ok(rows) {
			return rows
		}
	}
	t.Fatalf("%s: %v %v, not what was waited for in %v", q, rows, err, wait)
	return nil
}

// TestPrometheusWatchesTheDaemons: Debian's Prometheus server scrapes a
// cluster of processes (IAM, an edge, the watcher, an apiserver, each at
// its --metrics-listen) with the shipped alert rules: every target is up,
// a create (over the apiserver's client TLS) shows in the apiserver's and
// the edge's figures through PromQL,
// a kill -9 of the edge fires the target-down and edge-unhealthy alerts,
// and its restart resolves them. The rules' `for` durations are set to 0
// here (promtool's unit tests cover them); their expressions are those
// shipped.
func TestPrometheusWatchesTheDaemons(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	testutil.RequireBinary(t, "busybox")
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	storeDir := e2e.BusyboxStore(t, dir)
	d := newDaemons(t, dir)
	pkiDir := filepath.Join(dir, "pki")
	tlsFlags := d.certificates(pkiDir, map[string]string{"iam-1": "iam", "edge-1": "edge", "api-1": "apiserver", "watcher": "watcher"})
	ia, ea, wa, aa := freeAddr(t), freeAddr(t), freeAddr(t), freeAddr(t)
	m := map[string]string{"iam-1": freeAddr(t), "edge-1": freeAddr(t), "watcher": freeAddr(t), "api-1": freeAddr(t)}
	keyFile := filepath.Join(dir, "admin.key")
	d.start("iam-1", append([]string{"iam", "--id", "iam-1", "--dir", filepath.Join(dir, "iam-1"), "--bind", ia, "--bootstrap", "--admin-key-file", keyFile, "--metrics-listen", m["iam-1"]}, tlsFlags("iam-1")...)...)
	d.start("edge-1", append([]string{"edge", "--state-dir", filepath.Join(dir, "edge-1"), "--listen", ea, "--image-store", storeDir,
		"--backends", "container", "--agent", testutil.AgentBinary(t), "--sandbox-network=false", "--metrics-listen", m["edge-1"]}, tlsFlags("edge-1")...)...)
	d.start("watcher", append([]string{"watcher", "--listen", wa, "--edges", ea, "--metrics-listen", m["watcher"]}, tlsFlags("watcher")...)...)
	d.start("api-1", append([]string{"apiserver", "--id", "api-1", "--state-dir", filepath.Join(dir, "api-1"), "--listen", aa,
		"--edges", ea, "--iam", ia, "--image-store", storeDir, "--watcher", wa, "--metrics-listen", m["api-1"], "--client-tls"}, tlsFlags("api-1")...)...)

	// The shipped rules, fired at once.
	rules, err := os.ReadFile(filepath.Join(testutil.RepoRoot(t), "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	rulesFile := filepath.Join(dir, "alerts.yml")
	os.WriteFile(rulesFile, regexp.MustCompile(`(?m)^(\s+for:) .*$`).ReplaceAll(rules, []byte("$1 0s")), 0o644)
	p := startPrometheus(t, dir, []string{m["iam-1"], m["edge-1"], m["watcher"], m["api-1"]}, rulesFile)
	p.until(t, `sum(up{job="opendsec"})`, 90*time.Second, func(r []map[string]string) bool { return len(r) == 1 && r[0]["__value__"] == "4" })

	var key []byte
	for deadline := time.Now().Add(30 * time.Second); len(key) == 0; time.Sleep(100 * time.Millisecond) {
		if key, _ = os.ReadFile(keyFile); len(key) == 0 && time.Now().After(deadline) {
			t.Fatal("the bootstrap replica wrote no admin key")
		}
	}
	// Its clients reach it over TLS (--client-tls), verified with the CA.
	cl, err := client.NewWithCA("https://"+aa, strings.TrimSpace(string(key)), filepath.Join(pkiDir, "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(context.WithoutCancel(ctx))
	one := func(r []map[string]string) bool { return len(r) == 1 && r[0]["__value__"] == "1" }
	p.until(t, `sum(opendsec_edge_sandboxes{state="running", backend="container"})`, 30*time.Second, one)
	p.until(t, `sum(opendsec_apiserver_requests_total{method="CreateSandbox", code="ok"})`, 30*time.Second, one)
	p.until(t, `min(opendsec_iam_raft_has_leader)`, 30*time.Second, one) // the replica, and the apiserver's read replica

	// The dashboard's queries are PromQL this Prometheus runs.
	dash, err := os.ReadFile(filepath.Join(testutil.RepoRoot(t), "deploy", "grafana", "opendsec.json"))
	if err != nil {
		t.Fatal(err)
	}
	var board struct {
		Panels []struct{ Targets []struct{ Expr string } }
	}
	if err := json.Unmarshal(dash, &board); err != nil {
		t.Fatal(err)
	}
	for _, panel := range board.Panels {
		for _, tg := range panel.Targets {
			if _, err := p.query(strings.ReplaceAll(tg.Expr, "$__rate_interval", "1m")); err != nil {
				t.Errorf("the dashboard's query does not run: %v", err)
			}
		}
	}

	firing := func(alert string) string {
		return fmt.Sprintf(`ALERTS{alertname=%q, alertstate="firing"}`, alert)
	}
	d.kill("edge-1")
	p.until(t, firing("OpenDsecTargetDown"), 60*time.Second, func(r []map[string]string) bool { return len(r) == 1 && r[0]["instance"] == m["edge-1"] })
	p.until(t, firing("OpenDsecEdgeUnhealthy"), 60*time.Second, func(r []map[string]string) bool { return len(r) == 1 })
	d.restart("edge-1")
	p.until(t, firing("OpenDsecTargetDown"), 90*time.Second, func(r []map[string]string) bool { return len(r) == 0 })
	p.until(t, firing("OpenDsecEdgeUnhealthy"), 60*time.Second, func(r []map[string]string) bool { return len(r) == 0 })
	// The re-attached sandbox is counted again.
	p.until(t, `sum(opendsec_edge_sandboxes{state="running", backend="container"})`, 30*time.Second, one)
}

package controlplane

import (
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// scrape reads a metrics endpoint as Prometheus does.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("the metrics do not parse as Prometheus text: %v", err)
	}
	return fams
}

// value is the sum of a family's samples whose labels include want.
func value(fams map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return -1
	}
	sum := 0.0
	for _, m := range f.Metric {
		labels := map[string]string{}
		for _, l := range m.Label {
			labels[l.GetName()] = l.GetValue()
		}
		match := true
		for k, v := range want {
			match = match && labels[k] == v
		}
		if !match {
			continue
		}
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		case m.Histogram != nil:
			sum += float64(m.Histogram.GetSampleCount())
		}
	}
	return sum
}

// TestMetricsCountWhatTheClusterDoes: dsec up's metrics endpoint (its URL
// in client.env) shows the apiserver's calls by method and code, the
// edge's sandboxes by state, backend and project and its creates' times,
// in Prometheus' format; no label carries a sandbox id.
func TestMetricsCountWhatTheClusterDoes(t *testing.T) {
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.MetricsListen = "127.0.0.1:0" }, "fake")
	env, err := os.ReadFile(c.ClientEnv)
	if err != nil || !strings.Contains(string(env), "export DSEC_METRICS_URL="+c.MetricsURL+"\n") {
		t.Fatalf("client.env has no DSEC_METRICS_URL=%s: %s %v", c.MetricsURL, env, err)
	}
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, e2e.FakeSpec())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: string(c.Edge.Node()) + "-aaaaaaaaaaaaaaaa"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("get of a sandbox that is not there: %v", err)
	}
	// A pause and a resume are timed by operation.
	if _, err := sb.Pause(ctx, sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: sb.ID})); err != nil {
		t.Fatal(err)
	}
	// The edge adds up what sandboxes use every 5 s: the running sandbox's
	// memory-seconds reach Prometheus and the project's usage.
	var fams map[string]*dto.MetricFamily
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Second) {
		fams = scrape(t, c.MetricsURL)
		if value(fams, "opendsec_edge_memory_gb_seconds_total", map[string]string{"project": "root", "backend": "fake"}) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no memory GB-seconds of project root after 30 s: %v", fams["opendsec_edge_memory_gb_seconds_total"])
		}
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Second) { // the watcher's next poll
		p, err := c.Client.IAM.GetProject(ctx, connect.NewRequest(&iamv1.GetProjectRequest{Path: "root"}))
		if err != nil {
			t.Fatal(err)
		}
		if p.Msg.Project.Usage.GetMemoryGbSeconds() > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("project root's usage after 30 s: %v", p.Msg.Project.Usage)
		}
	}
	for _, ch := range []struct {
		name string
		want map[string]string
		min  float64
	}{
		{"opendsec_apiserver_requests_total", map[string]string{"method": "CreateSandbox", "code": "ok", "instance": "apiserver-1"}, 1},
		{"opendsec_apiserver_requests_total", map[string]string{"method": "GetSandbox", "code": "not_found"}, 1},
		{"opendsec_apiserver_request_duration_seconds", map[string]string{"method": "CreateSandbox"}, 1},
		{"opendsec_edge_requests_total", map[string]string{"method": "CreateSandbox", "code": "ok"}, 1},
		{"opendsec_edge_create_duration_seconds", map[string]string{"backend": "fake", "outcome": "ok"}, 1},
		{"opendsec_edge_sandboxes", map[string]string{"state": "running", "backend": "fake", "project": "root"}, 1},
		{"opendsec_edge_operation_duration_seconds", map[string]string{"operation": "pause", "backend": "fake", "outcome": "ok"}, 1},
		{"opendsec_edge_operation_duration_seconds", map[string]string{"operation": "resume", "backend": "fake", "outcome": "ok"}, 1},
		{"opendsec_edge_capacity", map[string]string{"resource": "sandboxes", "kind": "allocated"}, 1},
		{"opendsec_edge_state_disk_bytes", map[string]string{"kind": "free"}, 1},
		{"opendsec_watcher_nodes", map[string]string{"health": "healthy"}, 1},
		{"opendsec_iam_raft_has_leader", map[string]string{"instance": "iam-1"}, 1},
		{"opendsec_iam_raft_state", map[string]string{"state": "Leader"}, 1},
		{"go_goroutines", nil, 1},
	} {
		if got := value(fams, ch.name, ch.want); got < ch.min {
			t.Errorf("%s%v = %v; want at least %v", ch.name, ch.want, got, ch.min)
		}
	}
	// Every metric docs/operations.md lists is there (the gateway's run in
	// test/e2e/network).
	docs, err := os.ReadFile(filepath.Join(testutil.RepoRoot(t), "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	listed := 0
	for _, line := range strings.Split(string(docs), "\n") {
		name := regexp.MustCompile("^\\| `(opendsec_[a-z_]+)`").FindStringSubmatch(line)
		if name == nil {
			continue
		}
		listed++
		if !strings.HasPrefix(name[1], "opendsec_gateway_") && fams[name[1]] == nil {
			t.Errorf("docs/operations.md lists %s; the scrape has no such metric", name[1])
		}
	}
	if listed < 10 {
		t.Errorf("docs/operations.md's metrics table lists %d names", listed)
	}
	if age := value(fams, "opendsec_watcher_view_age_seconds", nil); age < 0 || age > 60 {
		t.Errorf("the watcher's view is %v s old", age)
	}
	for name, f := range fams {
		for _, m := range f.Metric {
			for _, l := range m.Label {
				if strings.Contains(l.GetName(), "sandbox") || strings.Contains(l.GetValue(), sb.ID) {
					t.Errorf("%s has a per-sandbox label %s=%q", name, l.GetName(), l.GetValue())
				}
			}
		}
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// The endpoint renders at most once a second (metrics.Handler).
	got := 0.0
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		if got = value(scrape(t, c.MetricsURL), "opendsec_edge_sandboxes", map[string]string{"state": "running"}); got <= 0 {
			break
		}
	}
	if got > 0 {
		t.Errorf("after the stop, %v sandboxes still counted running", got)
	}
}

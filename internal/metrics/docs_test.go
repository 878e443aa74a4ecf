package metrics

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var metricName = regexp.MustCompile(`opendsec_[a-z_]+`)

// documented are the metric names docs/operations.md's table lists.
func documented(t *testing.T) map[string]bool {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "docs", "operations.md"))
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "| `opendsec_") {
			names[metricName.FindString(line)] = true
		}
	}
	if len(names) < 10 {
		t.Fatalf("the metrics table of docs/operations.md lists %d names", len(names))
	}
	return names
}

// used are the metric names in text, a histogram's series under its name.
func used(text string) []string {
	var out []string
	for _, n := range metricName.FindAllString(text, -1) {
		for _, suffix := range []string{"_bucket", "_count", "_sum"} {
			n = strings.TrimSuffix(n, suffix)
		}
		out = append(out, n)
	}
	return out
}

// TestDashboardAndAlertsUseDocumentedMetrics: the Grafana dashboard and
// the alert rules query only metrics docs/operations.md lists (and the e2e
// tests find those in real scrapes, test/e2e/controlplane).
func TestDashboardAndAlertsUseDocumentedMetrics(t *testing.T) {
	docs := documented(t)
	dash, err := os.ReadFile(filepath.Join("..", "..", "deploy", "grafana", "opendsec.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(dash, &d); err != nil || len(d.Panels) == 0 {
		t.Fatalf("the dashboard: %v, %d panels", err, len(d.Panels))
	}
	for _, p := range d.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			for _, n := range used(tg.Expr) {
				if !docs[n] {
					t.Errorf("panel %q queries %s, which docs/operations.md does not list", p.Title, n)
				}
			}
		}
	}
	alerts, err := os.ReadFile(filepath.Join("..", "..", "deploy", "prometheus", "alerts.yml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range used(string(alerts)) {
		if !docs[n] {
			t.Errorf("an alert uses %s, which docs/operations.md does not list", n)
		}
	}
}

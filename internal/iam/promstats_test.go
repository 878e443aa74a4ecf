package iam

import (
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/pki"
)

// A replica's scrape counts its leader changes (its own election) and
// times the changes it applies as leader.
func TestReplicaMetricsCountLeaderChangesAndApplies(t *testing.T) {
	dir := t.TempDir()
	ca, _ := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	s := open(t, ca, dir, "iam-1", true, true)
	defer s.Close()
	if _, err := s.EnsureRoot(ctx(t)); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a", "b"} {
		if _, err := s.CreateProject(ctx(t), "root", name, fsm.Quota{}); err != nil {
			t.Fatal(err)
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(Collector(s))
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, f := range families {
		for _, m := range f.Metric {
			switch {
			case m.Counter != nil:
				got[f.GetName()] += m.Counter.GetValue()
			case m.Histogram != nil:
				got[f.GetName()] += float64(m.Histogram.GetSampleCount())
			}
		}
	}
	// EnsureRoot writes the root project and its key: 2 changes at least,
	// and the 2 projects.
	if n := got["opendsec_iam_raft_apply_duration_seconds"]; n < 3 {
		t.Errorf("applies timed: %v, want at least 3", n)
	}
	if n := got["opendsec_iam_raft_leader_changes_total"]; n < 1 {
		t.Errorf("leader changes: %v, want at least 1 (the replica's own election)", n)
	}
	s.Close() // twice: the observer stops once
}

package rollout

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// Gates are what a wave must pass while it soaks.
type Gates struct {
	// Soak is how long the cluster is watched after each wave, polled
	// every Poll.
	Soak, Poll time.Duration
	// Ready bounds a restarted component's wait to answer its metrics with
	// the new build's version.
	Ready time.Duration
	// MaxErrorRate is the share of RPCs (every component's
	// opendsec_*_requests_total) answered with a server error (internal,
	// unknown, unavailable, data_loss, deadline_exceeded) during the soak.
	MaxErrorRate float64
	// MaxCreateP99 bounds the 99th percentile of the edges' create times
	// during the soak (the upper bound of its histogram bucket).
	MaxCreateP99 time.Duration
	// MaxStuck is how many sandboxes may be creating or stopping at every
	// poll of the soak (one that never ends is stuck).
	MaxStuck int
}

// DefaultGates suit a small cluster under a steady load.
var DefaultGates = Gates{Soak: 20 * time.Second, Poll: time.Second, Ready: 2 * time.Minute, MaxErrorRate: 0.01, MaxCreateP99: 30 * time.Second, MaxStuck: 0}

// Families is one scrape of a component, by metric name.
type Families map[string]*dto.MetricFamily

// serverErrors are the codes that count against a build; the rest are
// the callers' (not found, invalid argument, permission…).
var serverErrors = map[string]bool{"internal": true, "unknown": true, "unavailable": true, "data_loss": true, "deadline_exceeded": true}

// soak gathers the polls of one wave's soak.
type soak struct {
	first, last map[string]Families // by component, the first and last good scrape
	down        map[string]error    // components whose scrape failed, the first error
	minStuck    int                 // sandboxes creating or stopping, the fewest at any poll
	polls       int
}

func newSoak() *soak {
	return &soak{first: map[string]Families{}, last: map[string]Families{}, down: map[string]error{}, minStuck: math.MaxInt}
}

// add takes one poll: every component's scrape or its error.
func (s *soak) add(scrapes map[string]Families, errs map[string]error) {
	s.polls++
	for name, err := range errs {
		if s.down[name] == nil {
			s.down[name] = err
		}
	}
	stuck := 0
	for name, f := range scrapes {
		if s.first[name] == nil {
			s.first[name] = f
		}
		s.last[name] = f
		stuck += int(sum(f["opendsec_edge_sandboxes"], func(l map[string]string) bool {
			return l["state"] == "creating" || l["state"] == "stopping"
		}))
	}
	s.minStuck = min(s.minStuck, stuck)
}

// verdict is the first gate the soak failed, or nil.
func (s *soak) verdict(g Gates) error {
	if len(s.down) > 0 {
		names := make([]string, 0, len(s.down))
		for n := range s.down {
			names = append(names, n)
		}
		sort.Strings(names)
		return &GateError{Gate: "target up", Detail: fmt.Sprintf("%s: %v", names[0], s.down[names[0]])}
	}
	var bad, total float64
	buckets := map[float64]float64{}
	for name, last := range s.last {
		first := s.first[name]
		for fam, f := range last {
			if strings.HasPrefix(fam, "opendsec_") && strings.HasSuffix(fam, "_requests_total") {
				all := func(map[string]string) bool { return true }
				// RPCs say their Connect code; the E2B gateway its HTTP status.
				failed := func(l map[string]string) bool { return serverErrors[l["code"]] || strings.HasPrefix(l["status"], "5") }
				total += grew(sum(first[fam], all), sum(f, all))
				bad += grew(sum(first[fam], failed), sum(f, failed))
			}
		}
		for ub, n := range bucketCounts(last["opendsec_edge_create_duration_seconds"]) {
			buckets[ub] += grew(bucketCounts(first["opendsec_edge_create_duration_seconds"])[ub], n)
		}
	}
	if total > 0 && bad/total > g.MaxErrorRate {
		return &GateError{Gate: "error rate", Detail: fmt.Sprintf("%.1f%% of %.0f calls answered with a server error (at most %.1f%%)", 100*bad/total, total, 100*g.MaxErrorRate)}
	}
	if p99, n := quantile(buckets, 0.99); n > 0 && p99 > g.MaxCreateP99.Seconds() {
		return &GateError{Gate: "create latency", Detail: fmt.Sprintf("p99 of %.0f creates above %gs (at most %v; creates by bucket: %s)", n, p99, g.MaxCreateP99, describeBuckets(buckets))}
	}
	if s.polls > 0 && s.minStuck > g.MaxStuck {
		return &GateError{Gate: "stuck sandboxes", Detail: fmt.Sprintf("%d sandboxes creating or stopping at every poll for %d polls (at most %d)", s.minStuck, s.polls, g.MaxStuck)}
	}
	return nil
}

// GateError is a failed gate: its name and what was seen.
type GateError struct{ Gate, Detail string }

func (e *GateError) Error() string { return "gate " + e.Gate + " failed: " + e.Detail }

// grew is how much a counter rose from a to b; a fall is a restart, after
// which b is all it counted.
func grew(a, b float64) float64 {
	if b < a {
		return b
	}
	return b - a
}

// sum adds a family's counter and gauge samples whose labels match.
func sum(f *dto.MetricFamily, match func(map[string]string) bool) float64 {
	if f == nil {
		return 0
	}
	total := 0.0
	for _, m := range f.Metric {
		if !match(labels(m)) {
			continue
		}
		switch {
		case m.Counter != nil:
			total += m.Counter.GetValue()
		case m.Gauge != nil:
			total += m.Gauge.GetValue()
		case m.Untyped != nil:
			total += m.Untyped.GetValue()
		}
	}
	return total
}

func labels(m *dto.Metric) map[string]string {
	l := make(map[string]string, len(m.Label))
	for _, p := range m.Label {
		l[p.GetName()] = p.GetValue()
	}
	return l
}

// bucketCounts sums a histogram's cumulative buckets (upper bound →
// count) over its samples whose outcome is ok.
func bucketCounts(f *dto.MetricFamily) map[float64]float64 {
	out := map[float64]float64{}
	if f == nil {
		return out
	}
	for _, m := range f.Metric {
		if m.Histogram == nil || labels(m)["outcome"] != "ok" {
			continue
		}
		for _, b := range m.Histogram.Bucket {
			if !math.IsInf(b.GetUpperBound(), 1) { // the text format lists +Inf; the count below is it
				out[b.GetUpperBound()] += float64(b.GetCumulativeCount())
			}
		}
		out[math.Inf(1)] += float64(m.Histogram.GetSampleCount())
	}
	return out
}

// quantile is the upper bound of the bucket holding the q-th quantile of
// cumulative bucket counts, and the number of observations.
func quantile(cum map[float64]float64, q float64) (float64, float64) {
	n := cum[math.Inf(1)]
	if n == 0 {
		return 0, 0
	}
	bounds := make([]float64, 0, len(cum))
	for ub := range cum {
		bounds = append(bounds, ub)
	}
	sort.Float64s(bounds)
	for _, ub := range bounds {
		if cum[ub] >= q*n {
			return ub, n
		}
	}
	return math.Inf(1), n
}

// versionOf is the version a scrape's opendsec_build_info says.
func versionOf(f Families) string {
	bi := f["opendsec_build_info"]
	if bi == nil {
		return ""
	}
	for _, m := range bi.Metric {
		if v := labels(m)["version"]; v != "" {
			return v
		}
	}
	return ""
}

// describeBuckets lists cumulative bucket counts as "≤1s: 3, ≤10s: 5, all: 5".
func describeBuckets(cum map[float64]float64) string {
	bounds := make([]float64, 0, len(cum))
	for ub := range cum {
		bounds = append(bounds, ub)
	}
	sort.Float64s(bounds)
	parts := make([]string, 0, len(bounds))
	for _, ub := range bounds {
		if math.IsInf(ub, 1) {
			parts = append(parts, fmt.Sprintf("all: %.0f", cum[ub]))
		} else {
			parts = append(parts, fmt.Sprintf("≤%gs: %.0f", ub, cum[ub]))
		}
	}
	return strings.Join(parts, ", ")
}

package edge

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/metrics"
)

// promStats is what the edge tells Prometheus (internal/metrics): its RPCs,
// its sandboxes by state, backend and project (read from the registry's
// published views at each scrape, without a sandbox's lock), and how long
// creates take.
type promStats struct {
	rpc     *metrics.RPC
	creates *prometheus.HistogramVec
}

func newPromStats(e *Edge, r prometheus.Registerer) *promStats {
	s := &promStats{
		rpc: metrics.NewRPC(r, "edge"),
		creates: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "edge", Name: "create_duration_seconds",
			Help:    "Time from a create's admission to its sandbox's agent answering, by backend and outcome (ok or an error code).",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120},
		}, []string{"backend", "outcome"}),
	}
	if r != nil {
		r.MustRegister(s.creates, sandboxCollector{e})
	}
	return s
}

// created records a create's time.
func (s *promStats) created(backend string, began time.Time, err error) {
	outcome := "ok"
	if err != nil {
		outcome = errdefs.Code(err).String()
	}
	s.creates.WithLabelValues(backend, outcome).Observe(time.Since(began).Seconds())
}

var (
	sandboxesDesc = prometheus.NewDesc(metrics.Namespace+"_edge_sandboxes",
		"Sandboxes on the node, by state, backend, project and task.", []string{"state", "backend", "project", "task"}, nil)
	cpuSecondsDesc = prometheus.NewDesc(metrics.Namespace+"_edge_cpu_seconds_total",
		"CPU time the node's sandboxes used, by backend, project and task (kept across restarts of the edge).", []string{"backend", "project", "task"}, nil)
	memoryGBSecondsDesc = prometheus.NewDesc(metrics.Namespace+"_edge_memory_gb_seconds_total",
		"Memory the node's sandboxes were given, in GB, times the seconds they ran (paused time is free), by backend, project and task.", []string{"backend", "project", "task"}, nil)
)

// sandboxCollector counts the node's sandboxes at each scrape, and reads
// the usage totals the metrics loop keeps (never a sandbox's cgroup).
type sandboxCollector struct{ e *Edge }

func (c sandboxCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- sandboxesDesc
	ch <- cpuSecondsDesc
	ch <- memoryGBSecondsDesc
}

func (c sandboxCollector) Collect(ch chan<- prometheus.Metric) {
	type key struct{ state, backend, project, task string }
	counts := map[key]int{}
	for _, sb := range c.e.reg.all() {
		v := sb.View()
		if v == nil {
			continue
		}
		state := strings.ToLower(strings.TrimPrefix(v.State.String(), "SANDBOX_STATE_"))
		counts[key{state, v.GetSpec().GetBackend(), v.Project, v.GetSpec().GetTask()}]++
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(n), k.state, k.backend, k.project, k.task)
	}
	for k, g := range c.e.usage.totals() {
		ch <- prometheus.MustNewConstMetric(cpuSecondsDesc, prometheus.CounterValue, g.CPUSeconds, k.Backend, k.Project, k.Task)
		ch <- prometheus.MustNewConstMetric(memoryGBSecondsDesc, prometheus.CounterValue, g.MemoryGBSeconds, k.Backend, k.Project, k.Task)
	}
}

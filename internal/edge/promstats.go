package edge

import (
	"errors"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/metrics"
	"github.com/opendsec/opendsec/internal/sandboxnet"
)

// promStats is what the edge tells Prometheus (internal/metrics): its RPCs,
// its sandboxes by state, backend and project (read from the registry's
// published views at each scrape, without a sandbox's lock), and how long
// creates take.
type promStats struct {
	rpc     *metrics.RPC
	creates *prometheus.HistogramVec
	ops     *prometheus.HistogramVec
	refusal *prometheus.CounterVec
	// exported counts the bytes of snapshot files served to other edges.
	exported prometheus.Counter
	policies *prometheus.CounterVec
	// claims counts creates that claimed a warm pool's sandbox.
	claims *prometheus.CounterVec
}

func newPromStats(e *Edge, r prometheus.Registerer) *promStats {
	s := &promStats{
		rpc: metrics.NewRPC(r, "edge"),
		creates: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "edge", Name: "create_duration_seconds",
			Help:    "Time from a create's admission to its sandbox's agent answering, by backend and outcome (ok or an error code).",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120},
		}, []string{"backend", "outcome"}),
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "edge", Name: "operation_duration_seconds",
			Help:    "Time of a sandbox's pause (freeze), offload, resume, snapshot, restore (a fork's copies included) and fork, and how long a fork's source did not run (fork_source_paused), by operation, backend and outcome (ok or an error code).",
			Buckets: []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120},
		}, []string{"operation", "backend", "outcome"}),
		refusal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "edge", Name: "admission_refusals_total",
			Help: "Creates the node refused, by what was missing: sandboxes, cpu_cores, memory, disk; fenced for a create another apiserver took over.",
		}, []string{"reason"}),
		policies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "edge", Name: "network_policy_updates_total",
			Help: "Changes of a running sandbox's network policy (UpdateNetwork), by outcome (ok or an error code).",
		}, []string{"outcome"}),
		claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "edge", Name: "pool_claims_total",
			Help: "Creates that claimed a warm pool's sandbox, by outcome (ok, or the error code of a claim that failed and started one instead).",
		}, []string{"outcome"}),
		exported: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "edge", Name: "snapshot_exported_bytes_total",
			Help: "Bytes of snapshot files this node served to other edges (forks and restores placed there).",
		}),
	}
	s.policies.WithLabelValues("ok")
	s.claims.WithLabelValues("ok")
	poolReady := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Namespace: metrics.Namespace, Subsystem: "edge", Name: "pool_ready_sandboxes",
		Help: "Sandboxes the node's warm pools hold started, ready to be claimed.",
	}, func() float64 {
		if e.pools == nil {
			return 0
		}
		return float64(e.pools.readyCount())
	})
	// Every reason from the start, so that the first refusal is a rise.
	for _, reason := range []string{"sandboxes", "cpu_cores", "memory", "disk", "fenced", "other"} {
		s.refusal.WithLabelValues(reason)
	}
	if r != nil {
		r.MustRegister(s.creates, s.ops, s.refusal, s.exported, s.policies, s.claims, poolReady, sandboxCollector{e})
	}
	return s
}

// claimed records a claim of a pool's sandbox.
func (s *promStats) claimed(err error) {
	outcome := "ok"
	if err != nil {
		outcome = errdefs.Code(err).String()
	}
	s.claims.WithLabelValues(outcome).Inc()
}

// took records one operation's time.
func (s *promStats) took(op, backend string, began time.Time, err error) {
	outcome := "ok"
	if err != nil {
		outcome = errdefs.Code(err).String()
	}
	s.ops.WithLabelValues(op, backend, outcome).Observe(time.Since(began).Seconds())
}

// sourcePaused records how long a fork's source did not run.
func (s *promStats) sourcePaused(backend string, d time.Duration) {
	s.ops.WithLabelValues("fork_source_paused", backend, "ok").Observe(d.Seconds())
}

// countExported counts what h writes in its successful answers.
func (s *promStats) countExported(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cw := &countingWriter{ResponseWriter: w}
		h.ServeHTTP(cw, r)
		if cw.status == 0 || cw.status/100 == 2 {
			s.exported.Add(float64(cw.n))
		}
	})
}

// countingWriter counts the bytes of a response and keeps its status.
type countingWriter struct {
	http.ResponseWriter
	status int
	n      int64
}

func (w *countingWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *countingWriter) Write(b []byte) (int, error) {
	n, err := w.ResponseWriter.Write(b)
	w.n += int64(n)
	return n, err
}

// ReadFrom keeps the connection's sendfile path for http.ServeContent.
func (w *countingWriter) ReadFrom(r io.Reader) (int64, error) {
	if rf, ok := w.ResponseWriter.(io.ReaderFrom); ok {
		n, err := rf.ReadFrom(r)
		w.n += n
		return n, err
	}
	n, err := io.Copy(struct{ io.Writer }{w.ResponseWriter}, r)
	w.n += n
	return n, err
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (w *countingWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// policyUpdated counts a network policy change by outcome.
func (s *promStats) policyUpdated(err error) {
	outcome := "ok"
	if err != nil {
		outcome = errdefs.Code(err).String()
	}
	s.policies.WithLabelValues(outcome).Inc()
}

// refused counts an admission refusal by its reason.
func (s *promStats) refused(err error) {
	reason := "other"
	var r *capacity.Refusal
	switch {
	case errors.As(err, &r):
		reason = r.Resource
	case errors.Is(err, errdefs.ErrFailedPrecondition):
		reason = "fenced"
	}
	s.refusal.WithLabelValues(reason).Inc()
}

// created records a create's time.
func (s *promStats) created(backend string, began time.Time, err error) {
	outcome := "ok"
	if err != nil {
		outcome = errdefs.Code(err).String()
	}
	s.creates.WithLabelValues(backend, outcome).Observe(time.Since(began).Seconds())
}

// maxTaskLabels bounds the task labels of the sandboxes gauge per scrape.
const maxTaskLabels = 200

var (
	sandboxesDesc = prometheus.NewDesc(metrics.Namespace+"_edge_sandboxes",
		"Sandboxes on the node, by state, backend, project and task.", []string{"state", "backend", "project", "task"}, nil)
	cpuSecondsDesc = prometheus.NewDesc(metrics.Namespace+"_edge_cpu_seconds_total",
		"CPU time the node's sandboxes used, by backend, project and task (kept across restarts of the edge).", []string{"backend", "project", "task"}, nil)
	pulledBytesDesc = prometheus.NewDesc(metrics.Namespace+"_edge_snapshot_pulled_bytes_total",
		"Bytes of snapshots this node received from other edges (a resumed pull counts only what it fetched).", nil, nil)
	pullFailuresDesc = prometheus.NewDesc(metrics.Namespace+"_edge_snapshot_pull_failures_total",
		"Snapshot pulls from other edges that failed.", nil, nil)
	linkRefusalsDesc = prometheus.NewDesc(metrics.Namespace+"_edge_agent_link_refusals_total",
		"Connections to sandboxes' agent sockets the edge refused: a failed handshake (not the sandbox's agent, or a wrong key) or a failed HTTP/2 setup.", nil, nil)
	dnsDesc = prometheus.NewDesc(metrics.Namespace+"_edge_dns_queries_total",
		"Queries the node's DNS proxy answered, by outcome: answered, policy_refused, rate_limited, unknown_source, malformed, failed.", []string{"outcome"}, nil)
	stateDiskDesc = prometheus.NewDesc(metrics.Namespace+"_edge_state_disk_bytes",
		"The file system of the edge's state directory: its size (kind total) and what is free for the edge (kind free).", []string{"kind"}, nil)
	capacityDesc = prometheus.NewDesc(metrics.Namespace+"_edge_capacity",
		"What the node admits against (kind total) and what its sandboxes hold (kind allocated), by resource: sandboxes, cpu_cores, memory_bytes.", []string{"resource", "kind"}, nil)
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
	ch <- capacityDesc
	ch <- pulledBytesDesc
	ch <- pullFailuresDesc
	ch <- stateDiskDesc
	ch <- linkRefusalsDesc
	ch <- dnsDesc
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
	// At most maxTaskLabels tasks keep their label, the first by name (so a
	// task keeps its series from one scrape to the next); the others count
	// as otherTasks.
	tasks := map[string]bool{}
	for k := range counts {
		tasks[k.task] = true
	}
	if len(tasks) > maxTaskLabels {
		names := slices.Sorted(maps.Keys(tasks))
		folded := map[key]int{}
		for k, n := range counts {
			if i, _ := slices.BinarySearch(names, k.task); i >= maxTaskLabels {
				k.task = otherTasks
			}
			folded[k] += n
		}
		counts = folded
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(sandboxesDesc, prometheus.GaugeValue, float64(n), k.state, k.backend, k.project, k.task)
	}
	total, held := c.e.cfg.Capacity, c.e.reg.allocatedNow()
	for _, m := range []struct {
		resource     string
		total, alloc float64
	}{
		{"sandboxes", float64(total.MaxSandboxes), float64(held.Sandboxes)},
		{"cpu_cores", total.CPUCores, held.CPU},
		{"memory_bytes", float64(total.MemoryMB) * (1 << 20), float64(held.MemoryMB) * (1 << 20)},
	} {
		ch <- prometheus.MustNewConstMetric(capacityDesc, prometheus.GaugeValue, m.total, m.resource, "total")
		ch <- prometheus.MustNewConstMetric(capacityDesc, prometheus.GaugeValue, m.alloc, m.resource, "allocated")
	}
	ch <- prometheus.MustNewConstMetric(pulledBytesDesc, prometheus.CounterValue, float64(c.e.snaps.Transfers.PulledBytes.Load()))
	ch <- prometheus.MustNewConstMetric(pullFailuresDesc, prometheus.CounterValue, float64(c.e.snaps.Transfers.PullFailures.Load()))
	if r := c.e.parts.LinkRefusals; r != nil {
		ch <- prometheus.MustNewConstMetric(linkRefusalsDesc, prometheus.CounterValue, float64(r.Count()))
	}
	q := &sandboxnet.DNSCounts{} // none without a sandbox network
	if c.e.net != nil {
		q = c.e.net.DNSQueries()
	}
	{
		for o, name := range sandboxnet.DNSOutcomes {
			ch <- prometheus.MustNewConstMetric(dnsDesc, prometheus.CounterValue, float64(q.Count(sandboxnet.DNSOutcome(o))), name)
		}
	}
	var st unix.Statfs_t
	if unix.Statfs(c.e.cfg.StateDir, &st) == nil {
		ch <- prometheus.MustNewConstMetric(stateDiskDesc, prometheus.GaugeValue, float64(st.Blocks)*float64(st.Bsize), "total")
		ch <- prometheus.MustNewConstMetric(stateDiskDesc, prometheus.GaugeValue, float64(st.Bavail)*float64(st.Bsize), "free")
	}
	for k, g := range c.e.usage.totals() {
		ch <- prometheus.MustNewConstMetric(cpuSecondsDesc, prometheus.CounterValue, g.CPUSeconds, k.Backend, k.Project, k.Task)
		ch <- prometheus.MustNewConstMetric(memoryGBSecondsDesc, prometheus.CounterValue, g.MemoryGBSeconds, k.Backend, k.Project, k.Task)
	}
}

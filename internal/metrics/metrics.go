// Package metrics is OpenDsec's Prometheus instrumentation [ours]: each
// component registers its metrics on the registry it is given (one per
// process; a process running several components wraps it with the
// component's instance label), and the process serves them at /metrics.
// Names follow Prometheus' conventions (opendsec_<component>_…_total,
// _seconds, _bytes); labels are bounded sets (an RPC method, a code, a
// backend, a state, a project), never a sandbox id: per-sandbox figures
// stay in the per-sandbox metrics API. docs/operations.md lists them.
package metrics

import (
	"bytes"
	"context"
	"net/http"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/common/expfmt"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/version"
)

// Namespace prefixes every OpenDsec metric.
const Namespace = "opendsec"

// NewRegistry returns a registry with the Go runtime's and the process's
// own metrics, and opendsec_build_info: 1, labelled with the binary's
// version (a rollout reads which processes run which build from it).
func NewRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	build := prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: Namespace, Name: "build_info",
		Help:        "1, labelled with the version this process was built as.",
		ConstLabels: prometheus.Labels{"version": version.Version},
	})
	build.Set(1)
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}), build)
	return r
}

// renderEvery bounds how often a flood of scrapes makes the process
// gather its metrics: scrapes within it get the same text.
const renderEvery = time.Second

// Handler serves a registry's metrics in Prometheus' text format. A
// scrape reads counters and in-memory state only; it never calls out.
// The text is made at most once a second, whatever the number of
// scrapers (bench/metrics).
func Handler(g prometheus.Gatherer) http.Handler {
	return &cachedHandler{g: g}
}

type cachedHandler struct {
	g    prometheus.Gatherer
	mu   sync.Mutex
	at   time.Time
	body []byte
	err  error
}

func (h *cachedHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	if time.Since(h.at) >= renderEvery {
		h.body, h.err = render(h.g)
		h.at = time.Now()
	}
	body, err := h.body, h.err
	h.mu.Unlock()
	if err != nil {
		http.Error(w, "gather metrics: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
	w.Write(body) //nolint:errcheck // the scraper went away
}

// render is the registry's metrics as Prometheus text.
func render(g prometheus.Gatherer) ([]byte, error) {
	mfs, err := g.Gather()
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if err := enc.Encode(mf); err != nil {
			return nil, err
		}
	}
	return buf.Bytes(), nil
}

// Instance labels a component's metrics when a process runs several of
// one kind (dsec up's apiservers, edges).
func Instance(r prometheus.Registerer, instance string) prometheus.Registerer {
	if r == nil || instance == "" {
		return r
	}
	return prometheus.WrapRegistererWith(prometheus.Labels{"instance": instance}, r)
}

// RPC counts a Connect server's calls by method and code, with their
// durations.
type RPC struct {
	calls    *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

// NewRPC registers a server's RPC metrics as opendsec_<subsystem>_…; a nil
// registerer makes metrics that go nowhere (tests, unconfigured daemons).
func NewRPC(r prometheus.Registerer, subsystem string) *RPC {
	m := &RPC{
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: Namespace, Subsystem: subsystem, Name: "requests_total",
			Help: "RPCs answered, by method and code (ok or a Connect error code).",
		}, []string{"method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: Namespace, Subsystem: subsystem, Name: "request_duration_seconds",
			Help:    "Time to answer an RPC (a stream: until it ends), by method.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"method"}),
	}
	if r != nil {
		r.MustRegister(m.calls, m.duration)
	}
	return m
}

// method is the last part of a procedure ("/pkg.Service/Method").
func method(procedure string) string {
	return procedure[strings.LastIndexByte(procedure, '/')+1:]
}

// codeOf is "ok" or the Connect code the client gets (errdefs' one
// classification).
func codeOf(err error) string {
	if err == nil {
		return "ok"
	}
	return errdefs.Code(err).String()
}

func (m *RPC) observe(procedure string, began time.Time, err error) {
	name := method(procedure)
	m.calls.WithLabelValues(name, codeOf(err)).Inc()
	m.duration.WithLabelValues(name).Observe(time.Since(began).Seconds())
}

// Interceptor counts the calls a handler answers; it goes first in the
// chain, so that refusals of the interceptors after it count too.
func (m *RPC) Interceptor() connect.Interceptor { return rpcInterceptor{m} }

type rpcInterceptor struct{ m *RPC }

func (i rpcInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		began := time.Now()
		resp, err := next(ctx, req)
		i.m.observe(req.Spec().Procedure, began, err)
		return resp, err
	}
}

func (i rpcInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (i rpcInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		began := time.Now()
		err := next(ctx, conn)
		i.m.observe(conn.Spec().Procedure, began, err)
		return err
	}
}

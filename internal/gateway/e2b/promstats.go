package e2b

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/opendsec/opendsec/internal/metrics"
)

// gatewayStats counts E2B requests by route (the control plane's pattern,
// or "envd" and "sandbox host") and status.
type gatewayStats struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
}

func newGatewayStats(r prometheus.Registerer) *gatewayStats {
	s := &gatewayStats{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "gateway", Name: "requests_total",
			Help: "E2B requests answered, by route and HTTP status.",
		}, []string{"route", "status"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "gateway", Name: "request_duration_seconds",
			Help:    "Time to answer an E2B request (a stream: until it ends), by route.",
			Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"route"}),
	}
	if r != nil {
		r.MustRegister(s.requests, s.duration)
	}
	return s
}

// statusWriter remembers the status a handler answered.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Flush passes on streaming responses' flushes.
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the connection.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// count serves r with h, counted under route (or the pattern the
// control plane's mux matched).
func (s *gatewayStats) count(w http.ResponseWriter, r *http.Request, route string, h http.Handler) {
	began := time.Now()
	sw := &statusWriter{ResponseWriter: w}
	h.ServeHTTP(sw, r)
	if route == "" {
		route = r.Pattern
		if route == "" {
			route = "other"
		}
	}
	if sw.status == 0 {
		sw.status = http.StatusOK
	}
	s.requests.WithLabelValues(route, strconv.Itoa(sw.status)).Inc()
	s.duration.WithLabelValues(route).Observe(time.Since(began).Seconds())
}

package apiserver

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/metrics"
)

// placeStats are the apiserver's Prometheus figures beyond its calls:
// where creates went, quota refusals and fork copies.
type placeStats struct {
	placements *prometheus.CounterVec
	moves      *prometheus.CounterVec
	quota      prometheus.Counter
	copies     *prometheus.CounterVec
}

// Placement outcomes: the first node tried admitted, a later one did
// after others declined, every node tried declined, no node fitted, or
// the edge answered another error.
const (
	placedFirst    = "placed"
	placedAfter    = "placed_after_refusal"
	placedNone     = "declined"
	placedNoNode   = "no_node"
	placedErrorOut = "error"
)

func newPlaceStats(r prometheus.Registerer) *placeStats {
	s := &placeStats{
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "apiserver", Name: "placements_total",
			Help: "Creates placed, by outcome: placed (the first node admitted), placed_after_refusal, declined (every node tried declined), no_node (none fitted), error.",
		}, []string{"outcome"}),
		moves: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "apiserver", Name: "placement_retries_total",
			Help: "Creates moved on to the next node because an edge declined, by the edge's answer (resource_exhausted or unavailable).",
		}, []string{"reason"}),
		quota: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "apiserver", Name: "quota_refusals_total",
			Help: "Creates, forks and restores refused by a project's quota.",
		}),
		copies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: "apiserver", Name: "fork_copies_total",
			Help: "Copies asked of forks and snapshot restores, by kind (fork, restore) and outcome (ok or the copy's error code).",
		}, []string{"kind", "outcome"}),
	}
	for _, o := range []string{placedFirst, placedAfter, placedNone, placedNoNode, placedErrorOut} {
		s.placements.WithLabelValues(o)
	}
	for _, r := range []string{"resource_exhausted", "unavailable"} {
		s.moves.WithLabelValues(r)
	}
	for _, k := range []string{"fork", "restore"} {
		s.copies.WithLabelValues(k, "ok")
	}
	if r != nil {
		r.MustRegister(s.placements, s.moves, s.quota, s.copies)
	}
	return s
}

// placed counts a placement's outcome.
func (s *placeStats) placed(outcome string) { s.placements.WithLabelValues(outcome).Inc() }

// moved counts a move to the next node after err.
func (s *placeStats) moved(err error) {
	reason := "unavailable"
	if errors.Is(err, errdefs.ErrResourceExhausted) {
		reason = "resource_exhausted"
	}
	s.moves.WithLabelValues(reason).Inc()
}

// held counts a quota hold's refusal.
func (s *placeStats) held(err error) {
	if errors.Is(errdefs.FromConnect(err), errdefs.ErrResourceExhausted) {
		s.quota.Inc()
	}
}

// copied counts the copies of a fork or restore by outcome.
func (s *placeStats) copied(kind string, results []*sandboxv1.ForkResult) {
	for _, r := range results {
		outcome := "ok"
		if r.Sandbox == nil {
			outcome = r.ErrorCode
			if outcome == "" {
				outcome = "unknown"
			}
		}
		s.copies.WithLabelValues(kind, outcome).Inc()
	}
}

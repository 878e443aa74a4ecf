package watcher

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/opendsec/opendsec/internal/metrics"
)

var (
	nodesDesc = prometheus.NewDesc(metrics.Namespace+"_watcher_nodes",
		"Edges in the watcher's view, by health.", []string{"health"}, nil)
	viewAgeDesc = prometheus.NewDesc(metrics.Namespace+"_watcher_view_age_seconds",
		"Age of the oldest answer in the watcher's view of the edges: what placements act on.", nil, nil)
)

// Collector reports w's view at each scrape (read without a lock).
func Collector(w *Watcher) prometheus.Collector { return viewCollector{w} }

type viewCollector struct{ w *Watcher }

func (c viewCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- nodesDesc
	ch <- viewAgeDesc
}

func (c viewCollector) Collect(ch chan<- prometheus.Metric) {
	v := c.w.View()
	healthy, unhealthy := 0, 0
	var oldest time.Time
	for _, n := range v.Nodes {
		if n.Healthy {
			healthy++
		} else {
			unhealthy++
		}
		if !n.PolledAt.IsZero() && (oldest.IsZero() || n.PolledAt.Before(oldest)) {
			oldest = n.PolledAt
		}
	}
	ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(healthy), "healthy")
	ch <- prometheus.MustNewConstMetric(nodesDesc, prometheus.GaugeValue, float64(unhealthy), "unhealthy")
	age := 0.0
	if !oldest.IsZero() {
		age = time.Since(oldest).Seconds()
	}
	ch <- prometheus.MustNewConstMetric(viewAgeDesc, prometheus.GaugeValue, age)
}

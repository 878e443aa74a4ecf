package iam

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/opendsec/opendsec/internal/metrics"
)

var (
	raftStateDesc = prometheus.NewDesc(metrics.Namespace+"_iam_raft_state",
		"1 for this replica's Raft state (Leader, Follower, Candidate, Shutdown).", []string{"state"}, nil)
	hasLeaderDesc = prometheus.NewDesc(metrics.Namespace+"_iam_raft_has_leader",
		"1 if this replica knows a leader: writes (keys, projects, quotas) need one.", nil, nil)
	termDesc = prometheus.NewDesc(metrics.Namespace+"_iam_raft_term",
		"The Raft term: a rise is an election.", nil, nil)
	indexDesc = prometheus.NewDesc(metrics.Namespace+"_iam_raft_index",
		"Raft log indexes: last, commit, applied.", []string{"index"}, nil)
)

// Collector reports the replica's Raft state at each scrape (Raft's own
// in-memory figures).
func Collector(s *Service) prometheus.Collector { return raftCollector{s} }

type raftCollector struct{ s *Service }

func (c raftCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{raftStateDesc, hasLeaderDesc, termDesc, indexDesc} {
		ch <- d
	}
}

func (c raftCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.s.Status()
	for _, s := range []string{"Leader", "Follower", "Candidate", "Shutdown"} {
		v := 0.0
		if st.State == s {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(raftStateDesc, prometheus.GaugeValue, v, s)
	}
	has := 0.0
	if st.LeaderID != "" {
		has = 1
	}
	ch <- prometheus.MustNewConstMetric(hasLeaderDesc, prometheus.GaugeValue, has)
	ch <- prometheus.MustNewConstMetric(termDesc, prometheus.GaugeValue, float64(st.Term))
	ch <- prometheus.MustNewConstMetric(indexDesc, prometheus.GaugeValue, float64(st.LastLogIndex), "last")
	ch <- prometheus.MustNewConstMetric(indexDesc, prometheus.GaugeValue, float64(st.CommitIndex), "commit")
	ch <- prometheus.MustNewConstMetric(indexDesc, prometheus.GaugeValue, float64(st.AppliedIndex), "applied")
}

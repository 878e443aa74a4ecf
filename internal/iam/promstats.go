package iam

import (
	"sync"
	"sync/atomic"

	"github.com/hashicorp/raft"
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
	leaderChangesDesc = prometheus.NewDesc(metrics.Namespace+"_iam_raft_leader_changes_total",
		"Changes of the leader this replica knows, losing it included.", nil, nil)
)

// raftStats are what a replica counts beyond Raft's own figures: leader
// changes (from a Raft observer) and the time of the changes it applies
// as leader.
type raftStats struct {
	leaderChanges atomic.Uint64
	applies       prometheus.Histogram
	observer      *raft.Observer
	observed      chan raft.Observation
	stopped       sync.Once
}

// watchRaft starts counting r's leader changes.
func watchRaft(r *raft.Raft) *raftStats {
	st := &raftStats{
		applies: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: metrics.Namespace, Subsystem: "iam", Name: "raft_apply_duration_seconds",
			Help:    "Time the leader took to commit and apply a change (keys, projects, quota reservations), from Raft's Apply to its answer.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 10},
		}),
		observed: make(chan raft.Observation, 16),
	}
	st.observer = raft.NewObserver(st.observed, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	r.RegisterObserver(st.observer)
	go func() {
		for range st.observed {
			st.leaderChanges.Add(1)
		}
	}()
	return st
}

// stop ends the observer: Raft sends nothing to it once deregistered.
func (st *raftStats) stop(r *raft.Raft) {
	st.stopped.Do(func() {
		r.DeregisterObserver(st.observer)
		close(st.observed)
	})
}

// Collector reports the replica's Raft state at each scrape (Raft's own
// in-memory figures).
func Collector(s *Service) prometheus.Collector { return raftCollector{s} }

type raftCollector struct{ s *Service }

func (c raftCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{raftStateDesc, hasLeaderDesc, termDesc, indexDesc, leaderChangesDesc} {
		ch <- d
	}
	c.s.stats.applies.Describe(ch)
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
	ch <- prometheus.MustNewConstMetric(leaderChangesDesc, prometheus.CounterValue, float64(c.s.stats.leaderChanges.Load()))
	c.s.stats.applies.Collect(ch)
}

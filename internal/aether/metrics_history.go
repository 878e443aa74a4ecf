package aether

import (
	"context"
	"sync"
	"time"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
)

// The agent records a sample every sampleEvery for the last historyLen
// samples (an hour), so a caller asking for a time range (E2B's
// get_metrics(start, end)) gets what happened then, not one sample of
// now. A paused sandbox records nothing: its agent is frozen too.
const (
	sampleEvery = 5 * time.Second
	historyLen  = 720
)

type metricsHistory struct {
	mu      sync.Mutex
	samples []*agentv1.MetricsSample // guarded by mu; oldest first
}

// run records samples until ctx ends. CPU use is over the interval since
// the sample before.
func (h *metricsHistory) run(ctx context.Context) {
	busy, total := cpuTimes()
	tick := time.NewTicker(sampleEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			b, t := cpuTimes()
			s := currentSample(now)
			if t > total {
				s.CpuUsedPct = 100 * float64(b-busy) / float64(t-total)
			}
			busy, total = b, t
			h.add(s)
		}
	}
}

func (h *metricsHistory) add(s *agentv1.MetricsSample) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.samples) == historyLen {
		copy(h.samples, h.samples[1:])
		h.samples = h.samples[:historyLen-1]
	}
	h.samples = append(h.samples, s)
}

// between returns the samples from start to end (unix seconds, 0:
// unbounded), and whether the newest one is older than sampleEvery.
func (h *metricsHistory) between(start, end int64, now time.Time) ([]*agentv1.MetricsSample, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []*agentv1.MetricsSample
	for _, s := range h.samples {
		if (start == 0 || s.TimestampUnix >= start) && (end == 0 || s.TimestampUnix <= end) {
			out = append(out, s)
		}
	}
	stale := len(h.samples) == 0 || now.Unix()-h.samples[len(h.samples)-1].TimestampUnix >= int64(sampleEvery/time.Second)
	return out, stale
}

// currentSample reads memory and disk now; CPU is left to the caller.
func currentSample(now time.Time) *agentv1.MetricsSample {
	m := readUsage()
	return &agentv1.MetricsSample{
		TimestampUnix: now.Unix(), MemUsedBytes: m.MemUsedBytes, MemTotalBytes: m.MemTotalBytes,
		MemCacheBytes: m.MemCacheBytes, DiskUsedBytes: m.DiskUsedBytes, DiskTotalBytes: m.DiskTotalBytes,
	}
}

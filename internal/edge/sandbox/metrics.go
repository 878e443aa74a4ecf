package sandbox

import (
	"math"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
)

// Metrics over time [ours; E2B answers the samples of a time range]. Every
// MetricsEvery the edge reads each sandbox's use from the host (its
// cgroups, through backend.UsageReader; its writable layer's file system):
// nothing enters the sandbox, so a paused one stays paused and a busy one
// is not slowed. The last MetricsKept samples are kept in memory; an edge
// restart starts them afresh.

const (
	MetricsEvery = 5 * time.Second
	MetricsKept  = 720 // an hour
)

// metricsRing is one sandbox's recorded samples.
type metricsRing struct {
	mu       sync.Mutex
	samples  []sample  // guarded by mu; oldest first
	lastCPU  uint64    // guarded by mu; CPU nanoseconds at the last sample
	lastAt   time.Time // guarded by mu
	layerDir string    // guarded by mu; the writable layer, once known
}

// forget drops what was recorded: the next sample is a first one.
func (r *metricsRing) forget() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.samples, r.lastCPU, r.lastAt = nil, 0, time.Time{}
}

// sample is one recorded sample, kept small (56 bytes: an hour of them is
// 40 KB a sandbox); proto turns it into the API's form.
type sample struct {
	at                   int64 // unix nanoseconds
	mem, memTotal, cache int64
	disk, diskTotal      int64
	cpuPct               float32
	cores                uint32
}

func (s sample) proto() *sandboxv1.MetricsSample {
	return &sandboxv1.MetricsSample{
		Time: timestamppb.New(time.Unix(0, s.at)), CpuCount: s.cores, CpuUsedPct: float64(s.cpuPct),
		MemUsedBytes: s.mem, MemTotalBytes: s.memTotal, MemCacheBytes: s.cache,
		DiskUsedBytes: s.disk, DiskTotalBytes: s.diskTotal,
	}
}

// Use is what a sandbox used between two samples, for the node's
// accounting by project, task and backend: the CPU time it took and its
// memory (what it was given, in GB) times the seconds it ran. A paused
// sandbox's time is free.
type Use struct {
	Project, Task, Backend string
	CPUSeconds             float64
	MemoryGBSeconds        float64
}

// RecordMetrics takes one sample of sb, if its backend can read its use
// and it is running or paused, and returns what it used since the last
// (zero at the first sample after a start of the edge).
func (sb *Sandbox) RecordMetrics(now time.Time) (use Use) {
	ur, ok := sb.be.(backend.UsageReader)
	if !ok {
		return use
	}
	view := sb.View()
	st := view.GetState()
	if st != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING && st != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		return use
	}
	u, err := ur.Usage(sb.id)
	if err != nil {
		return use // gone, or going: nothing to record
	}
	use = Use{Project: view.GetProject(), Task: view.GetSpec().GetTask(), Backend: view.GetSpec().GetBackend()}
	sb.limits.fromNode(u)
	r := &sb.metrics
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.layerDir == "" && sb.mu.TryLock() { // a busy sandbox's layer is learned at the next sample
		r.layerDir = sb.rec.LayerDir
		sb.mu.Unlock()
	}
	res := view.GetSpec().GetResources()
	cores := math.Ceil(float64(res.GetCpuCores()))
	if cores < 1 {
		cores = 1
	}
	s := sample{at: now.UnixNano(), cores: uint32(cores), mem: u.MemoryBytes, memTotal: u.LimitBytes, cache: u.CacheBytes}
	if limit := res.GetMemoryMb() << 20; limit > 0 && (s.memTotal == 0 || limit < s.memTotal) {
		s.memTotal = limit
	}
	if !r.lastAt.IsZero() && u.CPUNanos >= r.lastCPU {
		if dt := now.Sub(r.lastAt); dt > 0 {
			s.cpuPct = float32(min(100, 100*float64(u.CPUNanos-r.lastCPU)/(float64(dt.Nanoseconds())*cores)))
			use.CPUSeconds = float64(u.CPUNanos-r.lastCPU) / 1e9
			if st == sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
				use.MemoryGBSeconds = float64(res.GetMemoryMb()) / 1024 * dt.Seconds()
			}
		}
	}
	r.lastCPU, r.lastAt = u.CPUNanos, now
	if r.layerDir != "" {
		var st unix.Statfs_t
		if unix.Statfs(r.layerDir, &st) == nil {
			s.diskTotal = int64(st.Blocks) * st.Bsize
			s.disk = int64(st.Blocks-st.Bfree) * st.Bsize
		}
	}
	if len(r.samples) == MetricsKept {
		copy(r.samples, r.samples[1:])
		r.samples = r.samples[:MetricsKept-1]
	}
	r.samples = append(r.samples, s)
	return use
}

// Samples are its recorded samples between start and end (zero: open).
func (sb *Sandbox) Samples(start, end time.Time) []*sandboxv1.MetricsSample {
	r := &sb.metrics
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*sandboxv1.MetricsSample
	for _, s := range r.samples {
		t := time.Unix(0, s.at)
		if (!start.IsZero() && t.Before(start)) || (!end.IsZero() && t.After(end)) {
			continue
		}
		out = append(out, s.proto())
	}
	return out
}

package edge

import (
	"context"
	"errors"
	"strings"
	"testing"

	"time"

	"google.golang.org/protobuf/proto"

	"github.com/prometheus/client_golang/prometheus"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// The recorder: a sample when the sandbox starts, CPU as a share of its
// cores since the sample before, memory capped at its limit, the samples
// of a range, at most sandbox.MetricsKept, and none for another project.
func TestMetricsAreRecordedAndAnsweredByRange(t *testing.T) {
	f := newFixture(t, smallCapacity())
	created, err := f.edge.Create(context.Background(), spec(), "root/team")
	if err != nil {
		t.Fatal(err)
	}
	sb, err := f.edge.lookup(created.Id, "root")
	if err != nil {
		t.Fatal(err)
	}
	first, err := f.edge.Metrics(created.Id, "root/team", time.Time{}, time.Time{})
	if err != nil || len(first) != 1 || first[0].CpuUsedPct != 0 || first[0].CpuCount != 1 {
		t.Fatalf("right after the create: %v, %v; want one sample", first, err)
	}
	t0 := first[0].Time.AsTime()
	f.fake.SetUsage(sb.ID(), backend.Usage{CPUNanos: uint64(500 * time.Millisecond), MemoryBytes: 1 << 40, LimitBytes: 1 << 50})
	sb.RecordMetrics(t0.Add(time.Second))
	f.fake.SetUsage(sb.ID(), backend.Usage{CPUNanos: uint64(600 * time.Millisecond), MemoryBytes: 1 << 20})
	sb.RecordMetrics(t0.Add(2 * time.Second))
	all, _ := f.edge.Metrics(created.Id, "root", time.Time{}, time.Time{})
	if len(all) != 3 {
		t.Fatalf("%d samples, want 3", len(all))
	}
	if got := all[1].CpuUsedPct; got < 49.9 || got > 50.1 {
		t.Fatalf("CPU over the second second: %.2f%%, want 50%%", got)
	}
	if got := all[2].CpuUsedPct; got < 9.9 || got > 10.1 {
		t.Fatalf("CPU over the third second: %.2f%%, want 10%%", got)
	}
	if all[1].MemTotalBytes != 256<<20 || all[1].MemUsedBytes != 1<<40 {
		t.Fatalf("memory: used %d of %d, want the limit of 256 MiB as the total", all[1].MemUsedBytes, all[1].MemTotalBytes)
	}
	mid, _ := f.edge.Metrics(created.Id, "root", t0.Add(500*time.Millisecond), t0.Add(1500*time.Millisecond))
	if len(mid) != 1 || !mid[0].Time.AsTime().Equal(t0.Add(time.Second)) {
		t.Fatalf("the middle second: %v", mid)
	}
	if before, _ := f.edge.Metrics(created.Id, "root", t0.Add(-time.Hour), t0.Add(-time.Minute)); len(before) != 0 {
		t.Fatalf("a range before the sandbox existed: %v", before)
	}
	if _, err := f.edge.Metrics(created.Id, "root", t0, t0.Add(-time.Second)); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("end before start: %v", err)
	}
	if _, err := f.edge.Metrics(created.Id, "root/other", time.Time{}, time.Time{}); !errdefs.IsNotFound(err) {
		t.Fatalf("another project: %v", err)
	}
	for i := 0; i < sandbox.MetricsKept+5; i++ {
		sb.RecordMetrics(t0.Add(time.Duration(3+i) * time.Second))
	}
	all, _ = f.edge.Metrics(created.Id, "root", time.Time{}, time.Time{})
	if len(all) != sandbox.MetricsKept || !all[len(all)-1].Time.AsTime().Equal(t0.Add(time.Duration(sandbox.MetricsKept+7)*time.Second)) {
		t.Fatalf("after many: %d samples, last at %v", len(all), all[len(all)-1].Time.AsTime())
	}
}

// A status is stamped with the last usage change it includes: at or after
// a sandbox's admission once it counts it, later again once it is gone.
func TestStatusIsStampedWithTheChangesItIncludes(t *testing.T) {
	f := newFixture(t, smallCapacity())
	before := f.edge.Status().Usage
	created, err := f.edge.Create(context.Background(), spec(), "root/team")
	if err != nil {
		t.Fatal(err)
	}
	admitted := f.edge.AdmissionStamp(created.Id)
	st := f.edge.Status()
	if admitted.Epoch != before.Epoch || admitted.Seq <= before.Seq || st.Usage.Seq < admitted.Seq || st.Allocated.Sandboxes != 1 {
		t.Fatalf("before %v, admitted %v, status %v with %d sandboxes", before, admitted, st.Usage, st.Allocated.Sandboxes)
	}
	if _, err := f.edge.Destroy(context.Background(), created.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if after := f.edge.Status(); after.Usage.Seq <= st.Usage.Seq || after.Allocated.Sandboxes != 0 {
		t.Fatalf("after the removal: %v with %d sandboxes", after.Usage, after.Allocated.Sandboxes)
	}
}

// scrapingRegistry scrapes itself as each collector registers: Prometheus
// may scrape the endpoint at any moment of an edge's start.
type scrapingRegistry struct {
	*prometheus.Registry
	t *testing.T
}

func (r scrapingRegistry) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	if _, err := r.Gather(); err != nil {
		r.t.Errorf("a scrape during the edge's start: %v", err)
	}
	return nil
}

func (r scrapingRegistry) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// A scrape at any point of an edge's start answers (the sandbox counter
// once read a registry not yet made and took the edge down), and a
// restarted edge counts the sandboxes it recovered.
func TestScrapesDuringStartAnswer(t *testing.T) {
	f := newFixture(t, smallCapacity())
	if _, err := f.edge.Create(context.Background(), spec(), "root/team"); err != nil {
		t.Fatal(err)
	}
	f.edge.Close()
	reg := prometheus.NewRegistry()
	f.metrics = scrapingRegistry{reg, t}
	f.edge = f.open(t, smallCapacity())
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range families {
		if mf.GetName() == "opendsec_edge_sandboxes" && len(mf.Metric) == 1 && mf.Metric[0].GetGauge().GetValue() == 1 {
			return
		}
	}
	t.Fatalf("no opendsec_edge_sandboxes of 1 after the restart in %d families", len(families))
}

// What sandboxes use is added up by project, task and backend: the CPU
// time their cgroups report between samples, and their memory times the
// seconds they ran (a paused sandbox's time is free). The totals are in
// the node's status (the apiserver sums them per project) and in
// Prometheus, and a restarted edge goes on from them.
func TestUsageIsAddedUpByGroupAndKeptAcrossRestarts(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	s := spec()
	s.Task = "rollout-7"
	created, err := f.edge.Create(ctx, s, "root/team")
	if err != nil {
		t.Fatal(err)
	}
	sb, _ := f.edge.lookup(created.Id, "root")
	first, err := f.edge.Metrics(created.Id, "root", time.Time{}, time.Time{})
	if err != nil || len(first) != 1 {
		t.Fatalf("the sample of the start: %v, %v", first, err)
	}
	t0 := first[0].Time.AsTime()
	f.fake.SetUsage(sb.ID(), backend.Usage{CPUNanos: uint64(time.Second)})
	f.edge.sample(t0.Add(2 * time.Second))
	f.fake.SetUsage(sb.ID(), backend.Usage{CPUNanos: uint64(3 * time.Second)})
	f.edge.sample(t0.Add(4 * time.Second)) // 3 CPU-s since the start; 256 MiB for 4 s: 1 GB-s
	group := func(e *Edge) *edgev1.GroupUsage {
		t.Helper()
		for _, g := range e.Status().Groups {
			if g.Project == "root/team" && g.Task == "rollout-7" && g.Backend == "fake" {
				return g
			}
		}
		t.Fatalf("no group of root/team, rollout-7, fake in %v", e.Status().Groups)
		return nil
	}
	if g := group(f.edge); g.CpuSeconds != 3 || g.MemoryGbSeconds != 1 || g.Usage.Sandboxes != 1 {
		t.Fatalf("after 4 s: %v, want 3 CPU-s, 1 GB-s, 1 sandbox", g)
	}
	if _, err := f.edge.PauseAt(ctx, created.Id, "root/team", sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE); err != nil {
		t.Fatal(err)
	}
	f.fake.SetUsage(sb.ID(), backend.Usage{CPUNanos: uint64(3 * time.Second)})
	f.edge.sample(t0.Add(60 * time.Second))
	if g := group(f.edge); g.MemoryGbSeconds != 1 {
		t.Fatalf("paused for 56 s: %v GB-s, want still 1", g.MemoryGbSeconds)
	}
	if _, err := f.edge.Destroy(ctx, created.Id, "root/team"); err != nil {
		t.Fatal(err)
	}
	f.edge.Close()
	reg := prometheus.NewRegistry()
	f.metrics = reg
	f.edge = f.open(t, smallCapacity())
	if g := group(f.edge); g.CpuSeconds != 3 || g.MemoryGbSeconds != 1 || g.Usage.GetSandboxes() != 0 {
		t.Fatalf("after a restart, with the sandbox gone: %v, want the totals kept and no sandbox", g)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range families {
		for _, m := range mf.Metric {
			if strings.HasSuffix(mf.GetName(), "_seconds_total") && len(m.Label) > 0 {
				got[mf.GetName()] += m.GetCounter().GetValue()
			}
		}
	}
	if got["opendsec_edge_cpu_seconds_total"] != 3 || got["opendsec_edge_memory_gb_seconds_total"] != 1 {
		t.Fatalf("Prometheus says %v, want 3 CPU-s and 1 GB-s", got)
	}
}

// The edge's figures beside its creates: each pause, resume, snapshot,
// fork (and its copies' restores, and how long its source stood still) by
// operation, backend and outcome; refusals by what was missing; capacity
// total and allocated; the state disk.
func TestEdgeMetricsCountOperationsRefusalsAndCapacity(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	reg := prometheus.NewRegistry()
	f.metrics = reg
	room := smallCapacity()
	room.MaxSandboxes = 3
	f.edge = f.open(t, room)
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root/team")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.PauseAt(ctx, sb.Id, "root", sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE); err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.Resume(ctx, sb.Id, "root"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.Snapshot(ctx, sb.Id, "root", ""); err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.Fork(ctx, sb.Id, "root", ForkRequest{Count: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.Create(ctx, spec(), "root/team"); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Fatalf("a fourth sandbox on a node of 3: %v", err)
	}
	// A policy change, counted whatever its outcome (this node has no
	// sandbox network).
	_, policyErr := f.edge.UpdateNetwork(ctx, &sandboxv1.UpdateNetworkRequest{SandboxId: sb.Id, Internet: proto.Bool(true)}, "root")
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range families {
		for _, m := range mf.Metric {
			key := mf.GetName()
			for _, l := range m.Label {
				if l.GetName() != "instance" && l.GetName() != "backend" {
					key += "," + l.GetName() + "=" + l.GetValue()
				}
			}
			switch {
			case m.Histogram != nil:
				got[key] += float64(m.Histogram.GetSampleCount())
			case m.Counter != nil:
				got[key] += m.Counter.GetValue()
			case m.Gauge != nil:
				got[key] += m.Gauge.GetValue()
			}
		}
	}
	for key, want := range map[string]float64{
		"opendsec_edge_operation_duration_seconds,operation=pause,outcome=ok":              1,
		"opendsec_edge_operation_duration_seconds,operation=resume,outcome=ok":             1,
		"opendsec_edge_operation_duration_seconds,operation=snapshot,outcome=ok":           1,
		"opendsec_edge_operation_duration_seconds,operation=fork,outcome=ok":               1,
		"opendsec_edge_operation_duration_seconds,operation=fork_source_paused,outcome=ok": 1,
		"opendsec_edge_operation_duration_seconds,operation=restore,outcome=ok":            2,
		"opendsec_edge_admission_refusals_total,reason=sandboxes":                          1,
		"opendsec_edge_capacity,kind=total,resource=sandboxes":                             3,
		"opendsec_edge_capacity,kind=allocated,resource=sandboxes":                         3,
		"opendsec_edge_capacity,kind=allocated,resource=memory_bytes":                      3 * 256 << 20,
		"opendsec_edge_snapshot_pull_failures_total":                                       0,
	} {
		if got[key] != want {
			t.Errorf("%s = %v, want %v", key, got[key], want)
		}
	}
	policyOutcome := "ok"
	if policyErr != nil {
		policyOutcome = errdefs.Code(policyErr).String()
	}
	for key, want := range map[string]float64{
		"opendsec_edge_network_policy_updates_total,outcome=" + policyOutcome: 1,
		"opendsec_edge_agent_link_refusals_total":                             0,
		"opendsec_edge_dns_queries_total,outcome=answered":                    0,
	} {
		if v, ok := got[key]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", key, v, ok, want)
		}
	}
	if got["opendsec_edge_state_disk_bytes,kind=total"] <= 0 || got["opendsec_edge_state_disk_bytes,kind=free"] > got["opendsec_edge_state_disk_bytes,kind=total"] {
		t.Errorf("state disk: %v free of %v", got["opendsec_edge_state_disk_bytes,kind=free"], got["opendsec_edge_state_disk_bytes,kind=total"])
	}
}

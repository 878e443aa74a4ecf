package rollout

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"

	"github.com/opendsec/opendsec/internal/testutil"
)

// fakeCluster runs no process: a component "runs" the version its binary
// file held when it was last restarted; a build whose version starts with
// "broken" makes an apiserver answer every call with an internal error.
type fakeCluster struct {
	t         *testing.T
	dir       string
	plan      *Plan
	running   map[string]string // component → version
	calls     map[string]float64
	failed    map[string]float64
	restarts  []string
	onRestart func(n int) // after the n-th restart (1-based)
	// killBefore, if set, stops the rollout dead as its n-th restart
	// begins (the component still runs its old build).
	killBefore int
}

func newFakeCluster(t *testing.T, edges int) *fakeCluster {
	dir := t.TempDir()
	f := &fakeCluster{t: t, dir: dir, plan: &Plan{}, running: map[string]string{}, calls: map[string]float64{}, failed: map[string]float64{}}
	bin, agent := filepath.Join(dir, "dsec"), filepath.Join(dir, "aether")
	os.WriteFile(bin, []byte("v1"), 0o755)
	os.WriteFile(agent, []byte("v1"), 0o755)
	add := func(name, kind string) {
		c := Component{Name: name, Kind: kind, Binary: bin, Restart: []string{"restart", name}, Metrics: "http://" + name + "/metrics"}
		if kind == "edge" {
			c.Agent = agent
		}
		f.plan.Components = append(f.plan.Components, c)
		f.running[name] = "v1"
	}
	// Listed out of order: the waves put them in order.
	add("api-1", "apiserver")
	for i := 1; i <= edges; i++ {
		add(fmt.Sprintf("edge-%d", i), "edge")
	}
	add("iam-1", "iam")
	add("watcher", "watcher")
	add("iam-2", "iam")
	add("api-2", "apiserver")
	return f
}

func (f *fakeCluster) deps() Deps {
	return Deps{
		Scrape: func(ctx context.Context, url string) (Families, error) {
			name := strings.TrimSuffix(strings.TrimPrefix(url, "http://"), "/metrics")
			v := f.running[name]
			if v == "" {
				return nil, errors.New("connection refused")
			}
			// Each scrape stands for traffic: 10 calls, all failing on a
			// broken build.
			f.calls[name] += 10
			if strings.HasPrefix(v, "broken") && strings.HasPrefix(name, "api-") {
				f.failed[name] += 10
			}
			return Families{
				"opendsec_build_info": family(dto.MetricType_GAUGE, 1, "version", v),
				"opendsec_apiserver_requests_total": {Type: dto.MetricType_COUNTER.Enum(), Metric: []*dto.Metric{
					counter(f.calls[name]-f.failed[name], "code", "ok"), counter(f.failed[name], "code", "internal"),
				}},
			}, nil
		},
		Run: func(ctx context.Context, argv []string) error {
			if err := ctx.Err(); err != nil {
				return err
			}
			name := argv[1]
			if f.killBefore == len(f.restarts)+1 {
				runtime.Goexit()
			}
			for _, c := range f.plan.Components {
				if c.Name == name {
					data, err := os.ReadFile(c.Binary)
					if err != nil {
						return err
					}
					f.running[name] = string(data)
				}
			}
			f.restarts = append(f.restarts, name)
			if f.onRestart != nil {
				f.onRestart(len(f.restarts))
			}
			return nil
		},
		Sleep: func(ctx context.Context, d time.Duration) error { return ctx.Err() },
		Log:   testutil.Logger(f.t),
	}
}

// build writes a new build of version v and returns its dsec and aether.
func (f *fakeCluster) build(v string) (string, string) {
	d := f.t.TempDir()
	os.WriteFile(filepath.Join(d, "dsec"), []byte(v), 0o755)
	os.WriteFile(filepath.Join(d, "aether"), []byte(v), 0o755)
	return filepath.Join(d, "dsec"), filepath.Join(d, "aether")
}

func (f *fakeCluster) config(v string) Config {
	bin, agent := f.build(v)
	return Config{Plan: f.plan, StatePath: filepath.Join(f.dir, "rollout.state"), Binary: bin, Agent: agent, Version: v,
		Gates: Gates{Soak: 0, Poll: time.Millisecond, Ready: time.Second, MaxErrorRate: 0.01, MaxCreateP99: time.Minute}}
}

func (f *fakeCluster) allRun(t *testing.T, v string) {
	t.Helper()
	for name, got := range f.running {
		if got != v {
			t.Fatalf("%s runs %q, want %q (all: %v)", name, got, v, f.running)
		}
	}
	for _, p := range []string{"dsec", "aether"} {
		if data, _ := os.ReadFile(filepath.Join(f.dir, p)); string(data) != v {
			t.Fatalf("%s holds %q, want %q", p, data, v)
		}
	}
}

func family(typ dto.MetricType, v float64, kv ...string) *dto.MetricFamily {
	m := &dto.Metric{Gauge: &dto.Gauge{Value: proto.Float64(v)}}
	for i := 0; i < len(kv); i += 2 {
		m.Label = append(m.Label, &dto.LabelPair{Name: proto.String(kv[i]), Value: proto.String(kv[i+1])})
	}
	return &dto.MetricFamily{Type: typ.Enum(), Metric: []*dto.Metric{m}}
}

func counter(v float64, kv ...string) *dto.Metric {
	m := &dto.Metric{Counter: &dto.Counter{Value: proto.Float64(v)}}
	for i := 0; i < len(kv); i += 2 {
		m.Label = append(m.Label, &dto.LabelPair{Name: proto.String(kv[i]), Value: proto.String(kv[i+1])})
	}
	return m
}

// A good build reaches every component, kind by kind and one at a time,
// agent included, and the state says done.
func TestRolloutReplacesEveryComponentInWaves(t *testing.T) {
	f := newFakeCluster(t, 2)
	r, err := Open(f.config("v2"), f.deps())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	want := []string{"iam-1", "iam-2", "watcher", "api-1", "api-2", "edge-1", "edge-2"}
	if !slices.Equal(f.restarts, want) {
		t.Fatalf("restarts %v, want %v", f.restarts, want)
	}
	f.allRun(t, "v2")
	if st := r.State(); st.Phase != PhaseDone || len(st.Replaced) != 7 || st.Before["edge-1"] != "v1" {
		t.Fatalf("state: %+v", st)
	}
}

// A build that answers errors fails the error-rate gate at its first
// apiserver; every component replaced so far gets the previous build back,
// binaries included, and the error names the gate.
func TestRolloutOfABadBuildRollsBack(t *testing.T) {
	f := newFakeCluster(t, 2)
	r, err := Open(f.config("broken-v2"), f.deps())
	if err != nil {
		t.Fatal(err)
	}
	err = r.Run(context.Background())
	var rb *RolledBack
	var gate *GateError
	if !errors.As(err, &rb) || !errors.As(err, &gate) || gate.Gate != "error rate" || !strings.Contains(err.Error(), "api-1") {
		t.Fatalf("a broken build: %v", err)
	}
	if want := []string{"iam-1", "iam-2", "watcher", "api-1"}; !slices.Equal(rb.Components, want) {
		t.Fatalf("rolled back %v, want %v", rb.Components, want)
	}
	f.allRun(t, "v1")
	if st := r.State(); st.Phase != PhaseRolledBack || !strings.Contains(st.Failure, "error rate") {
		t.Fatalf("state: %+v", st)
	}
	// Rolled back, the same cluster takes a good build.
	r, err = Open(f.config("v3"), f.deps())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.allRun(t, "v3")
}

// runKilled runs r until f's n-th restart, where it stops dead, as a
// kill -9 would stop it: no step after, the state file as it was.
func runKilled(f *fakeCluster, r *Rollout, n int) {
	f.onRestart = func(i int) {
		if i == n {
			runtime.Goexit()
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Run(context.Background()) //nolint:errcheck // killed
	}()
	<-done
	f.onRestart, f.restarts = nil, nil
}

// A rollout killed mid-way resumes from its state file with the same
// build, restarting only the components not yet replaced; one of another
// build is refused until the first is finished or rolled back; a rollout
// killed while rolling back finishes the rollback when run again; and
// --rollback puts back what a killed rollout replaced.
func TestRolloutCutShortResumesOrRollsBack(t *testing.T) {
	f := newFakeCluster(t, 2)
	cfg := f.config("v2")
	r, _ := Open(cfg, f.deps())
	runKilled(f, r, 3)
	st, err := LoadState(cfg.StatePath)
	if err != nil || st.Phase != PhaseRolling || !slices.Equal(st.Replaced, []string{"iam-1", "iam-2", "watcher"}) {
		t.Fatalf("state after the kill: %+v %v", st, err)
	}
	if _, err := Open(f.config("v9"), f.deps()); err == nil || !strings.Contains(err.Error(), "unfinished rollout of v2") {
		t.Fatalf("another build over an unfinished rollout: %v", err)
	}
	r, err = Open(cfg, f.deps())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if want := []string{"api-1", "api-2", "edge-1", "edge-2"}; !slices.Equal(f.restarts, want) {
		t.Fatalf("the resumed rollout restarted %v, want %v", f.restarts, want)
	}
	f.allRun(t, "v2")

	// Killed while rolling back a broken build (restarts 1-4 roll it out
	// to api-1, 5 on roll back): the next run finishes the rollback.
	f = newFakeCluster(t, 2)
	cfg = f.config("broken-v2")
	r, _ = Open(cfg, f.deps())
	runKilled(f, r, 6)
	if st, _ := LoadState(cfg.StatePath); st.Phase != PhaseRollingBack || !strings.Contains(st.Failure, "error rate") {
		t.Fatalf("state after a kill during the rollback: %+v", st)
	}
	r, _ = Open(cfg, f.deps())
	if err := r.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "error rate") || !strings.Contains(err.Error(), "rolled back 4 components") {
		t.Fatalf("the resumed rollback: %v", err)
	}
	f.allRun(t, "v1")

	// Asked for: --rollback after a kill.
	f = newFakeCluster(t, 2)
	cfg = f.config("v2")
	r, _ = Open(cfg, f.deps())
	runKilled(f, r, 5)
	r, _ = Open(cfg, f.deps())
	if err := r.Rollback(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	f.allRun(t, "v1")
	if st := r.State(); st.Phase != PhaseRolledBack || st.Failure != "" {
		t.Fatalf("state after --rollback: %+v", st)
	}
}

// A rollout killed after recording a component as replaced but before its
// restart restarts it when resumed; --rollback after a finished rollout
// puts the previous build back everywhere.
func TestRolloutResumesARestartItDidNotMakeAndRollsBackWhenDone(t *testing.T) {
	f := newFakeCluster(t, 1)
	cfg := f.config("v2")
	r, _ := Open(cfg, f.deps())
	f.killBefore = 2 // iam-2 recorded, not restarted
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Run(context.Background()) //nolint:errcheck // killed
	}()
	<-done
	f.killBefore, f.restarts = 0, nil
	if st, _ := LoadState(cfg.StatePath); !slices.Equal(st.Replaced, []string{"iam-1", "iam-2"}) || f.running["iam-2"] != "v1" {
		t.Fatalf("after the kill: replaced %v, iam-2 runs %q", st.Replaced, f.running["iam-2"])
	}
	r, _ = Open(cfg, f.deps())
	if err := r.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	if f.restarts[0] != "iam-2" {
		t.Fatalf("the resumed rollout restarted %v; want iam-2 first", f.restarts)
	}
	f.allRun(t, "v2")

	r, err := OpenRecorded(Config{Plan: f.plan, StatePath: cfg.StatePath, Gates: cfg.Gates}, f.deps())
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Rollback(context.Background(), nil); err != nil {
		t.Fatal(err)
	}
	f.allRun(t, "v1")
	if st := r.State(); st.Phase != PhaseRolledBack || len(st.Replaced) != len(f.plan.Components) {
		t.Fatalf("after --rollback of a finished rollout: %+v", st)
	}
}

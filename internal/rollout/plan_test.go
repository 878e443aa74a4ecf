package rollout

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"
)

// A plan's mistakes are named by component and field.
func TestPlanCheckNamesTheField(t *testing.T) {
	good := Component{Name: "edge-1", Kind: "edge", Binary: "/opt/dsec", Agent: "/opt/aether", Restart: []string{"systemctl", "restart", "dsec-edge"}, Metrics: "http://10.0.0.1:7081/metrics"}
	for _, c := range []struct {
		mut  func(*Component)
		want string
	}{
		{func(c *Component) { c.Name = "" }, "components[0].name: empty"},
		{func(c *Component) { c.Kind = "router" }, `kind "router": want one of`},
		{func(c *Component) { c.Binary = "bin/dsec" }, "binary \"bin/dsec\": want an absolute path"},
		{func(c *Component) { c.Kind, c.Agent = "apiserver", "/opt/aether" }, ".agent: only an edge has one"},
		{func(c *Component) { c.Restart = nil }, ".restart: empty"},
		{func(c *Component) { c.Metrics = "10.0.0.1:7081" }, ".metrics \"10.0.0.1:7081\": want the http(s) URL"},
	} {
		bad := good
		c.mut(&bad)
		if err := (&Plan{Components: []Component{bad}}).Check(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want %q", bad, err, c.want)
		}
	}
	if err := (&Plan{Components: []Component{good, good}}).Check(); err == nil || !strings.Contains(err.Error(), "used twice") {
		t.Errorf("a name twice: %v", err)
	}
	if err := (&Plan{}).Check(); err == nil {
		t.Error("an empty plan passed")
	}
	path := filepath.Join(t.TempDir(), "plan.json")
	os.WriteFile(path, []byte(`{"components": [{"name": "x"`), 0o600)
	if _, err := LoadPlan(path); err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("a cut plan file: %v", err)
	}
}

// Edges go in waves of the given share of them.
func TestWavesTakeAShareOfTheEdges(t *testing.T) {
	p := &Plan{}
	for _, n := range []string{"e1", "e2", "e3", "e4", "e5"} {
		p.Components = append(p.Components, Component{Name: n, Kind: "edge"})
	}
	p.Components = append(p.Components, Component{Name: "gw", Kind: "gateway"}, Component{Name: "a", Kind: "apiserver"})
	var sizes []int
	for _, w := range p.Waves(0.4) {
		sizes = append(sizes, len(w))
	}
	if want := []int{1, 2, 2, 1, 1}; !slices.Equal(sizes, want) {
		t.Fatalf("wave sizes %v, want %v (apiserver; edges 2, 2, 1; gateway)", sizes, want)
	}
}

// The gates: a target that stops answering, creates slower than the
// bound, sandboxes creating at every poll.
func TestSoakGates(t *testing.T) {
	g := Gates{MaxErrorRate: 0.01, MaxCreateP99: 5e9, MaxStuck: 0}
	hist := func(counts map[float64]uint64, n uint64) Families {
		h := &dto.Histogram{SampleCount: proto.Uint64(n)}
		for _, ub := range []float64{1, 10, 60, math.Inf(1)} { // as the text format has them
			c := counts[ub]
			if math.IsInf(ub, 1) {
				c = n
			}
			h.Bucket = append(h.Bucket, &dto.Bucket{UpperBound: proto.Float64(ub), CumulativeCount: proto.Uint64(c)})
		}
		m := &dto.Metric{Histogram: h, Label: []*dto.LabelPair{{Name: proto.String("outcome"), Value: proto.String("ok")}}}
		return Families{"opendsec_edge_create_duration_seconds": {Metric: []*dto.Metric{m}}}
	}
	s := newSoak()
	s.add(map[string]Families{"e": hist(map[float64]uint64{1: 10, 10: 10, 60: 10}, 10)}, nil)
	s.add(map[string]Families{"e": hist(map[float64]uint64{1: 15, 10: 20, 60: 20}, 20)}, nil)
	if err := s.verdict(g); err == nil || !strings.Contains(err.Error(), "gate create latency failed: p99 of 10 creates above 10s") {
		t.Fatalf("slow creates: %v", err)
	}
	s = newSoak()
	s.add(map[string]Families{"e": hist(map[float64]uint64{1: 10, 10: 10, 60: 10}, 10)}, nil)
	s.add(map[string]Families{"e": hist(map[float64]uint64{1: 20, 10: 20, 60: 20}, 20)}, nil)
	if err := s.verdict(g); err != nil {
		t.Fatalf("fast creates: %v", err)
	}
	stuck := func(n float64) Families {
		return Families{"opendsec_edge_sandboxes": family(dto.MetricType_GAUGE, n, "state", "creating")}
	}
	s = newSoak()
	s.add(map[string]Families{"e": stuck(2)}, nil)
	s.add(map[string]Families{"e": stuck(1)}, nil)
	if err := s.verdict(g); err == nil || !strings.Contains(err.Error(), "1 sandboxes creating or stopping at every poll") {
		t.Fatalf("stuck: %v", err)
	}
	s.add(map[string]Families{"e": stuck(0)}, nil)
	if err := s.verdict(g); err != nil {
		t.Fatalf("creates that end: %v", err)
	}
	s.add(nil, map[string]error{"api-2": errRefused})
	if err := s.verdict(g); err == nil || !strings.Contains(err.Error(), "gate target up failed: api-2: connection refused") {
		t.Fatalf("a target down: %v", err)
	}
	if q, n := quantile(map[float64]float64{1: 0, math.Inf(1): 0}, 0.99); q != 0 || n != 0 {
		t.Fatalf("no creates: %v %v", q, n)
	}
}

var errRefused = errors.New("connection refused")

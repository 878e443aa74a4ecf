package placement

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func node(id string, cpuUsed float64) Node {
	return Node{
		ID: id, Healthy: true, Backends: map[string]string{"container": "", "gvisor": "runsc not found"},
		Capacity: Resources{Sandboxes: 100, CPUCores: 16, MemoryMB: 32000}, Allocated: Resources{CPUCores: cpuUsed},
		Host: Resources{CPUCores: 4, MemoryMB: 16000},
	}
}

func TestPowerOfKPrefersLessLoaded(t *testing.T) {
	t.Parallel()
	nodes := []Node{node("a", 15), node("b", 1), node("c", 10)}
	r := Request{Backend: "container", CPUCores: 1, MemoryMB: 512}
	// With k = all nodes, the least loaded always wins.
	for seed := uint64(0); seed < 20; seed++ {
		got, err := Place(nodes, nil, r, 3, rand.New(rand.NewPCG(seed, 1)))
		if err != nil || got[0] != "b" || len(got) != 3 {
			t.Fatalf("seed %d: %v, %v", seed, got, err)
		}
	}
	// In-flight placements count: b is full once 14 cores are on their way there.
	got, err := Place(nodes, map[string]Resources{"b": {CPUCores: 14}}, r, 3, rand.New(rand.NewPCG(1, 1)))
	if err != nil || got[0] != "c" {
		t.Fatalf("with in-flight: %v, %v", got, err)
	}
	// With k = 2 the most loaded node is never first.
	counts := map[string]int{}
	for seed := uint64(0); seed < 200; seed++ {
		got, _ := Place(nodes, nil, r, 2, rand.New(rand.NewPCG(seed, 7)))
		counts[got[0]]++
	}
	if counts["a"] != 0 || counts["b"] == 0 || counts["c"] == 0 {
		t.Fatalf("first choices %v", counts)
	}
}

func TestFullNodesComeLast(t *testing.T) {
	t.Parallel()
	// A node that looks full is still tried, after the others: the view may
	// be stale and the edge decides.
	got, err := Place([]Node{node("full", 15.5), node("roomy", 1)}, nil, Request{Backend: "container", CPUCores: 1}, 2, rand.New(rand.NewPCG(3, 4)))
	if err != nil || len(got) != 2 || got[0] != "roomy" || got[1] != "full" {
		t.Fatalf("got %v, %v", got, err)
	}
}

func TestPlaceErrors(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	nodes := []Node{node("a", 0)}
	cases := []struct {
		nodes []Node
		r     Request
		class error
		want  string
	}{
		{nil, Request{Backend: "container", CPUCores: 1}, errdefs.ErrUnavailable, "no healthy edge"},
		{nodes, Request{Backend: "gvisor", CPUCores: 1}, errdefs.ErrFailedPrecondition, "runsc not found"},
		{nodes, Request{Backend: "vm", CPUCores: 1}, errdefs.ErrInvalidArgument, `backend "vm": no node offers it`},
		{nodes, Request{Backend: "container", CPUCores: 8}, errdefs.ErrInvalidArgument, "resources.cpu_cores 8: over the node capacity (4 cores at most)"},
		{nodes, Request{Backend: "container", CPUCores: 1, MemoryMB: 20000}, errdefs.ErrInvalidArgument, "resources.memory_mb 20000"},
	}
	for i, c := range cases {
		_, err := Place(c.nodes, nil, c.r, 2, rng)
		if !errors.Is(err, c.class) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("case %d: %v; want %v with %q", i, err, c.class, c.want)
		}
	}
}

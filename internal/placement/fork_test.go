package placement

import (
	"math/rand/v2"
	"reflect"
	"testing"
)

func TestSplitForkKeepsCopiesOnTheSourceWhileTheyFit(t *testing.T) {
	t.Parallel()
	r := Request{Backend: "container", CPUCores: 1, MemoryMB: 512}
	rng := rand.New(rand.NewPCG(1, 2))
	// The source's node has room for all 8: no transfer.
	got, err := SplitFork([]Node{node("src", 0), node("b", 0)}, nil, "src", r, 8, false, 2, rng)
	if err != nil || !reflect.DeepEqual(got, []Share{{"src", 8}}) {
		t.Fatalf("roomy source: %v, %v", got, err)
	}
	// Room for 3 more on the source (16 cores, 13 used): 3 there, 5 spread
	// over the others, least loaded first.
	got, err = SplitFork([]Node{node("src", 13), node("b", 0), node("c", 0)}, nil, "src", r, 8, false, 2, rng)
	if err != nil || len(got) != 3 || got[0] != (Share{"src", 3}) || got[1].Count+got[2].Count != 5 || got[1].Count < 2 || got[2].Count < 2 {
		t.Fatalf("source with room for 3: %v, %v", got, err)
	}
	// In-flight placements on the source count against its room.
	got, err = SplitFork([]Node{node("src", 0), node("b", 0)}, map[string]Resources{"src": {CPUCores: 15}}, "src", r, 4, false, 2, rng)
	if err != nil || !reflect.DeepEqual(got, []Share{{"src", 1}, {"b", 3}}) {
		t.Fatalf("source with copies in flight: %v, %v", got, err)
	}
	// A node without the backend gets none; what fits nowhere goes to the
	// source's edge, which refuses it.
	noBackend := node("c", 0)
	noBackend.Backends = map[string]string{"gvisor": ""}
	got, err = SplitFork([]Node{node("src", 14), node("b", 15), noBackend}, nil, "src", r, 4, false, 2, rng)
	if err != nil || !reflect.DeepEqual(got, []Share{{"src", 3}, {"b", 1}}) {
		t.Fatalf("full cluster: %v, %v", got, err)
	}
}

func TestSplitForkSpreads(t *testing.T) {
	t.Parallel()
	r := Request{Backend: "container", CPUCores: 1, MemoryMB: 512}
	// With k = all nodes, copies go to the least loaded each time, the
	// source's node included: 9 copies on 3 empty nodes are 3 each.
	got, err := SplitFork([]Node{node("src", 0), node("b", 0), node("c", 0)}, nil, "src", r, 9, true, 3, rand.New(rand.NewPCG(5, 6)))
	if err != nil || !reflect.DeepEqual(got, []Share{{"src", 3}, {"b", 3}, {"c", 3}}) {
		t.Fatalf("spread: %v, %v", got, err)
	}
	if _, err := SplitFork(nil, nil, "src", r, 1, true, 2, rand.New(rand.NewPCG(5, 6))); err == nil {
		t.Fatal("spread over no nodes placed a copy")
	}
}

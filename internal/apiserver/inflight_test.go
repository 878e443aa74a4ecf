package apiserver

import (
	"testing"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/placement"
)

// polledAt is a view whose node n1 was last polled at t, with no stamp.
func polledAt(t time.Time) map[string]nodeMark { return map[string]nodeMark{"n1": {polledAt: t}} }

func TestInflightCountsUntilAPollShowsIt(t *testing.T) {
	t.Parallel()
	f := newInflight()
	one := placement.Resources{Sandboxes: 1, CPUCores: 1, MemoryMB: 100}
	id := f.add("n1", "root/a", one)
	byNode := f.overlay(polledAt(time.Now()))
	if byNode["n1"] != one {
		t.Fatalf("running create not counted: %v", byNode)
	}
	sent := time.Now()
	time.Sleep(time.Millisecond)
	f.finish(id, true, nil)
	// A poll that started before the edge answered (even after the create
	// was sent) may not show it.
	if byNode := f.overlay(polledAt(sent)); byNode["n1"] != one {
		t.Fatalf("dropped before a poll that surely shows it: %v", byNode)
	}
	if byNode := f.overlay(polledAt(time.Now())); byNode["n1"] != (placement.Resources{}) {
		t.Fatalf("still counted after a later poll: %v", byNode)
	}
	// A failed create is dropped at once; a removal counts negative.
	id = f.add("n1", "root/a", one)
	f.finish(id, false, nil)
	f.released("n1", "root/a", one)
	byNode = f.overlay(polledAt(time.Now().Add(-time.Hour)))
	if byNode["n1"].Sandboxes != -1 {
		t.Fatalf("after failure and release: %v", byNode)
	}
}

// A create retried on another node is counted on that node, once.
func TestInflightMoveCountsOnTheNewNode(t *testing.T) {
	t.Parallel()
	f := newInflight()
	one := placement.Resources{Sandboxes: 1, CPUCores: 1, MemoryMB: 100}
	id := f.add("n1", "root/a", one)
	f.move(id, "n2")
	byNode := f.overlay(map[string]nodeMark{})
	if byNode["n1"] != (placement.Resources{}) || byNode["n2"] != one {
		t.Fatalf("after a move: %v", byNode)
	}
}

// With the edge's stamps, a placement is dropped exactly when the node's
// status includes its admission: not before (under-count), and not a poll
// later (a status that started between the admission and the answer counts
// it already: the create after it was refused its quota).
func TestInflightDropsAPlacementTheStatusStampIncludes(t *testing.T) {
	t.Parallel()
	f := newInflight()
	one := placement.Resources{Sandboxes: 1, CPUCores: 1, MemoryMB: 100}
	id := f.add("n1", "root/a", one)
	answered := time.Now()
	f.finish(id, true, &edgev1.UsageStamp{Epoch: "run1", Seq: 7})
	mark := func(epoch string, seq uint64) map[string]nodeMark {
		// Polled before the answer: the time alone would keep it.
		return map[string]nodeMark{"n1": {polledAt: answered.Add(-time.Millisecond), usage: &edgev1.UsageStamp{Epoch: epoch, Seq: seq}}}
	}
	if byNode := f.overlay(mark("run1", 6)); byNode["n1"] != one {
		t.Fatalf("a status from before the admission: %v, want it counted here", byNode)
	}
	if byNode := f.overlay(mark("run0", 9)); byNode["n1"] != one {
		t.Fatalf("a status of another run of the edge: %v, want it counted here", byNode)
	}
	if byNode := f.overlay(mark("run1", 7)); byNode["n1"] != (placement.Resources{}) {
		t.Fatalf("a status that includes the admission: %v, want it dropped", byNode)
	}
}

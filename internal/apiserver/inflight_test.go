package apiserver

import (
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/placement"
)

func TestInflightCountsUntilAPollShowsIt(t *testing.T) {
	f := newInflight()
	one := placement.Resources{Sandboxes: 1, CPUCores: 1, MemoryMB: 100}
	id := f.add("n1", "root/a", one)
	byNode, pending := f.overlay(map[string]time.Time{"n1": time.Now()})
	if byNode["n1"] != one || len(pending) != 1 {
		t.Fatalf("running create not counted: %v %v", byNode, pending)
	}
	sent := time.Now()
	time.Sleep(time.Millisecond)
	f.finish(id, true)
	// A poll that started before the edge answered (even after the create
	// was sent) may not show it.
	if byNode, _ := f.overlay(map[string]time.Time{"n1": sent}); byNode["n1"] != one {
		t.Fatalf("dropped before a poll that surely shows it: %v", byNode)
	}
	if byNode, _ := f.overlay(map[string]time.Time{"n1": time.Now()}); byNode["n1"] != (placement.Resources{}) {
		t.Fatalf("still counted after a later poll: %v", byNode)
	}
	// A failed create is dropped at once; a removal counts negative.
	id = f.add("n1", "root/a", one)
	f.finish(id, false)
	f.released("n1", "root/a", one)
	byNode, pending = f.overlay(map[string]time.Time{"n1": time.Now().Add(-time.Hour)})
	if byNode["n1"].Sandboxes != -1 || len(pending) != 1 {
		t.Fatalf("after failure and release: %v %v", byNode, pending)
	}
}

// A create retried on another node is counted on that node, once.
func TestInflightMoveCountsOnTheNewNode(t *testing.T) {
	f := newInflight()
	one := placement.Resources{Sandboxes: 1, CPUCores: 1, MemoryMB: 100}
	id := f.add("n1", "root/a", one)
	f.move(id, "n2")
	byNode, pending := f.overlay(map[string]time.Time{})
	if byNode["n1"] != (placement.Resources{}) || byNode["n2"] != one || len(pending) != 1 {
		t.Fatalf("after a move: %v %v", byNode, pending)
	}
}

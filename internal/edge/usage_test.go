package edge

import (
	"fmt"
	"testing"

	"github.com/opendsec/opendsec/internal/edge/sandbox"
)

// A tenant naming a task per sandbox cannot grow the node's usage record
// (and its metric series) without bound: past maxUsageGroups groups, new
// tasks' use goes to their project's "(other)" group, nothing lost, and
// the record reads back whole.
func TestUsageGroupsAreBounded(t *testing.T) {
	dir := t.TempDir()
	m, err := openUsageMeter(dir)
	if err != nil {
		t.Fatal(err)
	}
	var uses []sandbox.Use
	for i := range maxUsageGroups + 50 {
		uses = append(uses, sandbox.Use{Project: "root/p", Task: fmt.Sprintf("t%d", i), Backend: "fake", CPUSeconds: 1, MemoryGBSeconds: 2})
	}
	if err := m.add(uses); err != nil {
		t.Fatal(err)
	}
	got := m.totals()
	if len(got) != maxUsageGroups+1 {
		t.Fatalf("%d groups, want %d and the (other) group", len(got), maxUsageGroups)
	}
	other := got[groupKey{"root/p", otherTasks, "fake"}]
	if other.CPUSeconds != 50 || other.MemoryGBSeconds != 100 {
		t.Fatalf("(other) holds %+v, want the 50 tasks past the bound", other)
	}
	again, err := openUsageMeter(dir)
	if err != nil || len(again.totals()) != maxUsageGroups+1 {
		t.Fatalf("the record read back: %d groups, %v", len(again.totals()), err)
	}
}

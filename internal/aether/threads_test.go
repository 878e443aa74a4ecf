package aether

import (
	"os"
	"testing"
)

// TestWarmThreadsLeavesSpareThreads: after warmThreads(n) the process
// keeps at least n threads beyond the one running the test (Go parks them
// for reuse rather than ending them).
func TestWarmThreadsLeavesSpareThreads(t *testing.T) {
	count := func() int {
		ents, err := os.ReadDir("/proc/self/task")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	warmThreads(16)
	if n := count(); n < 17 {
		t.Fatalf("%d threads after warming 16", n)
	}
}

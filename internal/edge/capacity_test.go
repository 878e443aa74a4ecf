package edge

import (
	"math"
	"runtime"
	"testing"
)

// TestOvercommitIsANodeSetting: a node's totals follow its own overcommit
// factors, and zero means the documented defaults.
func TestOvercommitIsANodeSetting(t *testing.T) {
	cores := float64(runtime.NumCPU())
	if c := HostCapacity(0, 0); c.CPUCores != cores*DefaultCPUOvercommit || c.HostCPUCores != cores {
		t.Fatalf("defaults: %+v", c)
	}
	dense := HostCapacity(64, 3)
	if dense.CPUCores != cores*64 {
		t.Fatalf("cpu overcommit 64: %+v", dense)
	}
	if def := HostCapacity(0, 0); math.Abs(float64(dense.MemoryMB)/float64(def.MemoryMB)-2) > 0.01 {
		t.Fatalf("memory overcommit 3 against 1.5: %d against %d", dense.MemoryMB, def.MemoryMB)
	}
}

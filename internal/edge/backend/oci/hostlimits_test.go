package oci

import "testing"

func TestSandboxThreadBoundKeepsTheNodesShare(t *testing.T) {
	for _, tc := range []struct{ max, want int64 }{
		{192729, 192729 - 38545}, // this machine: a fifth kept
		{10000, 10000 - 4096},    // small kernels keep at least 4096
		{2000, 1024},             // and sandboxes get at least 1024
	} {
		if got := SandboxThreadBound(tc.max); got != tc.want {
			t.Errorf("threads-max %d: %d, want %d", tc.max, got, tc.want)
		}
	}
}

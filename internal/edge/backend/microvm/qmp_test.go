package microvm

import "testing"

// TestStoppedByMonitor: the run states QEMU reports for a guest its
// monitor stopped, which the edge resumes with "cont" (a snapshot whose
// cont never came leaves it postmigrate), and the ones it does not.
func TestStoppedByMonitor(t *testing.T) {
	for _, c := range []struct {
		running bool
		status  string
		want    bool
	}{
		{true, "running", false},
		{false, "paused", true},
		{false, "postmigrate", true},
		{false, "finish-migrate", true},
		{false, "suspended", true},
		{false, "inmigrate", false},
		{false, "prelaunch", false},
		{false, "shutdown", false},
		{false, "internal-error", false},
		{false, "guest-panicked", false},
	} {
		if got := stoppedByMonitor(c.running, c.status); got != c.want {
			t.Errorf("running %v, status %q: stopped by the monitor %v, want %v", c.running, c.status, got, c.want)
		}
	}
}

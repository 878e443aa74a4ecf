package aether

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// What a meminfo file counts as used, and which process the watch would
// kill: the largest resident set, never PID 1 (the agent).
func TestMemoryWatchReadsUseAndPicksTheLargest(t *testing.T) {
	dir := t.TempDir()
	meminfo := filepath.Join(dir, "meminfo")
	os.WriteFile(meminfo, []byte("MemTotal:         327680 kB\nMemFree:           65536 kB\nMemAvailable:      65536 kB\n"), 0o644)
	if used, err := memoryUsed(meminfo); err != nil || used != (327680-65536)<<10 {
		t.Fatalf("used %d, %v; want %d", used, err, (327680-65536)<<10)
	}
	os.WriteFile(meminfo, []byte("MemTotal: 1 kB\n"), 0o644)
	if _, err := memoryUsed(meminfo); err == nil {
		t.Fatal("a meminfo without MemFree was read")
	}
	for pid, status := range map[string]string{
		"1":   "Name:\taether\nVmRSS:\t900000 kB\n",
		"17":  "Name:\tpython3\nVmRSS:\t204800 kB\n",
		"42":  "Name:\tsh\nVmRSS:\t1024 kB\n",
		"99":  "Name:\tkthread\n", // no RSS line
		"abc": "Name:\tnot a pid\nVmRSS:\t999999999 kB\n",
	} {
		os.MkdirAll(filepath.Join(dir, pid), 0o755)
		os.WriteFile(filepath.Join(dir, pid, "status"), []byte(status), 0o644)
	}
	if pid, rss, comm, all := largestProcess(dir); pid != 17 || rss != 204800<<10 || comm != "python3" || all != (204800+1024)<<10 {
		t.Fatalf("largest: pid %d rss %d %q of %d; want python3 (17), never the agent, of python3's and sh's", pid, rss, comm, all)
	}
	os.RemoveAll(filepath.Join(dir, "17"))
	os.RemoveAll(filepath.Join(dir, "42"))
	if pid, _, _, _ := largestProcess(dir); pid != 0 {
		t.Fatalf("with only the agent and a process without memory: pid %d, want none", pid)
	}
}

// TestWatchReadsOftenNearTheLimit: the watch reads every interval while
// the sandbox is well under its limit, and every nearInterval above three
// quarters of it.
func TestWatchReadsOftenNearTheLimit(t *testing.T) {
	for _, c := range []struct {
		used, max int64
		want      time.Duration
	}{
		{0, 1000, 50 * time.Millisecond},
		{750, 1000, 50 * time.Millisecond},
		{751, 1000, nearInterval},
		{2000, 1000, nearInterval},
	} {
		if got := watchInterval(c.used, c.max, 50*time.Millisecond); got != c.want {
			t.Errorf("%d of %d: %v, want %v", c.used, c.max, got, c.want)
		}
	}
	if got := watchInterval(900, 1000, time.Millisecond); got != time.Millisecond {
		t.Errorf("an interval below nearInterval: %v", got)
	}
}

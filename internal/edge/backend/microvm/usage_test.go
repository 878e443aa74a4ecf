package microvm

import (
	"os"
	"strings"
	"testing"
	"time"
)

func TestParseStatCPU(t *testing.T) {
	// A name with spaces and a parenthesis, as /proc shows it.
	line := "4242 (qemu (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 100 0 0\n"
	got, err := parseStatCPU([]byte(line))
	if err != nil || got != 3e9 {
		t.Fatalf("parseStatCPU = %d, %v; want 3 s (300 ticks)", got, err)
	}
	for _, bad := range []string{"", "4242 qemu S 1", "1 (q) S 1 2 3", "1 (q) S 1 2 3 4 5 6 7 8 9 10 x 5"} {
		if _, err := parseStatCPU([]byte(bad)); err == nil {
			t.Errorf("parseStatCPU(%q) did not fail", bad)
		}
	}
}

func TestParsePSS(t *testing.T) {
	got, err := parsePSS(strings.NewReader("55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss:  2048 kB\nPss:  1024 kB\n"))
	if err != nil || got != 1024<<10 {
		t.Fatalf("parsePSS = %d, %v", got, err)
	}
	if _, err := parsePSS(strings.NewReader("Rss: 1 kB\n")); err == nil {
		t.Fatal("no Pss line: no error")
	}
	// This process's own, as the backend reads a VMM's.
	if pss, err := processPSS(os.Getpid()); err != nil || pss <= 0 {
		t.Fatalf("processPSS(self) = %d, %v", pss, err)
	}
	for start := time.Now(); time.Since(start) < 50*time.Millisecond; { // some CPU time to count
	}
	if cpu, err := processCPU(os.Getpid()); err != nil || cpu == 0 {
		t.Fatalf("processCPU(self) = %d, %v", cpu, err)
	}
}

func FuzzParseStatCPU(f *testing.F) {
	f.Add([]byte("1 (q) S 1 2 3 4 5 6 7 8 9 10 11 12 13"))
	f.Fuzz(func(t *testing.T, data []byte) {
		parseStatCPU(data) //nolint:errcheck // must not panic
	})
}

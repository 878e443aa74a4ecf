package spawn

import (
	"os"
	"testing"
	"time"
)

func TestReadStatOfSelf(t *testing.T) {
	st, ok := ReadStat(os.Getpid())
	if !ok || st.PID != os.Getpid() || st.PPID != os.Getppid() || st.State == "" {
		t.Fatalf("ReadStat(self) = %+v, %v", st, ok)
	}
}

// utime and stime (fields 14 and 15) after a name with spaces and
// parentheses; a line without them, or with them not numbers, is refused.
func TestParseStatCPUTicks(t *testing.T) {
	line := "4242 (qemu (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 100 0 0\n"
	if st, ok := parseStat(4242, []byte(line)); !ok || st.CPUTicks != 300 || st.State != "S" {
		t.Fatalf("parseStat = %+v, %v; want 300 ticks", st, ok)
	}
	for _, bad := range []string{"", "4242 qemu S 1", "1 (q) S 1 2 3",
		"1 (q) S 1 2 3 4 5 6 7 8 9 10 x 5 0 0 20 0 3 0 100 0 0", "1 (q) S 1 2 3 4 5 6 7 8 9 10 5 x 0 0 20 0 3 0 100 0 0"} {
		if _, ok := parseStat(1, []byte(bad)); ok {
			t.Errorf("parseStat(%q) did not fail", bad)
		}
	}
	for start := time.Now(); time.Since(start) < 50*time.Millisecond; { // some CPU time to count
	}
	if st, ok := ReadStat(os.Getpid()); !ok || st.CPUTicks == 0 {
		t.Fatalf("ReadStat(self) after 50 ms of CPU: %+v, %v", st, ok)
	}
}

func FuzzParseStat(f *testing.F) {
	f.Add([]byte("1 (cmd with ) paren) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 0 0 100 18446744073709551615"))
	f.Fuzz(func(t *testing.T, data []byte) {
		parseStat(1, data) // must not panic
	})
}

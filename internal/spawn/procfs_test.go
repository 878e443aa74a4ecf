package spawn

import (
	"os"
	"testing"
)

func TestReadStatOfSelf(t *testing.T) {
	st, ok := ReadStat(os.Getpid())
	if !ok || st.PID != os.Getpid() || st.PPID != os.Getppid() || st.State == "" {
		t.Fatalf("ReadStat(self) = %+v, %v", st, ok)
	}
}

func FuzzParseStat(f *testing.F) {
	f.Add([]byte("1 (cmd with ) paren) S 0 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 0 0 100 18446744073709551615"))
	f.Fuzz(func(t *testing.T, data []byte) {
		parseStat(1, data) // must not panic
	})
}

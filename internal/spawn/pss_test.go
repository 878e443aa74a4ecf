package spawn

import (
	"os"
	"strings"
	"testing"
)

func TestParsePSS(t *testing.T) {
	got, err := parsePSS(strings.NewReader("55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss:  2048 kB\nPss:  1024 kB\n"))
	if err != nil || got != 1024<<10 {
		t.Fatalf("parsePSS = %d, %v", got, err)
	}
	if _, err := parsePSS(strings.NewReader("Rss: 1 kB\n")); err == nil {
		t.Fatal("no Pss line: no error")
	}
	// This process's own, as the backend reads a VMM's.
	if pss, err := ReadPSS(os.Getpid()); err != nil || pss <= 0 {
		t.Fatalf("ReadPSS(self) = %d, %v", pss, err)
	}
}

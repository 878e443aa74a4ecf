package progress

import (
	"bytes"
	"strings"
	"testing"
)

func TestPlainOutputIsSparseAndComplete(t *testing.T) {
	var buf bytes.Buffer
	b := New(&buf)
	for i := int64(0); i <= 100; i++ {
		b.Update("packing", i, 100)
	}
	b.Done("done")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) < 4 || len(lines) > 7 {
		t.Fatalf("want a handful of lines, got %d: %q", len(lines), buf.String())
	}
	if !strings.Contains(lines[len(lines)-2], "100%") || lines[len(lines)-1] != "done" {
		t.Fatalf("last lines: %q", lines[len(lines)-2:])
	}
}

func TestRender(t *testing.T) {
	got := render("unpack", 512<<20, 1<<30, 0)
	if !strings.Contains(got, " 50% 512.0MiB/1.0GiB") || strings.Count(got, "=") != 15 {
		t.Fatalf("render = %q", got)
	}
	if got := render("waiting", 0, 0, 0); got != "waiting (0s)" {
		t.Fatalf("render unknown = %q", got)
	}
}

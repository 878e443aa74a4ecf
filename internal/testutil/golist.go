package testutil

import (
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// GoList runs `go list` with args in the test's package directory and
// returns what it printed; the go tool is the one on PATH, else the one
// that built the test. Dependency pins use it (cmd/aether,
// internal/apiserver).
func GoList(t testing.TB, args ...string) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	out, err := exec.Command(goTool, append([]string{"list"}, args...)...).Output()
	if err != nil {
		t.Fatalf("go list %v: %v", args, err)
	}
	return string(out)
}

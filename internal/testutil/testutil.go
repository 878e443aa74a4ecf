// Package testutil holds guards and helpers shared by tests. Guards skip with
// the reason rather than fail when the host lacks something.
package testutil

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// RequireRoot skips unless the test runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (run with sudo -E or as root)")
	}
}

// RequireBinary skips unless name is on PATH, and returns its path.
func RequireBinary(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		t.Skipf("needs %s on PATH", name)
	}
	return p
}

// RequireKVM skips unless /dev/kvm exists.
func RequireKVM(t testing.TB) {
	t.Helper()
	if _, err := os.Stat("/dev/kvm"); err != nil {
		t.Skip("needs /dev/kvm (hardware virtualisation)")
	}
}

// RequireEnv skips unless the variable is set to "1".
func RequireEnv(t testing.TB, name string) {
	t.Helper()
	if os.Getenv(name) != "1" {
		t.Skipf("set %s=1 to run", name)
	}
}

// Logger returns a logger writing to t.Log.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// Context returns a context cancelled when the test ends.
func Context(t testing.TB) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	return ctx
}

// Package testutil holds guards and helpers shared by tests. Guards skip with
// the reason when the host lacks something, or fail in a strict run
// (DSEC_TEST_STRICT=1, which `make test` sets).
package testutil

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// StrictEnv names the variable that turns every guard's skip into a
// failure. `make test` sets it, so a green CI run means every runtime and
// image the suite covers was really there and exercised.
const StrictEnv = "DSEC_TEST_STRICT"

// Strict reports whether missing runtimes fail the test instead of
// skipping it.
func Strict() bool { return os.Getenv(StrictEnv) == "1" }

// Missing skips the test because the host lacks what it needs, or fails it
// in a strict run.
func Missing(t testing.TB, format string, args ...any) {
	t.Helper()
	reason := fmt.Sprintf(format, args...)
	if Strict() {
		t.Fatalf("%s (%s=1: a missing runtime or image fails the run instead of skipping)", reason, StrictEnv)
	}
	t.Skip(reason)
}

// RequireRoot skips (fails when strict) unless the test runs as root. In
// short mode (`make check`, the inner loop's tier) it always skips: that
// tier runs no runtime, VM or host network, root or not.
func RequireRoot(t testing.TB) {
	t.Helper()
	if testing.Short() {
		t.Skip("-short: needs root and the host's runtimes (make test runs it)")
	}
	if os.Geteuid() != 0 {
		Missing(t, "needs root (run with sudo -E or as root)")
	}
}

// RequireRootUser skips (fails when strict) unless the test runs as root,
// in short mode too: for tests of an in-process agent, which starts its
// processes as root in root's home but needs no runtime.
func RequireRootUser(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Missing(t, "needs root: the agent under test starts its processes as root (run with sudo -E or as root)")
	}
}

// RequireBinary skips (fails when strict) unless name is on PATH, and
// returns its path; in short mode it always skips, as RequireRoot does.
func RequireBinary(t testing.TB, name string) string {
	t.Helper()
	if testing.Short() {
		t.Skipf("-short: needs %s (make test runs it)", name)
	}
	p, err := exec.LookPath(name)
	if err != nil {
		Missing(t, "needs %s on PATH (make deps installs it)", name)
	}
	return p
}

// RequireEnv skips unless the variable is set to "1": for opt-in tests,
// never for runtimes (strict runs skip these too).
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

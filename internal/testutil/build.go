package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
)

var (
	agentOnce sync.Once
	agentPath string
	agentErr  error
)

// RepoRoot returns the module's root directory.
func RepoRoot(t testing.TB) string {
	t.Helper()
	_, file, _, _ := runtime.Caller(0)
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", ".."))
}

// AgentBinary builds cmd/aether once per test process (static, no cgo),
// with the gvisor backend's preload library beside it, and returns its path.
func AgentBinary(t testing.TB) string {
	t.Helper()
	agentOnce.Do(func() {
		dir, err := ProcessDir("aether")
		if err != nil {
			agentErr = err
			return
		}
		agentPath = filepath.Join(dir, "aether")
		cmd := exec.Command("go", "build", "-trimpath", "-o", agentPath, "./cmd/aether")
		cmd.Dir = RepoRoot(t)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			agentErr = &buildError{strings.TrimSpace(string(out)), err}
			return
		}
		// The gvisor backend's preload library goes next to the agent,
		// where the backend looks for it (see the Makefile's build).
		cc := exec.Command("gcc", "-shared", "-fPIC", "-O2", "-nostdlib", "-Wl,--build-id=none", "-Wall", "-Werror",
			"-o", filepath.Join(dir, "libdsec-compat.so"), "compat/gvisor/statx.c")
		cc.Dir = RepoRoot(t)
		if out, err := cc.CombinedOutput(); err != nil {
			agentErr = &buildError{strings.TrimSpace(string(out)), err}
		}
	})
	if agentErr != nil {
		t.Fatalf("build aether: %v", agentErr)
	}
	return agentPath
}

type buildError struct {
	out string
	err error
}

func (e *buildError) Error() string { return e.err.Error() + ": " + e.out }

var (
	vminitOnce sync.Once
	vminitPath string
	vminitErr  error
)

// VMInitBinary builds cmd/dsec-vminit (the microvm guest's init, static)
// once per test process and returns its path.
func VMInitBinary(t testing.TB) string {
	t.Helper()
	vminitOnce.Do(func() {
		dir, err := ProcessDir("vminit")
		if err != nil {
			vminitErr = err
			return
		}
		vminitPath = filepath.Join(dir, "dsec-vminit")
		cmd := exec.Command("go", "build", "-trimpath", "-o", vminitPath, "./cmd/dsec-vminit")
		cmd.Dir = RepoRoot(t)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			vminitErr = &buildError{strings.TrimSpace(string(out)), err}
		}
	})
	if vminitErr != nil {
		t.Fatalf("build dsec-vminit: %v", vminitErr)
	}
	return vminitPath
}

// GuestKernelDir is the microvm guest kernel make deps fetched
// (scripts/guest-kernel.sh); it skips (fails when strict) without one.
func GuestKernelDir(t testing.TB) string {
	t.Helper()
	dir := filepath.Join(RepoRoot(t), ".cache", "guest")
	if _, err := os.Stat(filepath.Join(dir, "vmlinux")); err != nil {
		Missing(t, "no microvm guest kernel in %s (make deps runs scripts/guest-kernel.sh): %v", dir, err)
	}
	return dir
}

// FirecrackerBinary is the Firecracker binary make deps fetched
// (scripts/firecracker.sh); missing, the test is skipped (fails when
// strict).
func FirecrackerBinary(t testing.TB) string {
	t.Helper()
	p := filepath.Join(RepoRoot(t), ".cache", "firecracker", "firecracker")
	if _, err := os.Stat(p); err != nil {
		Missing(t, "no Firecracker binary at %s (make deps runs scripts/firecracker.sh): %v", p, err)
	}
	return p
}

// NewerRunsc is the newer runsc make deps built (scripts/build-runsc.sh),
// which gVisor sandboxes run on wherever the node has it; missing, the
// test is skipped (fails when strict).
func NewerRunsc(t testing.TB) string {
	t.Helper()
	p := filepath.Join(RepoRoot(t), ".cache", "bin", "runsc-net")
	if _, err := os.Stat(p); err != nil {
		Missing(t, "the newer runsc is not built at %s (make deps runs scripts/build-runsc.sh): %v", p, err)
	}
	return p
}

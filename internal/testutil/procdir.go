package testutil

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
)

// ProcessDir returns a scratch directory for this test process under
// $TMPDIR/opendsec-test/name/<pid>, for what a process builds once and
// shares between its tests (binaries, image layers). A test process has no
// hook that runs after its last test, so each call first removes the
// directories of processes that are gone: a run cleans up after the runs
// before it, and at most one run's worth is left between runs.
func ProcessDir(name string) (string, error) {
	base := filepath.Join(os.TempDir(), "opendsec-test", name)
	if entries, err := os.ReadDir(base); err == nil {
		for _, e := range entries {
			pid, err := strconv.Atoi(e.Name())
			if err != nil || pid == os.Getpid() {
				continue
			}
			if _, err := os.Stat(filepath.Join("/proc", e.Name())); errors.Is(err, os.ErrNotExist) {
				os.RemoveAll(filepath.Join(base, e.Name())) //nolint:errcheck // best effort: stale scratch
			}
		}
	}
	dir := filepath.Join(base, strconv.Itoa(os.Getpid()))
	return dir, os.MkdirAll(dir, 0o755)
}

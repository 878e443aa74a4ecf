package testutil

import (
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
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
				// A process's mounts (image layers) outlive it.
				detachMountsUnder(filepath.Join(base, e.Name()))
				os.RemoveAll(filepath.Join(base, e.Name())) //nolint:errcheck // best effort: stale scratch
			}
		}
	}
	dir := filepath.Join(base, strconv.Itoa(os.Getpid()))
	return dir, os.MkdirAll(dir, 0o755)
}

// detachMountsUnder lazily unmounts everything mounted below dir, deepest
// first.
func detachMountsUnder(dir string) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var under []string
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			under = append(under, f[4])
		}
	}
	sort.Sort(sort.Reverse(sort.StringSlice(under)))
	for _, m := range under {
		unix.Unmount(m, unix.MNT_DETACH) //nolint:errcheck // best effort, as the removal
	}
}

package container

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/opendsec/opendsec/internal/errdefs"
)

const cgroupRoot = "/sys/fs/cgroup"

// fixHybridCgroups makes a hybrid (v1 + v2) host usable by crun, which
// refuses to run while any controller is attached to the v2 hierarchy. On
// Debian 12 that is hugetlb, because no v1 hierarchy mounts it; mounting one
// moves it off v2. This changes the host until reboot and is logged.
func fixHybridCgroups(log *slog.Logger) error {
	unified := filepath.Join(cgroupRoot, "unified", "cgroup.controllers")
	data, err := os.ReadFile(unified)
	if err != nil {
		return nil // pure v1 or pure v2: nothing to do
	}
	controllers := strings.Fields(string(data))
	if len(controllers) == 0 {
		return nil
	}
	for _, c := range controllers {
		dir := filepath.Join(cgroupRoot, c)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fixError(controllers, err)
		}
		if err := syscall.Mount("cgroup", dir, "cgroup", 0, c); err != nil {
			return fixError(controllers, err)
		}
		log.Info("mounted a v1 cgroup hierarchy so crun accepts this hybrid host", "controller", c, "path", dir)
	}
	return nil
}

func fixError(controllers []string, err error) error {
	return errdefs.FailedPrecondition("container backend: crun refuses hybrid cgroups while %v are on cgroup v2, and mounting them as v1 failed (%v); mount them by hand (mkdir /sys/fs/cgroup/hugetlb && mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb) or use runtime=runc", controllers, err)
}

// removeCgroups removes rel (e.g. "/opendsec/ID") from every hierarchy, in
// case the runtime left it behind.
func removeCgroups(rel string) error {
	ents, err := os.ReadDir(cgroupRoot)
	if err != nil {
		return nil
	}
	var errs []error
	for _, e := range ents {
		dir := filepath.Join(cgroupRoot, e.Name(), rel)
		if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove cgroup %s: %w", dir, err))
		}
	}
	return errors.Join(errs...)
}

// CgroupDirs lists the cgroup directories of a sandbox that still exist;
// tests use it to check that nothing leaked.
func CgroupDirs(id string) []string {
	ents, _ := os.ReadDir(cgroupRoot)
	var out []string
	for _, e := range ents {
		dir := filepath.Join(cgroupRoot, e.Name(), cgroupParent, id)
		if _, err := os.Stat(dir); err == nil {
			out = append(out, dir)
		}
	}
	return out
}

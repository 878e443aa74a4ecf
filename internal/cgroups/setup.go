package cgroups

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Prepare makes the node's cgroups ready for sandboxes, and is idempotent:
//   - v2: the parent exists and every controller of Controllers is enabled
//     on the way down to it (each ancestor's cgroup.subtree_control), so a
//     sandbox's limits are enforced; a controller the kernel or the
//     delegating unit does not offer is refused with the reason, since a
//     sandbox without its limits must not start.
//   - v1 with crun: crun refuses a hybrid host while a controller sits on
//     the v2 hierarchy (Debian 12's hugetlb); mounting that controller as
//     a v1 hierarchy moves it off. This changes the host until reboot and
//     is logged.
func (h *Host) Prepare(log *slog.Logger, forCrun bool) error {
	if h.Version == V2 {
		return h.enableControllers(log)
	}
	if forCrun {
		return h.fixHybrid(log)
	}
	return nil
}

func (h *Host) enableControllers(log *slog.Logger) error {
	avail, err := os.ReadFile(filepath.Join(h.Root, "cgroup.controllers"))
	if err != nil {
		return errdefs.FailedPrecondition("cgroup v2 at %s: %v", h.Root, err)
	}
	for _, c := range Controllers {
		if !slices.Contains(strings.Fields(string(avail)), c) {
			return errdefs.FailedPrecondition("cgroup v2: the kernel offers no %s controller (cgroup.controllers: %q); sandboxes' limits need %v", c, strings.TrimSpace(string(avail)), Controllers)
		}
	}
	// From the root down to the parent itself: each level passes the
	// controllers on to its children.
	rel := ""
	levels := append([]string{""}, strings.Split(strings.TrimPrefix(h.Parent, "/"), "/")...)
	for i, part := range levels {
		rel = filepath.Join(rel, part)
		dir := filepath.Join(h.Root, rel)
		if i > 0 {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return errdefs.FailedPrecondition("cgroup v2: make %s: %v", dir, err)
			}
		}
		if err := enable(dir); err != nil {
			return errdefs.FailedPrecondition("cgroup v2: %v; under systemd run the edge in a unit with Delegate=yes and give it --cgroup-parent inside that unit's cgroup (see docs/operations.md)", err)
		}
	}
	log.Debug("cgroup v2 controllers enabled for the sandboxes", "parent", h.Parent, "controllers", Controllers)
	return nil
}

// enable adds the controllers of Controllers that dir's subtree_control
// lacks, in one write ("+cpu +pids").
func enable(dir string) error {
	have, err := os.ReadFile(filepath.Join(dir, "cgroup.subtree_control"))
	if err != nil {
		return err
	}
	var add []string
	for _, c := range Controllers {
		if !slices.Contains(strings.Fields(string(have)), c) {
			add = append(add, "+"+c)
		}
	}
	if len(add) == 0 {
		return nil
	}
	if err := writeOnce(filepath.Join(dir, "cgroup.subtree_control"), strings.Join(add, " ")); err != nil {
		// EBUSY: dir holds processes of its own (the "no internal
		// processes" rule); ENOENT/EINVAL: not offered by its parent.
		return fmt.Errorf("enable %s in %s: %w", strings.Join(add, " "), dir, err)
	}
	return nil
}

func (h *Host) fixHybrid(log *slog.Logger) error {
	data, err := os.ReadFile(filepath.Join(h.Root, "unified", "cgroup.controllers"))
	if err != nil {
		return nil // pure v1: nothing to do
	}
	controllers := strings.Fields(string(data))
	for _, c := range controllers {
		dir := filepath.Join(h.Root, c)
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

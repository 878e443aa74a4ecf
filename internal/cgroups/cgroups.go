// Package cgroups reads and writes the cgroups a node keeps for its
// sandboxes, on both layouts Linux has [ours]:
//
//   - v1 (and hybrid hosts such as Debian 12): one hierarchy per controller,
//     a sandbox's cgroup is <root>/<controller>/<parent>/<id> in each;
//   - v2 (Debian 13, Ubuntu 22.04 and later; systemd 256 refuses v1): one
//     unified hierarchy, a sandbox's cgroup is <root>/<parent>/<id>.
//
// The OCI runtime (crun, runc, runsc) creates the cgroup and applies the
// spec's limits itself; this package does what the edge does beside it:
// freeze and thaw, CPU weight and bandwidth changes, usage and OOM reading,
// reclaim, killing what is left and removing the cgroup. It reads the
// kernel's files directly (Documentation/admin-guide/cgroup-v2.rst and the
// v1 documents) rather than through a library: the edge needs a dozen
// files, and containerd/cgroups would bring systemd's D-Bus and its own
// manager objects for it.
package cgroups

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

// Version is a cgroup layout.
type Version int

// The two layouts.
const (
	V1 Version = 1
	V2 Version = 2
)

// DefaultRoot is where the cgroup file system is mounted.
const DefaultRoot = "/sys/fs/cgroup"

// DefaultParent is the sandboxes' parent cgroup when nothing else is
// configured: a cgroup of the node's own at the top of the tree, as
// Docker's cgroupfs driver has. Under systemd the edge's unit delegates a
// subtree instead (see Host.Parent).
const DefaultParent = "/opendsec"

// Controllers the sandboxes' limits need.
var Controllers = []string{"cpu", "memory", "pids"}

// Host is a node's cgroup file system and the parent cgroup below which
// its sandboxes' cgroups live.
type Host struct {
	// Root is the mount point, normally DefaultRoot.
	Root string
	// Version is the layout found there.
	Version Version
	// Parent is the sandboxes' parent, a path from the root of the
	// hierarchy ("/opendsec", or "/system.slice/dsec-edge.service/sandboxes"
	// in a unit with Delegate=yes).
	Parent string
}

// Detect finds the layout mounted at root: v2 when root itself is a
// cgroup2 file system, else v1 (a hybrid host's unified mount holds no
// controller the sandboxes use).
func Detect(root, parent string) (*Host, error) {
	if parent == "" {
		parent = DefaultParent
	}
	if err := checkParent(parent); err != nil {
		return nil, err
	}
	var st unix.Statfs_t
	if err := unix.Statfs(root, &st); err != nil {
		return nil, fmt.Errorf("cgroups: %s: %w", root, err)
	}
	v := V1
	if st.Type == unix.CGROUP2_SUPER_MAGIC {
		v = V2
	}
	return &Host{Root: root, Version: v, Parent: parent}, nil
}

func checkParent(parent string) error {
	if !strings.HasPrefix(parent, "/") || path.Clean(parent) != parent || parent == "/" {
		return fmt.Errorf("cgroup parent %q: must be an absolute, clean path below the root (such as %s)", parent, DefaultParent)
	}
	return nil
}

// String says what the node has, for `dsec nodes` and logs.
func (h *Host) String() string {
	if h.Version == V2 {
		return "v2"
	}
	return "v1"
}

// Path is the cgroup of sandbox id as the OCI spec's cgroupsPath names it
// (for the runtimes' cgroupfs manager, on either layout).
func (h *Host) Path(id string) string { return h.Parent + "/" + id }

// Group is sandbox id's cgroup.
func (h *Host) Group(id string) Group { return Group{h: h, id: id} }

// dir is the directory of rel (a path from the hierarchy's root) for
// controller (ignored on v2, where every controller shares one directory).
func (h *Host) dir(controller, rel string) string {
	if h.Version == V2 {
		return filepath.Join(h.Root, rel)
	}
	return filepath.Join(h.Root, controller, rel)
}

// hierarchies lists the directories of rel in every hierarchy.
func (h *Host) hierarchies(rel string) []string {
	if h.Version == V2 {
		return []string{filepath.Join(h.Root, rel)}
	}
	ents, _ := os.ReadDir(h.Root)
	var out []string
	for _, e := range ents {
		if e.IsDir() {
			out = append(out, filepath.Join(h.Root, e.Name(), rel))
		}
	}
	return out
}

// Children lists the cgroups below the parent, in any hierarchy, whose
// names start with prefix.
func (h *Host) Children(prefix string) []string {
	seen := map[string]bool{}
	var out []string
	for _, dir := range h.hierarchies(h.Parent) {
		subs, _ := os.ReadDir(dir)
		for _, s := range subs {
			if s.IsDir() && strings.HasPrefix(s.Name(), prefix) && !seen[s.Name()] {
				seen[s.Name()] = true
				out = append(out, s.Name())
			}
		}
	}
	return out
}

// BoundTasks sets the pids limit of the parent: every sandbox's tasks
// together stay below n.
func (h *Host) BoundTasks(n int64) error {
	dir := h.dir("pids", h.Parent)
	if h.Version == V1 {
		if _, err := os.Stat(filepath.Join(h.Root, "pids")); err != nil {
			return nil // no pids hierarchy: the per-sandbox limits are refused by the runtime instead
		}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return write(filepath.Join(dir, "pids.max"), strconv.FormatInt(n, 10))
}

// TasksMax reads the parent's pids limit ("max" when none, "" unknown).
func (h *Host) TasksMax() string {
	data, err := os.ReadFile(filepath.Join(h.dir("pids", h.Parent), "pids.max"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(data))
}

func write(p, v string) error {
	if err := writeOnce(p, v); err != nil {
		return fmt.Errorf("cgroup %s: %w", p, err)
	}
	return nil
}

// writeOnce writes v to a cgroup file with one write(2) and returns its
// error as is. Not os.WriteFile: kernfs files can be polled, so Go's
// poller takes an EAGAIN (memory.reclaim's "could not reclaim it all") as
// "wait until writable" and the write never returns (seen on Debian 13:
// an offload hung in it).
func writeOnce(p, v string) error {
	fd, err := syscall.Open(p, syscall.O_WRONLY|syscall.O_TRUNC|syscall.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: p, Err: err}
	}
	defer syscall.Close(fd)
	if _, err := syscall.Write(fd, []byte(v)); err != nil {
		return &os.PathError{Op: "write", Path: p, Err: err}
	}
	return nil
}

func readUint(p string) (uint64, error) {
	data, err := os.ReadFile(p)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64)
}

// keyed reads a flat keyed file ("key value" lines: memory.stat,
// memory.events, cpu.stat, pids.events, memory.oom_control).
func keyed(p string) map[string]uint64 {
	data, err := os.ReadFile(p)
	if err != nil {
		return map[string]uint64{}
	}
	return ParseKeyed(string(data))
}

// ParseKeyed parses a flat keyed file's text; lines that are not
// "key value" with a number are skipped.
func ParseKeyed(s string) map[string]uint64 {
	out := map[string]uint64{}
	for _, line := range strings.Split(s, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}

func notExist(err error) bool { return errors.Is(err, fs.ErrNotExist) }

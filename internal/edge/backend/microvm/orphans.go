package microvm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/sandboxid"
)

// What a crash of the edge can leave of a VM the edge has no record of: a
// create or a fork's copy cut before its handle was saved, or a record
// removed before its VMM ended. Both VMMs run daemonized, so they outlive
// the edge; they are found by their command line, which names the box's
// directory (…/sandboxes/<sandbox id>/vm/…) and whose executable is this
// backend's QEMU or Firecracker (the same file: a process of a container
// sandbox, visible in the node's /proc, cannot pass for one by its name),
// and a QEMU's RAM by its file in /dev/shm.

var (
	boxDirArg = regexp.MustCompile(`/sandboxes/([a-z0-9]+-[a-z0-9]+)/vm/`)
	memName   = regexp.MustCompile(`^opendsec-([a-z0-9]+-[a-z0-9]+)\.mem$`)
)

// vmmBinaries identifies this backend's VMM executables by file.
func (b *Backend) vmmBinaries() []os.FileInfo {
	var names []string
	if b.qemu != nil {
		names = append(names, b.qemu.Binary)
	}
	if b.fc != nil {
		names = append(names, b.fc.Binary)
	}
	var out []os.FileInfo
	for _, n := range names {
		if p, err := exec.LookPath(n); err == nil {
			if fi, err := os.Stat(p); err == nil {
				out = append(out, fi)
			}
		}
	}
	return out
}

// vmmProcs returns the pids of this backend's VMM processes on the host by
// sandbox id.
func (b *Backend) vmmProcs() map[sandboxid.ID][]int {
	out := map[sandboxid.ID][]int{}
	binaries := b.vmmBinaries()
	ents, _ := os.ReadDir("/proc")
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cmdline"))
		if err != nil || len(cmdline) == 0 {
			continue
		}
		exe, err := os.Stat(filepath.Join("/proc", ent.Name(), "exe"))
		if err != nil || !slices.ContainsFunc(binaries, func(fi os.FileInfo) bool { return os.SameFile(fi, exe) }) {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
		for _, arg := range argv[1:] {
			if m := boxDirArg.FindStringSubmatch(arg); m != nil {
				if id := sandboxid.ID(m[1]); validID(id) {
					out[id] = append(out[id], pid)
				}
				break
			}
		}
	}
	return out
}

func validID(id sandboxid.ID) bool {
	_, _, err := sandboxid.Parse(string(id))
	return err == nil
}

// Found implements backend.Inventory: every sandbox of node with a VMM
// running or guest RAM in /dev/shm.
func (b *Backend) Found(ctx context.Context, node sandboxid.NodeID) ([]sandboxid.ID, error) {
	seen := map[sandboxid.ID]bool{}
	for id := range b.vmmProcs() {
		seen[id] = true
	}
	ents, err := os.ReadDir("/dev/shm")
	if err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	for _, ent := range ents {
		if m := memName.FindStringSubmatch(ent.Name()); m != nil && validID(sandboxid.ID(m[1])) {
			seen[sandboxid.ID(m[1])] = true
		}
	}
	var ids []sandboxid.ID
	for id := range seen {
		if _, n, err := sandboxid.Parse(string(id)); err == nil && n == node {
			ids = append(ids, id)
		}
	}
	return ids, nil
}

// destroyUnknown ends every VMM of sandbox id, found by its command line
// (whether or not this backend has a box of it), and removes its guest RAM
// and cpu cgroup; the edge removes its directory.
func (b *Backend) destroyUnknown(id sandboxid.ID) error {
	pids := b.vmmProcs()[id]
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGKILL) //nolint:errcheck // may be gone
	}
	for deadline := time.Now().Add(5 * time.Second); len(pids) > 0; {
		if len(b.vmmProcs()[id]) == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("microvm: sandbox %s: its VMM still runs 5 s after SIGKILL", id)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := os.Remove(memFile(id)); err != nil && !os.IsNotExist(err) {
		return err
	}
	return b.removeCPUCgroup(id)
}

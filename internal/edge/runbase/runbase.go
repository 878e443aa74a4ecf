// Package runbase is a node's run base (default /run/opendsec): the
// small tmpfs the edge bind-mounts into sandboxes from, with the agent
// staged in it by digest.
package runbase

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/logging"
)

// The run base (default /run/opendsec) holds what the edge bind-mounts into
// sandboxes: the agent binary and its companions, and each sandbox's run
// directory with the agent socket, hosts and resolv.conf [ours]. It is a
// small tmpfs of its own, so a sandbox's /proc/self/mountinfo names those
// files by their path in it ("/bin-1a2b…/aether") and not by a path on the
// node's disk. An existing non-empty directory is used as it is: mounting
// over it would hide the sockets of sandboxes already running.

// runBaseSize bounds the tmpfs: binaries (~10 MB a version) and small files.
const runBaseSize = "256m"

// Prepare makes the run base a tmpfs if it can and stages the agent
// there, returning the staged agent's path.
func Prepare(base, agent string, log *slog.Logger) (string, error) {
	if err := os.MkdirAll(base, 0o755); err != nil {
		return "", err
	}
	// Edges starting at once on a fresh node must not both mount a tmpfs:
	// the second would hide what the first staged.
	lock, err := os.Open(base)
	if err != nil {
		return "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", os.NewSyscallError("flock", err)
	}
	defer unix.Flock(int(lock.Fd()), unix.LOCK_UN) //nolint:errcheck // closing releases it too
	mounted, _ := rootfs.IsMountPoint(base)
	if !mounted && os.Geteuid() == 0 {
		if ents, err := os.ReadDir(base); err == nil && len(ents) == 0 {
			if err := unix.Mount("opendsec-run", base, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size="+runBaseSize); err != nil {
				log.Warn("run base stays on the node's disk; sandboxes' mountinfo will show its path", "dir", base, logging.Error, err)
			}
		} else {
			log.Warn("run base is a non-empty directory, not a mount: left as it is, so running sandboxes keep their sockets", "dir", base)
		}
	}
	staged, err := Stage(agent, base)
	if err != nil {
		return "", err
	}
	pruneStaged(base, filepath.Dir(staged), stagedKeep)
	return staged, nil
}

// stagedKeep is how long a staged agent version other than the running
// one is kept (an edge of that version may be starting on this node).
// Every rebuild of the agent stages a new one, ~10 MB of the 256 MB tmpfs:
// kept for a day, a day of rebuilds filled it.
const stagedKeep = time.Hour

// Stage stages the agent; if the run base is full, it
// removes every other staged version older than a minute and tries once
// more.
func Stage(agent, base string) (string, error) {
	staged, err := stageAgent(agent, base)
	if errors.Is(err, unix.ENOSPC) {
		pruneStaged(base, "", time.Minute)
		staged, err = stageAgent(agent, base)
	}
	return staged, err
}

// pruneStaged removes agent versions staged more than age ago, other
// than keep. Sandboxes running one keep it (a bind mount holds the file,
// not its name); an edge of another version on this node restages its own.
func pruneStaged(base, keep string, age time.Duration) {
	dirs, _ := filepath.Glob(filepath.Join(base, "bin-*"))
	for _, d := range dirs {
		if fi, err := os.Stat(d); err == nil && d != keep && time.Since(fi.ModTime()) > age {
			os.RemoveAll(d) //nolint:errcheck // best effort
		}
	}
}

// stageAgent copies the agent and the files beside it that sandboxes mount
// (the gVisor compat library) to base/bin-<digest>/: a new version gets a
// new directory, so sandboxes still running an older one keep theirs.
func stageAgent(agent, base string) (string, error) {
	files := []string{agent}
	if lib := filepath.Join(filepath.Dir(agent), compatLibName); fileExists(lib) {
		files = append(files, lib)
	}
	h := sha256.New()
	for _, f := range files {
		if err := hashFile(h, f); err != nil {
			return "", fmt.Errorf("stage %s: %w", f, err)
		}
	}
	dir := filepath.Join(base, "bin-"+hex.EncodeToString(h.Sum(nil))[:16])
	staged := filepath.Join(dir, "aether")
	if fileExists(staged) {
		return staged, nil
	}
	tmp, err := os.MkdirTemp(base, ".stage-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	for _, f := range files {
		name := filepath.Base(f)
		if f == agent {
			name = "aether"
		}
		if err := copyFile(f, filepath.Join(tmp, name), 0o555); err != nil {
			return "", err
		}
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, dir); err != nil && !errors.Is(err, os.ErrExist) && !fileExists(staged) {
		return "", err
	}
	return staged, nil
}

// compatLibName is the gVisor backend's preload library, built next to the
// agent.
const compatLibName = "libdsec-compat.so"

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

func hashFile(h io.Writer, p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.Copy(h, f)
	return err
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

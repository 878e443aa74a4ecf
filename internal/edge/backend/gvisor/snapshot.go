package gvisor

import (
	"context"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	rspec "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/oci"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// caps adds CAP_SYS_ADMIN to the default set: a restored copy's agent sets
// its own hostname. Inside gVisor it reaches only the sentry's own kernel.
var caps = append(append([]string(nil), oci.DefaultCaps...), "CAP_SYS_ADMIN")

func runtimeSpec(spec *backend.Spec, cg *cgroups.Host, runscID string) *rspec.Spec {
	// gVisor ignores setuid bits, so the image's sudo cannot work: the
	// agent binary takes its place and asks the agent's broker instead.
	s := oci.RuntimeSpec(spec, oci.Options{CgroupsPath: cg.Path(runscID), CgroupV2: cg.Version == cgroups.V2, Caps: caps, SudoBroker: true})
	// The sandbox's tasks are limited in the sentry's own kernel, where a
	// fork past the limit fails with EAGAIN: the agent sets that up
	// (aether.LimitTasks), with room for its own threads.
	if spec.Pids > 0 {
		s.Process.Args = append(s.Process.Args, "-pids-max", strconv.FormatInt(spec.Pids+agentTasks, 10))
	}
	// The sentry enforces no memory limit: the agent holds the sandbox to
	// memory_mb (aether.WatchMemory), and the host's limit, above it by
	// the sentry's own reserve, is what protects the node.
	if spec.MemoryMB > 0 {
		s.Process.Args = append(s.Process.Args, "-memory-max", strconv.FormatInt(spec.MemoryMB<<20, 10))
		host := (spec.MemoryMB + SentryReserveMB(spec.MemoryMB)) << 20
		s.Linux.Resources.Memory.Limit = &host
	}
	// The host cgroup holds the sentry and gofer. With the ptrace platform
	// every task costs the sentry about ten host threads, which it keeps
	// after the task exits, and a sentry that cannot make a thread dies: the
	// host limit is a bound that protects the node, far above what the
	// sandbox's own limit lets it reach in one go.
	bound := HostThreadBound(spec.Pids)
	s.Linux.Resources.Pids = &rspec.LinuxPids{Limit: &bound}
	// This runsc rejects AT_NO_AUTOMOUNT, which coreutils pass to statx:
	// a preloaded library clears it (compat/gvisor/statx.c).
	if lib := filepath.Join(filepath.Dir(spec.AgentPath), compatLib); fileExists(lib) {
		s.Mounts = append(s.Mounts, rspec.Mount{Destination: compatMount, Type: "bind", Source: lib, Options: []string{"rbind", "ro", "nodev"}})
		s.Process.Env = append(s.Process.Env, "LD_PRELOAD="+compatMount)
		// What the library reads for /proc/sys/kernel/random/boot_id (the
		// run directory itself is root's alone).
		if id := filepath.Join(spec.RunDir, "boot_id"); fileExists(id) {
			s.Mounts = append(s.Mounts, rspec.Mount{Destination: bootIDMount, Type: "bind", Source: id, Options: []string{"rbind", "ro", "nosuid", "nodev", "noexec"}})
		}
	}
	return s
}

// compatLib is the preload library built next to the agent binary, and
// compatMount where sandboxes see it.
const (
	compatLib   = "libdsec-compat.so"
	compatMount = "/.dsec/libdsec-compat.so"
	bootIDMount = "/.dsec/boot_id"
)

func fileExists(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

func writeSpec(dir string, s *rspec.Spec) error {
	data, err := json.MarshalIndent(s, "", " ")
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600)
}

// memoryDir is where runsc writes a snapshot's image.
func memoryDir(ref backend.SnapshotRef) string { return filepath.Join(ref.Dir, "memory") }

// Snapshot checkpoints the sandbox: memory, kernel state and the writable
// layer, which lives in the sandbox's memory. runsc stops the sandbox.
func (b *Backend) Snapshot(ctx context.Context, id sandboxid.ID, ref backend.SnapshotRef) (*backend.SnapshotInfo, error) {
	bx, err := b.get(id)
	if err != nil {
		return nil, err
	}
	dir := bx.dir
	if b.cg.Group(bx.runscID).Frozen() {
		return nil, errdefs.FailedPrecondition("sandbox %s is paused; resume it before a snapshot", id)
	}
	if bx.net && !bx.modern {
		return nil, errdefs.Unsupported("sandbox %s has a network and runs on Debian's runsc, which cannot checkpoint it", id)
	}
	tmpl, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, err
	}
	// runsc serializes and compresses the sandbox's memory in the sentry,
	// inside the sandbox's cgroup: under a one-core quota that doubled the
	// checkpoint. The workload is stopped while it runs, so the quota is
	// lifted; Debian's runsc's checkpoint ends the sandbox and its cgroup
	// with it. The newer runsc leaves it running (--leave-running: no
	// restore in place, which took it ~2 s more), and its quota is put back.
	// The bundle template goes first: a restore in place from this
	// checkpoint (the edge's, after it went down during it) needs it.
	if err := os.WriteFile(filepath.Join(ref.Dir, "config.json"), tmpl, 0o600); err != nil {
		return nil, err
	}
	rt := b.rtOf(bx)
	if err := os.WriteFile(filepath.Join(ref.Dir, releaseFile), []byte(releaseOf(rt)), 0o600); err != nil {
		return nil, err
	}
	b.cg.Group(bx.runscID).SetCPUQuota(-1, 0) //nolint:errcheck // only slower with the quota kept
	args := []string{"checkpoint", "--image-path", memoryDir(ref)}
	if rt.modern {
		args = append(args, "--leave-running")
	}
	if _, err := b.run(ctx, rt, b.logFile(dir), append(args, bx.runscID)...); err != nil {
		// A failed checkpoint kills the sandbox in Debian's runsc.
		return &backend.SnapshotInfo{Stopped: !rt.modern}, err
	}
	if rt.modern {
		var s rspec.Spec
		if err := json.Unmarshal(tmpl, &s); err == nil && s.Linux != nil && s.Linux.Resources != nil && s.Linux.Resources.CPU != nil && s.Linux.Resources.CPU.Quota != nil {
			var period uint64
			if s.Linux.Resources.CPU.Period != nil {
				period = *s.Linux.Resources.CPU.Period
			}
			if err := b.cg.Group(bx.runscID).SetCPUQuota(*s.Linux.Resources.CPU.Quota, period); err != nil {
				b.log.Warn("put the CPU limit back after a checkpoint", logging.SandboxID, id, logging.Error, err)
			}
		}
	}
	return &backend.SnapshotInfo{SizeBytes: dirSize(ref.Dir), Stopped: !rt.modern}, nil
}

func dirSize(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error { //nolint:errcheck // a size estimate
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}

// Restore starts a sandbox from a snapshot: the source itself (same id,
// after Snapshot stopped it) or a new copy with its own id, directory,
// agent socket and cgroup. Every copy reads the same image.
func (b *Backend) Restore(ctx context.Context, ref backend.SnapshotRef, spec *backend.Spec) (*backend.Handle, error) {
	tmpl, err := os.ReadFile(filepath.Join(ref.Dir, "config.json"))
	if err != nil {
		return nil, errdefs.NotFound("snapshot %s: no bundle template: %v", ref.ID, err)
	}
	var s rspec.Spec
	if err := json.Unmarshal(tmpl, &s); err != nil {
		return nil, err
	}
	// Restoring the source in place: its stopped container is deleted in
	// the background, under its old runsc id, after the restore.
	old, lookupErr := b.get(spec.ID)
	inPlace := lookupErr == nil
	// A networked snapshot was taken by the newer runsc, which restores it
	// into spec's namespace (the copy's own NIC and address).
	// The runsc that took the snapshot restores it.
	bx := b.newBox(spec)
	bx.modern = snapshotRelease(ref, spec) == releaseNewer
	if bx.modern {
		if _, ok := b.newer(); !ok {
			return nil, errdefs.FailedPrecondition("snapshot %s was taken by the newer runsc, which this node lacks (option runsc-network)", ref.ID)
		}
	} else {
		if bx.net {
			return nil, errdefs.Unsupported("snapshot %s is of a sandbox with a network, which this node's runsc cannot restore", ref.ID)
		}
		bx.diskMB = 0
	}
	target := filepath.Join(spec.Dir, "rootfs")
	if mounted, _ := rootfs.IsMounted(target); !mounted {
		if err := rootfs.Mount(spec.Layers, rootfs.LayoutIn(spec.Dir)); err != nil {
			return nil, err
		}
	}
	fresh := runtimeSpec(spec, b.cg, bx.runscID)
	s.Root, s.Hostname, s.Mounts = fresh.Root, fresh.Hostname, fresh.Mounts
	s.Linux.CgroupsPath, s.Linux.Resources = fresh.Linux.CgroupsPath, fresh.Linux.Resources
	// The copy's own network namespace (the source's is its own).
	s.Linux.Namespaces = fresh.Linux.Namespaces
	// Like the checkpoint, the restore's decompression runs in the new
	// sandbox's cgroup; it restores without a CPU quota and gets the
	// request's limit once it is up.
	var quota *int64
	var period *uint64
	if cpu := s.Linux.Resources.CPU; cpu != nil {
		quota, period = cpu.Quota, cpu.Period
		cpu.Quota = nil
	}
	if !inPlace {
		// A fork restores the source and its copies at once; the copies
		// restore with the least CPU weight so the source, which is what a
		// rollout waits on, comes back first. Their weight is raised after.
		low := uint64(lowShares)
		s.Linux.Resources.CPU.Shares = &low
	}
	if err := writeSpec(spec.Dir, &s); err != nil {
		return nil, err
	}
	rt := b.rtOf(*bx)
	if err := b.launch(ctx, rt, b.logFile(spec.Dir), *bx, "restore", "--detach", "--bundle", spec.Dir, "--image-path", memoryDir(ref), bx.runscID); err != nil {
		b.remove(context.WithoutCancel(ctx), box{runscID: bx.runscID}, rt) //nolint:errcheck // cleaning up a failed restore
		if !inPlace {
			rootfs.Unmount(target) //nolint:errcheck // reporting the restore's error
		}
		// In place, the old generation stays tracked; removing the sandbox
		// removes it and its mount.
		return nil, err
	}
	b.track(spec.ID, bx)
	if quota != nil {
		var p uint64
		if period != nil {
			p = *period
		}
		if err := b.cg.Group(bx.runscID).SetCPUQuota(*quota, p); err != nil {
			b.log.Warn("apply the CPU limit after a restore", logging.SandboxID, spec.ID, logging.Error, err)
		}
	}
	if !inPlace {
		b.cg.Group(bx.runscID).SetCPUShares(normalShares) //nolint:errcheck // the copy runs either way
	}
	if inPlace {
		go func() {
			if err := b.remove(context.Background(), box{runscID: old.runscID}, b.rtOf(old)); err != nil {
				b.log.Warn("delete the checkpointed generation", "runsc_id", old.runscID, logging.Error, err)
			}
		}()
	}
	return b.handle(spec.ID, bx), nil
}

// releaseFile, in a snapshot's directory, names the runsc release that
// took it (releaseNewer or releaseDebian): only that one restores it.
const (
	releaseFile   = "runsc-release"
	releaseNewer  = "newer"
	releaseDebian = "debian"
)

func releaseOf(rt runtime) string {
	if rt.modern {
		return releaseNewer
	}
	return releaseDebian
}

// snapshotRelease reads which runsc took ref. Snapshots from before the
// file existed were taken by the newer runsc if and only if the sandbox
// had a network.
func snapshotRelease(ref backend.SnapshotRef, spec *backend.Spec) string {
	if data, err := os.ReadFile(filepath.Join(ref.Dir, releaseFile)); err == nil {
		return strings.TrimSpace(string(data))
	}
	if spec.NetNS != "" {
		return releaseNewer
	}
	return releaseDebian
}

// CPU weights: the kernel's minimum while restoring a copy, then the default.
const (
	lowShares    = 2
	normalShares = 1024
)

// agentTasks is room for the agent's own threads in the sandbox's task
// limit.
const agentTasks = 32

// SentryReserveMB is what a gVisor sandbox of memoryMB may use on the node
// beyond it, for the sentry's and gofer's own memory: 64 MiB or an eighth,
// whichever is more.
func SentryReserveMB(memoryMB int64) int64 { return max(64, memoryMB/8) }

// HostThreadBound is the host pids limit of a gVisor sandbox whose own
// limit is pids: 16 host threads a task, and no less than 8192.
func HostThreadBound(pids int64) int64 { return max(8192, 16*pids) }

// Package oci builds OCI runtime bundles and reads the cgroups
// for the backends that run through an OCI runtime (crun, runc, runsc).
package oci

import (
	"os"
	"path"
	"path/filepath"
	"strings"

	rspec "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/sudo"
)

// DefaultCaps is root's capability set in a sandbox: enough for package
// managers (chown, setfcap for dpkg), changing user (setuid, setgid) and
// servers on low ports. It is Docker's default less CAP_NET_RAW (raw and
// packet sockets: nothing a default-deny sandbox needs, and a way to forge
// traffic) and CAP_MKNOD (device nodes, which the device cgroup refuses
// anyway). Never: CAP_SYS_ADMIN, SYS_PTRACE, SYS_MODULE, NET_ADMIN,
// SYS_TIME, SYS_RESOURCE, DAC_READ_SEARCH, SYS_BOOT, SYSLOG, BPF, PERFMON.
var DefaultCaps = []string{
	"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER",
	"CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
	"CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}

// ociVersion is the runtime-spec version written; crun 1.8 refuses newer
// ones than it knows.
const ociVersion = "1.0.2"

// cpuPeriod is the CFS period; the quota is cores times it.
const cpuPeriod = 100000

// agentOOMScore keeps the OOM killer off the agent; it resets its
// children to 0.
const agentOOMScore = -999

// Options are what differs between backends.
type Options struct {
	CgroupsPath string
	// CgroupV2 says the node has the unified hierarchy: no swap is asked
	// as memory.swap.max 0 (memory+swap = the limit) instead of v1's
	// swappiness 0, which v2 does not have.
	CgroupV2 bool
	// Caps of the agent and its children.
	Caps []string
	// ProtectAgent lowers the agent's OOM score (needs CAP_SYS_RESOURCE).
	ProtectAgent bool
	// NoFile is RLIMIT_NOFILE.
	NoFile uint64
	// Seccomp is the syscall filter, nil for none (gVisor's sentry is the
	// boundary there).
	Seccomp *rspec.LinuxSeccomp
	// SeccompBPF, if set, is the filter already compiled (SeccompBPF()),
	// given to crun in its run.oci.seccomp_bpf_data annotation instead of
	// Seccomp: crun then loads it without compiling it at every run.
	SeccompBPF string
	// NoNewPrivileges stops setuid and file capabilities from raising a
	// process's privileges; sudo then goes through the agent's broker.
	NoNewPrivileges bool
	// SudoBroker mounts the agent binary over the image's /usr/bin/sudo,
	// where it asks the agent's broker (internal/sudo): for runtimes that
	// ignore setuid (gVisor) or forbid it (no_new_privs).
	SudoBroker bool
}

// SudoPath is where images keep sudo.
const SudoPath = "/usr/bin/sudo"

// RuntimeSpec builds the OCI runtime config for a sandbox: the agent as the
// first process, the agent binary, run directory and hosts file bind-mounted
// read-only, new PID/IPC/UTS/mount namespaces, the network namespace the
// edge made (a new one with loopback only when it made none), the usual masked and
// read-only /proc paths, and cgroup limits from the request.
func RuntimeSpec(spec *backend.Spec, o Options) *rspec.Spec {
	var oom *int
	if o.ProtectAgent {
		v := agentOOMScore
		oom = &v
	}
	nofile, cgroupsPath, caps := o.NoFile, o.CgroupsPath, o.Caps
	if spec.NoFile > 0 && (nofile == 0 || uint64(spec.NoFile) < nofile) {
		nofile = uint64(spec.NoFile)
	}
	if nofile == 0 {
		nofile = 65536
	}
	if caps == nil {
		caps = DefaultCaps
	}
	quota := int64(spec.CPUCores * cpuPeriod)
	period := uint64(cpuPeriod)
	mem := spec.MemoryMB << 20
	pids := spec.Pids
	memory := &rspec.LinuxMemory{Limit: &mem}
	if o.CgroupV2 {
		memory.Swap = &mem
	} else {
		swappiness := uint64(0)
		memory.Swappiness = &swappiness
	}
	ro := []string{"nosuid", "noexec", "nodev", "ro"}
	s := &rspec.Spec{
		Version: ociVersion,
		Process: &rspec.Process{
			Args:            backend.AgentArgs(),
			Env:             spec.Env,
			Cwd:             workDir(spec.WorkDir),
			User:            rspec.User{UID: 0, GID: 0},
			OOMScoreAdj:     oom,
			NoNewPrivileges: o.NoNewPrivileges,
			Capabilities: &rspec.LinuxCapabilities{
				Bounding: caps, Effective: caps, Permitted: caps,
			},
			Rlimits: []rspec.POSIXRlimit{{Type: "RLIMIT_NOFILE", Hard: nofile, Soft: nofile}},
		},
		Root:     &rspec.Root{Path: filepath.Join(spec.Dir, "rootfs")},
		Hostname: spec.Hostname,
		Mounts: []rspec.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: ro},
			{Destination: "/sys/fs/cgroup", Type: "cgroup", Source: "cgroup", Options: ro},
			{Destination: backend.AgentMount, Type: "bind", Source: spec.AgentPath, Options: []string{"rbind", "ro", "nosuid", "nodev"}},
			{Destination: backend.RunMount, Type: "bind", Source: spec.RunDir, Options: []string{"rbind", "ro", "nosuid", "nodev", "noexec"}},
			{Destination: "/etc/hosts", Type: "bind", Source: spec.HostsFile, Options: []string{"rbind", "ro"}},
		},
		Linux: &rspec.Linux{
			CgroupsPath: cgroupsPath,
			Resources: &rspec.LinuxResources{
				Memory: memory,
				CPU:    &rspec.LinuxCPU{Quota: &quota, Period: &period},
				Pids:   &rspec.LinuxPids{Limit: &pids},
				Devices: []rspec.LinuxDeviceCgroup{
					{Allow: false, Access: "rwm"},
				},
			},
			Namespaces: []rspec.LinuxNamespace{
				{Type: rspec.PIDNamespace}, {Type: rspec.IPCNamespace}, {Type: rspec.UTSNamespace},
				{Type: rspec.MountNamespace}, {Type: rspec.NetworkNamespace, Path: spec.NetNS},
			},
			MaskedPaths: []string{
				"/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
				"/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware",
				"/proc/scsi", "/proc/kallsyms", "/proc/kmsg", "/proc/sysrq-trigger",
				"/sys/devices/virtual/powercap", "/sys/kernel/debug", "/sys/kernel/tracing",
			},
			ReadonlyPaths: []string{
				"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
			},
			Seccomp: o.Seccomp,
		},
	}
	if o.SeccompBPF != "" {
		s.Linux.Seccomp = nil
		s.Annotations = map[string]string{"run.oci.seccomp_bpf_data": o.SeccompBPF}
	}
	if spec.MachineID != "" {
		s.Process.Args = append(s.Process.Args, "-machine-id", spec.MachineID)
	}
	if spec.ResolvConf != "" {
		s.Mounts = append(s.Mounts, rspec.Mount{Destination: "/etc/resolv.conf", Type: "bind", Source: spec.ResolvConf, Options: []string{"rbind", "ro"}})
	}
	if o.SudoBroker {
		s.Process.Args = append(s.Process.Args, "-sudo-dir", sudo.Dir)
		if fi, err := os.Lstat(filepath.Join(spec.Dir, "rootfs", SudoPath)); err == nil && fi.Mode().IsRegular() {
			s.Mounts = append(s.Mounts, rspec.Mount{Destination: SudoPath, Type: "bind", Source: spec.AgentPath, Options: []string{"rbind", "ro"}})
		}
	}
	return s
}

// workDir is the agent's working directory, which processes that name none
// inherit: the image's WORKDIR, else "/". A WORKDIR the image lacks is
// made by the runtime, as docker does.
func workDir(dir string) string {
	if dir == "" || !strings.HasPrefix(dir, "/") {
		return "/"
	}
	return path.Clean(dir)
}

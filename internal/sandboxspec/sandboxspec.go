// Package sandboxspec validates a sandbox request and fills in defaults. The
// apiserver checks requests before placing them and the edge checks again
// before admitting, so both give the same message for the same mistake.
package sandboxspec

import (
	"math"
	"regexp"
	"sort"
	"strings"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// Limits bound what a request may ask for, and give defaults.
type Limits struct {
	DefaultCPUCores float64
	DefaultMemoryMB int64
	DefaultPids     int64
	DefaultTimeout  int64 // seconds
	DefaultDiskMB   int64
	DefaultNoFile   int64
	MaxCPUCores     float64
	MaxMemoryMB     int64
	MaxPids         int64
	MaxTimeout      int64 // seconds
	MaxDiskMB       int64
	MaxNoFile       int64
}

// DefaultLimits are the built-in defaults; MaxCPUCores and MaxMemoryMB are
// usually lowered to what the largest node can hold.
func DefaultLimits() Limits {
	return Limits{
		DefaultCPUCores: 1, DefaultMemoryMB: 512, DefaultPids: 1024, DefaultTimeout: 3600,
		DefaultDiskMB: 2048, DefaultNoFile: 65536,
		MaxCPUCores: 64, MaxMemoryMB: 256 << 10, MaxPids: 65536, MaxTimeout: 7 * 24 * 3600,
		MaxDiskMB: 1 << 20, MaxNoFile: 1 << 20,
	}
}

// MaxForkCount bounds the copies of one fork call, wherever it arrives
// (the API, an edge, the E2B gateway).
const MaxForkCount = 100

// MaxPoolSize bounds one warm pool on one node (each of its sandboxes
// runs), wherever it is set (the API, an edge's flag or state).
const MaxPoolSize = 1024

// Bounds of the small fields.
const (
	MinCPUCores   = 0.1
	MinMemoryMB   = 16
	MinPids       = 16
	MinDiskMB     = 16
	MinNoFile     = 1024
	maxMetadata   = 64
	maxMetaKey    = 128
	maxMetaValue  = 1024
	maxEnv        = 256
	maxEnvBytes   = 64 << 10
	maxTaskLen    = 128
	maxBackendLen = 32
)

// MaxDevices bounds the host PCI devices of one sandbox.
const MaxDevices = 8

// pciAddrRE is a PCI device's address as sysfs names it (domain, bus,
// device, function), in lower case.
// Domains past ffff (Intel VMD's 10000) have more digits.
var pciAddrRE = regexp.MustCompile(`^[0-9a-f]{4,8}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]$`)

// NormalizeDevices checks spec.Devices, lower-casing each address and
// giving a bare "BB:DD.F" domain 0000, as lspci prints them.
func NormalizeDevices(spec *sandboxv1.SandboxSpec) error {
	if len(spec.Devices) > MaxDevices {
		return errdefs.InvalidArgument("devices: %d given, at most %d", len(spec.Devices), MaxDevices)
	}
	seen := map[string]bool{}
	for i, d := range spec.Devices {
		a := strings.ToLower(strings.TrimSpace(d))
		if strings.Count(a, ":") == 1 {
			a = "0000:" + a
		}
		if !pciAddrRE.MatchString(a) {
			return errdefs.InvalidArgument("devices[%d] %q: not a PCI address; want DDDD:BB:DD.F as lspci -D prints it (e.g. 0000:01:00.0)", i, errdefs.Clip(d, 40))
		}
		if seen[a] {
			return errdefs.InvalidArgument("devices[%d] %s: named twice", i, a)
		}
		seen[a] = true
		spec.Devices[i] = a
	}
	return nil
}

var (
	taskRE    = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]*$`)
	envKeyRE  = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)
	backendRE = regexp.MustCompile(`^[a-z][a-z0-9-]*$`)
)

// Normalize checks spec and fills defaults in place. backends lists the
// backend names the cluster knows, for the error message.
func Normalize(spec *sandboxv1.SandboxSpec, lim Limits, backends []string) error {
	if spec == nil {
		return errdefs.InvalidArgument("spec: missing")
	}
	if spec.Backend == "" {
		return errdefs.InvalidArgument("backend: empty; choose one of %s", list(backends))
	}
	if len(spec.Backend) > maxBackendLen || !backendRE.MatchString(spec.Backend) || !contains(backends, spec.Backend) {
		return errdefs.InvalidArgument("backend %q: unknown; choose one of %s", errdefs.Clip(spec.Backend, 64), list(backends))
	}
	if _, err := image.ParseRef(spec.Image); err != nil {
		return err
	}
	if spec.Resources == nil {
		spec.Resources = &sandboxv1.Resources{}
	}
	r := spec.Resources
	if r.CpuCores == 0 {
		r.CpuCores = min(lim.DefaultCPUCores, lim.MaxCPUCores)
	}
	if math.IsNaN(r.CpuCores) || r.CpuCores < MinCPUCores || r.CpuCores > lim.MaxCPUCores {
		return errdefs.InvalidArgument("resources.cpu_cores %g: want %g to %g", r.CpuCores, MinCPUCores, lim.MaxCPUCores)
	}
	if r.MemoryMb == 0 {
		r.MemoryMb = min(lim.DefaultMemoryMB, lim.MaxMemoryMB)
	}
	if r.MemoryMb < MinMemoryMB || r.MemoryMb > lim.MaxMemoryMB {
		return errdefs.InvalidArgument("resources.memory_mb %d: want %d to %d", r.MemoryMb, MinMemoryMB, lim.MaxMemoryMB)
	}
	if r.Pids == 0 {
		r.Pids = lim.DefaultPids
	}
	if r.Pids < MinPids || r.Pids > lim.MaxPids {
		return errdefs.InvalidArgument("resources.pids %d: want %d to %d", r.Pids, MinPids, lim.MaxPids)
	}
	if r.DiskMb == 0 {
		r.DiskMb = min(lim.DefaultDiskMB, lim.MaxDiskMB)
	}
	if r.DiskMb < MinDiskMB || r.DiskMb > lim.MaxDiskMB {
		return errdefs.InvalidArgument("resources.disk_mb %d: want %d to %d", r.DiskMb, MinDiskMB, lim.MaxDiskMB)
	}
	if r.OpenFiles == 0 {
		r.OpenFiles = min(lim.DefaultNoFile, lim.MaxNoFile)
	}
	if r.OpenFiles < MinNoFile || r.OpenFiles > lim.MaxNoFile {
		return errdefs.InvalidArgument("resources.open_files %d: want %d to %d", r.OpenFiles, MinNoFile, lim.MaxNoFile)
	}
	if spec.TimeoutSeconds == 0 {
		spec.TimeoutSeconds = lim.DefaultTimeout
	}
	if spec.TimeoutSeconds < 1 || spec.TimeoutSeconds > lim.MaxTimeout {
		return errdefs.InvalidArgument("timeout_seconds %d: want 1 to %d", spec.TimeoutSeconds, lim.MaxTimeout)
	}
	if err := checkEnv(spec.Env); err != nil {
		return err
	}
	if err := CheckMetadata(spec.Metadata); err != nil {
		return err
	}
	if err := CheckTask(spec.Task); err != nil {
		return err
	}
	if err := NormalizeDevices(spec); err != nil {
		return err
	}
	if _, ok := sandboxv1.OnTimeout_name[int32(spec.OnTimeout)]; !ok {
		return errdefs.InvalidArgument("on_timeout %d: want KILL or PAUSE", spec.OnTimeout)
	}
	switch spec.OnTimeoutDepth {
	case sandboxv1.PauseDepth_PAUSE_DEPTH_UNSPECIFIED, sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD, sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM:
	default:
		return errdefs.InvalidArgument("on_timeout_depth %s: want OFFLOAD (the default) or FILESYSTEM", spec.OnTimeoutDepth)
	}
	if spec.OnTimeoutDepth != sandboxv1.PauseDepth_PAUSE_DEPTH_UNSPECIFIED && spec.OnTimeout != sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE {
		return errdefs.InvalidArgument("on_timeout_depth %s: only with on_timeout PAUSE", spec.OnTimeoutDepth)
	}
	if spec.Network != nil {
		p, err := NetworkPolicy(spec.Network)
		if err != nil {
			return err
		}
		spec.Network = NetworkPolicyProto(p, spec.Network)
	}
	return nil
}

// CheckTask validates a task label (empty: none).
func CheckTask(task string) error {
	if task != "" && (len(task) > maxTaskLen || !taskRE.MatchString(task)) {
		return errdefs.InvalidArgument("task %q: 1 to %d of letters, digits, '.', '_', ':' and '-'", errdefs.Clip(task, 64), maxTaskLen)
	}
	return nil
}

// CheckTimeout validates a new time to live.
func CheckTimeout(seconds int64, lim Limits) error {
	if seconds < 1 || seconds > lim.MaxTimeout {
		return errdefs.InvalidArgument("timeout_seconds %d: want 1 to %d", seconds, lim.MaxTimeout)
	}
	return nil
}

func checkEnv(env map[string]string) error {
	if len(env) > maxEnv {
		return errdefs.InvalidArgument("env: %d variables, at most %d", len(env), maxEnv)
	}
	size := 0
	for k, v := range env {
		if !envKeyRE.MatchString(k) {
			return errdefs.InvalidArgument("env %q: names are letters, digits and '_', not starting with a digit", errdefs.Clip(k, 64))
		}
		if strings.ContainsRune(v, 0) {
			return errdefs.InvalidArgument("env %s: value contains a NUL byte", k)
		}
		size += len(k) + len(v)
	}
	if size > maxEnvBytes {
		return errdefs.InvalidArgument("env: %d bytes in all, at most %d", size, maxEnvBytes)
	}
	return nil
}

// CheckMetadata validates metadata labels.
func CheckMetadata(md map[string]string) error {
	if len(md) > maxMetadata {
		return errdefs.InvalidArgument("metadata: %d entries, at most %d", len(md), maxMetadata)
	}
	for k, v := range md {
		if k == "" || len(k) > maxMetaKey {
			return errdefs.InvalidArgument("metadata key %q: 1 to %d characters", errdefs.Clip(k, 64), maxMetaKey)
		}
		if len(v) > maxMetaValue {
			return errdefs.InvalidArgument("metadata %q: value longer than %d characters", errdefs.Clip(k, 64), maxMetaValue)
		}
	}
	return nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func list(names []string) string {
	if len(names) == 0 {
		return "(none configured)"
	}
	s := append([]string(nil), names...)
	sort.Strings(s)
	return strings.Join(s, ", ")
}

package sandboxspec

import (
	"errors"
	"math"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

var backends = []string{"container", "gvisor"}

func TestNormalizeFillsDefaults(t *testing.T) {
	s := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11"}
	if err := Normalize(s, DefaultLimits(), backends); err != nil {
		t.Fatal(err)
	}
	r := s.Resources
	if r.CpuCores != 1 || r.MemoryMb != 512 || r.Pids != 1024 || s.TimeoutSeconds != 3600 {
		t.Fatalf("defaults not filled: %+v timeout %d", r, s.TimeoutSeconds)
	}
}

func TestNormalizeNamesTheField(t *testing.T) {
	base := func() *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11"}
	}
	lim := DefaultLimits()
	lim.MaxCPUCores, lim.MaxMemoryMB = 2, 4096
	cases := map[string]struct {
		mut  func(*sandboxv1.SandboxSpec)
		want string
	}{
		"unknown backend":             {func(s *sandboxv1.SandboxSpec) { s.Backend = "firecracker" }, `backend "firecracker": unknown; choose one of container, gvisor`},
		"no backend":                  {func(s *sandboxv1.SandboxSpec) { s.Backend = "" }, "backend: empty"},
		"bad image":                   {func(s *sandboxv1.SandboxSpec) { s.Image = "Py 3" }, "image"},
		"cpu too high":                {func(s *sandboxv1.SandboxSpec) { s.Resources = &sandboxv1.Resources{CpuCores: 3} }, "resources.cpu_cores 3: want 0.1 to 2"},
		"cpu NaN":                     {func(s *sandboxv1.SandboxSpec) { s.Resources = &sandboxv1.Resources{CpuCores: math.NaN()} }, "resources.cpu_cores"},
		"cpu negative":                {func(s *sandboxv1.SandboxSpec) { s.Resources = &sandboxv1.Resources{CpuCores: -1} }, "resources.cpu_cores -1"},
		"memory too big":              {func(s *sandboxv1.SandboxSpec) { s.Resources = &sandboxv1.Resources{MemoryMb: 100000} }, "resources.memory_mb 100000: want 16 to 4096"},
		"pids":                        {func(s *sandboxv1.SandboxSpec) { s.Resources = &sandboxv1.Resources{Pids: 3} }, "resources.pids 3"},
		"timeout":                     {func(s *sandboxv1.SandboxSpec) { s.TimeoutSeconds = -5 }, "timeout_seconds -5"},
		"env key":                     {func(s *sandboxv1.SandboxSpec) { s.Env = map[string]string{"A=B": "x"} }, `env "A=B"`},
		"task":                        {func(s *sandboxv1.SandboxSpec) { s.Task = "a b" }, `task "a b"`},
		"metadata":                    {func(s *sandboxv1.SandboxSpec) { s.Metadata = map[string]string{"": "x"} }, "metadata key"},
		"pause depth without a pause": {func(s *sandboxv1.SandboxSpec) { s.OnTimeoutDepth = sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM }, "on_timeout_depth PAUSE_DEPTH_FILESYSTEM: only with on_timeout PAUSE"},
		"device address":              {func(s *sandboxv1.SandboxSpec) { s.Devices = []string{"0000:01:00.0", "eth0"} }, `devices[1] "eth0": not a PCI address`},
		"device twice":                {func(s *sandboxv1.SandboxSpec) { s.Devices = []string{"01:00.0", "0000:01:00.0"} }, "devices[1] 0000:01:00.0: named twice"},
		"too many devices": {func(s *sandboxv1.SandboxSpec) {
			s.Devices = []string{"1", "2", "3", "4", "5", "6", "7", "8", "9"}
		}, "devices: 9 given, at most 8"},
		"freeze at the timeout": {func(s *sandboxv1.SandboxSpec) {
			s.OnTimeout, s.OnTimeoutDepth = sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE, sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE
		}, "on_timeout_depth PAUSE_DEPTH_FREEZE: want OFFLOAD (the default) or FILESYSTEM"},
	}
	for name, c := range cases {
		s := base()
		c.mut(s)
		err := Normalize(s, lim, backends)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want invalid argument containing %q", name, err, c.want)
		}
	}
}

// Devices are taken as lspci prints them, with or without the domain, in
// either case, and kept in sysfs's form.
func TestNormalizeDevices(t *testing.T) {
	s := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11", Devices: []string{"01:00.0", "0000:3B:00.1"}}
	if err := Normalize(s, DefaultLimits(), backends); err != nil {
		t.Fatal(err)
	}
	if s.Devices[0] != "0000:01:00.0" || s.Devices[1] != "0000:3b:00.1" {
		t.Fatalf("devices %v", s.Devices)
	}
}

func FuzzNormalize(f *testing.F) {
	seed, _ := proto.Marshal(&sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11", Env: map[string]string{"A": "1"}})
	f.Add(seed)
	f.Fuzz(func(t *testing.T, data []byte) {
		var s sandboxv1.SandboxSpec
		if proto.Unmarshal(data, &s) != nil {
			return
		}
		if err := Normalize(&s, DefaultLimits(), backends); err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("unclassified error %v", err)
			}
			return
		}
		r := s.Resources
		if r.CpuCores < MinCPUCores || r.MemoryMb < MinMemoryMB || r.Pids < MinPids || s.TimeoutSeconds < 1 {
			t.Fatalf("accepted out-of-range spec %+v", &s)
		}
		for _, d := range s.Devices {
			if !pciAddrRE.MatchString(d) {
				t.Fatalf("accepted device %q", d)
			}
		}
	})
}

package capacity

import (
	"errors"
	"math"
	"runtime"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// TestOvercommitIsANodeSetting: a node's totals follow its own overcommit
// factors, and zero means the documented defaults.
func TestOvercommitIsANodeSetting(t *testing.T) {
	t.Parallel()
	cores := float64(runtime.NumCPU())
	if c := Host(0, 0); c.CPUCores != cores*DefaultCPUOvercommit || c.HostCPUCores != cores {
		t.Fatalf("defaults: %+v", c)
	}
	dense := Host(64, 3)
	if dense.CPUCores != cores*64 {
		t.Fatalf("cpu overcommit 64: %+v", dense)
	}
	if def := Host(0, 0); math.Abs(float64(dense.MemoryMB)/float64(def.MemoryMB)-2) > 0.01 {
		t.Fatalf("memory overcommit 3 against 1.5: %d against %d", dense.MemoryMB, def.MemoryMB)
	}
}

// TestAdmitNamesWhatIsShort: one sandbox larger than the host is the
// caller's error (it can never fit here); a full node is exhausted, and
// says by what.
func TestAdmitNamesWhatIsShort(t *testing.T) {
	t.Parallel()
	node := Node{CPUCores: 4, MemoryMB: 4096, MaxSandboxes: 3, HostCPUCores: 2, HostMemoryMB: 2048}
	var cur Usage
	cur.Add(1.5, 1500, 2)
	for _, tc := range []struct {
		name  string
		cpu   float64
		mem   int64
		n     int64
		class error
		says  string
	}{
		{"fits", 0.5, 512, 1, nil, ""},
		{"more cores than the host", 3, 512, 1, errdefs.ErrInvalidArgument, "resources.cpu_cores 3"},
		{"more memory than the host", 1, 4096, 1, errdefs.ErrInvalidArgument, "resources.memory_mb 4096"},
		{"one sandbox too many", 0.1, 64, 2, errdefs.ErrResourceExhausted, "its limit is 3"},
		{"cores", 1.5, 512, 1, errdefs.ErrResourceExhausted, "1.0 of 4.0 cpu cores free, 1.5 asked"},
		{"memory", 0.5, 1200, 1, errdefs.ErrResourceExhausted, "1096 of 4096 MiB memory free, 1200 asked"},
	} {
		err := node.Admit("n1", cur, tc.cpu, tc.mem, tc.n)
		if tc.class == nil {
			if err != nil {
				t.Errorf("%s: %v", tc.name, err)
			}
			continue
		}
		if !errors.Is(err, tc.class) || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want %v saying %q", tc.name, err, tc.class, tc.says)
		}
		// A full node asks the client to come back; a request too big
		// for any node does not.
		if d, ok := errdefs.RetryDelay(err); ok != (tc.class == errdefs.ErrResourceExhausted) || (ok && d != RoomRetryAfter) {
			t.Errorf("%s: retry delay %v %v", tc.name, d, ok)
		}
	}
	cur.Add(1.5, 1500, -2)
	if cur != (Usage{}) {
		t.Errorf("adding and taking off two sandboxes left %+v", cur)
	}
}

// TestAdmitFillsANodeExactly: the last sandbox that fits exactly is
// admitted, also when its cores, added up in floating point, come to a hair
// over the total (0.1 + 0.1 + 0.1 > 0.3).
func TestAdmitFillsANodeExactly(t *testing.T) {
	node := Node{CPUCores: 0.3, MemoryMB: 192, MaxSandboxes: 3, HostCPUCores: 2, HostMemoryMB: 2048}
	var cur Usage
	for i := range 3 {
		if err := node.Admit("n1", cur, 0.1, 64, 1); err != nil {
			t.Fatalf("sandbox %d of 3 that fill the node exactly: %v", i+1, err)
		}
		cur.Add(0.1, 64, 1)
	}
	if err := node.Admit("n1", cur, 0.1, 64, 1); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("a fourth on a full node: %v, want resource exhausted", err)
	}
}

// TestSandboxLimitFollowsTheHost: the count a node admits is set by
// whichever of memory, tasks and file descriptors runs out first, named,
// with no fixed cap; an operator's setting replaces it.
func TestSandboxLimitFollowsTheHost(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		lim   HostLimits
		want  int64
		bound string
	}{
		// A 384-thread node of the seed: its burst of 5,120 fits.
		{"big host", HostLimits{MemoryMB: 1536 << 10, Tasks: 4194304, Files: 1 << 20}, 235929, "tasks"},
		{"memory", HostLimits{MemoryMB: 8192, Tasks: 4194304, Files: 1 << 20}, 2048, "memory (8192 MiB, 4 MiB a sandbox)"},
		{"a low pid_max", HostLimits{MemoryMB: 1536 << 10, Tasks: 32768, Files: 1 << 20}, 1843, "tasks (32768 of kernel.pid_max"},
		{"a low RLIMIT_NOFILE", HostLimits{MemoryMB: 1536 << 10, Tasks: 4194304, Files: 1024}, 256, "file descriptors (RLIMIT_NOFILE 1024"},
		{"nothing left", HostLimits{MemoryMB: 1, Tasks: 1, Files: 1}, 1, ""},
	} {
		n, bound := SandboxLimit(tc.lim)
		if n != tc.want || !strings.Contains(bound, tc.bound) {
			t.Errorf("%s: %d sandboxes, bounded by %q; want %d, %q", tc.name, n, bound, tc.want, tc.bound)
		}
	}
	host := Host(0, 0)
	if host.MaxSandboxes < 1 || host.SandboxBound == "" {
		t.Fatalf("this host: %d sandboxes, bound %q", host.MaxSandboxes, host.SandboxBound)
	}
	if set := host.WithMaxSandboxes(8192); set.MaxSandboxes != 8192 || set.SandboxBound != "the operator's setting" {
		t.Fatalf("operator's 8192: %+v", set)
	}
	if same := host.WithMaxSandboxes(0); same != host {
		t.Fatalf("no setting changed the node: %+v", same)
	}
}

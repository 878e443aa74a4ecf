package microvm

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// TestAVMMsCPULimitOnEitherLayout: the VMM's process goes into the
// sandbox's cgroup with a bandwidth of its cores, in the files each layout
// has (a fake tree; the kernel's own is exercised by the microvm suite on
// v1 and by the host test's VM on v2).
func TestAVMMsCPULimitOnEitherLayout(t *testing.T) {
	for _, tc := range []struct {
		v            cgroups.Version
		setup        map[string]string
		quota, procs string
	}{
		// The files the kernel makes with each cgroup directory.
		{cgroups.V1, map[string]string{"cpu/cpu.cfs_quota_us": "-1", "cpu/opendsec/sb/cpu.cfs_quota_us": "-1", "cpu/opendsec/sb/cpu.cfs_period_us": "100000", "cpu/opendsec/sb/cgroup.procs": ""},
			"cpu/opendsec/sb/cpu.cfs_quota_us", "cpu/opendsec/sb/cgroup.procs"},
		{cgroups.V2, map[string]string{"opendsec/cgroup.subtree_control": "cpu memory pids", "opendsec/sb/cpu.max": "max 100000", "opendsec/sb/cgroup.procs": ""},
			"opendsec/sb/cpu.max", "opendsec/sb/cgroup.procs"},
	} {
		root := t.TempDir()
		for rel, content := range tc.setup {
			os.MkdirAll(filepath.Dir(filepath.Join(root, rel)), 0o755)
			os.WriteFile(filepath.Join(root, rel), []byte(content), 0o644)
		}
		b := &Backend{cg: &cgroups.Host{Root: root, Version: tc.v, Parent: "/opendsec"}}
		if err := b.limitCPU(sandboxid.ID("sb"), 4242, 0.5); err != nil {
			t.Fatalf("v%d: %v", tc.v, err)
		}
		quota, _ := os.ReadFile(filepath.Join(root, tc.quota))
		procs, _ := os.ReadFile(filepath.Join(root, tc.procs))
		if want := map[cgroups.Version]string{cgroups.V1: "50000", cgroups.V2: "50000 100000"}[tc.v]; strings.TrimSpace(string(quota)) != want {
			t.Errorf("v%d: quota %q, want %q", tc.v, quota, want)
		}
		if string(procs) != "4242" {
			t.Errorf("v%d: cgroup.procs %q, want the VMM's pid", tc.v, procs)
		}
	}
	// Without a cpu controller for the sandboxes the limit is the vCPUs.
	b := &Backend{cg: &cgroups.Host{Root: t.TempDir(), Version: cgroups.V2, Parent: "/opendsec"}}
	if err := b.limitCPU("sb", 1, 0.5); err != errNoCPUController {
		t.Errorf("no controller: %v, want errNoCPUController", err)
	}
}

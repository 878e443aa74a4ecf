package cgroups

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// fakeHost lays out a cgroup tree under a temporary directory with the
// files the kernel would have for sandbox "sb", in the formats of
// Documentation/admin-guide/cgroup-v2.rst and the v1 documents.
func fakeHost(t *testing.T, v Version, files map[string]string) *Host {
	t.Helper()
	root := t.TempDir()
	for rel, content := range files {
		p := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return &Host{Root: root, Version: v, Parent: "/opendsec"}
}

func read(t *testing.T, h *Host, rel string) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(h.Root, rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(data)
}

func TestUsageAndEventsOnV2(t *testing.T) {
	h := fakeHost(t, V2, map[string]string{
		"opendsec/sb/cpu.stat":       "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 0\n",
		"opendsec/sb/memory.current": "10485760\n",
		"opendsec/sb/memory.max":     "67108864\n",
		"opendsec/sb/memory.stat":    "anon 4194304\nfile 6291456\ninactive_file 2097152\nactive_file 4194304\n",
		"opendsec/sb/memory.events":  "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n",
		"opendsec/sb/pids.events":    "max 7\n",
		"opendsec/sb/pids.current":   "33\n",
		"opendsec/sb/cgroup.procs":   "10\n11\n",
	})
	g := h.Group("sb")
	u, err := g.ReadUsage()
	if err != nil {
		t.Fatal(err)
	}
	want := Usage{CPUNanos: 1_500_000, MemoryBytes: 10485760 - 2097152, CacheBytes: 6291456, LimitBytes: 64 << 20, ActiveFileBytes: 4194304}
	if u != want {
		t.Errorf("usage %+v, want %+v", u, want)
	}
	if kills, limit := g.OOMKills(); kills != 2 || limit != 64<<20 {
		t.Errorf("OOMKills = %d, %d; want 2 kills, limit 64 MiB", kills, limit)
	}
	if got := g.DiagnoseOOM(); !strings.Contains(got, "limit 64 MiB") || !strings.Contains(got, "ended 2 process") {
		t.Errorf("DiagnoseOOM = %q", got)
	}
	if n := g.PidsRefused(); n != 7 {
		t.Errorf("PidsRefused = %d, want 7", n)
	}
	if n := g.PidsCurrent(); n != 33 {
		t.Errorf("PidsCurrent = %d, want 33", n)
	}
	if got := g.Procs(); len(got) != 2 || got[0] != 10 || got[1] != 11 {
		t.Errorf("Procs = %v", got)
	}
}

func TestNoMemoryLimitOnV2ReadsAsNone(t *testing.T) {
	h := fakeHost(t, V2, map[string]string{
		"opendsec/sb/cpu.stat":       "usage_usec 1\n",
		"opendsec/sb/memory.current": "4096\n",
		"opendsec/sb/memory.max":     "max\n",
	})
	u, err := h.Group("sb").ReadUsage()
	if err != nil || u.LimitBytes != 0 {
		t.Errorf("usage %+v, %v; want no limit", u, err)
	}
}

func TestUsageAndEventsOnV1(t *testing.T) {
	h := fakeHost(t, V1, map[string]string{
		"cpuacct/opendsec/sb/cpuacct.usage":           "123456789\n",
		"memory/opendsec/sb/memory.usage_in_bytes":    "8388608\n",
		"memory/opendsec/sb/memory.limit_in_bytes":    "33554432\n",
		"memory/opendsec/sb/memory.stat":              "cache 100\nactive_file 7\ntotal_cache 4194304\ntotal_inactive_file 1048576\ntotal_active_file 2097152\n",
		"memory/opendsec/sb/memory.oom_control":       "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
		"pids/opendsec/sb/pids.events":                "max 4\n",
		"pids/opendsec/sb/cgroup.procs":               "20\n",
		"memory/opendsec/sb/cgroup.procs":             "20\n21\n",
		"freezer/opendsec/sb/freezer.state":           "THAWED\n",
		"cpu/opendsec/sb/cpu.shares":                  "1024\n",
		"cpu/opendsec/sb/cpu.cfs_quota_us":            "-1\n",
		"cpu/opendsec/sb/cpu.cfs_period_us":           "100000\n",
		"memory/opendsec/sb/memory.force_empty":       "",
		"pids/opendsec/pids.max":                      "max\n",
		"cpuacct/opendsec/other-sandbox/cgroup.procs": "",
	})
	g := h.Group("sb")
	u, err := g.ReadUsage()
	if err != nil {
		t.Fatal(err)
	}
	want := Usage{CPUNanos: 123456789, MemoryBytes: 8388608 - 1048576, CacheBytes: 4194304, LimitBytes: 32 << 20, ActiveFileBytes: 2097152}
	if u != want {
		t.Errorf("usage %+v, want %+v", u, want)
	}
	if kills, _ := g.OOMKills(); kills != 3 {
		t.Errorf("OOMKills = %d, want 3", kills)
	}
	if n := g.PidsRefused(); n != 4 {
		t.Errorf("PidsRefused = %d, want 4", n)
	}
	if got := g.Procs(); len(got) != 2 {
		t.Errorf("Procs = %v, want 20 and 21 once each", got)
	}
	if err := g.SetCPUShares(2); err != nil || read(t, h, "cpu/opendsec/sb/cpu.shares") != "2" {
		t.Errorf("SetCPUShares: %v", err)
	}
	if err := g.SetCPUQuota(50000, 0); err != nil || read(t, h, "cpu/opendsec/sb/cpu.cfs_quota_us") != "50000" {
		t.Errorf("SetCPUQuota: %v", err)
	}
	if err := h.BoundTasks(1000); err != nil || read(t, h, "pids/opendsec/pids.max") != "1000" {
		t.Errorf("BoundTasks: %v", err)
	}
	if got := h.Children("other-"); len(got) != 1 || got[0] != "other-sandbox" {
		t.Errorf("Children = %v", got)
	}
	if err := g.Reclaim(); err != nil || read(t, h, "memory/opendsec/sb/memory.force_empty") != "0" {
		t.Errorf("Reclaim: %v", err)
	}
}

func TestCPUWritesOnV2(t *testing.T) {
	h := fakeHost(t, V2, map[string]string{
		"opendsec/sb/cpu.max":    "max 100000\n",
		"opendsec/sb/cpu.weight": "100\n",
	})
	g := h.Group("sb")
	if err := g.SetCPUQuota(25000, 0); err != nil || read(t, h, "opendsec/sb/cpu.max") != "25000 100000" {
		t.Errorf("SetCPUQuota(25000): %v, %q", err, read(t, h, "opendsec/sb/cpu.max"))
	}
	if err := g.SetCPUQuota(-1, 50000); err != nil || read(t, h, "opendsec/sb/cpu.max") != "max 50000" {
		t.Errorf("SetCPUQuota(-1): %v, %q", err, read(t, h, "opendsec/sb/cpu.max"))
	}
	if err := g.SetCPUShares(2); err != nil || read(t, h, "opendsec/sb/cpu.weight") != "1" {
		t.Errorf("SetCPUShares(2): %v, %q; want weight 1", err, read(t, h, "opendsec/sb/cpu.weight"))
	}
	for shares, weight := range map[uint64]uint64{2: 1, 1024: 39, 262144: 10000} {
		if got := SharesToWeight(shares); got != weight {
			t.Errorf("SharesToWeight(%d) = %d, want %d", shares, got, weight)
		}
	}
}

func TestAGroupThatIsGoneReadsAsNothing(t *testing.T) {
	for _, v := range []Version{V1, V2} {
		h := fakeHost(t, v, nil)
		g := h.Group("gone")
		if g.PidsCurrent() != 0 || g.PidsRefused() != 0 || len(g.Procs()) != 0 || g.Frozen() || g.DiagnoseOOM() != "" {
			t.Errorf("%v: a missing cgroup reads as something", h)
		}
		if err := g.Thaw(); err != nil {
			t.Errorf("%v: Thaw of a missing cgroup: %v", h, err)
		}
		if err := g.Remove(); err != nil {
			t.Errorf("%v: Remove of a missing cgroup: %v", h, err)
		}
		if err := g.Reclaim(); err != nil {
			t.Errorf("%v: Reclaim of a missing cgroup: %v", h, err)
		}
		if _, err := g.ReadUsage(); err == nil {
			t.Errorf("%v: usage of a missing cgroup answered", h)
		}
	}
}

func TestPrepareOnV2EnablesTheControllersDownToTheParent(t *testing.T) {
	h := fakeHost(t, V2, map[string]string{
		"cgroup.controllers":     "cpuset cpu io memory pids\n",
		"cgroup.subtree_control": "memory\n",
	})
	h.Parent = "/system.slice/dsec-edge.service/sandboxes"
	// A fake tree has no kernel to create files in new directories, so
	// make each level's subtree_control as mkdir would.
	for _, rel := range []string{"system.slice", "system.slice/dsec-edge.service", "system.slice/dsec-edge.service/sandboxes"} {
		if err := os.MkdirAll(filepath.Join(h.Root, rel), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(h.Root, rel, "cgroup.subtree_control"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := h.Prepare(testLogger(), true); err != nil {
		t.Fatal(err)
	}
	if got := read(t, h, "system.slice/dsec-edge.service/sandboxes/cgroup.subtree_control"); got != "+cpu +memory +pids" {
		t.Errorf("the parent's subtree_control got %q, want the controllers written down to it", got)
	}
	if got := read(t, h, "cgroup.subtree_control"); got != "+cpu +pids" {
		t.Errorf("the root's subtree_control got %q, want cpu and pids added (memory was there)", got)
	}
}

func TestPrepareOnV2RefusesAMissingController(t *testing.T) {
	h := fakeHost(t, V2, map[string]string{"cgroup.controllers": "cpuset cpu io\n"})
	err := h.Prepare(testLogger(), true)
	if err == nil || !strings.Contains(err.Error(), "no memory controller") {
		t.Fatalf("Prepare without memory: %v; want a refusal naming memory", err)
	}
}

func TestParentMustBeAnAbsoluteCleanPath(t *testing.T) {
	for _, p := range []string{"opendsec", "/", "/a/../b", "/a/"} {
		if _, err := Detect(DefaultRoot, p); err == nil {
			t.Errorf("parent %q accepted", p)
		}
	}
}

func TestParseKeyed(t *testing.T) {
	got := ParseKeyed("low 0\nhigh 3\nmax 12\noom 2\noom_kill 1\nbroken\n\nx y\nneg -1\n")
	if got["oom_kill"] != 1 || got["max"] != 12 || got["high"] != 3 || len(got) != 5 {
		t.Fatalf("parsed %v", got)
	}
}

// A write a signal interrupts is made again, a bounded number of times;
// another error ends it at once.
func TestAgainOnEINTR(t *testing.T) {
	calls := 0
	err := againOnEINTR(10, func() error {
		calls++
		if calls < 3 {
			return &os.PathError{Op: "write", Path: "memory.force_empty", Err: syscall.EINTR}
		}
		return nil
	})
	if err != nil || calls != 3 {
		t.Fatalf("%d calls, %v; want 3 and nil", calls, err)
	}
	calls = 0
	err = againOnEINTR(4, func() error { calls++; return syscall.EINTR })
	if !errors.Is(err, syscall.EINTR) || calls != 4 {
		t.Fatalf("always interrupted: %d calls, %v", calls, err)
	}
	calls = 0
	if err := againOnEINTR(4, func() error { calls++; return syscall.EBUSY }); !errors.Is(err, syscall.EBUSY) || calls != 1 {
		t.Fatalf("another error: %d calls, %v", calls, err)
	}
}

package container

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/testutil"
)

func env(t *testing.T) backendtest.Env {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	return backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
}

func factory(runtime string) backendtest.Factory {
	return func(t *testing.T, stateDir string) backend.Backend {
		b, err := New(context.Background(), backend.Config{StateDir: stateDir, Log: testutil.Logger(t), Options: map[string]string{"runtime": runtime}})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Probe(context.Background()); err != nil {
			t.Fatal(err)
		}
		return b
	}
}

func TestConformanceCrun(t *testing.T) {
	backendtest.Run(t, factory("crun"), env(t))
}

func TestConformanceRunc(t *testing.T) {
	e := env(t)
	testutil.RequireBinary(t, "runc")
	backendtest.Run(t, factory("runc"), e)
}

func TestLimitsAppliedAndNothingLeaks(t *testing.T) {
	e := env(t)
	b := factory("crun")(t, t.TempDir())
	spec := backendtest.NewSpec(t, e, "aaaaaaaa")
	spec.Resources = backend.Resources{CPUCores: 0.5, MemoryMB: 300, Pids: 77}
	sb := backendtest.Attach(t, b, spec)
	ctx := context.Background()
	if _, err := b.Create(ctx, spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	if err := b.Start(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if err := sb.Link.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	cg := func(ctrl, file string) string {
		data, err := os.ReadFile(filepath.Join("/sys/fs/cgroup", ctrl, "opendsec", string(spec.ID), file))
		if err != nil {
			t.Fatalf("cgroup %s/%s: %v", ctrl, file, err)
		}
		return strings.TrimSpace(string(data))
	}
	if got := cg("memory", "memory.limit_in_bytes"); got != "314572800" {
		t.Errorf("memory limit %s, want 314572800", got)
	}
	if got := cg("cpu", "cpu.cfs_quota_us"); got != "50000" {
		t.Errorf("cpu quota %s, want 50000", got)
	}
	if got := cg("pids", "pids.max"); got != "77" {
		t.Errorf("pids.max %s, want 77", got)
	}
	// The limit is real inside: the 100 sleepers (which outlive the
	// command) fill the sandbox to pids.max, and the shell is refused the
	// rest. pids counts threads too, the agent's among them.
	r, err := sb.Proc.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{
		Args: []string{"sh", "-c", "for i in $(seq 1 100); do sleep 1000 >/dev/null 2>&1 & done; true"},
	}}))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(r.Msg.Stderr), "fork") {
		t.Errorf("100 processes started under pids.max 77 (stderr %q)", r.Msg.Stderr)
	}
	if n, _ := strconv.Atoi(cg("pids", "pids.current")); n < 70 || n > 77 {
		t.Errorf("pids.current %d; want the sandbox full, at pids.max 77 or just under", n)
	}
	if err := b.Destroy(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if dirs := b.(*Backend).cg.Group(string(spec.ID)).Dirs(); len(dirs) != 0 {
		t.Errorf("cgroups left: %v", dirs)
	}
	if mounts, _ := rootfs.MountsUnder(spec.Dir); len(mounts) != 0 {
		t.Errorf("mounts left: %v", mounts)
	}
	if st, _ := b.Status(ctx, spec.ID); st.State != backend.StateStopped {
		t.Errorf("status after destroy: %v", st.State)
	}
}

func TestNoSnapshotReason(t *testing.T) {
	b, err := New(context.Background(), backend.Config{StateDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	c := b.Capabilities()
	if c.Snapshot || c.SnapshotUnavailable == "" {
		t.Fatalf("capabilities %+v: want no snapshot, with a reason", c)
	}
}

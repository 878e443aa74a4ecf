package gvisor

import (
	"bytes"
	"context"
	"fmt"
	"github.com/opendsec/opendsec/internal/cgroups"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

func env(t *testing.T) backendtest.Env {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	return backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
}

func factory(t *testing.T, stateDir string) backend.Backend {
	b, err := New(context.Background(), backend.Config{StateDir: stateDir, Log: testutil.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Probe(context.Background()); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestConformance(t *testing.T) {
	backendtest.Run(t, factory, env(t))
}

func TestSnapshotAndRestore(t *testing.T) {
	e := env(t)
	// RunSnapshot skips backends that declare no snapshots; this one must.
	if c := factory(t, t.TempDir()).Capabilities(); !c.Snapshot {
		t.Fatalf("the gvisor backend declares no memory snapshots: %+v", c)
	}
	backendtest.RunSnapshot(t, factory, e)
}

// TestRestoreAppliesCPULimit checks that the CPU quota lifted for the
// checkpoint and the restore (runsc's own work, done in the sandbox's
// cgroup) is in force again on the restored source and on a copy.
func TestRestoreAppliesCPULimit(t *testing.T) {
	e := env(t)
	b := factory(t, t.TempDir()).(*Backend)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	src := backendtest.Start(t, b, e)
	ref := backend.SnapshotRef{ID: sandboxid.NewSnapshot("aaaaaaaa"), Dir: filepath.Join(t.TempDir(), "snap")}
	if err := os.MkdirAll(ref.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := src.Link.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Snapshot(ctx, src.ID, ref); err != nil {
		t.Fatal(err)
	}
	if err := src.Link.Reattach(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Restore(ctx, ref, src.Spec); err != nil {
		t.Fatalf("restore the source: %v", err)
	}
	spec := backendtest.NewSpec(t, e, "aaaaaaaa")
	backendtest.Attach(t, b, spec)
	if _, err := b.Restore(ctx, ref, spec); err != nil {
		t.Fatalf("restore a copy: %v", err)
	}
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	for _, s := range []*backend.Spec{src.Spec, spec} {
		bx, err := b.get(s.ID)
		if err != nil {
			t.Fatal(err)
		}
		quotaFile := filepath.Join("/sys/fs/cgroup/cpu", b.cg.Path(bx.runscID), "cpu.cfs_quota_us")
		if b.cg.Version == cgroups.V2 {
			quotaFile = filepath.Join(b.cg.Root, b.cg.Path(bx.runscID), "cpu.max")
		}
		data, err := os.ReadFile(quotaFile)
		if err != nil {
			t.Fatal(err)
		}
		data, _, _ = bytes.Cut(data, []byte(" ")) // v2: "QUOTA PERIOD"
		want := fmt.Sprint(int64(s.Resources.CPUCores * 100000))
		if got := strings.TrimSpace(string(data)); got != want {
			t.Fatalf("sandbox %s: cpu.cfs_quota_us = %s after restore, want %s", s.ID, got, want)
		}
	}
}

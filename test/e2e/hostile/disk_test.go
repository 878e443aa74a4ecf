package hostile

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// smallStateDisk puts the state of a cluster's edges (their writable
// layers among it) on one file system of sizeMB of its own, as a node
// whose disk is nearly full, and runs that many edges.
func smallStateDisk(t *testing.T, sizeMB, edges int) func(*embed.Config) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	return func(cfg *embed.Config) {
		img := filepath.Join(t.TempDir(), "state.img")
		disk := filepath.Join(t.TempDir(), "disk")
		if err := os.MkdirAll(disk, 0o700); err != nil {
			t.Fatal(err)
		}
		for _, args := range [][]string{
			{"truncate", "-s", strconv.Itoa(sizeMB) + "M", img},
			{"mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", img},
			{"mount", "-o", "loop", img, disk},
		} {
			if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
				t.Fatalf("%v: %v: %s", args, err, out)
			}
		}
		os.Remove(filepath.Join(disk, "lost+found"))
		// Registered before the cluster's own cleanup, so they run after it.
		t.Cleanup(func() { exec.Command("umount", "-l", disk).Run() })
		for i := 1; i <= edges; i++ {
			name := "edge"
			if i > 1 {
				name = "edge-" + strconv.Itoa(i)
			}
			dir := filepath.Join(cfg.StateDir, name)
			for _, d := range []string{dir, filepath.Join(disk, name)} {
				if err := os.MkdirAll(d, 0o700); err != nil {
					t.Fatal(err)
				}
			}
			if out, err := exec.Command("mount", "--bind", filepath.Join(disk, name), dir).CombinedOutput(); err != nil {
				t.Fatalf("bind %s: %v: %s", dir, err, out)
			}
			t.Cleanup(func() { exec.Command("umount", "-l", dir).Run() })
		}
		cfg.WarmLayers = -1
		cfg.Edges = edges
	}
}

// A node admits writable layers only while its disk can hold all of them
// written in full: one sandbox filling its layer gets ENOSPC in its own
// layer, its neighbour's data is intact, and new work that would not fit
// is refused with the reason.
func TestALayerFillingItsDiskLeavesItsNeighbourIntact(t *testing.T) {
	c := e2e.StartClusterWith(t, "", smallStateDisk(t, 1024, 1), "container")
	ctx := e2e.Ctx(t)
	spec := func(diskMB int64) *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 256, DiskMb: diskMB}}
	}
	filler, err := c.Client.Create(ctx, spec(600))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.Create(ctx, spec(600)); connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "disk") {
		t.Fatalf("a second 600 MiB layer on a 1 GiB disk: %v, want resource exhausted naming the disk", err)
	}
	neighbour, err := c.Client.Create(ctx, spec(250))
	if err != nil {
		t.Fatal(err)
	}
	// The filler writes past its own size.
	r := sh(t, filler, "dd if=/dev/zero of=/fill bs=1M count=700 2>&1; sync; echo done", 2*time.Minute)
	if out := string(r.Stdout); !strings.Contains(out, "No space left") || !strings.Contains(out, "done") {
		t.Fatalf("filling a 600 MiB layer with 700 MiB: %q, want ENOSPC inside the sandbox", out)
	}
	// The neighbour writes 200 MiB of its 250, and reads back the same
	// bytes after the host's page cache is dropped (from its disk).
	r = sh(t, neighbour, "dd if=/dev/urandom of=/data bs=1M count=200 2>/dev/null && sync && sha256sum /data", 2*time.Minute)
	sum := strings.Fields(string(r.Stdout))
	if r.ExitCode != 0 || len(sum) != 2 {
		t.Fatalf("the neighbour's write: exit %d %q %q", r.ExitCode, r.Stdout, r.Stderr)
	}
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		t.Fatal(err)
	}
	r = sh(t, neighbour, "sha256sum /data", time.Minute)
	if again := strings.Fields(string(r.Stdout)); len(again) != 2 || again[0] != sum[0] {
		t.Fatalf("the neighbour's data changed: %q then %q (%q)", sum, r.Stdout, r.Stderr)
	}
	answers(t, filler, 10*time.Second)
	// What the two may still write is promised: a layer that does not fit
	// in what is left is refused.
	if _, err := c.Client.Create(ctx, spec(100)); connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "disk") {
		t.Fatalf("a 100 MiB layer on the nearly full disk: %v, want resource exhausted naming the disk", err)
	}
	if err := filler.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.Create(ctx, spec(100)); err != nil {
		t.Fatalf("a 100 MiB layer once the filler is gone: %v", err)
	}
}

// Two edges on one disk (`dsec up --edges 2`) do not both promise its free
// space: a layer that fits beside what either edge admitted is refused
// with the other edge's share named, wherever the apiserver places it.
func TestEdgesSharingADiskPromiseItOnce(t *testing.T) {
	c := e2e.StartClusterWith(t, "", smallStateDisk(t, 1024, 2), "container")
	ctx := e2e.Ctx(t)
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 256, DiskMb: 400}}
	var made []*client.Sandbox
	for range 2 {
		sb, err := c.Client.Create(ctx, spec)
		if err != nil {
			t.Fatalf("a 400 MiB layer (%d made) on a 1 GiB disk: %v", len(made), err)
		}
		made = append(made, sb)
	}
	// Whichever edge the third goes to (and the apiserver tries the other
	// after a refusal), the disk holds only 800 of its 1024 MiB more.
	_, err := c.Client.Create(ctx, spec)
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "node disk full") {
		t.Fatalf("a third 400 MiB layer: %v, want resource exhausted naming the disk", err)
	}
	// Both write their layers full; their data stays whole.
	for _, sb := range made {
		r := sh(t, sb, "dd if=/dev/urandom of=/data bs=1M count=360 2>&1 && sync && echo written", 2*time.Minute)
		if !strings.Contains(string(r.Stdout), "written") {
			t.Fatalf("writing 360 MiB into a 400 MiB layer: %q %q", r.Stdout, r.Stderr)
		}
	}
	if err := made[0].Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.Create(ctx, spec); err != nil {
		t.Fatalf("a 400 MiB layer once one is gone: %v", err)
	}
}

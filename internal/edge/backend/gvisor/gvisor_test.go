package gvisor

import (
	"bytes"
	"context"
	"fmt"
	"github.com/opendsec/opendsec/internal/cgroups"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
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

// factory is the backend on Debian's runsc alone.
func factory(t *testing.T, stateDir string) backend.Backend {
	return factoryWith(nil)(t, stateDir)
}

// newerFactory is the backend with every new sandbox on the newer runsc
// (runsc-newer-for=all).
func newerFactory(t *testing.T, stateDir string) backend.Backend {
	return factoryWith(map[string]string{"runsc-network": testutil.NewerRunsc(t), NewerForOption: NewerForAll})(t, stateDir)
}

func factoryWith(options map[string]string) backendtest.Factory {
	return func(t *testing.T, stateDir string) backend.Backend {
		b, err := New(context.Background(), backend.Config{StateDir: stateDir, Log: testutil.Logger(t), Options: options})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Probe(context.Background()); err != nil {
			t.Fatal(err)
		}
		if _, ok := b.(*Backend).newer(); !ok && options["runsc-network"] != "" {
			t.Fatalf("the newer runsc %s did not pass the probe", options["runsc-network"])
		}
		return b
	}
}

// releases are the two runsc releases a node may run sandboxes on.
var releases = []struct {
	name    string
	factory backendtest.Factory
}{{"debian", factory}, {"newer", newerFactory}}

func TestConformance(t *testing.T) {
	e := env(t)
	for _, r := range releases {
		t.Run(r.name, func(t *testing.T) { backendtest.Run(t, r.factory, e) })
	}
}

func TestSnapshotAndRestore(t *testing.T) {
	e := env(t)
	for _, r := range releases {
		t.Run(r.name, func(t *testing.T) {
			// RunSnapshot skips backends that declare no snapshots; this one must.
			if c := r.factory(t, t.TempDir()).Capabilities(); !c.Snapshot {
				t.Fatalf("the gvisor backend declares no memory snapshots: %+v", c)
			}
			backendtest.RunSnapshot(t, r.factory, e)
		})
	}
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

// TestWritableLayerIsBoundedByDiskMB: with every sandbox on the newer
// runsc, a sandbox's writes go to a file system of disk_mb backed by the
// node's disk: a fill gets ENOSPC inside and the sandbox answers on.
func TestWritableLayerIsBoundedByDiskMB(t *testing.T) {
	e := env(t)
	b := newerFactory(t, t.TempDir())
	if !b.Capabilities().DiskFile {
		t.Fatalf("on the newer runsc the writable layer is a file on the node's disk, but the backend does not say so: %+v", b.Capabilities())
	}
	spec := backendtest.NewSpec(t, e, sandboxid.NewNodeID())
	spec.DiskMB = 64
	sb := backendtest.StartSpec(t, b, spec)
	out := sb.Sh(t, "dd if=/dev/urandom of=/root/fill bs=1M count=100 2>&1 | grep -o 'No space left on device' | head -1; sync; df -m / | tail -1")
	if !strings.Contains(out, "No space left on device") {
		t.Fatalf("100 MiB into a 64 MiB writable layer: %q", out)
	}
	fields := strings.Fields(strings.Split(strings.TrimSpace(out), "\n")[1])
	if size, err := strconv.Atoi(fields[1]); err != nil || size > 64 || size < 50 {
		t.Fatalf("df / inside: %q, want the layer's 64 MiB", out)
	}
	// What was written is on the node's disk, in the unlinked file behind
	// the layer that runsc made in the sandbox's directory, and no more
	// than the layer holds.
	if held := filestoreBytes(t, b.(*Backend), spec); held < 40<<20 || held > 72<<20 {
		t.Fatalf("the file behind a filled 64 MiB layer holds %d MiB of the node's disk", held>>20)
	}
	sb.Sh(t, "rm /root/fill && echo again > /root/after")
	if got := sb.Sh(t, "cat /root/after"); got != "again\n" {
		t.Fatalf("after the fill: %q", got)
	}
}

// filestoreBytes is what the files behind spec's writable layer hold on
// the node's disk: runsc's unlinked filestores in the sandbox's directory,
// found among its processes' open files.
func filestoreBytes(t *testing.T, b *Backend, spec *backend.Spec) int64 {
	t.Helper()
	bx, err := b.get(spec.ID)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[[2]uint64]bool{}
	var n int64
	for _, pid := range b.cg.Group(bx.runscID).Procs() {
		fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
		for _, fd := range fds {
			target, err := os.Readlink(fd)
			if err != nil || !strings.HasPrefix(target, filepath.Join(spec.Dir, "runsc-filestore-")) {
				continue
			}
			var st syscall.Stat_t
			if err := syscall.Stat(fd, &st); err == nil && !seen[[2]uint64{st.Dev, st.Ino}] {
				seen[[2]uint64{st.Dev, st.Ino}] = true
				n += st.Blocks * 512
			}
		}
	}
	if len(seen) == 0 {
		t.Fatalf("no runsc filestore in %s among the sandbox's open files", spec.Dir)
	}
	return n
}

// TestNewBoxRelease: which runsc a new sandbox runs on, and where its
// writable layer lives, by the node's newer runsc and runsc-newer-for.
func TestNewBoxRelease(t *testing.T) {
	for _, c := range []struct {
		name             string
		newer, all, net  bool
		wantModern       bool
		wantDiskMB       int64
		wantDiskFileCaps bool
	}{
		{"no newer runsc", false, false, false, false, 0, false},
		{"no newer runsc, networked", false, false, true, false, 0, false},
		{"network: without one", true, false, false, false, 0, false},
		{"network: with one", true, false, true, true, 0, false},
		{"all: without one", true, true, false, true, 100, true},
		{"all: with one", true, true, true, true, 100, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			opts := map[string]string{}
			if c.newer {
				opts["runsc-network"] = "/opt/runsc-net"
			}
			if c.all {
				opts[NewerForOption] = NewerForAll
			}
			be, err := New(context.Background(), backend.Config{StateDir: t.TempDir(), Options: opts})
			if err != nil {
				t.Fatal(err)
			}
			b := be.(*Backend)
			spec := &backend.Spec{ID: sandboxid.New(sandboxid.NewNodeID()), Dir: "/state/sb", Resources: backend.Resources{DiskMB: 100}}
			if c.net {
				spec.NetNS = "/run/netns/x"
			}
			bx := b.newBox(spec)
			if bx.modern != c.wantModern || bx.diskMB != c.wantDiskMB {
				t.Fatalf("modern %v, disk %d MiB; want %v, %d", bx.modern, bx.diskMB, c.wantModern, c.wantDiskMB)
			}
			if got := b.Capabilities().DiskFile; got != c.wantDiskFileCaps {
				t.Fatalf("DiskFile %v, want %v", got, c.wantDiskFileCaps)
			}
			rt := b.rtOf(*bx)
			want := "root:memory"
			if c.wantDiskMB > 0 {
				want = "root:dir=/state/sb,size=100m"
			}
			if got := rt.overlay(*bx); got != want {
				t.Fatalf("overlay %q, want %q", got, want)
			}
		})
	}
	if _, err := New(context.Background(), backend.Config{StateDir: t.TempDir(), Options: map[string]string{NewerForOption: "some"}}); err == nil || !strings.Contains(err.Error(), `want "network" or "all"`) {
		t.Fatalf("a bad runsc-newer-for: %v", err)
	}
}

// TestFailedCallCarriesRunscsReason: a runsc call that fails says why in
// its error, from runsc's own log, on both releases.
func TestFailedCallCarriesRunscsReason(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	for _, r := range releases {
		t.Run(r.name, func(t *testing.T) {
			b := r.factory(t, t.TempDir()).(*Backend)
			dir := t.TempDir()
			bx := box{runscID: "reason-test", dir: dir}
			rt := b.legacy()
			if r.name == "newer" {
				rt, _ = b.newer()
			}
			err := b.launch(context.Background(), rt, b.logFile(dir), bx, "restore", "--detach", "--bundle", filepath.Join(dir, "missing"), "--image-path", dir, bx.runscID)
			if err == nil || !strings.Contains(err.Error(), "config.json") {
				t.Fatalf("a restore from a bundle that does not exist: %v, want runsc's reason naming config.json", err)
			}
		})
	}
}

func TestLastConsoleLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "runsc.log.console")
	if err := os.WriteFile(path, []byte("an earlier call's line\nsecond call: starting\nsecond call: it failed\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		offset int64
		want   string
	}{
		{0, "second call: it failed"},
		{int64(len("an earlier call's line\n")), "second call: it failed"},
		{1 << 20, ""},
	} {
		if got := lastConsoleLine(path, c.offset); got != c.want {
			t.Errorf("from %d: %q, want %q", c.offset, got, c.want)
		}
	}
	if got := lastConsoleLine(filepath.Join(t.TempDir(), "none"), 0); got != "" {
		t.Errorf("no console file: %q", got)
	}
}

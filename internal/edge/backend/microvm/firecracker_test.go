package microvm

import (
	"context"
	"errors"
	"log/slog"
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

// testFirecracker is the driver on the binary make deps fetched; it needs
// root and /dev/kvm (Firecracker has no emulator).
func testFirecracker(t *testing.T) *Firecracker {
	t.Helper()
	testutil.RequireRoot(t)
	bin := testutil.FirecrackerBinary(t)
	guest := testutil.GuestKernelDir(t)
	kvm, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("Firecracker needs /dev/kvm: %v", err)
	}
	kvm.Close()
	return &Firecracker{Binary: bin, Kernel: filepath.Join(guest, "vmlinux"), Init: testutil.VMInitBinary(t), Modules: filepath.Join(guest, "modules")}
}

// The driver's API calls on the real Firecracker binary, through the
// backend's own paths: a refused configuration names its fault; a guest
// is configured and started (its disks and vsock socket named relative to
// its directory), paused and resumed (Status follows), snapshotted, and
// a copy is loaded from the snapshot in a directory of its own, where it
// opens its own disks. Whether the guest boots does not matter here (it
// does not under a paravirtual KVM): these are the VMM's calls.
func TestFirecrackerAPIOnTheRealBinary(t *testing.T) {
	f := testFirecracker(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := &Backend{log: slog.New(slog.DiscardHandler), fc: f, boxes: map[sandboxid.ID]*box{}}
	src := sandboxid.ID("fc-api-source")
	dir := filepath.Join(t.TempDir(), string(src), "vm")
	os.MkdirAll(dir, 0o700)
	bx := &box{Dir: dir, VMM: vmmFirecracker}
	b.boxes[src] = bx
	g := Guest{VMM: vmmFirecracker, MemoryMB: 128, SMP: 1, Initrd: filepath.Join(dir, "initrd.cpio"),
		RootDisk: filepath.Join(dir, "root.ext4"), WritableDisk: filepath.Join(dir, "rw.ext4"), AgentSocket: filepath.Join(t.TempDir(), "edge.sock")}
	if err := f.WriteInitramfs(g.Initrd, nil); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{g.RootDisk, g.WritableDisk} {
		if err := NewWritableDisk(ctx, d, 16); err != nil {
			t.Fatal(err)
		}
	}
	if err := bx.saveGuest(g); err != nil {
		t.Fatal(err)
	}
	vm, err := f.start(ctx, bx, g)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bx.kill(0) })
	if i, err := vm.api.info(ctx); err != nil || i.State != "Not started" || !strings.HasPrefix(i.VMMVersion, "1.") {
		t.Fatalf("a new Firecracker: %+v %v", i, err)
	}
	var fe *fcError
	if err := vm.api.setMachine(ctx, fcMachineConfig{VCPUCount: 0, MemSizeMiB: 128}); !errors.As(err, &fe) || fe.Status != 400 || fe.Fault == "" {
		t.Fatalf("0 vCPUs: %v, want Firecracker's 400 with its fault", err)
	}
	if err := f.configure(ctx, vm.api, g); err != nil {
		t.Fatalf("configure and start: %v; console: %s", err, consoleTail(dir))
	}
	state := func(id sandboxid.ID) backend.State {
		t.Helper()
		st, err := b.Status(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return st.State
	}
	if got := state(src); got != backend.StateRunning {
		t.Fatalf("after InstanceStart: %v", got)
	}
	if err := b.Pause(ctx, src); err != nil {
		t.Fatal(err)
	}
	if got := state(src); got != backend.StatePaused {
		t.Fatalf("after Pause: %v", got)
	}
	if err := b.Resume(ctx, src); err != nil {
		t.Fatal(err)
	}
	if got := state(src); got != backend.StateRunning {
		t.Fatalf("after Resume: %v", got)
	}
	ref := backend.SnapshotRef{ID: sandboxid.NewSnapshot("aaaaaaaa"), Dir: t.TempDir()}
	if _, err := b.Snapshot(ctx, src, ref); err != nil {
		t.Fatalf("snapshot: %v; console: %s", err, consoleTail(dir))
	}
	if fi, err := os.Stat(filepath.Join(ref.Dir, "mem")); err != nil || fi.Size() != 128<<20 {
		t.Fatalf("the snapshot's memory file: %v %v", fi, err)
	}
	for _, f := range []string{"state", "rw.ext4", "root.ext4", "guest.json"} {
		if _, err := os.Stat(filepath.Join(ref.Dir, f)); err != nil {
			t.Fatalf("the snapshot lacks %s: %v", f, err)
		}
	}
	if got := state(src); got != backend.StateRunning {
		t.Fatalf("the source after the snapshot: %v", got)
	}
	spec := &backend.Spec{ID: "fc-api-copy", Dir: filepath.Join(t.TempDir(), "copy"), RunDir: t.TempDir()}
	if _, err := b.Restore(ctx, ref, spec); err != nil {
		t.Fatalf("restore: %v; console: %s", err, consoleTail(filepath.Join(spec.Dir, "vm")))
	}
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	if got := state(spec.ID); got != backend.StateRunning {
		t.Fatalf("the copy: %v", got)
	}
	// The copy runs in its own directory and opened its own disks: the
	// snapshot names them relative to it.
	cb, _ := b.get(spec.ID)
	pid, ok := cb.pid()
	if !ok {
		t.Fatal("the copy's Firecracker is not running")
	}
	if cwd, _ := os.Readlink(filepathProc(pid, "cwd")); cwd != cb.Dir {
		t.Fatalf("the copy runs in %q, want %q", cwd, cb.Dir)
	}
	fds, _ := filepath.Glob(filepathProc(pid, "fd/*"))
	opened := map[string]bool{}
	for _, fd := range fds {
		if p, err := os.Readlink(fd); err == nil {
			opened[p] = true
		}
	}
	if !opened[filepath.Join(cb.Dir, "rw.ext4")] || opened[g.WritableDisk] {
		t.Fatalf("the copy's open files: %v", opened)
	}
	// Its console is the FIFO, held read-write and non-blocking (see
	// fcConsoleFIFO), for its output and its log alike. (Firecracker also
	// makes its standard output non-blocking itself; the stand-in VMM of
	// TestConsoleIsBoundedAndNeverStopsItsVMM tests the edge's handover.)
	for _, fd := range []string{"1", "2"} {
		if p, _ := os.Readlink(filepathProc(pid, "fd/"+fd)); p != filepath.Join(cb.Dir, fcConsoleFIFO) {
			t.Fatalf("the copy's fd %s is %q, want its console FIFO", fd, p)
		}
		info, _ := os.ReadFile(filepathProc(pid, "fdinfo/"+fd))
		var flags int
		for _, l := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(l, "flags:"); ok {
				flags64, _ := strconv.ParseInt(strings.TrimSpace(v), 8, 64)
				flags = int(flags64)
			}
		}
		if flags&syscall.O_ACCMODE != syscall.O_RDWR || flags&syscall.O_NONBLOCK == 0 {
			t.Fatalf("the copy's console (fd %s) has flags %o, want read-write and non-blocking", fd, flags)
		}
	}
	if l, _ := os.Readlink(filepath.Join(cb.Dir, "v.sock_1024")); l != filepath.Join(spec.RunDir, "edge.sock") {
		t.Fatalf("the copy's agent socket leads to %q", l)
	}
	for _, id := range []sandboxid.ID{spec.ID, src} {
		if err := b.Destroy(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := cb.pid(); ok {
		t.Fatal("the copy's Firecracker outlived Destroy")
	}
}

func filepathProc(pid int, rest string) string {
	return filepath.Join("/proc", strconv.Itoa(pid), rest)
}

// TestFirecrackerProbeDecides: with a Firecracker binary configured, the
// backend tries it first and uses it only if its probe guest boots. Where
// it boots, the conformance suite runs on it; where it does not (this
// workplace's kvm_pvm), the backend runs on QEMU and says why not
// Firecracker.
func TestFirecrackerProbeDecides(t *testing.T) {
	f := testFirecracker(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	q := testQEMU(t)
	newBackend := func(t *testing.T, stateDir string) backend.Backend {
		b, err := New(context.Background(), backend.Config{StateDir: stateDir, Log: testutil.Logger(t), Options: map[string]string{
			"qemu": q.Binary, "guest": filepath.Dir(q.Kernel), "init": q.Init, "firecracker": f.Binary,
		}})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Probe(context.Background()); err != nil {
			t.Fatal(err)
		}
		return b
	}
	b := newBackend(t, t.TempDir()).(*Backend)
	desc := b.Describe()
	t.Logf("microvm with Firecracker configured: %s", desc)
	if b.probe.Driver == "firecracker" {
		backendtest.Run(t, newBackend, backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true})
		return
	}
	if !strings.HasPrefix(desc, "qemu microvm") || !strings.Contains(desc, "; not firecracker: ") {
		t.Fatalf("Firecracker's probe failed and the node's description does not say so: %q", desc)
	}
	t.Skipf("Firecracker's guests do not boot on this host, so its boot tests cannot run: %s", b.probe.Skipped[0])
}

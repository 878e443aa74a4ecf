package microvm

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/testutil"
)

// readNewc parses a newc archive: name -> (mode, data).
func readNewc(t *testing.T, b []byte) map[string]struct {
	mode uint64
	data string
} {
	t.Helper()
	out := map[string]struct {
		mode uint64
		data string
	}{}
	field := func(h []byte, i int) uint64 {
		v, err := strconv.ParseUint(string(h[6+8*i:14+8*i]), 16, 32)
		if err != nil {
			t.Fatalf("header field %d: %v", i, err)
		}
		return v
	}
	align := func(n int) int { return (n + 3) &^ 3 }
	for off := 0; ; {
		h := b[off : off+110]
		if string(h[:6]) != "070701" {
			t.Fatalf("bad magic at %d: %q", off, h[:6])
		}
		size, namesize := int(field(h, 6)), int(field(h, 11))
		name := string(b[off+110 : off+110+namesize-1])
		off = align(off + 110 + namesize)
		if name == "TRAILER!!!" {
			return out
		}
		out[name] = struct {
			mode uint64
			data string
		}{field(h, 1), string(b[off : off+size])}
		off = align(off + size)
	}
}

func TestInitramfsHasFilesParentsAndConsole(t *testing.T) {
	var buf bytes.Buffer
	err := WriteInitramfs(&buf, []InitFile{{Path: "/init", Mode: 0o755, Data: []byte("#!")}, {Path: "/lib/modules/a.ko", Mode: 0o644, Data: []byte("12345")}})
	if err != nil {
		t.Fatal(err)
	}
	got := readNewc(t, buf.Bytes())
	want := map[string]uint64{"init": typeFile | 0o755, "lib": typeDir | 0o755, "lib/modules": typeDir | 0o755, "lib/modules/a.ko": typeFile | 0o644, "dev": typeDir | 0o755, "dev/console": typeChar | 0o600}
	for name, mode := range want {
		if got[name].mode != mode {
			t.Errorf("%s: mode %o, want %o", name, got[name].mode, mode)
		}
	}
	if got["lib/modules/a.ko"].data != "12345" || got["init"].data != "#!" || len(got) != len(want) {
		t.Fatalf("entries: %v", got)
	}
	// The kernel's own unpacker agrees: cpio lists the same names.
	if cpio, err := exec.LookPath("cpio"); err == nil {
		cmd := exec.Command(cpio, "-it", "--quiet")
		cmd.Stdin = bytes.NewReader(buf.Bytes())
		out, err := cmd.Output()
		if err != nil || len(strings.Fields(string(out))) != len(want) {
			t.Fatalf("cpio -it: %q, %v", out, err)
		}
	}
	if err := WriteInitramfs(&buf, []InitFile{{Path: "../x"}}); err == nil {
		t.Fatal("a relative path was packed")
	}
}

// TestQEMUProbeBoot boots the probe guest: Debian's cloud kernel under
// QEMU's microvm machine, the init loading the virtio modules and writing
// its marker to the agent's virtio-serial port. On this machine KVM opens
// but does not boot a stock kernel: the probe says so and uses TCG.
func TestQEMUProbeBoot(t *testing.T) {
	qemu := testutil.RequireBinary(t, "qemu-system-x86_64")
	guest := filepath.Join(testutil.RepoRoot(t), ".cache", "guest")
	if _, err := os.Stat(filepath.Join(guest, "vmlinux")); err != nil {
		testutil.Missing(t, "no guest kernel in %s (make deps runs scripts/guest-kernel.sh): %v", guest, err)
	}
	init := filepath.Join(t.TempDir(), "dsec-vminit")
	build := exec.Command("go", "build", "-trimpath", "-o", init, "./cmd/dsec-vminit")
	build.Dir = testutil.RepoRoot(t)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build dsec-vminit: %v\n%s", err, out)
	}
	q := &QEMU{Binary: qemu, Kernel: filepath.Join(guest, "vmlinux"), Init: init, Modules: filepath.Join(guest, "modules")}
	res, err := q.Probe(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("probe: %s with %s in %v; not used: %v", res.Driver, res.Accel, res.Boot, res.Skipped)
	if res.Accel != "tcg" && res.Accel != "kvm" || res.Boot <= 0 {
		t.Fatalf("probe result %+v", res)
	}
}

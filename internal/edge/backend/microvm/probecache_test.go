package microvm

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
)

// The probe's answer is reused only for the same boot and the same parts:
// a changed kernel (or QEMU, init) makes the next start probe again.
func TestProbeAnswerIsKeptForTheSameParts(t *testing.T) {
	dir := t.TempDir()
	part := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(name), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	b := &Backend{cfg: backend.Config{StateDir: dir}, qemu: &QEMU{Binary: part("qemu"), Kernel: part("vmlinuz"), Init: part("init")}}
	key, err := b.probeKey()
	if err != nil {
		t.Fatal(err)
	}
	if b.cachedProbe(key) != nil {
		t.Fatal("an answer before any probe")
	}
	want := &ProbeResult{Driver: "qemu", Accel: "tcg", Boot: 1700 * time.Millisecond, Skipped: []string{"kvm: no"}}
	b.saveProbe(key, want)
	if got := b.cachedProbe(key); got == nil || got.Driver != "qemu" || got.Accel != "tcg" || got.Boot != want.Boot {
		t.Fatalf("kept answer: %+v", got)
	}
	later := time.Now().Add(time.Minute)
	if err := os.Chtimes(b.qemu.Kernel, later, later); err != nil {
		t.Fatal(err)
	}
	key2, err := b.probeKey()
	if err != nil {
		t.Fatal(err)
	}
	if key2 == key || b.cachedProbe(key2) != nil {
		t.Fatal("a changed kernel reused the earlier answer")
	}
}

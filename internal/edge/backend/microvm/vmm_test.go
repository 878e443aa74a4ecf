package microvm

import (
	"context"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// A guest's recorded VMM picks its driver; a Firecracker guest on an edge
// started without a Firecracker binary is still its driver's (to pause or
// read its console through its socket) but is not started again; a VMM
// this release does not know is refused by name.
func TestVMMOfAGuest(t *testing.T) {
	b := &Backend{log: slog.New(slog.DiscardHandler), qemu: &QEMU{Binary: "qemu-system-x86_64"}}
	dir := filepath.Join(t.TempDir(), "sandbox-1", "vm")
	for vmmID, want := range map[string]string{"": "QEMU", vmmFirecracker: "Firecracker"} {
		v, err := b.vmmOf(&box{Dir: dir, VMM: vmmID})
		if err != nil || v.title() != want || v.id() != vmmID {
			t.Fatalf("VMM %q: %v %v; want %s", vmmID, v, err, want)
		}
	}
	v, _ := b.vmmOf(&box{Dir: dir, VMM: vmmFirecracker})
	err := v.launch(context.Background(), &box{Dir: dir, VMM: vmmFirecracker}, Guest{})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "sandbox-1 runs on Firecracker") || !strings.Contains(err.Error(), "--microvm-firecracker") {
		t.Fatalf("launch without a Firecracker binary: %v", err)
	}
	if _, err := b.vmmOf(&box{Dir: dir, VMM: "cloud-hypervisor"}); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), `"cloud-hypervisor"`) {
		t.Fatalf("an unknown VMM: %v", err)
	}
	if got := b.booting(); got.title() != "QEMU" {
		t.Fatalf("new guests with no Firecracker: %s", got.title())
	}
	b.fc = &Firecracker{Binary: "firecracker"}
	b.probe = &ProbeResult{Driver: "firecracker", Accel: "kvm"}
	if got := b.booting(); got.title() != "Firecracker" {
		t.Fatalf("new guests after Firecracker's probe boot: %s", got.title())
	}
	if m := b.booting().modules(true); !strings.Contains(strings.Join(m, " "), "vmw_vsock_virtio_transport") || m[len(m)-1] != "virtio_net" {
		t.Fatalf("a Firecracker guest's modules with a network: %v", m)
	}
}

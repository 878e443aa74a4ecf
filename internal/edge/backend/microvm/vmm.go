package microvm

import (
	"context"
	"log/slog"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// vmm is a Driver as the backend uses it for one guest: how the guest is
// booted, paused, resumed, snapshotted and restored, how the backend tells
// whether it is paused, and where its console is. QEMU and Firecracker
// implement it; a box's VMM names which one its guest runs on (vmmOf), and
// no other code asks which.
type vmm interface {
	Driver
	// title names the VMM in messages ("QEMU").
	title() string
	// id is what Guest.VMM and box.VMM hold for its guests.
	id() string
	// modules are the kernel modules its guests load, in order, with the
	// network's when net.
	modules(net bool) []string
	// sharesMemory says a guest's RAM is a file the backend maps shared
	// and copies for a snapshot (QEMU), rather than one the VMM writes.
	sharesMemory() bool
	// launch starts the VMM of g in bx's directory, outliving the edge,
	// with its pid in bx.pidFile().
	launch(ctx context.Context, bx *box, g Guest) error
	pause(ctx context.Context, bx *box) error
	resume(ctx context.Context, bx *box) error
	// paused says the VMM answers that the guest's vCPUs are stopped.
	paused(ctx context.Context, bx *box) bool
	// snapshot writes the guest's state and memory and the files a copy
	// needs to ref.Dir; the source runs on.
	snapshot(ctx context.Context, bx *box, g Guest, ref backend.SnapshotRef) (*backend.SnapshotInfo, error)
	// restore starts a copy, g, in bx from the snapshot in ref (the caller
	// made the copy's disks), and leaves it running; started runs as soon
	// as its VMM runs, before the copy takes its state in (the CPU limit),
	// and ends the copy if it fails.
	restore(ctx context.Context, bx *box, g Guest, ref backend.SnapshotRef, started func() error) error
	// consoleTail is the end of the guest's console.
	consoleTail(ctx context.Context, bx *box, g Guest) string
	// reattach takes a running guest back after an edge restart.
	reattach(bx *box, log *slog.Logger)
	// diagnose says what the VMM reports of a guest whose agent went
	// silent (diagnose.go).
	diagnose(ctx context.Context, bx *box) string
}

var (
	_ vmm = (*QEMU)(nil)
	_ vmm = (*Firecracker)(nil)
)

// vmmOf is the VMM bx's guest runs on. A Firecracker guest is served
// without a Firecracker binary configured (its API socket is enough)
// except to start one.
func (b *Backend) vmmOf(bx *box) (vmm, error) {
	switch bx.VMM {
	case "":
		return b.qemu, nil
	case vmmFirecracker:
		if b.fc != nil {
			return b.fc, nil
		}
		return &Firecracker{Log: b.log}, nil
	}
	return nil, errdefs.FailedPrecondition("microvm: a guest on VMM %q, which this release does not know", bx.VMM)
}

// booting is the VMM new guests run on: the one the probe boot chose.
func (b *Backend) booting() vmm {
	if b.fc != nil && b.probe != nil && b.probe.Driver == b.fc.Name() {
		return b.fc
	}
	return b.qemu
}

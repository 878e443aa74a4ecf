// Package vm is the vm backend [ours]: each sandbox a full QEMU virtual
// machine on the q35 machine, with firmware (SeaBIOS), ACPI and its
// virtio devices on PCI, booting the node's guest kernel with the image as
// its root disk. Where the image has systemd the guest runs it as PID 1,
// with the agent as a unit of it (cmd/dsec-vminit); an image without an
// init of its own runs the agent as init, as a microVM does.
//
// It is the microvm backend's machinery on another machine: disks, the
// agent's virtio-serial port, memory snapshots and forks, templates, the
// network's TAP and pause are the same code (internal/edge/backend/
// microvm), so one conformance suite covers both.
package vm

import (
	"context"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
)

// Name is the backend's name.
const Name = microvm.VMName

// New makes the backend; it takes the microvm backend's options but
// "firecracker".
func New(ctx context.Context, cfg backend.Config) (backend.Backend, error) {
	return microvm.NewOnMachine(ctx, cfg, Name, microvm.MachineQ35)
}

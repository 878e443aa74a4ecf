// Package microvm is the backend that runs each sandbox in a virtual
// machine of its own [ours: the paper's fork-with-memory figures come from
// such VMs]. A Driver is the hypervisor seam: QEMU's microvm machine
// (TCG, or KVM where a probe boot succeeds) and Firecracker (tried first
// when a binary is configured; used only where its probe guest boots).
// Each also carries what the backend does to one guest on it (vmm.go:
// launch, pause, resume, snapshot, restore, its paused state, console);
// the backend picks it by the guest's recorded VMM and asks no other way.
//
// Built: the guest kernel from Debian's packages
// (scripts/guest-kernel.sh), the guest's init (cmd/dsec-vminit), the
// initramfs writer, the probe boots, which decide the driver and the
// accelerator from a boot that reaches userspace (never from "/dev/kvm
// opens"), and the agent in the guest serving the edge's link over
// virtio-serial (QEMU joins the port to the link's Unix socket;
// agentlink.VirtioPrefix) or vsock (Firecracker joins the host's port to
// a Unix socket linked to the edge's; agentlink.VsockPrefix), and the
// guest's root: the image's tree as a read-only ext4 disk (shared) under
// an overlay whose upper layer is the sandbox's own sparse ext4 disk,
// which bounds what it writes, and the Backend (backend.go): the VMM runs
// in its own session (it outlives the edge and dials the edge's new
// socket after a restart), root images built once per image, pause
// (QMP stop/cont; PATCH /vm), with the guest's clock stepped to the
// node's by the agent after a resume (headers.HostTime), and memory
// snapshots (snapshot.go): under QEMU, guest RAM in a shared-memory file,
// device state only through QEMU (x-ignore-shared), copies mapping the
// snapshot's RAM copy-on-write; under Firecracker, its own snapshot files,
// copies loading the memory file (mapped privately by Firecracker). QEMU
// passes the conformance and snapshot suites under TCG and forks through
// the API. Firecracker's API calls are tested on the real binary; its
// guests do not boot on these machines (kvm_pvm), so its boot, agent and
// fork paths are unverified.
// Networking (net.go): the sandbox network's namespace, with the guest
// on a TAP joined to its eth0; the network policy suite passes on QEMU.
// Not yet: snapshots of a guest with a network.
package microvm

import (
	"context"
	"time"
)

// Driver is a hypervisor.
type Driver interface {
	Name() string
	// Probe boots a tiny guest to its init's marker, in scratch directory
	// dir, and says with which accelerator and how fast; an error says why
	// no guest boots here.
	Probe(ctx context.Context, dir string) (*ProbeResult, error)
}

// ProbeResult is how a probe boot went.
type ProbeResult struct {
	Driver string
	// Accel is the accelerator that booted the guest ("kvm", "tcg").
	Accel string
	// Boot is the time from the hypervisor's start to the marker on the
	// agent's port.
	Boot time.Duration
	// Skipped says why a faster accelerator was not used (e.g. "kvm: the
	// probe guest did not boot: ...").
	Skipped []string
}

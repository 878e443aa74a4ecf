package main

import (
	"flag"
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/edge/backend/vm"
)

// registry lists the backends built into this binary; this is the one
// place they are registered.
func registry() *backend.Registry {
	r := &backend.Registry{}
	r.Register(container.Name, container.New)
	r.Register(gvisor.Name, gvisor.New)
	r.Register(microvm.Name, microvm.New)
	r.Register(vm.Name, vm.New)
	return r
}

// backendFlags are the flags of every backend's options, the same for
// dsec up and dsec edge.
type backendFlags struct {
	runtime, platform, runscNet *string
	newerFor                    *string
	guest, vmInit, firecracker  *string
	templates                   *string
	cgroupParent                *string
	vmDevices                   *string
}

func addBackendFlags(fs *flag.FlagSet) *backendFlags {
	return &backendFlags{
		runtime:      fs.String("runtime", "crun", "OCI runtime of the container backend: crun or runc"),
		platform:     fs.String("gvisor-platform", "ptrace", "platform of Debian's runsc, which runs sandboxes the newer runsc does not: ptrace, or systrap/kvm where runsc and the host have them"),
		runscNet:     fs.String("gvisor-runsc-network", "", "the newer runsc (systrap), for gvisor sandboxes with a network, which it can snapshot and fork (default: runsc-net next to dsec, built by make; \"none\" for none)"),
		newerFor:     fs.String("gvisor-newer-runsc-for", "network", "which new gvisor sandboxes run on the newer runsc: \"network\" (those with a network) or \"all\" (every one, with its writable layer bounded by disk_mb on the node's disk instead of in memory; a fork bomb costs its sentry more node memory there: docs/design.md)"),
		guest:        fs.String("microvm-guest", "", "directory of the microvm backend's guest kernel (default: .cache/guest of the tree dsec was built in; scripts/guest-kernel.sh fills it)"),
		vmInit:       fs.String("microvm-init", "", "the microvm guest's init, dsec-vminit (default: next to dsec, built by make)"),
		cgroupParent: fs.String("cgroup-parent", "", "the sandboxes' parent cgroup, a path from the cgroup root (default /opendsec; under systemd the edge unit's delegated subtree, as deploy/quickstart.sh sets it)"),
		templates:    fs.String("microvm-templates", "on", "\"on\": a node boots the first microVM of an image and shape once, snapshots it and creates every later one by restoring that snapshot (a fifth of a boot's time under TCG); \"off\": every microVM boots"),
		vmDevices:    fs.String("vm-devices", "", "host PCI devices (comma-separated addresses, lspci -D's form) this node passes through to vm sandboxes that ask for them, each bound to vfio-pci on a host with its IOMMU on; no other is handed out"),
		firecracker:  fs.String("microvm-firecracker", "", "a Firecracker binary the microvm backend tries before QEMU: its probe boot decides (make deps fetches one into .cache/firecracker; default: none)"),
	}
}

// options are backend name's options from the flags (each backend refuses
// an option it does not take): the container backend's OCI runtime,
// gVisor's platform and newer runsc, the microvm backend's guest kernel
// directory and init, found next to dsec (make build and make deps put
// them there) unless given, and its Firecracker if given; and every one's
// parent cgroup. A backend this binary does not know gets none.
func (f *backendFlags) options(name string) map[string]string {
	o := map[string]string{}
	switch name {
	case container.Name:
		o["runtime"] = *f.runtime
	case gvisor.Name:
		o["platform"], o["runsc-network"], o[gvisor.NewerForOption] = *f.platform, findRunscNet(*f.runscNet), *f.newerFor
	case microvm.Name, vm.Name:
		guest, init, fc := *f.guest, *f.vmInit, *f.firecracker
		if name == vm.Name {
			fc = "" // QEMU's q35 only
			if *f.vmDevices != "" {
				o["devices"] = *f.vmDevices
			}
		}
		if self, err := os.Executable(); err == nil {
			bin := filepath.Dir(self)
			if init == "" {
				init = filepath.Join(bin, "dsec-vminit")
			}
			if guest == "" {
				guest = filepath.Join(bin, "..", ".cache", "guest")
			}
		}
		for k, v := range map[string]string{"guest": guest, "init": init, "firecracker": fc} {
			if v != "" {
				o[k], _ = filepath.Abs(v)
			}
		}
		o["templates"] = *f.templates
	default:
		return o
	}
	if *f.cgroupParent != "" {
		o["cgroup-parent"] = *f.cgroupParent
	}
	return o
}

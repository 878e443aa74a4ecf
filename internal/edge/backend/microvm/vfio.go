package microvm

import (
	"os"
	"path/filepath"
	"slices"
	"strings"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// PCI passthrough [ours; the vm backend]. QEMU hands a host PCI device to
// a q35 guest with VFIO (-device vfio-pci,host=ADDR), which needs, on the
// node: an IOMMU the kernel uses (its groups in /sys/kernel/iommu_groups),
// the device bound to the vfio-pci driver, and its group's /dev/vfio/N.
// Only devices the operator lists (the backend's option devices, dsec's
// --vm-devices) are handed out: an API key names a device, the node
// decides which may be named. A create asks for each and is refused
// naming the first that is missing and how an operator provides it; QEMU
// then claims the group, so a device one sandbox holds is refused to the
// next by QEMU's own error. Unverified here: this machine has no IOMMU and
// no device to spare (docs/design.md).

// passthroughDevices parses the backend's option devices (comma-separated
// PCI addresses), which only a PCI machine takes.
func passthroughDevices(opt string, pci bool, backendName string) ([]string, error) {
	if strings.TrimSpace(opt) == "" {
		return nil, nil
	}
	if !pci {
		return nil, errdefs.InvalidArgument("%s backend: option devices: it has no PCI bus; the vm backend passes devices through", backendName)
	}
	spec := &sandboxv1.SandboxSpec{Devices: strings.Split(opt, ",")}
	if err := sandboxspec.NormalizeDevices(spec); err != nil {
		return nil, errdefs.InvalidArgument("%s backend: option %v", backendName, strings.TrimPrefix(err.Error(), "invalid argument: "))
	}
	return spec.Devices, nil
}

// checkPassthrough says why devices (sysfs addresses) cannot be passed
// through on the host whose root is root ("/") and which offers offered,
// or nil.
func checkPassthrough(root string, offered, devices []string) error {
	groups, _ := os.ReadDir(filepath.Join(root, "sys/kernel/iommu_groups"))
	for _, d := range devices {
		if !slices.Contains(offered, d) {
			return errdefs.PermissionDenied("devices: %s: not one this node passes through (its operator lists those: dsec edge --vm-devices %s)", d, d)
		}
		dev := filepath.Join(root, "sys/bus/pci/devices", d)
		if _, err := os.Stat(dev); err != nil {
			return errdefs.FailedPrecondition("devices: %s: no such PCI device on this node (lspci -D lists them)", d)
		}
		if len(groups) == 0 {
			return errdefs.FailedPrecondition("devices: %s: this node has no IOMMU in use (/sys/kernel/iommu_groups is empty): enable VT-d or AMD-Vi in the firmware and boot with intel_iommu=on or amd_iommu=on", d)
		}
		group, err := os.Readlink(filepath.Join(dev, "iommu_group"))
		if err != nil {
			return errdefs.FailedPrecondition("devices: %s: in no IOMMU group, so it cannot be isolated for a guest", d)
		}
		driver, _ := os.Readlink(filepath.Join(dev, "driver"))
		if filepath.Base(driver) != "vfio-pci" {
			now := "no driver"
			if driver != "" {
				now = "driver " + filepath.Base(driver)
			}
			return errdefs.FailedPrecondition("devices: %s: bound to %s, not vfio-pci: modprobe vfio-pci; echo vfio-pci > %s/driver_override; echo %s > /sys/bus/pci/drivers_probe (after unbinding it)", d, now, filepath.Join("/sys/bus/pci/devices", d), d)
		}
		if _, err := os.Stat(filepath.Join(root, "dev/vfio", filepath.Base(group))); err != nil {
			return errdefs.FailedPrecondition("devices: %s: its IOMMU group's %s is missing (%v)", d, filepath.Join("/dev/vfio", filepath.Base(group)), err)
		}
	}
	return nil
}

package microvm

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// fakeHost is a sysfs and /dev of one PCI device, 0000:01:00.0, in IOMMU
// group 7, bound to driver.
func fakeHost(t *testing.T, iommu bool, driver string, devNode bool) string {
	t.Helper()
	root := t.TempDir()
	dev := filepath.Join(root, "sys/bus/pci/devices/0000:01:00.0")
	for _, d := range []string{dev, filepath.Join(root, "sys/kernel/iommu_groups"), filepath.Join(root, "dev/vfio")} {
		os.MkdirAll(d, 0o755)
	}
	if iommu {
		os.MkdirAll(filepath.Join(root, "sys/kernel/iommu_groups/7"), 0o755)
		os.Symlink("../../../../kernel/iommu_groups/7", filepath.Join(dev, "iommu_group"))
	}
	if driver != "" {
		os.Symlink("../../../../bus/pci/drivers/"+driver, filepath.Join(dev, "driver"))
	}
	if devNode {
		os.WriteFile(filepath.Join(root, "dev/vfio/7"), nil, 0o600)
	}
	return root
}

// A device passes through only with an IOMMU, bound to vfio-pci, with its
// group's node; each refusal names what is missing.
func TestCheckPassthroughNamesWhatIsMissing(t *testing.T) {
	for _, c := range []struct {
		name, driver string
		iommu, node  bool
		device, want string
	}{
		{"ready", "vfio-pci", true, true, "0000:01:00.0", ""},
		{"no such device", "vfio-pci", true, true, "0000:02:00.0", "no such PCI device"},
		{"no IOMMU", "vfio-pci", false, true, "0000:01:00.0", "no IOMMU in use"},
		{"host driver", "nvme", true, true, "0000:01:00.0", "bound to driver nvme, not vfio-pci"},
		{"unbound", "", true, true, "0000:01:00.0", "bound to no driver"},
		{"no group node", "vfio-pci", true, false, "0000:01:00.0", "/dev/vfio/7 is missing"},
	} {
		offered := []string{"0000:01:00.0", "0000:02:00.0"}
		err := checkPassthrough(fakeHost(t, c.iommu, c.driver, c.node), offered, []string{c.device})
		if (c.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}

// Only the devices the operator offers are handed out, whatever the host
// has; the option takes lspci's forms and only on a PCI machine.
func TestOnlyOfferedDevicesPassThrough(t *testing.T) {
	err := checkPassthrough(fakeHost(t, true, "vfio-pci", true), nil, []string{"0000:01:00.0"})
	if !errors.Is(err, errdefs.ErrPermissionDenied) || !strings.Contains(err.Error(), "not one this node passes through") {
		t.Fatalf("a ready device nobody offered: %v", err)
	}
	got, err := passthroughDevices(" 01:00.0,0000:3B:00.1", true, "vm")
	if err != nil || !slices.Equal(got, []string{"0000:01:00.0", "0000:3b:00.1"}) {
		t.Fatalf("option devices: %v, %v", got, err)
	}
	if _, err := passthroughDevices("01:00.0", false, "microvm"); err == nil || !strings.Contains(err.Error(), "no PCI bus") {
		t.Fatalf("devices on microvm: %v", err)
	}
	if _, err := passthroughDevices("eth0", true, "vm"); err == nil || !strings.Contains(err.Error(), "option devices[0]") {
		t.Fatalf("a bad address: %v", err)
	}
}

// A q35 guest's devices are VFIO devices on its command line; a microvm
// has no PCI bus to put them on.
func TestDevicesOnTheCommandLine(t *testing.T) {
	q := &QEMU{Binary: "qemu", Kernel: "/k", Machine: MachineQ35}
	args := q.Args(Guest{MemoryMB: 256, Initrd: "/i", AgentChardev: "socket,id=agent,path=/a", Devices: []string{"0000:01:00.0"}})
	if i := slices.Index(args, "vfio-pci,host=0000:01:00.0"); i < 1 || args[i-1] != "-device" {
		t.Fatalf("q35 args lack the device: %v", args)
	}
	if !slices.Contains(args, "virtio-serial-pci") || !slices.Contains(args, "q35") {
		t.Fatalf("q35 args: %v", args)
	}
}

// A guest recorded with a kernel or modules disk this node lacks is
// refused a restore by name, before QEMU is asked.
func TestRestoreNamesAMissingHostFile(t *testing.T) {
	dir := t.TempDir()
	kernel := filepath.Join(dir, "vmlinuz")
	os.WriteFile(kernel, nil, 0o600)
	if err := (Guest{Kernel: kernel}).hostFilesPresent(); err != nil {
		t.Fatal(err)
	}
	err := (Guest{Kernel: kernel, ModulesDisk: filepath.Join(dir, "modules.img")}).hostFilesPresent()
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "the kernel modules disk "+filepath.Join(dir, "modules.img")) {
		t.Fatalf("a missing modules disk: %v", err)
	}
}

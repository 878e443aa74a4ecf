package microvm

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// VMInitMarker is what the guest's init (cmd/dsec-vminit) writes to the
// agent's port once it runs.
const VMInitMarker = "DSEC-VMINIT-UP"

// ModuleOrder is the order the guest loads the virtio modules the guest
// kernel has as modules (virtio_ring first, or "Unknown symbol"), and
// erofs for roots shared through the image store (libcrc32c first).
var ModuleOrder = []string{"virtio_ring", "virtio", "virtio_mmio", "virtio_console", "virtio_blk", "overlay", "libcrc32c", "erofs"}

// PCIModules are the modules a guest on a PCI machine (q35) loads before
// its virtio devices' drivers, in their load order after virtio.
var PCIModules = []string{"virtio_pci_legacy_dev", "virtio_pci_modern_dev", "virtio_pci"}

// Machines QEMU emulates for a guest.
const (
	// MachineMicrovm is QEMU's microvm: no PCI, no ACPI, no firmware;
	// virtio devices on MMIO. The microvm backend's.
	MachineMicrovm = "microvm"
	// MachineQ35 is a full PC: firmware (SeaBIOS), ACPI, virtio devices
	// on PCI (and so room for a host's PCI device). The vm backend's.
	MachineQ35 = "q35"
)

// QEMU runs guests on one of QEMU's machines.
type QEMU struct {
	Binary  string // qemu-system-x86_64
	Kernel  string // an uncompressed PVH vmlinux
	Init    string // the static dsec-vminit
	Modules string // directory of the guest kernel's .ko files
	// Machine is MachineMicrovm ("" too) or MachineQ35.
	Machine string
	// ModulesDisk, if set, is the node's read-only ext4 disk of every
	// module of its guest kernel, indexed (scripts/guest-kernel.sh's
	// modules.img), which new q35 guests of that kernel get (Guest.
	// ModulesDisk); microVMs do not, so they keep the devices their
	// snapshots were taken with.
	ModulesDisk string
}

// pci says the guest's devices are on PCI.
func (q *QEMU) pci() bool { return q.Machine == MachineQ35 }

// moduleOrder is the order the guest loads its modules: the microvm's,
// with the PCI transport after virtio on a PCI machine.
func (q *QEMU) moduleOrder() []string {
	if !q.pci() {
		return ModuleOrder
	}
	out := make([]string, 0, len(ModuleOrder)+len(PCIModules))
	for _, m := range ModuleOrder {
		out = append(out, m)
		if m == "virtio" {
			out = append(out, PCIModules...)
		}
	}
	return out
}

// device is QEMU's name of a virtio device of kind ("blk", "serial",
// "net") on the guest's bus.
func (q *QEMU) device(kind string) string {
	if q.pci() {
		return "virtio-" + kind + "-pci"
	}
	return "virtio-" + kind + "-device"
}

// Name implements Driver.
func (q *QEMU) Name() string { return "qemu" }

// probeTimeouts bound a probe boot per accelerator: a stock kernel under
// a paravirtual KVM spins rather than fails.
var probeTimeouts = map[string]time.Duration{"kvm": 20 * time.Second, "tcg": 90 * time.Second}

// Probe implements Driver: KVM when /dev/kvm opens and a guest boots with
// it, else TCG.
func (q *QEMU) Probe(ctx context.Context, dir string) (*ProbeResult, error) {
	initrd := filepath.Join(dir, "probe.cpio")
	if err := q.writeInitramfs(initrd); err != nil {
		return nil, err
	}
	res := &ProbeResult{Driver: q.Name()}
	accels := []string{"tcg"}
	if f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0); err == nil {
		f.Close()
		accels = []string{"kvm", "tcg"}
	} else {
		res.Skipped = append(res.Skipped, "kvm: "+err.Error())
	}
	var errs []error
	for _, accel := range accels {
		took, err := q.boot(ctx, dir, initrd, accel)
		if err == nil {
			res.Accel, res.Boot = accel, took
			return res, nil
		}
		res.Skipped = append(res.Skipped, accel+": "+err.Error())
		errs = append(errs, fmt.Errorf("%s: %w", accel, err))
	}
	return nil, fmt.Errorf("qemu: no probe guest booted: %w", errors.Join(errs...))
}

// writeInitramfs packs the init and the modules the kernel needs.
func (q *QEMU) writeInitramfs(dst string) error { return q.WriteInitramfs(dst, nil) }

// WriteInitramfs packs the init, the modules the kernel needs and extra.
func (q *QEMU) WriteInitramfs(dst string, extra []InitFile) error {
	return writeGuestInitramfs(dst, q.Init, q.Modules, q.moduleOrder(), extra)
}

// writeSandboxInitrd writes a booting sandbox guest's initramfs to dst:
// the init, the kernel modules, the agent at agentPath and config, its
// /dsec/config.json.
func (q *QEMU) writeSandboxInitrd(dst, agentPath, modulesDir string, modules []string, config []byte) error {
	agent, err := os.ReadFile(agentPath)
	if err != nil {
		return err
	}
	extra := []InitFile{{Path: "/aether", Mode: 0o755, Data: agent}, {Path: "/dsec/config.json", Mode: 0o600, Data: config}}
	return writeGuestInitramfs(dst, q.Init, modulesDir, modules, extra)
}

// writeGuestInitramfs packs the init, those of modules (in their load
// order) that modulesDir has (the others are built into the kernel) and
// extra.
func writeGuestInitramfs(dst, initPath, modulesDir string, modules []string, extra []InitFile) error {
	init, err := os.ReadFile(initPath)
	if err != nil {
		return fmt.Errorf("microvm: the guest init: %w", err)
	}
	files := append([]InitFile{{Path: "/init", Mode: 0o755, Data: init}}, extra...)
	var order []string
	for _, m := range modules {
		data, err := os.ReadFile(filepath.Join(modulesDir, m+".ko"))
		if errors.Is(err, os.ErrNotExist) {
			continue // built into the kernel
		}
		if err != nil {
			return err
		}
		files = append(files, InitFile{Path: "/lib/modules/" + m + ".ko", Mode: 0o644, Data: data})
		order = append(order, m)
	}
	files = append(files, InitFile{Path: "/lib/modules/order", Mode: 0o644, Data: []byte(strings.Join(order, "\n") + "\n")})
	var buf bytes.Buffer
	if err := WriteInitramfs(&buf, files); err != nil {
		return err
	}
	return os.WriteFile(dst, buf.Bytes(), 0o644)
}

// Guest is what one QEMU guest is started with.
type Guest struct {
	Accel, CPU string // "tcg" and "max" when empty
	MemoryMB   int
	SMP        int // vCPUs; 1 when 0
	// CPUCores is the sandbox's CPU limit, held on the node (cpu.go); 0:
	// the vCPUs only.
	CPUCores float64 `json:",omitempty"`
	Initrd   string
	// Console is the serial console's log file; "" keeps the console in
	// a ring of consoleRingBytes in QEMU's memory instead (a sandbox's:
	// its guest's root could write to a file without end), which
	// ConsoleTail reads.
	Console      string
	AgentChardev string // QEMU -chardev for the agent's port (id=agent)
	// AgentSocket is the edge's socket for the agent (Firecracker's vsock
	// leads there; QEMU's AgentChardev names it).
	AgentSocket string `json:",omitempty"`
	// VMM is the hypervisor that runs the guest: "" for QEMU, or
	// "firecracker".
	VMM string `json:",omitempty"`
	// NetNS, if set, is the sandbox's network namespace: the VMM runs in
	// it, on its TAP (net.go), and the guest's NIC has MAC.
	NetNS string `json:",omitempty"`
	MAC   string `json:",omitempty"`
	// RootDisk (read-only, shared) and WritableDisk (the sandbox's own)
	// are raw ext4 images; without them the guest runs from its initramfs.
	// RootDisk is a link in the guest's directory to Root, the node's
	// one image of the sandbox's image.
	RootDisk, WritableDisk string
	Root                   string `json:",omitempty"`
	// MemFile, if set, backs the guest's RAM (MemShared: mapped shared,
	// so a snapshot leaves RAM in the file instead of copying it; else
	// privately, copy-on-write over a snapshot's file).
	MemFile   string
	MemShared bool
	// Incoming starts the guest waiting for a migration stream (QMP
	// migrate-incoming) instead of booting.
	Incoming bool
	// Template, if set, is the template snapshot the guest's first start
	// restores (template.go) instead of booting.
	Template string `json:",omitempty"`
	// Kernel, if set, is the image's own kernel the guest boots
	// (imagekernel.go); "" is the node's.
	Kernel string `json:",omitempty"`
	// ModulesDisk, if set, is the kernel modules disk the guest has
	// (QEMU.ModulesDisk when it started), which it mounts at
	// /lib/modules/RELEASE; recorded, so that a restore has the devices
	// its snapshot was taken with.
	ModulesDisk string `json:",omitempty"`
	// Devices are host PCI devices (sysfs addresses) passed through with
	// VFIO (vfio.go); q35 guests only.
	Devices []string `json:",omitempty"`
	// BootInitrd, if set, is what the guest's own initramfs is made of,
	// joined at its first boot (bootinitrd.go); until then Initrd is the
	// one it runs from, its template's or snapshot's.
	BootInitrd []string `json:",omitempty"`
}

// Args is the QEMU command line of g.
func (q *QEMU) Args(g Guest) []string {
	if g.Accel == "" {
		g.Accel = "tcg"
	}
	if g.CPU == "" {
		g.CPU = "max"
	}
	machine := "microvm,pit=on,pic=on,rtc=on"
	if q.pci() {
		// SeaBIOS, QEMU's default firmware, starts the kernel (PVH).
		machine = "q35"
	}
	var mem []string
	if g.MemFile != "" {
		share := "off"
		if g.MemShared {
			share = "on"
		}
		machine += ",memory-backend=mem"
		mem = []string{"-object", fmt.Sprintf("memory-backend-file,id=mem,size=%dM,mem-path=%s,share=%s", g.MemoryMB, g.MemFile, share)}
	}
	args := []string{
		"-M", machine, "-accel", g.Accel, "-cpu", g.CPU, "-m", fmt.Sprint(g.MemoryMB), "-smp", fmt.Sprint(max(g.SMP, 1)),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", cmp.Or(g.Kernel, q.Kernel), "-initrd", g.Initrd, "-append", q.kernelArgs(),
	}
	if g.Console != "" {
		args = append(args, "-serial", "file:"+g.Console)
	} else {
		args = append(args, "-chardev", fmt.Sprintf("ringbuf,id=%s,size=%d", consoleChardev, consoleRingBytes), "-serial", "chardev:"+consoleChardev)
	}
	args = append(args,
		"-device", q.device("serial"), "-chardev", g.AgentChardev,
		"-device", "virtserialport,chardev=agent,name="+AgentPort,
	)
	if g.RootDisk != "" && g.WritableDisk != "" {
		args = append(args,
			"-drive", "id=root,file="+g.RootDisk+",format=raw,if=none,readonly=on",
			"-device", q.device("blk")+",drive=root,serial="+RootSerial,
			"-drive", "id=rw,file="+g.WritableDisk+",format=raw,if=none",
			"-device", q.device("blk")+",drive=rw,serial="+WritableSerial)
	}
	if g.ModulesDisk != "" {
		args = append(args,
			"-drive", "id=mods,file="+g.ModulesDisk+",format=raw,if=none,readonly=on",
			"-device", q.device("blk")+",drive=mods,serial="+ModulesSerial)
	}
	for _, d := range g.Devices {
		args = append(args, "-device", "vfio-pci,host="+d)
	}
	if g.NetNS != "" {
		args = append(args, "-netdev", "tap,id=net0,ifname="+guestTap+",script=no,downscript=no",
			"-device", q.device("net")+",netdev=net0,mac="+g.MAC)
	}
	args = append(args, mem...)
	if g.Incoming {
		args = append(args, "-incoming", "defer")
	}
	return args
}

// AgentPort is the name of the agent's virtio-serial port.
const AgentPort = "dsec.agent"

// boot runs one probe guest and returns the time to the init's marker on
// the agent's port.
func (q *QEMU) boot(ctx context.Context, dir, initrd, accel string) (time.Duration, error) {
	agentOut := filepath.Join(dir, "agent-"+accel+".out")
	console := filepath.Join(dir, "console-"+accel+".log")
	os.Remove(agentOut)
	os.Remove(console)
	cpu := "max"
	if accel == "kvm" {
		cpu = "host"
	}
	ctx, cancel := context.WithTimeout(ctx, probeTimeouts[accel])
	defer cancel()
	cmd := exec.CommandContext(ctx, q.Binary, q.Args(Guest{Accel: accel, CPU: cpu, MemoryMB: 128, Initrd: initrd, Console: console, AgentChardev: "file,id=agent,path=" + agentOut})...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	began := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-exited:
			if out, _ := os.ReadFile(agentOut); bytes.Contains(out, []byte(VMInitMarker)) {
				return time.Since(began), nil // powered off before the next tick
			}
			return 0, fmt.Errorf("the guest ended without its marker (%v): %s%s", err, strings.TrimSpace(stderr.String()), tail(console))
		case <-tick.C:
			if out, _ := os.ReadFile(agentOut); bytes.Contains(out, []byte(VMInitMarker)) {
				took := time.Since(began)
				select {
				case <-exited:
				case <-time.After(5 * time.Second):
					cmd.Process.Kill() //nolint:errcheck // it powers off by itself
					<-exited
				}
				return took, nil
			}
		}
	}
}

// KernelArgs is the guest kernel's command line. The microvm machine has
// no HPET or PM timer: under TCG the kernel cannot calibrate its TSC
// against the PIT (on a busy host), marks it unstable and crawls (84 s to
// userspace); given the host's TSC rate it boots in about 1.5 s.
func KernelArgs() string {
	args := "console=ttyS0 panic=-1 quiet rdinit=/init"
	if khz := hostTSCkHz(); khz > 0 {
		args += fmt.Sprintf(" tsc_early_khz=%d", khz)
	}
	return args
}

// modulesDiskFor is the modules disk a new guest booting kernel gets: the
// node's, on q35, unless the kernel is an image's own (which has its own
// modules).
func (q *QEMU) modulesDiskFor(kernel *bootKernel) string {
	if !q.pci() || kernel.Image {
		return ""
	}
	return q.ModulesDisk
}

// ImageInitArg on a guest's kernel command line has its init hand the
// guest over to the image's own init (systemd) where the image has one,
// with the agent as a service of it (cmd/dsec-vminit).
const ImageInitArg = "dsec.init=image"

// kernelArgs is KernelArgs, and on a full machine ImageInitArg.
func (q *QEMU) kernelArgs() string {
	if q.pci() {
		return KernelArgs() + " " + ImageInitArg
	}
	return KernelArgs()
}

// hostTSCkHz reads the host's clock rate from /proc/cpuinfo (0 if absent).
func hostTSCkHz() int64 {
	data, _ := os.ReadFile("/proc/cpuinfo")
	for _, line := range strings.Split(string(data), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "cpu MHz" {
			var mhz float64
			if _, err := fmt.Sscan(strings.TrimSpace(v), &mhz); err == nil {
				return int64(mhz * 1000)
			}
		}
	}
	return 0
}

// A sandbox's console, in QEMU's memory: a ring of its last 64 KiB (QEMU
// wants a power of two), never on the node's disk.
const (
	consoleChardev   = "console"
	consoleRingBytes = 64 << 10
)

// tail is the end of a console log, for errors.
func tail(path string) string {
	data, _ := os.ReadFile(path)
	return quoteConsole(data)
}

// quoteConsole is the end of a console's output, for errors: "" if there
// is none, else "; console: " and its last 800 bytes.
func quoteConsole(data []byte) string {
	if len(data) > 800 {
		data = data[len(data)-800:]
	}
	if len(data) == 0 {
		return ""
	}
	return "; console: " + strings.TrimSpace(string(data))
}

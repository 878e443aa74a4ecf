// Command dsec-vminit is PID 1 of a microvm sandbox's guest (static, from
// the initramfs): it mounts the kernel's file systems, loads the virtio
// modules the initramfs carries (with their parameters from the kernel
// command line, as modprobe would) and finds the agent's link to the host:
// the virtio-serial port by name (QEMU), or the host's vsock port named
// by "dsec.agent=vsock:PORT" on the command line (Firecracker). It finds
// the root and writable disks by virtio serial or, lacking one, by ext4
// label. With the agent in the initramfs (/aether) it then becomes the
// agent, which serves the edge on that link; without, it writes its marker
// there and on the console and powers the guest off (the node's probe
// boot).
package main

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Marker is what a probe boot prints once userspace runs and the agent's
// port answers.
const Marker = "DSEC-VMINIT-UP"

// agentPort is the virtio-serial port name the host gives the agent.
const agentPort = "dsec.agent"

// agentBinary, when the initramfs carries it, is started in place of
// this init once the modules are loaded: the guest's PID 1 from then on.
const agentBinary = "/aether"

func main() {
	began := time.Now()
	link, err := run()
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsec-vminit:", err)
	}
	if _, err := os.Stat(agentBinary); err == nil {
		cfg, err := readConfig()
		if err != nil {
			fmt.Fprintln(os.Stderr, "dsec-vminit:", err)
		}
		agent, init := agentBinary, ""
		if root, rw := findDisk(rootSerial), findDisk(writableSerial); root != "" && rw != "" {
			if err := switchRoot(root, rw); err != nil {
				// An agent on the initramfs alone would serve a sandbox
				// without its image: the guest ends instead, and its
				// create fails with this line of its console.
				fmt.Fprintln(os.Stderr, "dsec-vminit: the image's root:", err)
				unix.Sync()
				unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF) //nolint:errcheck // the guest ends either way
			} else {
				agent = "/.dsec/aether"
				cmdline, _ := os.ReadFile("/proc/cmdline")
				init = systemdInit(string(cmdline))
			}
		}
		if err := cfg.apply(); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-vminit:", err)
		}
		fmt.Printf("%s after %s in userspace; starting the agent\n", Marker, time.Since(began).Round(time.Millisecond))
		args := []string{agent, "-edge-socket", link, "-sync-clock"}
		cgroup, err := cfg.limit()
		if err != nil {
			fmt.Fprintln(os.Stderr, "dsec-vminit: the sandbox's limits:", err)
		}
		if cgroup != "" {
			args = append(args, "-spawn-cgroup", cgroup)
		}
		if cfg.MachineID != "" {
			args = append(args, "-machine-id", cfg.MachineID)
		}
		if init != "" {
			fmt.Printf("handing the guest to the image's init, %s, with the agent as its unit %s\n", init, agentUnit)
			err := handOver(init, args, cfg.environ(), cfg.WorkDir, cfg)
			fmt.Fprintln(os.Stderr, "dsec-vminit: the image's init:", err, "; the agent runs as init instead")
		}
		cfg.enterWorkDir()
		err = unix.Exec(agent, args, cfg.environ())
		fmt.Fprintln(os.Stderr, "dsec-vminit: start the agent:", err)
	}
	fmt.Printf("%s after %s in userspace\n", Marker, time.Since(began).Round(time.Millisecond))
	unix.Sync()
	unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF) //nolint:errcheck // the guest ends either way
}

// run mounts the kernel's file systems, loads the modules and finds the
// agent's link to the host, which it returns as the agent's -edge-socket:
// the virtio-serial port (QEMU), or with "dsec.agent=vsock:PORT" on the
// kernel command line the host's vsock port PORT (Firecracker, which has
// no virtio-serial). A probe guest's marker goes to the port, and to the
// console in any case.
func run() (string, error) {
	link := "virtio-port:" + agentPort
	for _, m := range []struct{ src, dst, fstype string }{
		{"proc", "/proc", "proc"}, {"sysfs", "/sys", "sysfs"}, {"devtmpfs", "/dev", "devtmpfs"},
	} {
		os.MkdirAll(m.dst, 0o755)
		if err := unix.Mount(m.src, m.dst, m.fstype, 0, ""); err != nil && err != unix.EBUSY {
			return link, fmt.Errorf("mount %s: %w", m.dst, err)
		}
	}
	cmdline, _ := os.ReadFile("/proc/cmdline")
	if err := loadModules("/lib/modules", string(cmdline)); err != nil {
		return link, err
	}
	if port, ok := vsockPort(string(cmdline)); ok {
		return fmt.Sprintf("vsock:%d:%s", hostCID, port), nil
	}
	port, err := findPort(agentPort, 5*time.Second)
	if err != nil {
		return link, err
	}
	if _, err := os.Stat(agentBinary); err == nil {
		return link, nil // the agent's link speaks first on the port
	}
	f, err := os.OpenFile(port, os.O_WRONLY, 0)
	if err != nil {
		return link, err
	}
	defer f.Close()
	_, err = fmt.Fprintf(f, "%s\n", Marker)
	return link, err
}

// hostCID is the vsock address of the host, seen from a guest.
const hostCID = 2

// vsockPort is the PORT of a "dsec.agent=vsock:PORT" word of cmdline.
func vsockPort(cmdline string) (string, bool) {
	for _, w := range strings.Fields(cmdline) {
		if p, ok := strings.CutPrefix(w, "dsec.agent=vsock:"); ok && p != "" && strings.Trim(p, "0123456789") == "" {
			return p, true
		}
	}
	return "", false
}

// Disk serials (microvm.RootSerial, microvm.WritableSerial).
const (
	rootSerial     = "dsec-root"
	writableSerial = "dsec-rw"
	modulesSerial  = "dsec-modules"
)

// findDisk is the block device whose virtio serial is name (QEMU sets
// it), else the one whose ext4 label is name (the backend labels its
// disks the same; Firecracker gives its disks no serial), or for the root
// the EROFS disk, or "".
func findDisk(name string) string {
	disks, _ := filepath.Glob("/sys/block/vd*")
	sort.Strings(disks)
	for _, d := range disks {
		if b, err := os.ReadFile(filepath.Join(d, "serial")); err == nil && strings.TrimSpace(string(b)) == name {
			return "/dev/" + filepath.Base(d)
		}
	}
	for _, d := range disks {
		dev := "/dev/" + filepath.Base(d)
		if ext4Label(dev) == name {
			return dev
		}
		// A root shared through the image store is EROFS, which carries no
		// label of ours: the only EROFS disk is the root.
		if name == rootSerial && rootFSType(dev) == "erofs" {
			return dev
		}
	}
	return ""
}

// ext4Label reads the volume name of the ext4 file system on dev ("" if
// it has none or is not ext4).
func ext4Label(dev string) string {
	f, err := os.Open(dev)
	if err != nil {
		return ""
	}
	defer f.Close()
	sb := make([]byte, 1024)
	if _, err := f.ReadAt(sb, 1024); err != nil {
		return ""
	}
	return superblockLabel(sb)
}

// superblockLabel is s_volume_name of an ext2/3/4 superblock, if its
// magic (0xEF53 at 0x38) is there.
func superblockLabel(sb []byte) string {
	if len(sb) < 0x88 || sb[0x38] != 0x53 || sb[0x39] != 0xEF {
		return ""
	}
	name := sb[0x78:0x88]
	if i := bytes.IndexByte(name, 0); i >= 0 {
		name = name[:i]
	}
	return string(name)
}

// erofsMagic is EROFS's superblock magic, at byte 1024 of the disk.
const erofsMagic = 0xE0F5E1E2

// rootFSType is "erofs" for a root disk an image store shares between
// nodes (an EROFS image), else "ext4" (one a node made).
func rootFSType(dev string) string {
	f, err := os.Open(dev)
	if err != nil {
		return "ext4"
	}
	defer f.Close()
	var b [4]byte
	if _, err := f.ReadAt(b[:], 1024); err == nil && binary.LittleEndian.Uint32(b[:]) == erofsMagic {
		return "erofs"
	}
	return "ext4"
}

// switchRoot makes the image's root disk (read-only) under an overlay
// whose upper layer is on the writable disk the root, with the agent on a
// tmpfs at /.dsec, and moves this init there.
func switchRoot(rootDev, rwDev string) error {
	for _, m := range []struct{ src, dst, fstype, data string }{
		{rootDev, "/mnt/lower", rootFSType(rootDev), ""}, {rwDev, "/mnt/rw", "ext4", ""},
	} {
		os.MkdirAll(m.dst, 0o755)
		flags := uintptr(0)
		if m.dst == "/mnt/lower" {
			flags = unix.MS_RDONLY
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, flags, m.data); err != nil {
			return fmt.Errorf("mount %s on %s: %w", m.src, m.dst, err)
		}
	}
	for _, d := range []string{"/mnt/rw/upper", "/mnt/rw/work", "/newroot"} {
		os.MkdirAll(d, 0o755)
	}
	if err := unix.Mount("overlay", "/newroot", "overlay", 0, "lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work"); err != nil {
		return fmt.Errorf("mount the overlay: %w", err)
	}
	if err := mountModules(findDisk(modulesSerial), "/newroot"); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-vminit: the kernel's modules:", err)
	}
	os.MkdirAll("/newroot/.dsec", 0o755)
	if err := unix.Mount("tmpfs", "/newroot/.dsec", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755"); err != nil {
		return err
	}
	// The agent is bound in from the initramfs, not copied: 9.5 MB of
	// memcpy cost 100 ms under TCG, and the copy memory the initramfs
	// holds anyway.
	if err := os.WriteFile("/newroot/.dsec/aether", nil, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(agentBinary, "/newroot/.dsec/aether", "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind the agent: %w", err)
	}
	for _, d := range []string{"/proc", "/sys", "/dev"} {
		os.MkdirAll("/newroot"+d, 0o755)
		if err := unix.Mount(d, "/newroot"+d, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("move %s: %w", d, err)
		}
	}
	// Terminals (a PTY opens /dev/ptmx, which needs devpts at /dev/pts)
	// and POSIX shared memory, as a container runtime gives them.
	for _, m := range []struct{ fstype, dst, data string }{
		{"devpts", "/newroot/dev/pts", "newinstance,ptmxmode=0666,mode=0620,gid=5"},
		{"tmpfs", "/newroot/dev/shm", "mode=1777"},
	} {
		os.MkdirAll(m.dst, 0o755)
		if err := unix.Mount(m.fstype, m.dst, m.fstype, unix.MS_NOSUID|unix.MS_NOEXEC, m.data); err != nil {
			return fmt.Errorf("mount %s: %w", m.dst, err)
		}
	}
	if err := unix.Chdir("/newroot"); err != nil {
		return err
	}
	if err := unix.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("move the new root: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return err
	}
	return unix.Chdir("/")
}

// mountModules mounts the kernel's modules disk dev (read-only; none
// when dev is "") at root's /lib/modules/RELEASE, where modprobe looks.
func mountModules(dev, root string) error {
	if dev == "" {
		return nil
	}
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return err
	}
	// Merged /usr makes /lib a link, which is followed here in the
	// initramfs, not the image: /usr/lib then.
	lib := filepath.Join(root, "lib")
	if fi, err := os.Lstat(lib); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		lib = filepath.Join(root, "usr/lib")
	}
	dst := filepath.Join(lib, "modules", unix.ByteSliceToString(u.Release[:]))
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return err
	}
	if err := unix.Mount(dev, dst, "ext4", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mount %s on %s: %w", dev, dst, err)
	}
	return nil
}

// loadModules loads DIR's modules in the order DIR/order names them,
// passing each the "name.param=value" words of cmdline.
func loadModules(dir, cmdline string) error {
	order, err := os.ReadFile(filepath.Join(dir, "order"))
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, name := range strings.Fields(string(order)) {
		f, err := os.Open(filepath.Join(dir, name+".ko"))
		if err != nil {
			return err
		}
		err = unix.FinitModule(int(f.Fd()), moduleParams(name, cmdline), 0)
		f.Close()
		if err != nil && err != unix.EEXIST {
			return fmt.Errorf("load module %s: %w", name, err)
		}
	}
	return nil
}

// moduleParams collects "module.param=value" words for module.
func moduleParams(module, cmdline string) string {
	var out []string
	for _, w := range strings.Fields(cmdline) {
		if p, ok := strings.CutPrefix(w, module+"."); ok && strings.Contains(p, "=") {
			out = append(out, p)
		}
	}
	return strings.Join(out, " ")
}

// findPort waits for the virtio-serial port called name and returns its
// device path.
func findPort(name string, wait time.Duration) (string, error) {
	deadline := time.Now().Add(wait)
	for {
		ports, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
		sort.Strings(ports)
		for _, p := range ports {
			if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == name {
				return "/dev/" + filepath.Base(filepath.Dir(p)), nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no virtio-serial port named %s (ports: %v)", name, ports)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

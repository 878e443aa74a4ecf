package microvm

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
)

// Firecracker runs guests on Firecracker [ours]. It needs a KVM that
// boots stock guests: Firecracker has no emulator, so on a host whose KVM
// does not (a paravirtual KVM such as kvm_pvm) its probe boot fails and
// the backend uses QEMU. Firecracker has no virtio-serial: the agent
// reaches the edge over vsock (the guest dials the host's CID 2, port
// AgentVsockPort, which Firecracker joins to the Unix socket
// "v.sock_1024" in the guest's directory, a link to the edge's socket).
// Every path Firecracker is given for a sandbox's files is relative to
// the guest's directory, its working directory: a snapshot then names
// "rw.ext4" and "v.sock", and each copy, started in its own directory,
// opens its own.
//
// Verified on these machines: the API calls (configure, start, pause,
// resume, snapshot create and load) against the real binary, and the
// probe's refusal. Not verified: a guest booting, the agent over vsock,
// and forks (no host here boots a Firecracker guest).
type Firecracker struct {
	Binary  string // firecracker
	Kernel  string // an uncompressed vmlinux
	Init    string // the static dsec-vminit
	Modules string // directory of the guest kernel's .ko files
	Log     *slog.Logger
}

// logger is f.Log, or one that discards.
func (f *Firecracker) logger() *slog.Logger { return logging.OrDiscard(f.Log) }

// FirecrackerModules are the modules a Firecracker guest loads, in order:
// virtio-mmio devices, block, and the vsock transport for the agent.
var FirecrackerModules = []string{"virtio_ring", "virtio", "virtio_mmio", "virtio_blk",
	"vsock", "vmw_vsock_virtio_transport_common", "vmw_vsock_virtio_transport", "overlay", "libcrc32c", "erofs"}

// AgentVsockPort is the host port a Firecracker guest's agent dials.
const AgentVsockPort = 1024

// Files in a Firecracker guest's directory.
const (
	fcSocket   = "fc.sock" // the API
	fcVsockUDS = "v.sock"  // the vsock device's socket prefix
)

// fcProbeTimeout bounds Firecracker's probe boot: on a KVM that boots
// stock guests it takes well under a second; on kvm_pvm the guest is
// still in its kernel's start after 30 s.
const fcProbeTimeout = 10 * time.Second

// Name implements Driver.
func (f *Firecracker) Name() string { return "firecracker" }

// KernelArgs is a Firecracker guest's command line (Firecracker adds its
// virtio-mmio devices to it).
func (f *Firecracker) KernelArgs() string {
	return fmt.Sprintf("console=ttyS0 reboot=k panic=-1 pci=off quiet rdinit=/init dsec.agent=vsock:%d", AgentVsockPort)
}

// WriteInitramfs packs the init, the modules a Firecracker guest needs
// and extra.
func (f *Firecracker) WriteInitramfs(dst string, extra []InitFile) error {
	return writeGuestInitramfs(dst, f.Init, f.Modules, FirecrackerModules, extra)
}

// Probe implements Driver: /dev/kvm must open, and a guest must print the
// init's marker on its console within fcProbeTimeout.
func (f *Firecracker) Probe(ctx context.Context, dir string) (*ProbeResult, error) {
	kvm, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("firecracker needs KVM: %w", err)
	}
	kvm.Close()
	dir = filepath.Join(dir, "firecracker")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	initrd := filepath.Join(dir, "probe.cpio")
	if err := f.WriteInitramfs(initrd, nil); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, fcProbeTimeout)
	defer cancel()
	began := time.Now()
	vm, err := f.spawn(ctx, dir, "probe", "")
	if err != nil {
		return nil, err
	}
	defer vm.kill()
	if err := f.configure(ctx, vm.api, Guest{MemoryMB: 128, SMP: 1, Initrd: initrd}); err != nil {
		return nil, err
	}
	for {
		if out, _ := readRing(filepath.Join(dir, fcConsoleRing)); bytes.Contains(out, []byte(VMInitMarker)) {
			return &ProbeResult{Driver: f.Name(), Accel: "kvm", Boot: time.Since(began)}, nil
		}
		select {
		case <-vm.exited:
			return nil, fmt.Errorf("the guest ended without its marker%s", consoleTail(dir))
		case <-ctx.Done():
			return nil, fmt.Errorf("the probe guest did not reach userspace in %s%s", fcProbeTimeout, consoleTail(dir))
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// fcVM is one Firecracker process.
type fcVM struct {
	cmd    *exec.Cmd
	api    *fcAPI
	exited chan struct{} // closed when the process ended
}

// kill ends the process and waits for it.
func (vm *fcVM) kill() {
	vm.cmd.Process.Kill() //nolint:errcheck // may have ended
	<-vm.exited
}

// spawn starts Firecracker in dir, its own session (it outlives the
// edge), in the network namespace netns if set, with its console and log
// drained into dir's console ring, and waits until its API answers.
func (f *Firecracker) spawn(ctx context.Context, dir, id, netns string) (*fcVM, error) {
	sock := filepath.Join(dir, fcSocket)
	os.Remove(sock) // Firecracker refuses a socket path that exists
	console, err := openConsoleFIFO(dir)
	if err != nil {
		return nil, err
	}
	defer console.Close()
	if _, err := drainConsole(dir, f.logger(), drainWait); err != nil { // ends with the VMM
		return nil, err
	}
	argv := []string{f.Binary, "--api-sock", sock, "--id", fcID(id), "--level", "Warning"}
	if netns != "" {
		argv = inNetNS(netns, argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Dir = dir
	cmd.Stdout, cmd.Stderr = console, console
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start firecracker: %w", err)
	}
	if err := handOver(console); err != nil {
		cmd.Process.Kill() //nolint:errcheck // reaped below
		cmd.Wait()         //nolint:errcheck // the error is the handover's
		return nil, fmt.Errorf("firecracker's console: %w", err)
	}
	vm := &fcVM{cmd: cmd, api: newFCAPI(sock), exited: make(chan struct{})}
	go func() {
		cmd.Wait() //nolint:errcheck // reaped only; its console says why it ended
		close(vm.exited)
	}()
	if err := vm.api.waitAPI(ctx, vm.exited); err != nil {
		vm.kill()
		return nil, fmt.Errorf("%w%s", err, consoleTail(dir))
	}
	return vm, nil
}

// fcID is id as Firecracker's --id takes it: letters, digits and '-', at
// most 64.
func fcID(id string) string {
	id = strings.Map(func(r rune) rune {
		if r == '-' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' {
			return r
		}
		return '-'
	}, id)
	if len(id) > 64 {
		id = id[:64]
	}
	return id
}

// configure gives a Firecracker that has not started the guest g and
// starts it. The disks and the vsock socket are named relative to the
// guest's directory (see Firecracker).
func (f *Firecracker) configure(ctx context.Context, api *fcAPI, g Guest) error {
	if err := api.setBootSource(ctx, fcBootSource{KernelImagePath: f.Kernel, BootArgs: f.KernelArgs(), InitrdPath: g.Initrd}); err != nil {
		return err
	}
	if err := api.setMachine(ctx, fcMachineConfig{VCPUCount: max(g.SMP, 1), MemSizeMiB: g.MemoryMB}); err != nil {
		return err
	}
	if g.RootDisk != "" && g.WritableDisk != "" {
		for _, d := range []fcDrive{
			{DriveID: "root", PathOnHost: filepath.Base(g.RootDisk), IsReadOnly: true},
			{DriveID: "rw", PathOnHost: filepath.Base(g.WritableDisk)},
		} {
			if err := api.setDrive(ctx, d); err != nil {
				return err
			}
		}
	}
	if g.AgentSocket != "" {
		if err := api.setVsock(ctx, fcVsock{GuestCID: 3, UDSPath: fcVsockUDS}); err != nil {
			return err
		}
	}
	if g.NetNS != "" {
		if err := api.setNIC(ctx, fcNIC{IfaceID: "eth0", HostDevName: guestTap, GuestMAC: g.MAC}); err != nil {
			return err
		}
	}
	return api.start(ctx)
}

// linkAgent makes the Unix socket a guest's vsock connections to the
// agent's port reach (dir/v.sock_1024) lead to the edge's socket.
func linkAgent(dir, edgeSocket string) error {
	l := filepath.Join(dir, fcVsockUDS+"_"+strconv.Itoa(AgentVsockPort))
	os.Remove(l)
	return os.Symlink(edgeSocket, l)
}

// launch starts a sandbox's Firecracker, booting g, in the box's
// directory, and records its pid.
func (f *Firecracker) launch(ctx context.Context, bx *box, g Guest) error {
	if err := f.configured(bx); err != nil {
		return err
	}
	vm, err := f.start(ctx, bx, g)
	if err != nil {
		return err
	}
	if err := f.configure(ctx, vm.api, g); err != nil {
		vm.kill()
		return err
	}
	return nil
}

// start spawns a sandbox's Firecracker, not yet configured.
func (f *Firecracker) start(ctx context.Context, bx *box, g Guest) (*fcVM, error) {
	if err := linkAgent(bx.Dir, g.AgentSocket); err != nil {
		return nil, err
	}
	if err := os.WriteFile(bx.started(), nil, 0o600); err != nil {
		return nil, err
	}
	if g.NetNS != "" {
		if err := plugTap(ctx, g.NetNS); err != nil {
			return nil, err
		}
	}
	vm, err := f.spawn(ctx, bx.Dir, filepath.Base(filepath.Dir(bx.Dir)), g.NetNS)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(bx.pidFile(), []byte(strconv.Itoa(vm.cmd.Process.Pid)), 0o600); err != nil {
		vm.kill()
		return nil, err
	}
	return vm, nil
}

// configured refuses to start a guest without a Firecracker binary (an
// edge restarted without --microvm-firecracker still serves the guests
// that run, through their API sockets).
func (f *Firecracker) configured(bx *box) error {
	if f.Binary == "" {
		return errdefs.FailedPrecondition("microvm: sandbox %s runs on Firecracker, and this edge has none configured (--microvm-firecracker)", filepath.Base(filepath.Dir(bx.Dir)))
	}
	return nil
}

package microvm

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/cgroups"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/oci"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/spawn"
)

// Name is the backend's name.
const Name = "microvm"

// VMName is the vm backend's name (internal/edge/backend/vm), which runs
// this backend's machinery on the q35 machine.
const VMName = "vm"

// MinMemoryMB is the least guest memory a microVM sandbox runs in: the
// guest kernel, dsec-vminit and the agent take about 60 MiB of it.
const MinMemoryMB = 128

// VMMinMemoryMB is the least guest memory of a vm sandbox: an image's
// systemd and its services boot in it beside the agent.
const VMMinMemoryMB = 256

// Backend runs each sandbox in a QEMU microvm guest.
//
// Lock order: mu guards boxes and roots; it is never held over QEMU, mkfs
// or QMP calls.
type Backend struct {
	name string // Name, or the vm backend's (NewOnMachine)
	cfg  backend.Config
	log  *slog.Logger
	qemu *QEMU
	fc   *Firecracker  // nil unless a Firecracker binary is configured
	cg   *cgroups.Host // the node's cgroups, for the VMMs' CPU limits

	probeOnce sync.Once
	probe     *ProbeResult
	probeErr  error

	mu    sync.Mutex
	boxes map[sandboxid.ID]*box  // guarded by mu
	roots map[string]*sync.Mutex // guarded by mu: a lock per root image being made

	devices     []string   // Options.Devices, in sysfs's form
	templatesOn bool       // Options.Templates
	tpl         *templates // the node's template snapshots
	rootStore   string     // Options.RootStore
	mkfsEROFS   string     // its path, "" without erofs-utils
	sharedWhy   string     // why roots are not shared here, "" if they are
}

// box is one sandbox's guest.
type box struct {
	Dir string `json:"dir"`           // the guest's files: disks, initramfs, sockets
	VMM string `json:"vmm,omitempty"` // Guest.VMM
	// QMP is QEMU's monitor socket, in the sandbox's run directory: a unix
	// socket path holds 107 bytes, which Dir under a deep state directory
	// exceeds. Handles saved before it existed have it in Dir.
	QMP string `json:"qmp,omitempty"`
}

// newBox is the box of a new guest of spec.
func newBox(spec *backend.Spec, vmm string) *box {
	bx := &box{Dir: filepath.Join(spec.Dir, "vm"), VMM: vmm}
	if spec.RunDir != "" {
		bx.QMP = filepath.Join(spec.RunDir, "qmp.sock")
	}
	return bx
}

// vmmFirecracker is Guest.VMM of a Firecracker guest.
const vmmFirecracker = "firecracker"

func (b box) pidFile() string { return filepath.Join(b.Dir, "qemu.pid") }
func (b box) qmpSock() string {
	if b.QMP != "" {
		return b.QMP
	}
	return filepath.Join(b.Dir, "qmp.sock")
}

// Options are the microvm backend's options.
type Options struct {
	// QEMU is the QEMU binary (default: qemu-system-x86_64 on PATH).
	QEMU string `option:"qemu"`
	// Guest is the directory scripts/guest-kernel.sh filled.
	Guest string `option:"guest"`
	// Init is the guest's init, dsec-vminit.
	Init string `option:"init"`
	// Firecracker is a binary the probe tries before QEMU (none: QEMU only).
	Firecracker string `option:"firecracker"`
	// CgroupParent is the VMMs' parent cgroup (oci.Cgroups).
	CgroupParent string `option:"cgroup-parent"`
	// Templates: "on" (the default) creates QEMU guests by restoring a
	// snapshot of a booted guest of their image and shape (template.go);
	// "off" boots every guest.
	Templates string `option:"templates"`
	// RootStore is where root disks shared by every node are kept
	// (sharedroot.go; the image store's blobs/vm-root). Empty: each node
	// makes its own.
	RootStore string `option:"root-store"`
	// Devices are the host PCI devices (comma-separated addresses) this
	// node passes through to the vm backend's sandboxes that ask for
	// them; no other is handed to a guest (vfio.go).
	Devices string `option:"devices"`
}

// New makes the backend.
func New(ctx context.Context, cfg backend.Config) (backend.Backend, error) {
	return NewOnMachine(ctx, cfg, Name, MachineMicrovm)
}

// NewOnMachine makes a backend called name whose QEMU guests run on
// machine (MachineQ35: the vm backend, whose guests run the image's own
// init where it has one; internal/edge/backend/vm).
func NewOnMachine(ctx context.Context, cfg backend.Config, name, machine string) (backend.Backend, error) {
	var o Options
	if err := backend.DecodeOptions(name, cfg.Options, &o); err != nil {
		return nil, err
	}
	q := &QEMU{Binary: o.QEMU, Kernel: filepath.Join(o.Guest, "vmlinux"), Modules: filepath.Join(o.Guest, "modules"), Init: o.Init, Machine: machine}
	if q.Binary == "" {
		q.Binary = "qemu-system-x86_64"
	}
	if mods := filepath.Join(o.Guest, "modules.img"); q.pci() {
		if _, err := os.Stat(mods); err == nil {
			q.ModulesDisk = mods
		}
	}
	devices, err := passthroughDevices(o.Devices, q.pci(), name)
	if err != nil {
		return nil, err
	}
	if o.Firecracker != "" && q.pci() {
		return nil, errdefs.InvalidArgument("%s backend: option firecracker: Firecracker has no %s machine; the %s backend runs on QEMU only", name, machine, name)
	}
	if err := os.MkdirAll(filepath.Join(cfg.StateDir, "roots"), 0o700); err != nil {
		return nil, err
	}
	b := &Backend{name: name, cfg: cfg, log: logging.OrDiscard(cfg.Log).With(logging.Backend, name), qemu: q,
		boxes: map[sandboxid.ID]*box{}, roots: map[string]*sync.Mutex{}, devices: devices}
	cg, err := oci.Cgroups(o.CgroupParent)
	if err == nil {
		b.cg = cg
		if err := cg.Prepare(b.log, false); err != nil {
			b.log.Warn("no CPU limit for microVMs beyond their vCPU count", "err", err)
		}
	} else {
		return nil, err
	}
	if o.Firecracker != "" {
		b.fc = &Firecracker{Binary: o.Firecracker, Kernel: q.Kernel, Modules: q.Modules, Init: q.Init, Log: b.log}
	}
	if b.templatesOn, err = templatesOption(o.Templates); err != nil {
		return nil, err
	}
	if b.tpl, err = newTemplates(filepath.Join(cfg.StateDir, "templates"), q, b.log); err != nil {
		return nil, err
	}
	b.rootStore = o.RootStore
	b.mkfsEROFS, _ = exec.LookPath("mkfs.erofs")
	if b.sharedWhy = b.sharedRootsWhyNot(); b.sharedWhy != "" && b.rootStore != "" {
		b.log.Info("root disks are made per node", "why", b.sharedWhy)
	}
	return b, nil
}

// Name implements backend.Backend.
func (b *Backend) Name() string { return b.name }

// Capabilities implements backend.Backend.
func (b *Backend) Capabilities() backend.Capabilities {
	// A guest's agent on a vCPU or two serves few calls at once, and under
	// TCG fewer: of 500 execs with a 3 s deadline, 8 were admitted at once
	// and answered too late with 32 slots there, and again with 8 (a
	// fresh-clone run; each exec takes some 0.4 s of a TCG vCPU).
	calls, wait := 32, time.Duration(0)
	if b.Accel() == "tcg" {
		calls, wait = 4, tcgAgentWait(b.probe.Boot)
	}
	// A copy of a guest with a network takes its own address (Restore);
	// on QEMU only: Firecracker's copies are unverified.
	snapNet := b.booting() == vmm(b.qemu)
	isolation, minMemory := "microvm", int64(MinMemoryMB)
	if b.qemu.pci() {
		isolation, minMemory = "vm", VMMinMemoryMB
	}
	return backend.Capabilities{Isolation: isolation, PCIDevices: b.qemu.pci(), Pause: true, LinkBeforeAgent: true, Snapshot: true, SnapshotNetwork: snapNet, ConcurrentCalls: calls, DiskFile: true, MinMemoryMB: minMemory, AgentWait: wait}
}

// tcgAgentWait is how long a guest under TCG is given to boot and answer:
// every vCPU is emulated on a host thread, so guests booting together on
// a busy node take many times the probe's lone boot (beside a CPU hog of
// two busy processes on 2 cores, two guests of one test did not answer
// within the edge's 30 s). Twenty probe boots, and no less than 2 minutes.
func tcgAgentWait(probeBoot time.Duration) time.Duration {
	return max(2*time.Minute, 20*probeBoot)
}

// Probe implements backend.Backend: the parts are there and a probe guest
// boots (once per process; its result is logged).
func (b *Backend) Probe(ctx context.Context) error {
	b.probeOnce.Do(func() {
		for what, p := range map[string]string{"the guest kernel (scripts/guest-kernel.sh)": b.qemu.Kernel, "the guest init (dsec-vminit)": b.qemu.Init} {
			if _, err := os.Stat(p); err != nil {
				b.probeErr = fmt.Errorf("%s: %w", what, err)
				return
			}
		}
		if _, err := exec.LookPath(b.qemu.Binary); err != nil {
			b.probeErr = fmt.Errorf("QEMU: %w (Debian's qemu-system-x86)", err)
			return
		}
		if _, err := exec.LookPath("mkfs.ext4"); err != nil {
			b.probeErr = fmt.Errorf("mkfs.ext4: %w (Debian's e2fsprogs)", err)
			return
		}
		key, keyErr := b.probeKey()
		if keyErr == nil {
			if res := b.cachedProbe(key); res != nil {
				b.probe = res
				b.log.Info("probe boot: the answer of an earlier start of this boot, with the same parts", "driver", res.Driver, "accel", res.Accel, "boot", res.Boot.Round(time.Millisecond))
				return
			}
		}
		dir, err := os.MkdirTemp(b.cfg.StateDir, "probe-")
		if err != nil {
			b.probeErr = err
			return
		}
		defer os.RemoveAll(dir)
		b.probe, b.probeErr = b.probeDrivers(ctx, dir)
		if b.probeErr == nil {
			b.log.Info("probe boot", "machine", cmp.Or(b.qemu.Machine, MachineMicrovm), "driver", b.probe.Driver, "accel", b.probe.Accel, "boot", b.probe.Boot.Round(time.Millisecond), "not_used", b.probe.Skipped)
			if keyErr == nil {
				b.saveProbe(key, b.probe)
			}
		}
	})
	return b.probeErr
}

// probeDrivers tries Firecracker (if configured) and then QEMU; the
// result says why a driver or accelerator tried first was not used.
func (b *Backend) probeDrivers(ctx context.Context, dir string) (*ProbeResult, error) {
	var skipped []string
	if b.fc != nil {
		res, err := b.fc.Probe(ctx, dir)
		if err == nil {
			return res, nil
		}
		b.log.Info("microvm: Firecracker's probe boot failed; trying QEMU", "err", err)
		skipped = append(skipped, "firecracker: "+err.Error())
	}
	res, err := b.qemu.Probe(ctx, dir)
	if err != nil {
		return nil, err
	}
	res.Skipped = append(skipped, res.Skipped...)
	return res, nil
}

// Describe implements backend.Describer: the hypervisor, the accelerator
// the probe boot chose, and why a faster one is not used.
func (b *Backend) Describe() string {
	if b.probe == nil {
		return ""
	}
	d := fmt.Sprintf("%s %s, %s (probe boot %s)", b.probe.Driver, cmp.Or(b.qemu.Machine, MachineMicrovm), b.probe.Accel, b.probe.Boot.Round(time.Millisecond))
	for _, s := range b.probe.Skipped {
		if line, _, _ := strings.Cut(s, "\n"); line != "" {
			d += "; not " + line
		}
	}
	return d
}

// Accel is the accelerator the probe chose ("" before a successful Probe).
func (b *Backend) Accel() string {
	if b.probe == nil {
		return ""
	}
	return b.probe.Accel
}

// rootImage returns the read-only root disk of the image whose layers
// are given, making it once per node.
func (b *Backend) rootImage(ctx context.Context, layers []string) (string, error) {
	merged := func() (string, func(), error) { return b.mergeLayers(layers) }
	if key, ok := sharedRootKey(layers); ok && b.sharedWhy == "" {
		l := b.rootLock(key)
		l.Lock()
		defer l.Unlock()
		began := time.Now()
		out, err := b.sharedRoot(ctx, key, merged)
		if err == nil && time.Since(began) > 100*time.Millisecond {
			b.log.Info("shared root image ready", "image", key, "took", time.Since(began).Round(time.Millisecond))
		}
		return out, err
	}
	sum := sha256.Sum256([]byte(strings.Join(layers, "\n")))
	key := hex.EncodeToString(sum[:16])
	out := filepath.Join(b.cfg.StateDir, "roots", key+".ext4")
	l := b.rootLock(key)
	l.Lock()
	defer l.Unlock()
	if _, err := os.Stat(out); err == nil {
		// Its time of last use, which PruneCache's grace counts from.
		now := time.Now()
		return out, os.Chtimes(out, now, now)
	}
	tree, done, err := merged()
	if err != nil {
		return "", err
	}
	defer done()
	began := time.Now()
	if err := BuildRootImage(ctx, tree, out); err != nil {
		return "", err
	}
	b.log.Info("root image built", "image", key, "took", time.Since(began).Round(time.Millisecond))
	return out, nil
}

// mergeLayers gives a read-only view of the layers merged, and what ends
// it.
func (b *Backend) mergeLayers(layers []string) (string, func(), error) {
	if len(layers) == 1 {
		return layers[0], func() {}, nil
	}
	mnt, err := os.MkdirTemp(b.cfg.StateDir, "merge-")
	if err != nil {
		return "", nil, err
	}
	lower := make([]string, len(layers))
	for i, d := range layers {
		lower[len(layers)-1-i] = d // overlayfs wants the top layer first
	}
	if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(lower, ":")); err != nil {
		os.Remove(mnt)
		return "", nil, fmt.Errorf("merge the image's layers: %w", err)
	}
	return mnt, func() {
		unix.Unmount(mnt, unix.MNT_DETACH) //nolint:errcheck // a read-only view
		os.Remove(mnt)
	}, nil
}

// GuestConfig is the sandbox's settings the guest's init applies
// (cmd/dsec-vminit reads it from /dsec/config.json).
type GuestConfig struct {
	Hostname   string    `json:"hostname"`
	Env        []string  `json:"env"`
	WorkDir    string    `json:"work_dir,omitempty"`
	MachineID  string    `json:"machine_id,omitempty"`
	Hosts      string    `json:"hosts,omitempty"`
	ResolvConf string    `json:"resolv_conf,omitempty"`
	Net        *GuestNet `json:"net,omitempty"`
	// Pids and NoFile are the sandbox's limits, which dsec-vminit applies
	// inside the guest.
	Pids   int64 `json:"pids,omitempty"`
	NoFile int64 `json:"nofile,omitempty"`
}

// shapeOf is what a guest of spec runs as on vmm: its accelerator and
// CPU model, memory and vCPUs, and CPU limit.
func (b *Backend) shapeOf(spec *backend.Spec, vmm string) Guest {
	g := Guest{Accel: b.Accel(), MemoryMB: int(spec.MemoryMB), SMP: int(math.Max(1, math.Ceil(spec.CPUCores))), CPUCores: spec.CPUCores, VMM: vmm}
	if g.Accel == "kvm" {
		g.CPU = "host"
	}
	return g
}

// diskOf is the size of spec's writable disk.
func diskOf(spec *backend.Spec) int64 {
	if spec.DiskMB <= 0 {
		return 1024
	}
	return spec.DiskMB
}

// guestConfig is the settings of spec's guest, with nic its network
// interface (nil: none), as its /dsec/config.json.
func guestConfig(spec *backend.Spec, nic *GuestNet) []byte {
	gc := GuestConfig{Hostname: spec.Hostname, Env: spec.Env, WorkDir: spec.WorkDir, MachineID: spec.MachineID, Pids: spec.Pids, NoFile: spec.NoFile, Net: nic}
	if spec.HostsFile != "" {
		data, _ := os.ReadFile(spec.HostsFile)
		gc.Hosts = string(data)
	}
	if spec.ResolvConf != "" {
		data, _ := os.ReadFile(spec.ResolvConf)
		gc.ResolvConf = string(data)
	}
	data, _ := json.Marshal(gc)
	return data
}

// Create implements backend.Backend: the root disk (shared), the
// sandbox's writable disk and its initramfs with its settings.
func (b *Backend) Create(ctx context.Context, spec *backend.Spec) (*backend.Handle, error) {
	if len(spec.Layers) == 0 {
		return nil, errdefs.InvalidArgument("microvm: the image has no layers")
	}
	bx := newBox(spec, "")
	if err := os.MkdirAll(bx.Dir, 0o700); err != nil {
		return nil, err
	}
	root, err := b.rootImage(ctx, spec.Layers)
	if err != nil {
		return nil, err
	}
	disk := diskOf(spec)
	var nic *GuestNet
	if spec.NetNS != "" {
		n, err := readGuestNet(ctx, spec.NetNS)
		if err != nil {
			return nil, err
		}
		nic = &n
	}
	config := guestConfig(spec, nic)
	v := b.booting()
	bx.VMM = v.id()
	rootDisk := filepath.Join(bx.Dir, "root.ext4")
	if err := shareRoot(root, root, rootDisk); err != nil {
		return nil, err
	}
	guest := b.shapeOf(spec, bx.VMM)
	if len(spec.Devices) > 0 {
		if !b.qemu.pci() {
			return nil, errdefs.InvalidArgument("devices: the %s backend passes no host PCI device through; the vm backend does", b.name)
		}
		if err := checkPassthrough("/", b.devices, spec.Devices); err != nil {
			return nil, err
		}
		guest.Devices = spec.Devices
	}
	kernel, err := b.kernelFor(ctx, spec.Layers)
	if err != nil {
		return nil, err
	}
	if kernel.Image {
		guest.Kernel = kernel.Path
	}
	guest.ModulesDisk = b.qemu.modulesDiskFor(kernel)
	guest.Root, guest.Initrd = root, filepath.Join(bx.Dir, "initrd.cpio")
	guest.RootDisk, guest.WritableDisk = rootDisk, filepath.Join(bx.Dir, "rw.ext4")
	guest.AgentChardev, guest.AgentSocket = agentChardev(spec), agentSocket(spec)
	if nic != nil {
		guest.NetNS, guest.MAC = spec.NetNS, nic.MAC
	}
	if v.sharesMemory() {
		guest.MemFile, guest.MemShared = memFile(spec.ID), true
	}
	if err := b.writableDisk(ctx, spec, &guest, disk); err != nil {
		return nil, err
	}
	if guest.Template != "" {
		err = bootInitrdLater(ctx, &guest, bx.Dir, filepath.Join(guest.Template, "initrd.cpio"), config)
	} else {
		modulesDir, modules := b.qemu.Modules, v.modules(nic != nil)
		if kernel.Image {
			modulesDir, modules = kernel.ModulesDir, kernel.modules(nic != nil)
		}
		err = b.qemu.writeSandboxInitrd(guest.Initrd, spec.AgentPath, modulesDir, modules, config)
	}
	if err != nil {
		return nil, err
	}
	if err := bx.saveGuest(guest); err != nil {
		return nil, err
	}
	state, _ := json.Marshal(bx)
	b.mu.Lock()
	b.boxes[spec.ID] = bx
	b.mu.Unlock()
	h := &backend.Handle{ID: spec.ID, Backend: b.name, Version: 1, State: state, Restored: guest.Template != ""}
	if h.Restored {
		h.Network = nic
	}
	return h, nil
}

// guestOf is the box of sandbox id and the description of its guest.
func (b *Backend) guestOf(id sandboxid.ID) (*box, Guest, error) {
	bx, err := b.get(id)
	if err != nil {
		return nil, Guest{}, err
	}
	g, err := bx.loadGuest()
	return bx, g, err
}

func (b *Backend) get(id sandboxid.ID) (*box, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	bx, ok := b.boxes[id]
	if !ok {
		return nil, errdefs.NotFound("microvm: no sandbox %s", id)
	}
	return bx, nil
}

// Start implements backend.Backend: QEMU daemonizes, so the guest outlives
// the edge; it dials the edge's socket for the agent's port and dials
// again after an edge restart.
func (b *Backend) Start(ctx context.Context, id sandboxid.ID) error {
	bx, g, err := b.guestOf(id)
	if err != nil {
		return err
	}
	if g.Template != "" {
		return b.startFromTemplate(ctx, bx, g)
	}
	return b.launch(ctx, bx, g)
}

// launch starts the VMM of g and puts it under the guest's CPU limit.
func (b *Backend) launch(ctx context.Context, bx *box, g Guest) error {
	v, err := b.vmmOf(bx)
	if err != nil {
		return err
	}
	if len(g.BootInitrd) > 0 {
		if g, err = bootInitrd(g, bx.Dir); err != nil {
			return err
		}
		if err := bx.saveGuest(g); err != nil {
			return err
		}
	}
	if err := v.launch(ctx, bx, g); err != nil {
		return err
	}
	return b.limitGuestCPU(bx, g, v)
}

// limitGuestCPU puts a started guest's VMM under its CPU limit; a guest
// that cannot be limited is ended.
func (b *Backend) limitGuestCPU(bx *box, g Guest, v vmm) error {
	if g.CPUCores > 0 {
		id := sandboxid.ID(filepath.Base(filepath.Dir(bx.Dir)))
		pid, ok := bx.pid()
		if !ok {
			return fmt.Errorf("microvm: %s of %s ended as it started; console: %s", v.title(), id, tail(g.Console))
		}
		if err := b.limitCPU(id, pid, g.CPUCores); err != nil && !errors.Is(err, errNoCPUController) {
			bx.kill(0) //nolint:errcheck // a VM without its limit does not run
			return fmt.Errorf("microvm: CPU limit of %s: %w", id, err)
		}
	}
	return nil
}

// shareRoot makes dst name a root disk: a hard link to disk (so a
// snapshot or guest directory keeps it even after the directory it came
// from is removed), or, across file systems, a symlink to the node's
// shared image root.
func shareRoot(disk, root, dst string) error {
	if err := os.Link(disk, dst); err == nil {
		return nil
	}
	if root == "" {
		root = disk
	}
	if err := os.Symlink(root, dst); err != nil {
		return fmt.Errorf("microvm: the root disk: %w", err)
	}
	if strings.HasSuffix(root, sharedRootSuffix) {
		return nil // in the store, which no node prunes
	}
	// A symlink does not count as a link: the root must never be pruned.
	if err := os.WriteFile(root+symlinkedSuffix, nil, 0o600); err != nil {
		return fmt.Errorf("microvm: mark the root disk kept: %w", err)
	}
	return nil
}

// agentChardev joins the agent's port to the sandbox's edge socket; QEMU
// dials it again after an edge restart or a detach.
func agentChardev(spec *backend.Spec) string {
	return "socket,id=agent,path=" + agentSocket(spec) + ",server=off,reconnect=1"
}

// agentSocket is the edge's socket for the sandbox's agent.
func agentSocket(spec *backend.Spec) string { return filepath.Join(spec.RunDir, "edge.sock") }

// memFile is where a sandbox's guest RAM lives: shared memory, so the
// guest's memory is a file a snapshot can keep without copying it through
// QEMU.
func memFile(id sandboxid.ID) string { return filepath.Join("/dev/shm", "opendsec-"+string(id)+".mem") }

func (bx *box) saveGuest(g Guest) error {
	data, err := json.Marshal(g)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(bx.Dir, "guest.json"), data, 0o600)
}

func (bx *box) loadGuest() (Guest, error) {
	var g Guest
	data, err := os.ReadFile(filepath.Join(bx.Dir, "guest.json"))
	if err == nil {
		err = json.Unmarshal(data, &g)
	}
	return g, err
}

// pid is the guest's QEMU process, if it runs.
func (bx *box) started() string { return filepath.Join(bx.Dir, "started") }

func (bx *box) pid() (int, bool) {
	data, err := os.ReadFile(bx.pidFile())
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !strings.Contains(string(cmdline), bx.Dir) {
		return 0, false // gone, or the pid was reused
	}
	return pid, true
}

// Status implements backend.Backend.
func (b *Backend) Status(ctx context.Context, id sandboxid.ID) (backend.Status, error) {
	bx, err := b.get(id)
	if err != nil {
		return backend.Status{ID: id, State: backend.StateUnknown}, err
	}
	pid, ok := bx.pid()
	if !ok {
		// QEMU removes its pid file when it ends: a marker says it ran.
		if _, err := os.Stat(bx.started()); errors.Is(err, os.ErrNotExist) {
			return backend.Status{ID: id, State: backend.StateCreated}, nil
		}
		return backend.Status{ID: id, State: backend.StateStopped}, nil
	}
	st := backend.Status{ID: id, State: backend.StateRunning, Pid: pid}
	if backend.ProcessStopped(pid) {
		st.HostStopped = true // its monitor would not answer either
		return st, nil
	}
	v, err := b.vmmOf(bx)
	if err != nil {
		return st, err
	}
	if v.paused(ctx, bx) {
		st.State = backend.StatePaused
	}
	return st, nil
}

// stoppedByMonitor reports whether QEMU's run state (query-status) is a
// guest stopped by its monitor, which "cont" runs again: a pause, or a
// snapshot's migration to a file, under way or done, whose "cont" never
// came (the edge went down during it). QEMU then stays "postmigrate".
func stoppedByMonitor(running bool, status string) bool {
	if running {
		return false
	}
	switch status {
	case "paused", "postmigrate", "finish-migrate", "suspended":
		return true
	}
	return false
}

// Stop implements backend.Backend: QEMU quits at SIGTERM; SIGKILL after
// grace.
func (b *Backend) Stop(ctx context.Context, id sandboxid.ID, grace time.Duration) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	return bx.kill(grace)
}

func (bx *box) kill(grace time.Duration) error {
	pid, ok := bx.pid()
	if !ok {
		return nil
	}
	was, _ := spawn.ReadStat(pid)
	syscall.Kill(pid, syscall.SIGTERM) //nolint:errcheck // may be gone
	deadline := time.Now().Add(grace)
	for time.Now().Before(deadline) {
		if _, ok := bx.pid(); !ok {
			return waitExited(pid, was)
		}
		time.Sleep(10 * time.Millisecond)
	}
	syscall.Kill(pid, syscall.SIGKILL) //nolint:errcheck // may be gone
	for range 500 {
		if _, ok := bx.pid(); !ok {
			return waitExited(pid, was)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return fmt.Errorf("microvm: QEMU %d did not end", pid)
}

// waitExited waits until process pid, as it was (spawn.ReadStat's), has
// exited: gone, a zombie, or the pid another process's. bx.pid stops
// naming an exiting QEMU as soon as its memory is gone (its cmdline reads
// empty), before it has closed its files: a QEMU started on the same pid
// file then found it still locked ("Cannot lock pid file", seen once in a
// fresh make test's restore in place after a release).
func waitExited(pid int, was spawn.ProcStat) error {
	for range 500 {
		if st, ok := spawn.ReadStat(pid); !ok || st.StartTime != was.StartTime || st.State == "Z" {
			return nil
		}
		time.Sleep(10 * time.Millisecond)
	}
	return fmt.Errorf("microvm: QEMU %d was still exiting 5 s after it ended", pid)
}

// Destroy implements backend.Backend: the guest ends and its files go
// (the root image stays for the image's other sandboxes). A sandbox it has
// no box of (a crash cut its create) is found by its id (orphans.go), and
// so is a VMM whose start was cut before it wrote its pid file.
func (b *Backend) Destroy(ctx context.Context, id sandboxid.ID) error {
	b.mu.Lock()
	bx, ok := b.boxes[id]
	b.mu.Unlock()
	if !ok {
		return b.destroyUnknown(id)
	}
	if err := bx.kill(time.Second); err != nil {
		return err
	}
	if g, err := bx.loadGuest(); err == nil && g.MemShared && g.MemFile != "" {
		os.Remove(g.MemFile)
	}
	if err := b.destroyUnknown(id); err != nil {
		return err
	}
	if err := os.RemoveAll(bx.Dir); err != nil {
		return err
	}
	b.mu.Lock()
	delete(b.boxes, id)
	b.mu.Unlock()
	return nil
}

// Recover implements backend.Backend: a guest that runs is taken back as
// is (QEMU dials the edge's new socket by itself).
func (b *Backend) Recover(ctx context.Context, h *backend.Handle, spec *backend.Spec) error {
	var bx box
	if err := json.Unmarshal(h.State, &bx); err != nil || bx.Dir == "" {
		return fmt.Errorf("microvm: sandbox %s: unreadable handle: %v", h.ID, err)
	}
	b.mu.Lock()
	b.boxes[h.ID] = &bx
	b.mu.Unlock()
	v, err := b.vmmOf(&bx)
	if err != nil {
		return err
	}
	if _, ok := bx.pid(); !ok {
		return errdefs.Unavailable("microvm: sandbox %s: its %s is gone", h.ID, v.title())
	}
	v.reattach(&bx, b.log.With("sandbox", h.ID))
	return nil
}

// ConsoleTail implements backend.ConsoleReader: the end of the guest's
// console, as its VMM keeps it.
func (b *Backend) ConsoleTail(ctx context.Context, id sandboxid.ID) string {
	bx, g, err := b.guestOf(id)
	if err != nil {
		return ""
	}
	v, err := b.vmmOf(bx)
	if err != nil {
		return ""
	}
	return v.consoleTail(ctx, bx, g)
}

// Pause implements backend.Pauser: the guest's vCPUs stop.
func (b *Backend) Pause(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	v, err := b.vmmOf(bx)
	if err != nil {
		return err
	}
	return v.pause(ctx, bx)
}

// Resume implements backend.Pauser.
func (b *Backend) Resume(ctx context.Context, id sandboxid.ID) error {
	bx, err := b.get(id)
	if err != nil {
		return err
	}
	v, err := b.vmmOf(bx)
	if err != nil {
		return err
	}
	return v.resume(ctx, bx)
}

var (
	_ backend.Backend       = (*Backend)(nil)
	_ backend.Pauser        = (*Backend)(nil)
	_ backend.Inventory     = (*Backend)(nil)
	_ backend.ConsoleReader = (*Backend)(nil)
)

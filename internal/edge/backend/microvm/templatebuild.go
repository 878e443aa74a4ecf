package microvm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/sparsefile"
)

// Building a template snapshot (template.go): a guest of the shape booted
// with neutral settings, its agent waited for and its shell run once, then
// snapshotted as a fork's source is, into a build directory renamed into
// place when whole.

// buildMemFile is the template guest's RAM while it is made: shared memory
// named after its build directory (not a sandbox id, so orphans.go never
// takes it for one).
func buildMemFile(build string) string {
	sum := sha256.Sum256([]byte(build))
	return filepath.Join("/dev/shm", "opendsec-template."+hex.EncodeToString(sum[:8])+".mem")
}

// buildNetNS names the namespace a template guest with a NIC runs in
// while it is made (a TAP that leads nowhere).
func buildNetNS(build string) string {
	sum := sha256.Sum256([]byte(build))
	return "dsec-tpl-" + hex.EncodeToString(sum[:6])
}

// templateNet is the template guest's interface: an address of no
// network, which every copy replaces with its own.
var templateNet = GuestNet{Address: "10.255.255.2", Gateway: "10.255.255.1", MAC: "02:00:0a:ff:ff:02"}

// build boots a template guest of s, waits for its agent, snapshots it and
// puts the snapshot at dir.
func (t *templates) build(ctx context.Context, s templateShape, agentPath, dir string, wait time.Duration) (err error) {
	ctx, cancel := context.WithTimeout(ctx, wait+time.Minute)
	defer cancel()
	build := filepath.Join(t.dir, ".build-"+filepath.Base(dir))
	os.Remove(buildMemFile(build)) //nolint:errcheck // from a build a crash cut
	if err := os.RemoveAll(build); err != nil {
		return err
	}
	boot := filepath.Join(build, "boot")
	if err := os.MkdirAll(boot, 0o700); err != nil {
		return err
	}
	defer func() {
		os.Remove(buildMemFile(build)) //nolint:errcheck // may not exist
		if err != nil {
			os.RemoveAll(build) //nolint:errcheck // reporting err
		}
	}()
	g, err := t.prepare(ctx, s, agentPath, build, boot)
	if err != nil {
		return err
	}
	if s.Net {
		ns := buildNetNS(build)
		if out, err := exec.CommandContext(ctx, "ip", "netns", "add", ns).CombinedOutput(); err != nil {
			return fmt.Errorf("microvm: the template's namespace: %v: %s", err, strings.TrimSpace(string(out)))
		}
		defer exec.Command("ip", "netns", "del", ns).Run() //nolint:errcheck // reported by the next start's cleanup if left
		g.NetNS, g.MAC = "/run/netns/"+ns, templateNet.MAC
		for _, args := range [][]string{{"ip", "tuntap", "add", "dev", guestTap, "mode", "tap"}, {"ip", "link", "set", guestTap, "up"}} {
			if _, err := runIn(ctx, g.NetNS, args...); err != nil {
				return fmt.Errorf("microvm: the template's TAP: %w", err)
			}
		}
	}
	// The agent's and monitor's sockets need a short path.
	socks, err := os.MkdirTemp("", "dsec-tpl")
	if err != nil {
		return err
	}
	defer os.RemoveAll(socks)
	link, err := agentlink.Listen(filepath.Join(socks, "a.sock"), t.log)
	if err != nil {
		return err
	}
	defer link.Close()
	g.AgentChardev = "socket,id=agent,path=" + link.Path() + ",server=off,reconnect=1"
	bx := &box{Dir: boot, QMP: filepath.Join(socks, "q.sock")}
	stop, err := t.start(bx, g)
	if err != nil {
		return err
	}
	defer stop()
	serving, cancelWait := context.WithTimeout(ctx, wait)
	defer cancelWait()
	if err := link.WaitServing(serving); err != nil {
		return fmt.Errorf("the template guest's agent did not answer within %s: %w; console: %s", wait, err, t.q.consoleTail(ctx, bx, g))
	}
	warmShell(ctx, link)
	if err := link.Detach(ctx); err != nil {
		return err
	}
	if _, err := t.q.snapshot(ctx, bx, g, backend.SnapshotRef{Dir: build}); err != nil {
		return err
	}
	stop()
	// Every copy copies the template's RAM file; a fifth of its blocks
	// hold only zeros (98 MiB allocated, 75 MiB of data for a 256 MiB
	// busybox guest), which then are neither copied nor held by a copy.
	if _, err := sparsefile.PunchZeros(ctx, filepath.Join(build, "mem")); err != nil {
		return err
	}
	if err := os.RemoveAll(boot); err != nil {
		return err
	}
	shape, _ := json.MarshalIndent(s, "", "  ")
	if err := os.WriteFile(filepath.Join(build, "shape.json"), shape, 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(build, "ready"), nil, 0o600); err != nil {
		return err
	}
	os.RemoveAll(dir) //nolint:errcheck // a template that was not ready
	return os.Rename(build, dir)
}

// prepare writes the template guest's disks and initramfs in boot and
// returns its description.
func (t *templates) prepare(ctx context.Context, s templateShape, agentPath, build, boot string) (Guest, error) {
	rw := filepath.Join(boot, "rw.ext4")
	if err := NewWritableDisk(ctx, rw, s.DiskMB); err != nil {
		return Guest{}, err
	}
	gc := GuestConfig{Hostname: "dsec-template", Pids: s.Pids, NoFile: s.NoFile}
	if s.Net {
		n := templateNet
		gc.Net = &n
	}
	cfg, _ := json.Marshal(gc)
	initrd := filepath.Join(boot, "initrd.cpio")
	kernel := t.q.nodeKernel()
	if s.Kernel != "" {
		k, err := loadBootKernel(filepath.Dir(s.Kernel))
		if err != nil {
			return Guest{}, fmt.Errorf("the image's kernel: %w", err)
		}
		kernel = k
	}
	if err := t.q.writeSandboxInitrd(initrd, agentPath, kernel.ModulesDir, kernel.modules(s.Net), cfg); err != nil {
		return Guest{}, err
	}
	rootDisk := filepath.Join(boot, "root.ext4")
	if err := shareRoot(s.Root, s.Root, rootDisk); err != nil {
		return Guest{}, err
	}
	return Guest{Root: s.Root, Kernel: s.Kernel, ModulesDisk: t.q.modulesDiskFor(kernel), Accel: s.Accel, CPU: s.CPU, MemoryMB: s.MemoryMB, SMP: s.SMP,
		Initrd: initrd, RootDisk: rootDisk, WritableDisk: rw,
		MemFile: buildMemFile(build), MemShared: true}, nil
}

// start runs the template guest's QEMU as the edge's child, which the
// kernel ends if the edge dies (PDEATHSIG, bound to this OS thread until
// stop), at low CPU priority beside the node's sandboxes.
func (t *templates) start(bx *box, g Guest) (stop func(), err error) {
	runtime.LockOSThread()
	argv := append(append([]string{t.q.Binary}, t.q.Args(g)...), "-qmp", "unix:"+bx.qmpSock()+",server=on,wait=off", "-pidfile", bx.pidFile())
	if g.NetNS != "" {
		argv = inNetNS(g.NetNS, argv...) // nsenter execs QEMU: the same process
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("microvm: start the template guest: %w", err)
	}
	syscall.Setpriority(syscall.PRIO_PROCESS, cmd.Process.Pid, 10) //nolint:errcheck // only its priority
	var once sync.Once
	return func() {
		once.Do(func() {
			cmd.Process.Kill() //nolint:errcheck // may have ended
			cmd.Wait()         //nolint:errcheck // killed
			runtime.UnlockOSThread()
		})
	}, nil
}

// warmShell runs the image's shell once in the template guest, so its
// copies start with it in their page cache: a copy's first command is
// most often a shell's, and under TCG its reads from the root disk cost
// a copy tens of milliseconds. An image without /bin/sh is left as it is.
func warmShell(ctx context.Context, link *agentlink.Link) {
	c := agentv1connect.NewProcessServiceClient(&http.Client{Transport: link}, "http://agent")
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	c.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"/bin/sh", "-c", "true"}}})) //nolint:errcheck // a warm-up
}

package microvm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/testutil"
)

// readNewc parses a newc archive: name -> (mode, data).
func readNewc(t *testing.T, b []byte) map[string]struct {
	mode uint64
	data string
} {
	t.Helper()
	out := map[string]struct {
		mode uint64
		data string
	}{}
	field := func(h []byte, i int) uint64 {
		v, err := strconv.ParseUint(string(h[6+8*i:14+8*i]), 16, 32)
		if err != nil {
			t.Fatalf("header field %d: %v", i, err)
		}
		return v
	}
	align := func(n int) int { return (n + 3) &^ 3 }
	for off := 0; ; {
		h := b[off : off+110]
		if string(h[:6]) != "070701" {
			t.Fatalf("bad magic at %d: %q", off, h[:6])
		}
		size, namesize := int(field(h, 6)), int(field(h, 11))
		name := string(b[off+110 : off+110+namesize-1])
		off = align(off + 110 + namesize)
		if name == "TRAILER!!!" {
			return out
		}
		out[name] = struct {
			mode uint64
			data string
		}{field(h, 1), string(b[off : off+size])}
		off = align(off + size)
	}
}

func TestInitramfsHasFilesParentsAndConsole(t *testing.T) {
	var buf bytes.Buffer
	err := WriteInitramfs(&buf, []InitFile{{Path: "/init", Mode: 0o755, Data: []byte("#!")}, {Path: "/lib/modules/a.ko", Mode: 0o644, Data: []byte("12345")}})
	if err != nil {
		t.Fatal(err)
	}
	got := readNewc(t, buf.Bytes())
	want := map[string]uint64{"init": typeFile | 0o755, "lib": typeDir | 0o755, "lib/modules": typeDir | 0o755, "lib/modules/a.ko": typeFile | 0o644, "dev": typeDir | 0o755, "dev/console": typeChar | 0o600}
	for name, mode := range want {
		if got[name].mode != mode {
			t.Errorf("%s: mode %o, want %o", name, got[name].mode, mode)
		}
	}
	if got["lib/modules/a.ko"].data != "12345" || got["init"].data != "#!" || len(got) != len(want) {
		t.Fatalf("entries: %v", got)
	}
	// The kernel's own unpacker agrees: cpio lists the same names.
	if cpio, err := exec.LookPath("cpio"); err == nil {
		cmd := exec.Command(cpio, "-it", "--quiet")
		cmd.Stdin = bytes.NewReader(buf.Bytes())
		out, err := cmd.Output()
		if err != nil || len(strings.Fields(string(out))) != len(want) {
			t.Fatalf("cpio -it: %q, %v", out, err)
		}
	}
	if err := WriteInitramfs(&buf, []InitFile{{Path: "../x"}}); err == nil {
		t.Fatal("a relative path was packed")
	}
}

// TestQEMUProbeBoot boots the probe guest: Debian's cloud kernel under
// QEMU's microvm machine, the init loading the virtio modules and writing
// its marker to the agent's virtio-serial port. On this machine KVM opens
// but does not boot a stock kernel: the probe says so and uses TCG.
// The q35 machine (the vm backend's) boots the same kernel through its
// firmware, its virtio devices on PCI.
func TestQEMUProbeBoot(t *testing.T) {
	for _, machine := range []string{MachineMicrovm, MachineQ35} {
		t.Run(machine, func(t *testing.T) {
			q := testQEMU(t)
			q.Machine = machine
			res, err := q.Probe(context.Background(), t.TempDir())
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("probe: %s with %s in %v; not used: %v", res.Driver, res.Accel, res.Boot, res.Skipped)
			if res.Accel != "tcg" && res.Accel != "kvm" || res.Boot <= 0 {
				t.Fatalf("probe result %+v", res)
			}
		})
	}
}

// testQEMU is the QEMU driver with the guest kernel make deps fetched and
// a freshly built guest init.
func testQEMU(t *testing.T) *QEMU {
	t.Helper()
	qemu := testutil.RequireBinary(t, "qemu-system-x86_64")
	guest := testutil.GuestKernelDir(t)
	return &QEMU{Binary: qemu, Kernel: filepath.Join(guest, "vmlinux"), Init: testutil.VMInitBinary(t), Modules: filepath.Join(guest, "modules")}
}

// TestAgentAnswersInsideTheVM boots a guest whose init hands over to the
// agent (aether), with QEMU joining the agent's virtio-serial port to an
// edge link's Unix socket: a command runs in the guest through the same
// link and HTTP/2 API as in a container, on the guest's own kernel.
func TestAgentAnswersInsideTheVM(t *testing.T) {
	q := testQEMU(t)
	busybox := testutil.RequireBinary(t, "busybox")
	dir := t.TempDir()
	var extra []InitFile
	for p, src := range map[string]string{"/aether": testutil.AgentBinary(t), "/bin/busybox": busybox} {
		data, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		extra = append(extra, InitFile{Path: p, Mode: 0o755, Data: data})
	}
	link, stop := bootGuest(t, q, dir, extra, Guest{MemoryMB: 256})
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	// The link has a connection as soon as QEMU joins the port to it; the
	// agent answers once the guest has booted.
	if err := link.WaitReady(ctx); err != nil {
		t.Fatalf("QEMU did not reach the link: %v", err)
	}
	proc := agentv1connect.NewProcessServiceClient(&http.Client{Transport: link}, "http://agent")
	run := func(args ...string) string {
		t.Helper()
		resp, err := proc.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: args}}))
		if err != nil || resp.Msg.ExitCode != 0 {
			t.Fatalf("run %v: %v, %v", args, resp, err)
		}
		return strings.TrimSpace(string(resp.Msg.Stdout))
	}
	if got := run("/bin/busybox", "echo", "hi from the guest"); got != "hi from the guest" {
		t.Fatalf("echo: %q", got)
	}
	firstExec := time.Since(began)
	// The guest's own kernel, not the host's.
	release, _ := os.ReadFile(filepath.Join(testutil.RepoRoot(t), ".cache", "guest", "release"))
	host, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	if got := run("/bin/busybox", "uname", "-r"); got != strings.TrimSpace(string(release)) || got == strings.TrimSpace(string(host)) {
		t.Fatalf("uname -r in the guest: %q (guest kernel %q, host %q)", got, release, host)
	}
	t.Logf("QEMU start to the first exec's answer: %v", firstExec)
}

// TestAgentRunsOnTheImagesRootDisk: the guest's root is a read-only ext4
// image of a tree (an image's layers) under an overlay whose upper layer
// is the sandbox's own writable disk; the agent runs there, a command
// writes a file, the root image stays as built, and the writable disk
// bounds what can be written.
func TestAgentRunsOnTheImagesRootDisk(t *testing.T) {
	q := testQEMU(t)
	busybox := testutil.RequireBinary(t, "busybox")
	testutil.RequireBinary(t, "mkfs.ext4")
	dir := t.TempDir()
	tree := filepath.Join(dir, "tree")
	for _, d := range []string{"bin", "etc", "root", "tmp"} {
		os.MkdirAll(filepath.Join(tree, d), 0o755)
	}
	data, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(tree, "bin", "busybox"), data, 0o755)
	for _, applet := range []string{"sh", "cat", "echo", "mount", "dd", "df"} {
		os.Symlink("busybox", filepath.Join(tree, "bin", applet))
	}
	os.WriteFile(filepath.Join(tree, "etc", "from-image"), []byte("layer\n"), 0o644)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rootImg, rw := filepath.Join(dir, "root.ext4"), filepath.Join(dir, "rw.ext4")
	if err := BuildRootImage(ctx, tree, rootImg); err != nil {
		t.Fatal(err)
	}
	if err := NewWritableDisk(ctx, rw, 64); err != nil {
		t.Fatal(err)
	}
	before, _ := os.ReadFile(rootImg)
	agent, _ := os.ReadFile(testutil.AgentBinary(t))
	link, stop := bootGuest(t, q, dir, []InitFile{{Path: "/aether", Mode: 0o755, Data: agent}}, Guest{MemoryMB: 256, RootDisk: rootImg, WritableDisk: rw})
	defer stop()
	proc := agentv1connect.NewProcessServiceClient(&http.Client{Transport: link}, "http://agent")
	sh := func(line string) (string, int32) {
		t.Helper()
		resp, err := proc.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"/bin/sh", "-c", line}}}))
		if err != nil {
			t.Fatalf("%s: %v", line, err)
		}
		return strings.TrimSpace(string(resp.Msg.Stdout)), resp.Msg.ExitCode
	}
	if got, _ := sh("cat /etc/from-image; echo written > /root/f; cat /root/f; echo changed > /etc/from-image"); got != "layer\nwritten" {
		t.Fatalf("files: %q", got)
	}
	if got, _ := sh("cat /proc/mounts"); !strings.Contains(got, "overlay / overlay rw,relatime,lowerdir=/mnt/lower,upperdir=/mnt/rw/upper") {
		t.Fatalf("the root is not the image under an overlay:\n%s", got)
	}
	// The writable disk bounds what is written: 64 MiB.
	if _, code := sh("dd if=/dev/zero of=/root/big bs=1M count=100 2>/dev/null"); code == 0 {
		t.Fatal("100 MiB written on a 64 MiB writable disk")
	}
	stop()
	if after, _ := os.ReadFile(rootImg); !bytes.Equal(before, after) {
		t.Fatal("the shared root image changed")
	}
}

// factory makes the backend as cmd/dsec would, on the guest kernel make
// deps fetched.
func factory(q *QEMU) backendtest.Factory {
	return func(t *testing.T, stateDir string) backend.Backend {
		b, err := New(context.Background(), backend.Config{StateDir: stateDir, Log: testutil.Logger(t), Options: map[string]string{
			"qemu": q.Binary, "guest": filepath.Dir(q.Kernel), "init": q.Init,
		}})
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Probe(context.Background()); err != nil {
			t.Fatal(err)
		}
		return b
	}
}

func TestConformance(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	q := testQEMU(t)
	backendtest.Run(t, factory(q), backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true})
}

func TestSnapshotAndCopies(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	q := testQEMU(t)
	backendtest.RunSnapshot(t, factory(q), backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true})
}

// bootGuest starts QEMU with g, an initramfs of the guest init and extra,
// and the agent's port joined to a link on a socket in dir; stop (safe to
// call twice) ends the guest and shows its console if the test failed.
func bootGuest(t *testing.T, q *QEMU, dir string, extra []InitFile, g Guest) (*agentlink.Link, func()) {
	t.Helper()
	g.Initrd, g.Console = filepath.Join(dir, "guest.cpio"), filepath.Join(dir, "console.log")
	if err := q.WriteInitramfs(g.Initrd, extra); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "edge.sock")
	link, err := agentlink.Listen(sock, testutil.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	g.AgentChardev = "socket,id=agent,path=" + sock + ",server=off,reconnect=1"
	cmd := exec.Command(q.Binary, q.Args(g)...)
	if err := cmd.Start(); err != nil {
		link.Close()
		t.Fatal(err)
	}
	var once sync.Once
	return link, func() {
		once.Do(func() {
			cmd.Process.Kill() //nolint:errcheck // the test's guest
			cmd.Wait()         //nolint:errcheck // killed
			link.Close()
			if t.Failed() {
				console, _ := os.ReadFile(g.Console)
				t.Logf("console:\n%s", console)
			}
		})
	}
}

// TestGuestNetwork: a sandbox given a network namespace (as the edge's
// sandbox network makes one: eth0 with a /32, a link route to the gateway
// and the default route) reaches the gateway's side from inside the guest,
// and a server in the guest answers from there, through the TAP joined
// to eth0. Both namespaces are the test's own.
func TestGuestNetwork(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	for _, tool := range []string{"ip", "tc", "nsenter"} {
		testutil.RequireBinary(t, tool)
	}
	q := testQEMU(t)
	sbNS, peerNS := "dsect-vm-"+randSuffix(), "dsect-vmpeer-"+randSuffix()
	sh := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	sh("netns", "add", peerNS)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", peerNS).Run() })
	// sandboxNS makes a sandbox's namespace as the edge's sandbox network
	// does: eth0 with addr, joined to the peer by gw, the gateway 10.99.0.1.
	sandboxNS := func(ns, gw, addr string) {
		sh("netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
		sh("-n", peerNS, "link", "add", gw, "type", "veth", "peer", "name", "eth0", "netns", ns)
		sh("-n", peerNS, "addr", "add", "10.99.0.1/32", "dev", gw)
		sh("-n", peerNS, "link", "set", gw, "up")
		sh("-n", peerNS, "route", "add", addr+"/32", "dev", gw)
		sh("-n", ns, "addr", "add", addr+"/32", "dev", "eth0")
		sh("-n", ns, "link", "set", "eth0", "up")
		sh("-n", ns, "route", "add", "10.99.0.1/32", "dev", "eth0")
		sh("-n", ns, "route", "add", "default", "via", "10.99.0.1")
	}
	sandboxNS(sbNS, "gw0", "10.99.0.2")
	var ln net.Listener
	if err := sandboxnet.InNetNS("/run/netns/"+peerNS, func() (err error) {
		ln, err = net.Listen("tcp", "10.99.0.1:8080")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "hello from the peer") }))

	b := factory(q)(t, t.TempDir())
	env := backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
	spec := backendtest.NewSpec(t, env, sandboxid.NewNodeID())
	spec.NetNS = "/run/netns/" + sbNS
	sb := backendtest.StartSpec(t, b, spec)
	if got := sb.Sh(t, "ip -4 -o addr show | awk '{print $2, $4}'; ip route | sort"); got != "lo 127.0.0.1/8\neth0 10.99.0.2/32\n10.99.0.1 dev eth0 scope link \ndefault via 10.99.0.1 dev eth0 \n" {
		t.Fatalf("the guest's addresses and routes:\n%s", got)
	}
	if got := sb.Sh(t, "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc 10.99.0.1 8080 | tail -1"); got != "hello from the peer" {
		t.Fatalf("from the guest to the peer: %q", got)
	}
	sb.Sh(t, "(echo hello from the guest | nc -l -p 9000) >/dev/null 2>&1 &")
	var reply []byte
	err := sandboxnet.InNetNS("/run/netns/"+peerNS, func() error {
		var err error
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
			var c net.Conn
			if c, err = net.DialTimeout("tcp", "10.99.0.2:9000", time.Second); err == nil {
				c.SetDeadline(time.Now().Add(10 * time.Second))
				reply, err = io.ReadAll(c)
				c.Close()
				return err
			}
		}
		return err
	})
	if err != nil || string(reply) != "hello from the guest\n" {
		t.Fatalf("from the peer to the guest: %q %v", reply, err)
	}

	// A copy on a namespace of its own (another address and MAC on the
	// same gateway) takes its own address and reaches the peer; the source
	// keeps its own.
	copyNS := "dsect-vmcopy-" + randSuffix()
	sandboxNS(copyNS, "gw1", "10.99.0.3")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ref := backend.SnapshotRef{ID: sandboxid.NewSnapshot("aaaaaaaa"), Dir: t.TempDir()}
	if err := sb.Link.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.(backend.Snapshotter).Snapshot(ctx, sb.ID, ref); err != nil {
		t.Fatalf("snapshot of a guest with a network: %v", err)
	}
	if err := sb.Link.Reattach(); err != nil {
		t.Fatal(err)
	}
	cspec := backendtest.NewSpec(t, env, sandboxid.NewNodeID())
	cspec.NetNS = "/run/netns/" + copyNS
	cp := backendtest.Attach(t, b, cspec)
	h, err := b.(backend.Snapshotter).Restore(ctx, ref, cspec)
	if err != nil {
		t.Fatalf("restore with a network: %v", err)
	}
	t.Cleanup(func() { b.Destroy(context.Background(), cspec.ID) })
	if h.Network == nil || h.Network.Address != "10.99.0.3" {
		t.Fatalf("the copy's network in its handle: %+v", h.Network)
	}
	if err := backendtest.WaitCopy(ctx, cp.Link, cspec, h); err != nil {
		t.Fatalf("the copy's agent: %v", err)
	}
	if err := backendtest.WaitAgent(ctx, b, sb.Link); err != nil {
		t.Fatalf("the source's agent after the snapshot: %v", err)
	}
	if got := cp.Sh(t, "ip -4 -o addr show dev eth0 | awk '{print $4}'; cat /sys/class/net/eth0/address"); got != "10.99.0.3/32\n"+h.Network.MAC+"\n" {
		t.Fatalf("the copy's address and MAC:\n%s", got)
	}
	for who, s := range map[string]*backendtest.Sandbox{"the copy": cp, "the source": sb} {
		if got := s.Sh(t, "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc 10.99.0.1 8080 | tail -1"); got != "hello from the peer" {
			t.Fatalf("from %s to the peer: %q", who, got)
		}
	}
}

func randSuffix() string { return strconv.FormatInt(time.Now().UnixNano()%1e6, 36) }

// TestConsoleStaysInQEMUMemory: what the guest writes to its console
// (root in it can write without end) fills a 64 KiB ring in QEMU's memory,
// never a file on the node's disk, and its end is what the edge quotes.
func TestConsoleStaysInQEMUMemory(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	q := testQEMU(t)
	b := factory(q)(t, t.TempDir())
	env := backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
	sb := backendtest.Start(t, b, env)
	sb.Sh(t, "head -c 4194304 /dev/zero | tr '\\0' x > /dev/ttyS0; echo the-last-words > /dev/ttyS0")
	var files int64
	filepath.Walk(sb.Dir, func(_ string, fi os.FileInfo, err error) error { //nolint:errcheck // a sum
		if err == nil && fi.Mode().IsRegular() && strings.Contains(fi.Name(), "console") {
			files += fi.Size()
		}
		return nil
	})
	if files > 0 {
		t.Fatalf("the guest's console wrote %d bytes of files in the sandbox's directory", files)
	}
	if got := b.(backend.ConsoleReader).ConsoleTail(context.Background(), sb.ID); !strings.HasSuffix(got, "the-last-words") || len(got) > 1024 {
		t.Fatalf("console tail (%d bytes) ends %q", len(got), got[max(0, len(got)-40):])
	}
}

// TestConsoleArgs: a sandbox's console is a ring chardev of a power of two
// (QEMU refuses others); a probe's, a file.
func TestConsoleArgs(t *testing.T) {
	q := &QEMU{Binary: "qemu-system-x86_64", Kernel: "/k"}
	args := strings.Join(q.Args(Guest{Initrd: "/i", AgentChardev: "socket,id=agent,path=/s"}), " ")
	if !strings.Contains(args, "-chardev ringbuf,id=console,size=65536 -serial chardev:console") || consoleRingBytes&(consoleRingBytes-1) != 0 {
		t.Fatalf("a sandbox's console: %s", args)
	}
	if args := strings.Join(q.Args(Guest{Initrd: "/i", Console: "/c.log", AgentChardev: "file,id=agent,path=/a"}), " "); !strings.Contains(args, "-serial file:/c.log") || strings.Contains(args, "ringbuf") {
		t.Fatalf("a probe's console: %s", args)
	}
}

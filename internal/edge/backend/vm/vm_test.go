package vm

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// factory makes the backend as cmd/dsec does, on the guest kernel make
// deps fetched.
func factory(t *testing.T) backendtest.Factory {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	qemu := testutil.RequireBinary(t, "qemu-system-x86_64")
	guest := testutil.GuestKernelDir(t)
	init := testutil.VMInitBinary(t)
	return func(t *testing.T, stateDir string) backend.Backend {
		b, err := New(context.Background(), backend.Config{StateDir: stateDir, Log: testutil.Logger(t), Options: map[string]string{
			"qemu": qemu, "guest": guest, "init": init,
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

// busybox has no init of its own: the agent is its guest's init, on the
// q35 machine.
func busybox(t *testing.T) backendtest.Env {
	return backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
}

func TestConformance(t *testing.T) {
	f := factory(t)
	backendtest.Run(t, f, busybox(t))
}

func TestSnapshotAndCopies(t *testing.T) {
	f := factory(t)
	backendtest.RunSnapshot(t, f, busybox(t))
}

// An image with systemd boots it as PID 1, the agent a unit of it; the
// guest has the sandbox's hostname and machine id, the sandbox's
// processes get their own cgroup outside the agent's unit, the kernel's
// modules load, and systemd itself runs its services (a transient one
// started through it).
func TestSystemdIsPID1WithTheAgentAsItsUnit(t *testing.T) {
	sb, spec := startImage(t, "root/debian-systemd:13", 1, 512)
	run := func(script string) string { t.Helper(); return shell(t, sb, script, time.Minute) }
	if got := run("cat /proc/1/comm"); got != "systemd" {
		t.Fatalf("PID 1 is %q, want systemd", got)
	}
	if got := run("systemctl is-active dsec-agent.service"); got != "active" {
		t.Fatalf("the agent's unit: %q", got)
	}
	// Created from the node's template of the image, the guest took the
	// sandbox's identity with the agent's first request.
	if got := run("hostname; uname -n"); got != spec.Hostname+"\n"+spec.Hostname {
		t.Fatalf("hostname %q, want %q", got, spec.Hostname)
	}
	if id := run("cat /etc/machine-id"); len(id) != 32 || strings.Trim(id, "0123456789abcdef") != "" || (spec.MachineID != "" && id != spec.MachineID) {
		t.Fatalf("machine id %q, want 32 hex digits (the spec's %q if it names one)", id, spec.MachineID)
	}
	if got := run("cat /proc/self/cgroup"); !strings.Contains(got, "/sandbox") {
		t.Fatalf("a sandbox process's cgroup is %q, want the sandbox's own", got)
	}
	// Its limits hold under systemd too: open files (the unit's
	// LimitNOFILE) and processes (the sandbox cgroup's pids.max).
	if got, want := run("ulimit -n; cat /sys/fs/cgroup/sandbox/pids.max"), fmt.Sprintf("%d\n%d", spec.NoFile, spec.Pids); got != want {
		t.Fatalf("open files and pids limits %q, want %q", got, want)
	}
	// The kernel's modules are there for modprobe (the node's modules
	// disk, at /lib/modules/RELEASE).
	if got := run("modprobe veth && grep -c '^veth ' /proc/modules"); got != "1" {
		t.Fatalf("modprobe veth: %q", got)
	}
	// systemd runs what it is asked to: wait for the boot, then a
	// transient service.
	run("systemctl is-system-running --wait >/dev/null || true")
	if got := run("systemd-run --wait --quiet --pipe echo from-a-unit"); got != "from-a-unit" {
		t.Fatalf("systemd-run: %q", got)
	}
	t.Logf("systemd's boot: %s", run("systemctl is-system-running || true; systemd-analyze 2>/dev/null | head -1 || true"))
}

// Docker inside: root/debian-docker:13 boots its systemd, which starts
// Debian's dockerd; an image loaded from a tarball (docker save's format,
// made here of the node's static busybox) runs as a container on Docker's
// own bridge, its modules loaded from the node's modules disk.
func TestDockerRunsInsideAVM(t *testing.T) {
	archive := dockerArchive(t, testutil.RequireBinary(t, "busybox"), "dsec/busybox:1")
	sb, _ := startImage(t, "root/debian-docker:13", 2, 1024)
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	run := func(script string) string { t.Helper(); return shell(t, sb, script, 330*time.Second) }
	if _, err := sb.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: "/root/busybox.tar", Data: archive})); err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	run("timeout 300 sh -c 'until docker info >/dev/null 2>&1; do sleep 1; done' || { systemctl status docker --no-pager; journalctl -u docker --no-pager | tail -30; exit 1; }")
	t.Logf("dockerd answered %v after the sandbox's agent", time.Since(began).Round(time.Second))
	if got := run("docker load -i /root/busybox.tar"); !strings.Contains(got, "dsec/busybox:1") {
		t.Fatalf("docker load: %q", got)
	}
	if got := run("docker run --rm dsec/busybox:1 sh -c 'echo hi from a container; ip -o -4 addr show eth0 | grep -c inet'"); got != "hi from a container\n1" {
		t.Fatalf("docker run: %q", got)
	}
}

// startImage starts a sandbox of image (from the repository's store) on
// a new vm backend, with cpus vCPUs and memoryMB of memory.
func startImage(t *testing.T, image string, cpus float64, memoryMB int64) (*backendtest.Sandbox, *backend.Spec) {
	t.Helper()
	f := factory(t)
	layers := backendtest.StoreImageLayers(t, image, "make images")
	spec := backendtest.NewSpec(t, backendtest.Env{Layers: layers, Agent: testutil.AgentBinary(t), Isolated: true}, sandboxid.NewNodeID())
	spec.CPUCores, spec.MemoryMB = cpus, memoryMB
	return backendtest.StartSpec(t, f(t, t.TempDir()), spec), spec
}

// shell runs script in sb with sh and returns its output, trimmed; the
// process may take up to limit. Any failure ends the test.
func shell(t *testing.T, sb *backendtest.Sandbox, script string, limit time.Duration) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit+30*time.Second)
	defer cancel()
	r, err := sb.Proc.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", script}, TimeoutMs: uint32(limit.Milliseconds())}}))
	if err != nil {
		t.Fatalf("%s: %v", script, err)
	}
	if r.Msg.ExitCode != 0 {
		t.Fatalf("%s: exit %d: %s%s", script, r.Msg.ExitCode, r.Msg.Stdout, r.Msg.Stderr)
	}
	return strings.TrimSpace(string(r.Msg.Stdout))
}

// dockerArchive is a tarball in docker save's format of one image, tag,
// whose one layer is the static busybox at bin with sh and ip linked to it.
func dockerArchive(t *testing.T, busybox, tag string) []byte {
	t.Helper()
	bin, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	tw.WriteHeader(&tar.Header{Name: "bin/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(bin))})
	tw.Write(bin)
	for _, applet := range []string{"sh", "ip", "echo", "grep"} {
		tw.WriteHeader(&tar.Header{Name: "bin/" + applet, Typeflag: tar.TypeSymlink, Linkname: "busybox", Mode: 0o777})
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	diffID := sha256.Sum256(layer.Bytes())
	config, _ := json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Cmd": []string{"/bin/sh"}, "Env": []string{"PATH=/bin"}},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{"sha256:" + hex.EncodeToString(diffID[:])}},
	})
	configSum := sha256.Sum256(config)
	configName := hex.EncodeToString(configSum[:]) + ".json"
	manifest, _ := json.Marshal([]map[string]any{{"Config": configName, "RepoTags": []string{tag}, "Layers": []string{"layer.tar"}}})
	var out bytes.Buffer
	ow := tar.NewWriter(&out)
	for _, f := range []struct {
		name string
		data []byte
	}{{"layer.tar", layer.Bytes()}, {configName, config}, {"manifest.json", manifest}} {
		ow.WriteHeader(&tar.Header{Name: f.name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(f.data))})
		ow.Write(f.data)
	}
	if err := ow.Close(); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

// An image with a kernel of its own (root/debian-kernel:13: Debian 13's)
// boots it, not the node's, with its own modules for modprobe, and its
// systemd as PID 1.
func TestTheImagesOwnKernelBoots(t *testing.T) {
	f := factory(t)
	env := backendtest.Env{Layers: backendtest.StoreImageLayers(t, "root/debian-kernel:13", "make images"), Agent: testutil.AgentBinary(t), Isolated: true}
	spec := backendtest.NewSpec(t, env, sandboxid.NewNodeID())
	spec.CPUCores, spec.MemoryMB = 1, 512
	stateA := t.TempDir()
	a := f(t, stateA)
	sb := backendtest.StartSpec(t, a, spec)
	lines := strings.Fields(shell(t, sb, "uname -r; ls /boot | grep vmlinuz; cat /proc/1/comm; modprobe veth && grep -c '^veth ' /proc/modules", time.Minute))
	node, _ := os.ReadFile(filepath.Join(testutil.GuestKernelDir(t), "release"))
	if len(lines) != 4 || "vmlinuz-"+lines[0] != lines[1] || lines[0] == strings.TrimSpace(string(node)) || lines[2] != "systemd" || lines[3] != "1" {
		t.Fatalf("kernel, the image's, PID 1, veth loaded: %q (the node's kernel is %s)", lines, node)
	}
	t.Logf("the guest runs the image's kernel %s", lines[0])

	// Its snapshot restores on a node that never ran the image's guests:
	// the snapshot carries the kernel.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	shell(t, sb, "echo kept > /root/file; sync", time.Minute)
	taken := backend.SnapshotRef{ID: sandboxid.NewSnapshot(sb.ID.Node()), Dir: filepath.Join(stateA, "snapshots", "s1")}
	if err := os.MkdirAll(taken.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := sb.Link.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.(backend.Snapshotter).Snapshot(ctx, sb.ID, taken); err != nil {
		t.Fatal(err)
	}
	pulled := backend.SnapshotRef{ID: taken.ID, Dir: filepath.Join(t.TempDir(), "pulled")}
	if out, err := exec.Command("cp", "-r", "--sparse=always", taken.Dir, pulled.Dir).CombinedOutput(); err != nil {
		t.Fatalf("copy the snapshot as a pull does: %v: %s", err, out)
	}
	if err := os.RemoveAll(filepath.Join(stateA, "kernels")); err != nil { // what the first node took of the image
		t.Fatal(err)
	}
	b := f(t, t.TempDir())
	other := backendtest.NewSpec(t, env, sandboxid.NewNodeID())
	other.CPUCores, other.MemoryMB = 1, 512
	cp := backendtest.Attach(t, b, other)
	t.Cleanup(func() { b.Destroy(context.Background(), other.ID) })
	h, err := b.(backend.Snapshotter).Restore(ctx, pulled, other)
	if err != nil {
		t.Fatalf("restore on a node without the image's kernel: %v", err)
	}
	if err := backendtest.WaitCopy(ctx, cp.Link, other, h); err != nil {
		t.Fatalf("the copy on another node: %v", err)
	}
	if got := strings.Fields(cp.Sh(t, "uname -r; cat /root/file")); len(got) != 2 || got[0] != lines[0] || got[1] != "kept" {
		t.Fatalf("the copy on another node: its kernel and its disk's file = %q, want %s kept", got, lines[0])
	}
	// Its kernel file is the snapshot's, linked into its own directory.
	var g struct{ Kernel string }
	if data, err := os.ReadFile(filepath.Join(other.Dir, "vm", "guest.json")); err != nil || json.Unmarshal(data, &g) != nil {
		t.Fatalf("the copy's guest record: %v", err)
	}
	mine, err1 := os.Stat(g.Kernel)
	kept, err2 := os.Stat(filepath.Join(pulled.Dir, "vmlinuz"))
	if err1 != nil || err2 != nil || filepath.Dir(g.Kernel) != filepath.Join(other.Dir, "vm") || !os.SameFile(mine, kept) {
		t.Fatalf("the copy boots %s (%v, %v), want a link of the snapshot's vmlinuz in its own directory", g.Kernel, err1, err2)
	}
}

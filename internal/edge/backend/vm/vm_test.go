package vm

import (
	"context"
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
	f := factory(t)
	layers := backendtest.StoreImageLayers(t, "root/debian-systemd:13", "make images")
	b := f(t, t.TempDir())
	spec := backendtest.NewSpec(t, backendtest.Env{Layers: layers, Agent: testutil.AgentBinary(t), Isolated: true}, sandboxid.NewNodeID())
	spec.MemoryMB = 512
	sb := backendtest.StartSpec(t, b, spec)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	run := func(script string) string {
		t.Helper()
		r, err := sb.Proc.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", script}}}))
		if err != nil {
			t.Fatalf("%s: %v", script, err)
		}
		if r.Msg.ExitCode != 0 {
			t.Fatalf("%s: exit %d: %s%s", script, r.Msg.ExitCode, r.Msg.Stdout, r.Msg.Stderr)
		}
		return strings.TrimSpace(string(r.Msg.Stdout))
	}
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

package sandboxes

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestVMThroughTheAPI: a sandbox with backend "vm" is a full QEMU machine
// (q35, firmware, PCI); made of root/debian-systemd:13 it runs the image's
// systemd as PID 1 with the agent as its unit, and answers commands, file
// calls and sessions through the API like the other backends; it pauses
// and resumes, and forks into copies that carry its memory (a file on its
// /tmp, which systemd makes a tmpfs, and a shell session's variable), each
// copy with its own name.
func TestVMThroughTheAPI(t *testing.T) {
	store := e2e.PyStore(t)
	if s, err := image.OpenStore(store); err == nil {
		ref, _ := image.ParseRef("root/debian-systemd:13")
		if _, err := s.Resolve(ref); err != nil {
			testutil.Missing(t, "root/debian-systemd:13 is not built (make images): %v", err)
		}
	}
	opts := e2e.MicrovmOptions(t)
	opts["devices"] = "0000:00:00.0" // offered, for the refusal to be this host's lack of an IOMMU
	c := e2e.StartClusterWith(t, store, func(cfg *embed.Config) { cfg.Backends["vm"] = opts }, "vm")
	ctx := e2e.Ctx(t)
	nodes, err := c.Client.Sandboxes.ListNodes(ctx, connect.NewRequest(&sandboxv1.ListNodesRequest{}))
	if err != nil || len(nodes.Msg.Nodes) != 1 {
		t.Fatalf("nodes: %v, %v", nodes, err)
	}
	if detail := nodes.Msg.Nodes[0].BackendDetails["vm"]; !strings.HasPrefix(detail, "qemu q35, ") {
		t.Fatalf("the node's vm detail: %q", detail)
	}
	// A host PCI device: this node has no IOMMU (or the device is not
	// bound to vfio-pci), and the refusal says which.
	_, err = c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "vm", Image: "root/debian-systemd:13", Devices: []string{"00:00.0"}, Resources: &sandboxv1.Resources{MemoryMb: 512}})
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "devices: 0000:00:00.0: ") {
		t.Fatalf("a create with a host device on a node without passthrough: %v", err)
	}
	t.Logf("passthrough refused here: %v", err)
	// One the node does not offer is refused before anything is asked of
	// the host.
	_, err = c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "vm", Image: "root/debian-systemd:13", Devices: []string{"0000:00:01.0"}, Resources: &sandboxv1.Resources{MemoryMb: 512}})
	if connect.CodeOf(err) != connect.CodePermissionDenied || !strings.Contains(err.Error(), "devices: 0000:00:01.0: not one this node passes through") {
		t.Fatalf("a create with a device the node does not offer: %v", err)
	}
	a, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "vm", Image: "root/debian-systemd:13", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 512, DiskMb: 512}})
	if err != nil {
		t.Fatal(err)
	}
	sh := func(sb *client.Sandbox, script string) string {
		t.Helper()
		return strings.TrimSpace(string(e2e.Shell(t, sb, script).Stdout))
	}
	if got := sh(a, "cat /proc/1/comm; systemctl is-active dsec-agent.service; hostname"); got != "systemd\nactive\n"+a.ID {
		t.Fatalf("PID 1, the agent's unit, the hostname: %q", got)
	}
	if got := sh(a, "ls /sys/bus/pci/devices | wc -l"); got == "0" || got == "" {
		t.Fatalf("PCI devices in a q35 guest: %q", got)
	}
	if _, err := a.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: "/tmp/note", Data: []byte("in RAM")})); err != nil {
		t.Fatal(err)
	}
	if got := sh(a, "findmnt -no FSTYPE /tmp; cat /tmp/note"); got != "tmpfs\nin RAM" {
		t.Fatalf("/tmp and the file written through the API: %q", got)
	}
	for _, call := range []func() error{
		func() error {
			_, err := c.Client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: a.ID}))
			return err
		},
		func() error {
			_, err := c.Client.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: a.ID}))
			return err
		},
	} {
		if err := call(); err != nil {
			t.Fatal(err)
		}
	}
	sess, err := a.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	secret := e2e.RunIn(t, a, sess.Msg.Session.Id, "SECRET=$RANDOM$RANDOM; echo $SECRET")
	resp, err := c.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: a.ID, Count: 2}))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork(2) of a vm sandbox: source paused %d us", resp.Msg.SourcePauseUs)
	for i, r := range append([]*sandboxv1.ForkResult{{Sandbox: &sandboxv1.Sandbox{Id: a.ID}}}, resp.Msg.Results...) {
		if r.Sandbox == nil {
			t.Fatalf("copy %d: %s %s", i, r.ErrorCode, r.ErrorMessage)
		}
		sb := c.Client.Sandbox(r.Sandbox.Id)
		if got := e2e.RunIn(t, sb, sess.Msg.Session.Id, "echo $SECRET"); string(got) != string(secret) {
			t.Fatalf("sandbox %d: the session's variable reads %q, want %q", i, got, secret)
		}
		if got := sh(sb, "cat /tmp/note; echo; hostname; cat /proc/1/comm"); got != "in RAM\n"+sb.ID+"\nsystemd" {
			t.Fatalf("sandbox %d: %q", i, got)
		}
	}
}

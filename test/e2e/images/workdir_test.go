package images

import (
	"testing"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestWorkdirTheImageLacks: an image whose WORKDIR does not exist in it
// still starts, in that directory (made, as docker makes it), on every
// backend.
func TestWorkdirTheImageLacks(t *testing.T) {
	c := pullCluster(t)
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(ctx)
	cfg := &imagev1.ImageConfig{Env: []string{"PATH=/bin:/sbin:/usr/bin"}, WorkingDir: "/made/by/the/runtime"}
	resp, err := c.Client.Sandboxes.CommitSandbox(ctx, connect.NewRequest(&sandboxv1.CommitSandboxRequest{SandboxId: sb.ID, Name: "root/workdir:1", Config: cfg}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.Msg.Image.Config.WorkingDir != cfg.WorkingDir {
		t.Fatalf("committed config %+v", resp.Msg.Image.Config)
	}
	res := &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256, DiskMb: 128}
	for _, be := range []string{"container", "gvisor", "microvm"} {
		t.Run(be, func(t *testing.T) {
			nsb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: be, Image: "root/workdir:1", Resources: res})
			if err != nil {
				t.Fatal(err)
			}
			defer nsb.Stop(ctx)
			if r := e2e.Shell(t, nsb, "pwd"); string(r.Stdout) != "/made/by/the/runtime\n" {
				t.Fatalf("pwd: %q %q", r.Stdout, r.Stderr)
			}
		})
	}
}

package controlplane

import (
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/test/e2e"
)

// An image's start and ready labels (image.LabelStart...): the create is
// answered once the service is ready, on both backends; a service that
// never gets ready fails the create and leaves no sandbox.
func TestImageServiceStartsBeforeTheCreateAnswers(t *testing.T) {
	c := e2e.GvisorCluster(t)
	ctx := e2e.Ctx(t)
	base, err := c.Images.Resolve(mustRef(t, "root/busybox:latest"))
	if err != nil {
		t.Fatal(err)
	}
	commit := func(name string, labels map[string]string) string {
		t.Helper()
		cfg := base.Config.Config
		cfg.Labels = labels
		if _, err := c.Images.Commit(mustRef(t, name), base, nil, cfg); err != nil {
			t.Fatal(err)
		}
		return name
	}
	// Ready one second after the start: a create that did not wait would
	// find no /tmp/ready.
	svc := commit("root/svc:ready", map[string]string{
		image.LabelStart:     "sleep 1; id -un > /tmp/ready; exec sleep 100000",
		image.LabelStartUser: "user",
		image.LabelReady:     "test -s /tmp/ready",
	})
	never := commit("root/svc:never", map[string]string{
		image.LabelStart: "exec sleep 100000", image.LabelReady: "false", image.LabelReadyLimit: "1s",
	})
	badLimit := commit("root/svc:badlimit", map[string]string{image.LabelStart: "true", image.LabelReadyLimit: "soon"})
	for _, backend := range []string{"container", "gvisor"} {
		t.Run(backend, func(t *testing.T) {
			sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: svc})
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Stop(ctx) //nolint:errcheck // best effort
			r := e2e.Shell(t, sb, "cat /tmp/ready; ps -o user,args | grep '[s]leep 100000'")
			if out := string(r.Stdout); !strings.HasPrefix(out, "user\n") || !strings.Contains(out, "sleep 100000") {
				t.Fatalf("right after the create: %q %q, want the service's marker (written as user) and its process", r.Stdout, r.Stderr)
			}

			_, err = c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: never})
			if !errors.Is(errdefs.FromConnect(err), errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "did not become ready within 1s") || !strings.Contains(err.Error(), `ready check "false"`) {
				t.Fatalf("a service that never gets ready: %v", err)
			}
			_, err = c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: backend, Image: badLimit})
			if !errors.Is(errdefs.FromConnect(err), errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), image.LabelReadyLimit) {
				t.Fatalf("a bad ready limit: %v", err)
			}
			list, err := c.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
			if err != nil {
				t.Fatal(err)
			}
			if got := list.Msg.Sandboxes; len(got) != 1 || got[0].Id != sb.ID {
				t.Fatalf("sandboxes after the failed creates: %v, want only %s", got, sb.ID)
			}
		})
	}
}

func mustRef(t *testing.T, s string) image.Ref {
	t.Helper()
	r, err := image.ParseRef(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

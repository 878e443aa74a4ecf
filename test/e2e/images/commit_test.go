package images

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// changes is what the committed sandbox does to root/busybox: files made,
// changed and deleted, a directory replaced (opaque), a symlink, a hard
// link, a setuid file, another owner, a large file, and paths the commit
// leaves out.
const changes = `set -e
mkdir -p /data/sub /root/.cache
echo new > /data/new
ln -s new /data/link
ln /data/new /data/hard
echo suid > /data/suid && chmod 4755 /data/suid
echo owned > /data/owned && chown 1234:5678 /data/owned && chmod 640 /data/owned
echo 'extra:x:4321:4321::/home/extra:/bin/sh' >> /etc/passwd
rm /etc/group /bin/vi
rm -rf /sbin && mkdir /sbin && echo only > /sbin/only
head -c 8388608 /dev/urandom > /data/big
echo secret > /root/.cache/token
echo bytecode > /data/sub/x.pyc
sha256sum /data/big | cut -d' ' -f1`

// committedChecks are what a sandbox of the committed image must see.
func committedChecks(bigSum string) []struct{ cmd, want string } {
	return []struct{ cmd, want string }{
		{"cat /data/new /data/link", "new\nnew\n"},
		{"[ $(stat -c %i /data/new) = $(stat -c %i /data/hard) ] && echo same-inode", "same-inode\n"},
		{"readlink /data/link", "new\n"},
		{"stat -c '%a' /data/suid; stat -c '%u:%g %a' /data/owned", "4755\n1234:5678 640\n"},
		{"tail -n 1 /etc/passwd", "extra:x:4321:4321::/home/extra:/bin/sh\n"},
		{"for f in /etc/group /bin/vi /root/.cache /data/sub/x.pyc; do [ -e $f ] || [ -L $f ] && echo $f; done; echo checked", "checked\n"},
		{"ls /sbin | tr '\\n' ' '", "only "},
		{"[ -d /data/sub ] && echo dir", "dir\n"},
		{"sha256sum /data/big | cut -d' ' -f1", bigSum + "\n"},
	}
}

// TestCommitAndRunEverywhere: a running container sandbox and a microvm
// sandbox are committed (pack_diff) after changing their files; each keeps
// running, and sandboxes of the new images see exactly those changes on
// container, gvisor and microvm; the image pushes, and skopeo reads it
// back. gVisor sandboxes cannot be committed (their writable layer is in
// their memory) and say so.
func TestCommitAndRunEverywhere(t *testing.T) {
	c := pullCluster(t)
	reg := e2e.StartRegistry(t)
	ctx := e2e.Ctx(t)
	res := &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256, DiskMb: 256}
	for _, from := range []string{"container", "microvm"} {
		t.Run(from, func(t *testing.T) {
			sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: from, Image: "root/busybox:latest", Resources: res})
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Stop(ctx)
			r := e2e.Shell(t, sb, changes)
			if r.ExitCode != 0 {
				t.Fatalf("changes: exit %d: %s", r.ExitCode, r.Stderr)
			}
			bigSum := strings.TrimSpace(string(r.Stdout))
			e2e.Shell(t, sb, "sleep 1000 >/dev/null 2>&1 &")
			name := "root/committed-" + from + ":1"
			im, err := sb.Commit(ctx, name, "/root/.cache", "*.pyc")
			if err != nil {
				t.Fatal(err)
			}
			if im.Layers != 2 || im.Name != name {
				t.Fatalf("committed %+v; want 2 layers named %s", im, name)
			}
			got, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
			if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
				t.Fatalf("after the commit the sandbox is %v (%v); want running", got.Msg.GetSandbox().GetState(), err)
			}
			if r := e2e.Shell(t, sb, "pidof sleep >/dev/null && echo alive"); string(r.Stdout) != "alive\n" {
				t.Fatalf("the sandbox's process after the commit: %q", r.Stdout)
			}
			for _, to := range []string{"container", "gvisor", "microvm"} {
				t.Run(to, func(t *testing.T) {
					nsb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: to, Image: name, Resources: res})
					if err != nil {
						t.Fatal(err)
					}
					defer nsb.Stop(ctx)
					checkAll(t, nsb, committedChecks(bigSum))
				})
			}
			if _, err := c.Client.PushImage(ctx, name, reg+"/committed/"+from+":1", nil, nil); err != nil {
				t.Fatal(err)
			}
			if got := skopeoInspectDigest(t, reg+"/committed/"+from+":1"); string(got) != `"`+im.Digest+`"` {
				t.Fatalf("skopeo reads digest %s; committed %s", got, im.Digest)
			}
		})
	}

	g, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: res})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Stop(ctx)
	if _, err := g.Commit(ctx, "root/committed-gvisor:1"); connect.CodeOf(err) != connect.CodeUnimplemented || !strings.Contains(err.Error(), "gvisor") {
		t.Fatalf("commit of a gvisor sandbox: %v", err)
	}
	if _, err := g.Commit(ctx, "root/bad name"); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("commit under a bad name: %v", err)
	}
	if _, err := g.Commit(ctx, "root/x:1", "/"); connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "everything") {
		t.Fatalf("commit excluding /: %v", err)
	}
	gone := c.Client.Sandbox(g.ID)
	g.Stop(ctx)
	if _, err := gone.Commit(ctx, "root/x:1"); connect.CodeOf(err) != connect.CodeNotFound && connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("commit of a stopped sandbox: %v", err)
	}
}

func checkAll(t *testing.T, sb *client.Sandbox, checks []struct{ cmd, want string }) {
	t.Helper()
	for _, ch := range checks {
		r := e2e.Shell(t, sb, ch.cmd)
		if string(r.Stdout) != ch.want {
			t.Errorf("%q: got %q (exit %d, stderr %q); want %q", ch.cmd, r.Stdout, r.ExitCode, r.Stderr, ch.want)
		}
	}
}

// TestCacheLimitWhileSandboxesRun: on a node whose layer cache may hold
// almost nothing, dsec image gc removes the layers of an image no sandbox
// uses, says why, and keeps those of a running sandbox, which goes on
// working; the removed image starts again (unpacked anew). The new
// layers are kept unpacked (--unpack-layers): a layer mounted from its
// EROFS form takes none of the node's disk and no limit applies to it.
func TestCacheLimitWhileSandboxesRun(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.LayerCacheLimit = 1; cfg.UnpackLayers = true }, "container")
	ctx := e2e.Ctx(t)
	running, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	defer running.Stop(ctx)
	e2e.Shell(t, running, "echo other > /other")
	other, err := running.Commit(ctx, "root/other:1")
	if err != nil {
		t.Fatal(err)
	}
	osb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: other.Name})
	if err != nil {
		t.Fatal(err)
	}
	osb.Stop(ctx)
	time.Sleep(6 * time.Second) // past the gc's grace for a create's layers
	resp, err := c.Client.Images.CollectGarbage(ctx, connect.NewRequest(&imagev1.CollectGarbageRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Msg.Nodes) != 1 || len(resp.Msg.Nodes[0].Removed) != 1 || !strings.Contains(resp.Msg.Nodes[0].Removed[0], "over its limit") {
		t.Fatalf("gc removed %+v; want root/other's own layer, over the limit", resp.Msg.Nodes)
	}
	if r := e2e.Shell(t, running, "cat /other; ls /bin/sh"); string(r.Stdout) != "other\n/bin/sh\n" {
		t.Fatalf("the running sandbox after the gc: %q %q", r.Stdout, r.Stderr)
	}
	again, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: other.Name})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Stop(ctx)
	if r := e2e.Shell(t, again, "cat /other"); string(r.Stdout) != "other\n" {
		t.Fatalf("a sandbox of the collected image: %q", r.Stdout)
	}
}

// TestCommitGvisorOnTheNewerRunsc: a gVisor sandbox on the newer runsc is
// committed (its sentry writes out its writable layer) and its image runs
// on container and gvisor with exactly its changes.
func TestCommitGvisorOnTheNewerRunsc(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	net := filepath.Join(testutil.RepoRoot(t), ".cache", "bin", "runsc-net")
	if _, err := os.Stat(net); err != nil {
		testutil.Missing(t, "the newer runsc is not built (make deps): %v", err)
	}
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Backends["gvisor"] = map[string]string{"runsc-network": net, "runsc-newer-for": "all"}
	}, "gvisor", "container")
	ctx := e2e.Ctx(t)
	res := &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256, DiskMb: 256}
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: res})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Stop(ctx)
	r := e2e.Shell(t, sb, changes)
	if r.ExitCode != 0 {
		t.Fatalf("changes: exit %d: %s", r.ExitCode, r.Stderr)
	}
	bigSum := strings.TrimSpace(string(r.Stdout))
	if r := e2e.Shell(t, sb, "echo before"); string(r.Stdout) != "before\n" {
		t.Fatalf("before the commit: %q %q exit %d", r.Stdout, r.Stderr, r.ExitCode)
	}
	im, err := sb.Commit(ctx, "root/committed-gvisor:1", "/root/.cache", "*.pyc")
	if err != nil {
		t.Fatal(err)
	}
	if r := e2e.Shell(t, sb, "echo still running"); string(r.Stdout) != "still running\n" {
		t.Fatalf("after the commit: %q %q exit %d", r.Stdout, r.Stderr, r.ExitCode)
	}
	for _, to := range []string{"container", "gvisor"} {
		t.Run(to, func(t *testing.T) {
			nsb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: to, Image: im.Name, Resources: res})
			if err != nil {
				t.Fatal(err)
			}
			defer nsb.Stop(ctx)
			checkAll(t, nsb, committedChecks(bigSum))
		})
	}
}

package images

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/test/e2e"
)

// TestCLIPushPull: dsec image push and pull as a person runs them, with
// progress on stderr and the result on stdout.
func TestCLIPushPull(t *testing.T) {
	c := e2e.ContainerCluster(t)
	reg := e2e.StartRegistry(t)
	bin := e2e.DsecBinary(t)
	home := t.TempDir() // no user's docker config
	run := func(stdin string, args ...string) (string, string, int) {
		t.Helper()
		return e2e.RunCLI(t, bin, []string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key, "HOME=" + home, "DOCKER_CONFIG="}, stdin, args...)
	}
	out, errOut, code := run("", "image", "push", "root/busybox:latest", reg+"/cli/bb:1")
	if code != 0 || !strings.HasPrefix(out, reg+"/cli/bb:1 sha256:") {
		t.Fatalf("dsec image push: %q %q exit %d", out, errOut, code)
	}
	pushed := strings.Fields(out)[1]
	out, errOut, code = run("", "image", "pull", reg+"/cli/bb:1", "--as", "root/bb:cli")
	if code != 0 || !strings.HasPrefix(out, "root/bb:cli "+pushed) || !strings.Contains(errOut, "layer 1/") {
		t.Fatalf("dsec image pull: %q %q exit %d", out, errOut, code)
	}
	// A login from stdin (this registry asks none, so any is taken).
	if out, errOut, code = run("s3cret\n", "image", "pull", "--username", "u", "--password-stdin", reg+"/cli/bb:1"); code != 0 || !strings.HasPrefix(out, "root/bb:1 "+pushed) {
		t.Fatalf("dsec image pull with a login and the default name: %q %q exit %d", out, errOut, code)
	}
	if _, errOut, code = run("", "image", "pull", "--username", "u", reg+"/cli/bb:1"); code == 0 || !strings.Contains(errOut, "go together") {
		t.Fatalf("--username without --password-stdin: %q exit %d", errOut, code)
	}
	if _, errOut, code = run("", "image", "pull", reg+"/cli/none:1"); code == 0 || !strings.Contains(errOut, "not_found") {
		t.Fatalf("pull of a missing image: %q exit %d", errOut, code)
	}

	// A build's step cache is left out of dsec image ls, unless --all.
	if out, errOut, code = run("", "image", "tag", "root/bb:cli", "root/build-cache:0123456789abcdef"); code != 0 {
		t.Fatalf("dsec image tag: %q %q exit %d", out, errOut, code)
	}
	out, errOut, code = run("", "image", "ls")
	if code != 0 || strings.Contains(out, "build-cache") || !strings.Contains(out, "root/bb:cli") || !strings.Contains(errOut, "1 build cache images not shown") {
		t.Fatalf("dsec image ls: %q %q exit %d", out, errOut, code)
	}
	if out, _, code = run("", "image", "ls", "--all"); code != 0 || !strings.Contains(out, "root/build-cache:0123456789abcdef") {
		t.Fatalf("dsec image ls --all: %q exit %d", out, code)
	}
	if _, errOut, code = run("", "image", "ls", "--everything"); code == 0 || !strings.Contains(errOut, "usage") {
		t.Fatalf("dsec image ls with a bad flag: %q exit %d", errOut, code)
	}
}

// TestCLIBuildRootfs: dsec image build RECIPE --rootfs DIR writes the
// recipe's root into a new directory (as make test-hosts makes its
// machine's disk), and refuses a second destination or a directory that
// holds something.
func TestCLIBuildRootfs(t *testing.T) {
	bin := e2e.DsecBinary(t)
	root := filepath.Join(t.TempDir(), "root")
	out, errOut, code := e2e.RunCLI(t, bin, nil, "", "image", "build", "busybox", "--rootfs", root)
	if code != 0 || !strings.Contains(out, root) {
		t.Fatalf("build --rootfs: %q %q exit %d", out, errOut, code)
	}
	if _, err := os.Stat(filepath.Join(root, "bin", "busybox")); err != nil {
		t.Fatalf("the root lacks its shell: %v", err)
	}
	if _, errOut, code = e2e.RunCLI(t, bin, nil, "", "image", "build", "busybox", "--rootfs", root); code == 0 || !strings.Contains(errOut, "not empty") {
		t.Fatalf("a second build into the same root: %q exit %d", errOut, code)
	}
	if _, errOut, code = e2e.RunCLI(t, bin, nil, "", "image", "build", "busybox", "--rootfs", t.TempDir(), "--store", t.TempDir()); code == 0 || !strings.Contains(errOut, "exactly one of") {
		t.Fatalf("--rootfs with --store: %q exit %d", errOut, code)
	}
	if _, errOut, code = e2e.RunCLI(t, bin, nil, "", "image", "build", "code-interpreter", "--rootfs", t.TempDir()); code == 0 || !strings.Contains(errOut, "no root of its own") {
		t.Fatalf("--rootfs of a recipe on a base: %q exit %d", errOut, code)
	}
}

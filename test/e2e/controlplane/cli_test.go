package controlplane

import (
	"slices"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/test/e2e"
)

// TestCLI drives the dsec verbs a person uses against a real cluster.
func TestCLI(t *testing.T) {
	c := e2e.ContainerCluster(t)
	bin := e2e.DsecBinary(t)
	run := func(args ...string) (string, string, int) {
		t.Helper()
		return e2e.RunCLI(t, bin, []string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key}, "", args...)
	}
	id, stderr, code := run("run", "--image", "root/busybox:latest", "--cpu", "0.5", "--memory", "128")
	id = strings.TrimSpace(id)
	if code != 0 || len(id) != 25 {
		t.Fatalf("dsec run: %q %q %d", id, stderr, code)
	}
	if out, _, code := run("exec", id, "--", "sh", "-c", "echo hi; exit 7"); out != "hi\n" || code != 7 {
		t.Fatalf("dsec exec: %q exit %d", out, code)
	}
	if _, errOut, code := run("exec", id, "--", "no-such-program"); code != 127 || !strings.Contains(errOut, "command not found") {
		t.Fatalf("missing program: %q exit %d", errOut, code)
	}
	if out, _, _ := run("ls", "-q"); strings.TrimSpace(out) != id {
		t.Fatalf("dsec ls -q: %q", out)
	}
	if _, errOut, code := run("run", "--backend", "nope"); code == 0 || !strings.Contains(errOut, `invalid_argument: backend "nope": unknown`) {
		t.Fatalf("bad backend: %q exit %d", errOut, code)
	}
	if out, _, code := run("run", "--rm", "--image", "root/busybox:latest", "--", "echo", "once"); out != "once\n" || code != 0 {
		t.Fatalf("dsec run --rm: %q exit %d", out, code)
	}
	other, _, _ := run("run", "--image", "root/busybox:latest")
	out, _, code := run("stop", "--all")
	if stopped := strings.Fields(out); code != 0 || len(stopped) != 2 || !slices.Contains(stopped, id) || !slices.Contains(stopped, strings.TrimSpace(other)) {
		t.Fatalf("dsec stop --all: %q exit %d; want %s and %s", out, code, id, other)
	}
	// Nothing of the three sandboxes this test made (the --rm one too).
	e2e.AssertNoLeaks(t, c)
	if out, _, _ := run("ls", "-q"); strings.TrimSpace(out) != "" {
		t.Fatalf("sandboxes after stop --all: %q", out)
	}
}

package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/opendsec/opendsec/internal/testutil"
)

var (
	dsecOnce sync.Once
	dsecBin  string
	dsecErr  error
)

// dsecBinary builds cmd/dsec once per test process.
func dsecBinary(t *testing.T) string {
	dsecOnce.Do(func() {
		dir, err := testutil.ProcessDir("dsec-cli")
		if err != nil {
			dsecErr = err
			return
		}
		dsecBin = filepath.Join(dir, "dsec")
		cmd := exec.Command("go", "build", "-o", dsecBin, "./cmd/dsec")
		cmd.Dir = testutil.RepoRoot(t)
		if out, err := cmd.CombinedOutput(); err != nil {
			dsecErr = err
			t.Logf("%s", out)
		}
	})
	if dsecErr != nil {
		t.Fatal(dsecErr)
	}
	return dsecBin
}

// TestCLI drives the dsec verbs a person uses against a real cluster.
func TestCLI(t *testing.T) {
	c := containerCluster(t)
	bin := dsecBinary(t)
	env := append(os.Environ(), "DSEC_API_URL="+c.APIURL, "DSEC_API_KEY="+c.key)
	run := func(args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = env
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errb.String(), code
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
	assertNoLeaks(t, c)
	if out, _, _ := run("ls", "-q"); strings.TrimSpace(out) != "" {
		t.Fatalf("sandboxes after stop --all: %q", out)
	}
}

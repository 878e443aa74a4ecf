package e2e

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/testutil"
)

// StartRegistry runs Debian's docker-registry (the CNCF Distribution
// registry) on a loopback port of the test's own, storing in a temporary
// directory, and returns its "127.0.0.1:PORT". It stops with the test.
func StartRegistry(t *testing.T) string {
	t.Helper()
	bin := testutil.RequireBinary(t, "docker-registry")
	dir := t.TempDir()
	host := fmt.Sprintf("127.0.0.1:%d", FreePort(t))
	cfg := fmt.Sprintf(`version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
http:
  addr: %s
`, filepath.Join(dir, "data"), host)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(dir, "registry.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "serve", cfgPath)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		logf.Close()
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + host + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return host
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("docker-registry on %s did not answer in 30 s: %v\n%s", host, err, TailFile(logPath))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

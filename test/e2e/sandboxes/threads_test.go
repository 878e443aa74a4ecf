package sandboxes

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/test/e2e"
)

// hostThreadsOf counts the host tasks of a gVisor sandbox: its runsc
// generation's pids cgroup (sentry, gofer and stub threads).
func hostThreadsOf(t *testing.T, id string) int {
	files, _ := filepath.Glob("/sys/fs/cgroup/pids/opendsec/" + id + "-*/pids.current")
	n := 0
	for _, f := range files {
		data, _ := os.ReadFile(f)
		k, _ := strconv.Atoi(strings.TrimSpace(string(data)))
		n += k
	}
	return n
}

// gVisor keeps host threads after tasks end; the edge compacts a sandbox
// that holds many once it is quiet, and the count returns to its idle level
// with the sandbox's state intact.
func TestGvisorHostThreadsReturnToIdleAfterWaves(t *testing.T) {
	c := e2e.GvisorCluster(t)
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{MemoryMb: 1024}})
	if err != nil {
		t.Fatal(err)
	}
	e2e.Shell(t, sb, "echo kept > /root/mark; sleep 1000 >/dev/null 2>&1 &")
	idle := hostThreadsOf(t, sb.ID)
	for w := 0; w < 2; w++ {
		e2e.Shell(t, sb, "for i in $(seq 200); do sleep 1 & done; wait")
	}
	peak := hostThreadsOf(t, sb.ID)
	t.Logf("host threads: idle %d, after two waves of 200 %d", idle, peak)
	if peak < idle+500 {
		t.Fatalf("the waves did not raise the host threads (%d -> %d): this test shows nothing", idle, peak)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for hostThreadsOf(t, sb.ID) > idle+100 {
		if time.Now().After(deadline) {
			t.Fatalf("host threads still %d, idle level %d", hostThreadsOf(t, sb.ID), idle)
		}
		time.Sleep(500 * time.Millisecond)
	}
	t.Logf("host threads back to %d", hostThreadsOf(t, sb.ID))
	if r := e2e.Shell(t, sb, "cat /root/mark; ps | grep -v grep | grep -c 'sleep 1000'"); string(r.Stdout) != "kept\n1\n" {
		t.Fatalf("state after compaction: %q", r.Stdout)
	}
}

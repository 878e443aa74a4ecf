package controlplane

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// clusterScript is a cluster scripts/cluster.sh made for a test.
type clusterScript struct {
	t        *testing.T
	script   string
	state    string // its directory
	url, key string // from its client.env
	downed   bool
}

// startClusterScript runs `scripts/cluster.sh up` (bin/dsec and bin/aether
// built) with the busybox image and backends; the test's end takes it down
// and shows its logs if the test failed.
func startClusterScript(t *testing.T, backends string) *clusterScript {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	testutil.RequireBinary(t, "nsenter")
	repo := testutil.RepoRoot(t)
	for _, b := range []string{"bin/dsec", "bin/aether"} {
		if _, err := os.Stat(filepath.Join(repo, b)); err != nil {
			testutil.Missing(t, "%s is not built (make build)", b)
		}
	}
	dir := t.TempDir()
	cs := &clusterScript{t: t, script: filepath.Join(repo, "scripts", "cluster.sh"), state: filepath.Join(dir, "cluster")}
	logs := func() {
		logs, _ := filepath.Glob(filepath.Join(cs.state, "log", "*.log"))
		for _, l := range logs {
			data, _ := os.ReadFile(l)
			t.Logf("%s:\n%s", filepath.Base(l), data)
		}
	}
	if out, err := exec.Command(cs.script, "up", cs.state, "--image-store", e2e.BusyboxStore(t, dir), "--backends", backends).CombinedOutput(); err != nil {
		logs()
		cs.down()
		t.Fatalf("cluster.sh up: %v\n%s", err, out)
	}
	t.Cleanup(func() {
		if t.Failed() {
			logs()
		}
		if !cs.downed {
			cs.down()
		}
	})
	env, err := os.ReadFile(filepath.Join(cs.state, "client.env"))
	if err != nil {
		t.Fatal(err)
	}
	cs.url, cs.key = e2e.EnvValue(string(env), "DSEC_API_URL"), e2e.EnvValue(string(env), "DSEC_API_KEY")
	return cs
}

func (cs *clusterScript) down() {
	cs.downed = true
	if out, err := exec.Command(cs.script, "down", cs.state).CombinedOutput(); err != nil {
		cs.t.Errorf("cluster.sh down: %v\n%s", err, out)
	}
}

// TestClusterScript runs scripts/cluster.sh: 3 IAM replicas, a watcher, 2
// apiservers and 3 edges, each edge in its own network namespace.
// Sandboxes spread over the 3 edges, each answers through either
// apiserver, a gVisor fork's copies on other edges carry its memory, and
// `down` leaves no process, namespace, link or mount behind.
func TestClusterScript(t *testing.T) {
	testutil.RequireBinary(t, "runsc")
	cs := startClusterScript(t, "container,gvisor")
	url, key := cs.url, cs.key
	if strings.Count(url, ",") != 1 {
		t.Fatalf("client.env names %q, want two apiservers", url)
	}
	cl, err := client.New(url, key)
	if err != nil {
		t.Fatal(err)
	}
	ctx := e2e.Ctx(t)
	nodes := map[string]bool{}
	var made []*client.Sandbox
	for range 9 {
		sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64}})
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		made = append(made, sb)
		_, node, _ := sandboxid.Parse(sb.ID)
		nodes[string(node)] = true
	}
	if len(nodes) != 3 {
		t.Fatalf("9 sandboxes on %d of 3 edges", len(nodes))
	}
	for i, u := range strings.Split(url, ",") {
		one, _ := client.New(u, key)
		for _, sb := range made[i*4 : i*4+4] {
			r, err := one.Sandbox(sb.ID).Shell(ctx, "hostname")
			if err != nil || strings.TrimSpace(string(r.GetStdout())) != sb.ID {
				t.Fatalf("hostname in %s through %s: %v, %v", sb.ID, u, r, err)
			}
		}
	}
	forkAcrossNamespaces(t, cl)
	state := cs.state
	cs.down()
	if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), "dsec-edge-") {
		t.Errorf("namespaces left: %s", out)
	}
	if out, _ := exec.Command("ip", "link").Output(); strings.Contains(string(out), "dsec-e1") {
		t.Errorf("links left: %s", out)
	}
	if mounts, _ := os.ReadFile("/proc/mounts"); strings.Contains(string(mounts), state) {
		t.Errorf("mounts left under %s", state)
	}
	if out, _ := exec.Command("pgrep", "-f", state).Output(); len(out) > 0 {
		t.Errorf("processes left: %s", out)
	}
}

// forkAcrossNamespaces forks a gVisor sandbox with its copies spread: the
// source's edge is the most loaded, so copies go to edges in other
// namespaces, which pull the snapshot from the source's edge at its
// namespace's address, and carry its memory.
func forkAcrossNamespaces(t *testing.T, cl *client.Client) {
	ctx := e2e.Ctx(t)
	src, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.25, MemoryMb: 256}})
	if err != nil {
		t.Fatalf("gvisor create: %v", err)
	}
	defer src.Stop(ctx) //nolint:errcheck // down removes it too
	if _, err := src.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", "X=held-$$; echo $X > /tmp/x; exec sleep 1000"}, Tag: "held"}})); err != nil {
		t.Fatal(err)
	}
	want := e2e.Shell(t, src, "for i in 1 2 3 4 5; do [ -s /tmp/x ] && break; sleep 0.2; done; cat /tmp/x; pidof sleep").Stdout
	resp, err := cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 2, Placement: sandboxv1.ForkPlacement_FORK_PLACEMENT_SPREAD}))
	if err != nil {
		t.Fatal(err)
	}
	_, srcNode, _ := sandboxid.Parse(src.ID)
	remote := 0
	for _, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			t.Fatalf("copy: %s %s", r.ErrorCode, r.ErrorMessage)
		}
		if _, node, _ := sandboxid.Parse(r.Sandbox.Id); node != srcNode {
			remote++
		}
		got := e2e.Shell(t, cl.Sandbox(r.Sandbox.Id), "cat /tmp/x; pidof sleep").Stdout
		if string(got) != string(want) {
			t.Fatalf("copy %s reads %q, the source %q", r.Sandbox.Id, got, want)
		}
	}
	if remote == 0 {
		t.Fatalf("spread fork from the most loaded edge placed no copy on another edge")
	}
}

package controlplane

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// buildRelease builds dsec and aether as version (the way the Makefile
// stamps a release), with a fault (version.Fault) if not "", with the flags of the test's own builds so that only
// the link differs, and returns their paths.
func buildRelease(t *testing.T, version, fault string) (dsec, agent string) {
	t.Helper()
	dir := t.TempDir()
	ld := "-X github.com/opendsec/opendsec/internal/version.Version=" + version
	if fault != "" {
		ld += " -X github.com/opendsec/opendsec/internal/version.Fault=" + fault
	}
	dsec, agent = filepath.Join(dir, "dsec"), filepath.Join(dir, "aether")
	for _, b := range []struct {
		args []string
		env  string
	}{
		{[]string{"build", "-ldflags", ld, "-o", dsec, "./cmd/dsec"}, ""},
		{[]string{"build", "-trimpath", "-ldflags", ld, "-o", agent, "./cmd/aether"}, "CGO_ENABLED=0"},
	} {
		cmd := exec.Command("go", b.args...)
		cmd.Dir = testutil.RepoRoot(t)
		cmd.Env = append(os.Environ(), b.env)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %v: %v\n%s", b.args, err, out)
		}
	}
	// The gvisor backend's preload library goes beside the agent.
	lib, err := os.ReadFile(filepath.Join(filepath.Dir(testutil.AgentBinary(t)), "libdsec-compat.so"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "libdsec-compat.so"), lib, 0o755); err != nil {
		t.Fatal(err)
	}
	return dsec, agent
}

// TestUpgradeEachComponentUnderLoad upgrades a running cluster of
// separate processes as an operator would: each component in turn
// (the IAM followers, then the leader; the watcher; each apiserver; each
// edge with its agent) is stopped with SIGTERM and a build of another
// version started on the same state, while a load of creates and commands
// runs through the client. No call fails, no sandbox is lost, every
// component then says the new version, and the sandboxes made before
// their edge's upgrade keep their old agent, are marked outdated in the
// API and in `dsec ls`, and answer; new sandboxes get the new agent.
func TestUpgradeEachComponentUnderLoad(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "busybox")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	const newVersion = "e2e-upgraded"
	newDsec, newAgent := buildRelease(t, newVersion, "")
	old := strings.TrimSpace(string(mustOutput(t, testutil.AgentBinary(t), "--version")))
	if old == newVersion || old == "" {
		t.Fatalf("the test's own agent says %q", old)
	}
	dir := t.TempDir()
	dc := startDaemonCluster(t, ctx, dir, newDaemons(t, dir))
	d, cl := dc.d, dc.cl
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: 256}}
	var made []*client.Sandbox
	t.Cleanup(func() {
		for _, sb := range made {
			sb.Stop(e2e.Ctx(t)) //nolint:errcheck // best effort
		}
	})
	for range 4 {
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		made = append(made, sb)
	}
	// upgradeUnderLoad runs the load while name is upgraded, with commands
	// in the sandboxes made so far (those of an edge being upgraded wait
	// out its restart at the apiserver).
	upgradeUnderLoad := func(name, agent string, existing []*client.Sandbox, ready func()) {
		t.Helper()
		l := startLoad(ctx, cl, spec, existing)
		began := time.Now()
		d.upgrade(name, newDsec, agent)
		ready()
		took := time.Since(began)
		time.Sleep(2 * time.Second)
		res := l.stop()
		made = append(made, res.made...)
		t.Logf("upgrade of %s: back in %v; load of %d creates and %d execs", name, took.Round(time.Millisecond), res.creates, res.execs)
		if len(res.errs) > 0 || res.creates < 1 {
			t.Fatalf("upgrade of %s: %d creates, errors %v", name, res.creates, res.errs)
		}
	}

	// IAM: the followers one at a time, then the leader; each comes back
	// into the cluster, which has a leader all along but for an election.
	st, err := iam.RemoteStatus(ctx, dc.iamAddrs["iam-1"], mustIdentity(t, dc.pkiDir, "iam-1").ClientConfig())
	if err != nil || st.LeaderID == "" {
		t.Fatalf("IAM status: %+v, %v", st, err)
	}
	order := []string{}
	for _, id := range []string{"iam-1", "iam-2", "iam-3"} {
		if id != st.LeaderID {
			order = append(order, id)
		}
	}
	for _, id := range append(order, st.LeaderID) {
		upgradeUnderLoad(id, "", made, func() {
			for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
				st, err := iam.RemoteStatus(ctx, dc.iamAddrs[id], mustIdentity(t, dc.pkiDir, id).ClientConfig())
				if err == nil && st.Version == newVersion && st.LeaderID != "" && st.AppliedIndex > 0 {
					return
				}
				if time.Now().After(deadline) {
					t.Fatalf("IAM replica %s after its upgrade: %+v, %v", id, st, err)
				}
			}
		})
	}
	upgradeUnderLoad("watcher", "", made, func() { time.Sleep(time.Second) })
	for _, name := range []string{"api-1", "api-2"} {
		upgradeUnderLoad(name, "", made, func() { dc.waitAPI(t, ctx, dc.apis[name]) })
	}
	beforeEdges := len(made)
	for _, edge := range []string{"edge-1", "edge-2"} {
		upgradeUnderLoad(edge, newAgent, made, func() { dc.waitAPI(t, ctx, dc.apis["api-1"]) })
	}

	// Every component says the new version.
	for name, addr := range dc.metrics {
		fams := scrape(t, "http://"+addr+"/metrics")
		if v := value(fams, "opendsec_build_info", map[string]string{"version": newVersion}); v != 1 {
			t.Errorf("%s: opendsec_build_info{version=%q} = %v after the upgrade", name, newVersion, v)
		}
	}
	for _, n := range dc.waitAPI(t, ctx, dc.apis["api-2"]) {
		if n.Version != newVersion {
			t.Errorf("node %s says version %q after the upgrade", n.Id, n.Version)
		}
	}
	// No sandbox lost; each made before its edge's upgrade keeps the old
	// agent and says so, and answers.
	after, err := cl.Create(ctx, spec)
	if err != nil {
		t.Fatal(err)
	}
	made = append(made, after)
	list, err := cl.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{PageSize: 1000}))
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Msg.Sandboxes) != len(made) {
		t.Fatalf("after the upgrade: %d sandboxes listed, want %d", len(list.Msg.Sandboxes), len(made))
	}
	byID := map[string]*sandboxv1.Sandbox{}
	outdated := 0
	for _, sb := range list.Msg.Sandboxes {
		byID[sb.Id] = sb
		if sb.AgentOutdated != (sb.AgentVersion != newVersion) || (sb.AgentVersion != newVersion && sb.AgentVersion != old) {
			t.Errorf("sandbox %s: agent %q, outdated %v", sb.Id, sb.AgentVersion, sb.AgentOutdated)
		}
		if sb.AgentOutdated {
			outdated++
		}
	}
	for i, sb := range made {
		v := byID[sb.ID]
		if v == nil {
			t.Fatalf("sandbox %s was lost", sb.ID)
		}
		if i < beforeEdges && v.AgentVersion != old {
			t.Errorf("sandbox %s, made before the edges' upgrade: agent %q, want %q", sb.ID, v.AgentVersion, old)
		}
		r, err := sb.Shell(ctx, "echo alive")
		if err != nil || strings.TrimSpace(string(r.GetStdout())) != "alive" {
			t.Fatalf("after the upgrade: exec in %s (agent %s): %v, %v", sb.ID, v.AgentVersion, r, err)
		}
	}
	if v := byID[after.ID]; v.AgentVersion != newVersion || v.AgentOutdated {
		t.Fatalf("a sandbox made after the upgrade: agent %q outdated %v", v.AgentVersion, v.AgentOutdated)
	}
	out, stderr, code := e2e.RunCLI(t, newDsec, []string{"DSEC_API_URL=http://" + dc.apis["api-1"], "DSEC_API_KEY=" + dc.key}, "", "ls")
	if code != 0 || strings.Count(out, old+" (outdated)") != outdated || outdated < beforeEdges || !strings.Contains(out, " "+newVersion+" ") {
		t.Fatalf("dsec ls: want %d rows with %q and some with %q (exit %d, %s):\n%s", outdated, old+" (outdated)", newVersion, code, stderr, out)
	}
}

func mustOutput(t *testing.T, bin string, args ...string) []byte {
	t.Helper()
	out, err := exec.Command(bin, args...).Output()
	if err != nil {
		t.Fatalf("%s %v: %v", bin, args, err)
	}
	return out
}

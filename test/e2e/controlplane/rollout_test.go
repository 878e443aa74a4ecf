package controlplane

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/rollout"
	"github.com/opendsec/opendsec/internal/testutil"
)

// TestRolloutOverClusterScript runs dsec rollout over the plan
// scripts/cluster.sh writes. A build that answers errors fails the
// error-rate gate at the first apiserver and is rolled back by itself:
// every component it replaced answers as its previous version again, the
// cluster's binaries are the previous ones and the sandboxes answer. A
// good build then reaches every component, agent included, under a load of
// creates and commands with no failed call.
func TestRolloutOverClusterScript(t *testing.T) {
	testutil.RequireBinary(t, "runsc")
	// The cluster's logs follow a failure and hid its reason in CI's cut
	// of the output: the reason is said again after them.
	var failure string
	t.Cleanup(func() {
		if failure != "" {
			t.Logf("this test failed: %s", failure)
		}
	})
	fatalf := func(format string, args ...any) {
		t.Helper()
		failure = fmt.Sprintf(format, args...)
		t.Fatal(failure)
	}
	cs := startClusterScript(t, "container,gvisor") // the load makes gVisor sandboxes too
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	repo := testutil.RepoRoot(t)
	planFile := filepath.Join(cs.state, "rollout.json")
	plan, err := rollout.LoadPlan(planFile)
	if err != nil {
		fatalf("%v", err)
	}
	if len(plan.Components) != 9 {
		fatalf("the plan names %d components, want 9", len(plan.Components))
	}
	before := strings.TrimSpace(string(mustOutput(t, filepath.Join(cs.state, "bin", "dsec"), "version")))
	versions := func() map[string]string {
		out := map[string]string{}
		for _, c := range plan.Components {
			v := "(no answer)"
			for _, m := range scrape(t, c.Metrics)["opendsec_build_info"].GetMetric() {
				for _, l := range m.Label {
					if l.GetName() == "version" {
						v = l.GetValue()
					}
				}
			}
			out[c.Name] = v
		}
		return out
	}
	allAt := func(what, v string) {
		t.Helper()
		for name, got := range versions() {
			if got != v {
				fatalf("%s: %s answers as %q, want %q", what, name, got, v)
			}
		}
	}
	allAt("before the rollouts", before)
	cl, err := client.New(cs.url, cs.key)
	if err != nil {
		fatalf("%v", err)
	}
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: 64}}
	var made []*client.Sandbox
	for range 3 {
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			fatalf("%v", err)
		}
		made = append(made, sb)
	}
	rolloutCmd := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, filepath.Join(repo, "bin", "dsec"), append([]string{"rollout", "--plan", planFile, "--ready-timeout", "90s"}, args...)...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}

	// The bad build, with calls reaching each apiserver.
	badDsec, badAgent := buildRelease(t, "e2e-rollout-bad", "answer-errors")
	trafficCtx, stopTraffic := context.WithCancel(ctx)
	for _, u := range strings.Split(cs.url, ",") {
		one, _ := client.New(u, cs.key)
		go func() {
			for trafficCtx.Err() == nil {
				one.Sandboxes.ListSandboxes(trafficCtx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{})) //nolint:errcheck // the bad build's errors are the point
				time.Sleep(50 * time.Millisecond)
			}
		}()
	}
	out, err := rolloutCmd("--binary", badDsec, "--agent", badAgent, "--soak", "4s")
	stopTraffic()
	t.Logf("the bad build's rollout:\n%s", out)
	if err == nil || !strings.Contains(out, "gate error rate failed") || !strings.Contains(out, "rolled back 5 components") {
		fatalf("a build that answers errors: %v, want the error-rate gate to fail at api-1 and 5 components rolled back", err)
	}
	allAt("after the rollback", before)
	if got := strings.TrimSpace(string(mustOutput(t, filepath.Join(cs.state, "bin", "dsec"), "version"))); got != before {
		fatalf("the cluster's dsec says %q after the rollback, want %q", got, before)
	}
	var st rollout.State
	data, _ := os.ReadFile(planFile + ".state")
	if err := json.Unmarshal(data, &st); err != nil || st.Phase != rollout.PhaseRolledBack || !strings.Contains(st.Failure, "error rate") {
		fatalf("the rollout's state: %s (%v)", data, err)
	}
	for _, sb := range made {
		if r, err := sb.Shell(ctx, "echo alive"); err != nil || strings.TrimSpace(string(r.GetStdout())) != "alive" {
			fatalf("after the rollback: exec in %s: %v, %v", sb.ID, r, err)
		}
	}

	// The good build, under load.
	goodDsec, goodAgent := buildRelease(t, "e2e-rollout-good", "")
	l := startLoad(ctx, cl, spec, made)
	began := time.Now()
	out, err = rolloutCmd("--binary", goodDsec, "--agent", goodAgent, "--soak", "3s", "--max-stuck", "3")
	res := l.stop()
	t.Logf("the good build's rollout in %v, under a load of %d creates and %d execs:\n%s", time.Since(began).Round(time.Second), res.creates, res.execs, out)
	if err != nil {
		fatalf("a good build: %v", err)
	}
	if len(res.errs) > 0 {
		fatalf("calls failed during the rollout: %v", res.errs)
	}
	allAt("after the rollout", "e2e-rollout-good")
	fresh, err := cl.Create(ctx, spec)
	if err != nil {
		fatalf("%v", err)
	}
	got, err := cl.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: fresh.ID}))
	if err != nil || got.Msg.Sandbox.AgentVersion != "e2e-rollout-good" {
		fatalf("a sandbox made after the rollout: %v, %v", got, err)
	}
}

package controlplane

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"connectrpc.com/connect"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/version"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestProjectAndNodesCLI: dsec project creates, lists (usage against
// quota, counted from the quota ledger), changes and removes projects;
// dsec nodes shows every edge of a two-edge cluster; a member key may not
// list nodes.
func TestProjectAndNodesCLI(t *testing.T) {
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.Edges = 2 }, "fake")
	bin := e2e.DsecBinary(t)
	run := func(key string, args ...string) (string, error) {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "DSEC_API_URL="+c.APIURL, "DSEC_API_KEY="+key)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	// row is a project's quota columns (PROJECT to INTERNET); the usage
	// columns after them grow with time.
	row := func(out, project string) string {
		for _, line := range strings.Split(out, "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] == project {
				return strings.Join(f[:min(len(f), 6)], " ")
			}
		}
		return ""
	}
	out, err := run(c.Key, "project", "create", "root/cli", "--max-sandboxes", "2", "--cpu", "1")
	if err != nil || row(out, "root/cli") != "root/cli 0/2 0/1 0/- 0/- allowed" {
		t.Fatalf("project create: %v\n%s", err, out)
	}
	key, err := c.Client.IAM.CreateAPIKey(e2e.Ctx(t), connect.NewRequest(&iamv1.CreateAPIKeyRequest{Project: "root/cli", Name: "m", Role: iamv1.Role_ROLE_MEMBER}))
	if err != nil {
		t.Fatal(err)
	}
	member, _ := client.New(c.APIURL, key.Msg.Secret)
	sb, err := member.Create(e2e.Ctx(t), sized(0.5, 128)())
	if err != nil {
		t.Fatal(err)
	}
	out, err = run(c.Key, "project", "ls")
	if err != nil || row(out, "root/cli") != "root/cli 1/2 0.5/1 128/- 0/- allowed" || !strings.Contains(row(out, "root"), "root 1/-") {
		t.Fatalf("project ls with one sandbox: %v\n%s", err, out)
	}
	out, err = run(c.Key, "project", "quota", "root/cli", "--max-sandboxes", "5", "--no-internet", "--storage-mb", "64")
	if err != nil || row(out, "root/cli") != "root/cli 1/5 0.5/- 128/- 0/64 no" {
		t.Fatalf("project quota: %v\n%s", err, out)
	}
	if out, err := run(c.Key, "project", "create", "cli"); err == nil || !strings.Contains(out, "PARENT/NAME") {
		t.Fatalf("project create without a parent: %v\n%s", err, out)
	}
	out, err = run(c.Key, "nodes")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if err != nil || len(lines) != 3 || !strings.Contains(lines[1], "healthy") || !strings.Contains(lines[2], "healthy") || !strings.Contains(out, "fake") {
		t.Fatalf("nodes: %v\n%s", err, out)
	}
	// Each node says its cgroup layout (this machine's, detected by the edge).
	if want := " " + e2e.NodeCgroups().String() + " "; !strings.Contains(lines[0], "CGROUP") || !strings.Contains(lines[1], want) || !strings.Contains(lines[2], want) {
		t.Fatalf("nodes: want a CGROUP column saying%q\n%s", want, out)
	}
	// And its edge's version (this test's edges are built in, "dev").
	if want := " " + version.Version + " "; !strings.Contains(lines[0], "VERSION") || !strings.Contains(lines[1], want) || !strings.Contains(lines[2], want) {
		t.Fatalf("nodes: want a VERSION column saying %q\n%s", want, out)
	}
	if out, err := run(key.Msg.Secret, "nodes"); err == nil || !strings.Contains(out, "ADMIN") {
		t.Fatalf("nodes with a member key: %v\n%s", err, out)
	}
	// Stopped, the sandbox leaves the usage; then the project can go.
	if err := sb.Stop(e2e.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.IAM.RevokeAPIKey(e2e.Ctx(t), connect.NewRequest(&iamv1.RevokeAPIKeyRequest{Id: key.Msg.Key.Id})); err != nil {
		t.Fatal(err)
	}
	if out, err := run(c.Key, "project", "rm", "root/cli"); err != nil {
		t.Fatalf("project rm: %v\n%s", err, out)
	}
	if out, _ := run(c.Key, "project", "ls"); row(out, "root/cli") != "" {
		t.Fatalf("root/cli still listed:\n%s", out)
	}
}

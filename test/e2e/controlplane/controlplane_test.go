package controlplane

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/test/e2e"
)

func TestAuthentication(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	bad, _ := client.New(c.APIURL, "dsec_not_a_key")
	_, err := bad.Create(e2e.Ctx(t), e2e.FakeSpec())
	if connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("bad key: %v", err)
	}
	resp, body := e2e.RawPost(t, c.APIURL+"/opendsec.sandbox.v1.SandboxService/ListSandboxes", nil, "{}")
	if resp.StatusCode != 401 || !strings.Contains(string(body), "missing API key") {
		t.Fatalf("no key: %d %s", resp.StatusCode, body)
	}
	// The agent proxy authenticates too.
	resp, _ = e2e.RawPost(t, c.APIURL+"/opendsec.agent.v1.ProcessService/Run", map[string]string{"Dsec-Sandbox-Id": "aaaaaaaa-aaaaaaaaaaaaaaaa"}, "{}")
	if resp.StatusCode != 401 {
		t.Fatalf("agent call without key: %d", resp.StatusCode)
	}
}

func TestBadRequestsNameTheFieldAndLeaveNothing(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	cases := map[string]struct {
		mut  func(*sandboxv1.SandboxSpec)
		code connect.Code
		want string
	}{
		"unknown backend": {func(s *sandboxv1.SandboxSpec) { s.Backend = "firecracker" }, connect.CodeInvalidArgument, `backend "firecracker": unknown; choose one of fake`},
		"malformed image": {func(s *sandboxv1.SandboxSpec) { s.Image = "Busy Box" }, connect.CodeInvalidArgument, "image"},
		"missing image":   {func(s *sandboxv1.SandboxSpec) { s.Image = "root/nope:1" }, connect.CodeNotFound, `image "root/nope:1": not in the image store`},
		"cpu over node":   {func(s *sandboxv1.SandboxSpec) { s.Resources.CpuCores = 64 }, connect.CodeInvalidArgument, "resources.cpu_cores 64: want 0.1 to 2"},
		"memory over":     {func(s *sandboxv1.SandboxSpec) { s.Resources.MemoryMb = 1 << 20 }, connect.CodeInvalidArgument, "resources.memory_mb 1048576: want 16 to 8192"},
		"negative pids":   {func(s *sandboxv1.SandboxSpec) { s.Resources.Pids = -1 }, connect.CodeInvalidArgument, "resources.pids -1"},
		"no spec":         {nil, connect.CodeInvalidArgument, "spec: missing"},
	}
	for name, tc := range cases {
		var spec *sandboxv1.SandboxSpec
		if tc.mut != nil {
			spec = e2e.FakeSpec()
			tc.mut(spec)
		}
		_, err := c.Client.Create(e2e.Ctx(t), spec)
		if connect.CodeOf(err) != tc.code || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want %v containing %q", name, err, tc.code, tc.want)
		}
	}
	list, err := c.Client.Sandboxes.ListSandboxes(e2e.Ctx(t), connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if err != nil || len(list.Msg.Sandboxes) != 0 {
		t.Fatalf("sandboxes after bad requests: %v, %v", list, err)
	}
	ents, _ := os.ReadDir(filepath.Join(c.Cfg.StateDir, "edge", "sandboxes"))
	if len(ents) != 0 {
		t.Fatalf("%d sandbox directories left", len(ents))
	}
	// Malformed JSON is a clear error, not a crash.
	resp, body := e2e.RawPost(t, c.APIURL+"/opendsec.sandbox.v1.SandboxService/CreateSandbox", map[string]string{"Authorization": "Bearer " + c.Key}, `{"spec": {"resources": {"cpuCores": "lots"}}}`)
	if resp.StatusCode != 400 || !strings.Contains(string(body), "invalid_argument") {
		t.Fatalf("bad JSON: %d %s", resp.StatusCode, body)
	}
}

func TestProjectsQuotasAndIsolation(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	ctx := e2e.Ctx(t)
	for _, name := range []string{"a", "b"} {
		if _, err := c.Client.IAM.CreateProject(ctx, connect.NewRequest(&iamv1.CreateProjectRequest{Parent: "root", Name: name, Quota: &iamv1.Quota{MaxSandboxes: 2}})); err != nil {
			t.Fatal(err)
		}
	}
	keyFor := func(project string) *client.Client {
		r, err := c.Client.IAM.CreateAPIKey(ctx, connect.NewRequest(&iamv1.CreateAPIKeyRequest{Project: project, Name: "k", Role: iamv1.Role_ROLE_MEMBER}))
		if err != nil {
			t.Fatal(err)
		}
		cl, _ := client.New(c.APIURL, r.Msg.Secret)
		return cl
	}
	a, b := keyFor("root/a"), keyFor("root/b")
	sa, err := a.Create(ctx, e2e.FakeSpec())
	if err != nil {
		t.Fatal(err)
	}
	if sa.Info.Project != "root/a" {
		t.Fatalf("created in %q", sa.Info.Project)
	}
	// b cannot see or reach a's sandbox, even by forging the scope header.
	if _, err := b.Sandbox(sa.ID).Shell(ctx, "true"); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("b ran a command in a's sandbox: %v", err)
	}
	resp, _ := e2e.RawPost(t, c.APIURL+"/opendsec.agent.v1.ProcessService/Run", map[string]string{
		"X-API-Key": bKeyOf(t, c, b), "Dsec-Sandbox-Id": sa.ID, "Dsec-Scope": "root",
	}, `{"process":{"args":["true"]}}`)
	if resp.StatusCode != 404 {
		t.Fatalf("forged scope header: status %d", resp.StatusCode)
	}
	if err := b.Sandbox(sa.ID).Stop(ctx); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("b stopped a's sandbox: %v", err)
	}
	if _, err := b.Create(ctx, &sandboxv1.SandboxSpec{Backend: "fake", Image: "root/busybox:latest"}); err != nil {
		t.Fatalf("b create: %v", err)
	}
	// A member key cannot make projects; a key cannot act outside its tree.
	if _, err := a.IAM.CreateProject(ctx, connect.NewRequest(&iamv1.CreateProjectRequest{Parent: "root/a", Name: "x"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("member created a project: %v", err)
	}
	if _, err := a.Sandboxes.CreateSandbox(ctx, connect.NewRequest(&sandboxv1.CreateSandboxRequest{Spec: e2e.FakeSpec(), Project: "root/b"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("a created in b: %v", err)
	}
	if _, err := a.ImportImage(ctx, "root/b/x:1", strings.NewReader("x"), 1); err == nil || !strings.Contains(err.Error(), "permission_denied") {
		t.Fatalf("a imported into b: %v", err)
	}
	// Quota: two sandboxes allowed in root/a.
	if _, err := a.Create(ctx, e2e.FakeSpec()); err != nil {
		t.Fatal(err)
	}
	_, err = a.Create(ctx, e2e.FakeSpec())
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "quota of project root/a: 2 of 2 sandboxes") {
		t.Fatalf("third sandbox: %v", err)
	}
	// The admin sees everything; each member only its own.
	all, _ := c.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	mine, _ := b.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if len(all.Msg.Sandboxes) != 3 || len(mine.Msg.Sandboxes) != 1 {
		t.Fatalf("admin sees %d, b sees %d", len(all.Msg.Sandboxes), len(mine.Msg.Sandboxes))
	}
}

// bKeyOf recovers the secret of a client (for raw requests).
func bKeyOf(t *testing.T, c *e2e.Cluster, cl *client.Client) string {
	t.Helper()
	r, err := c.Client.IAM.CreateAPIKey(e2e.Ctx(t), connect.NewRequest(&iamv1.CreateAPIKeyRequest{Project: "root/b", Name: "raw"}))
	if err != nil {
		t.Fatal(err)
	}
	return r.Msg.Secret
}

func TestListFiltersAndPages(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	ctx := e2e.Ctx(t)
	for i := 0; i < 5; i++ {
		s := e2e.FakeSpec()
		s.Resources.CpuCores = 0.5
		s.Metadata = map[string]string{"parity": []string{"even", "odd"}[i%2]}
		s.Task = "t1"
		if i == 4 {
			s.Task = "t2"
		}
		if _, err := c.Client.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	var seen []string
	token := ""
	for {
		r, err := c.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{PageSize: 2, PageToken: token}))
		if err != nil {
			t.Fatal(err)
		}
		for _, sb := range r.Msg.Sandboxes {
			seen = append(seen, sb.Id)
		}
		if token = r.Msg.NextPageToken; token == "" {
			break
		}
	}
	if len(seen) != 5 {
		t.Fatalf("paged through %d sandboxes", len(seen))
	}
	r, _ := c.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{Task: "t1", Metadata: map[string]string{"parity": "even"}}))
	if len(r.Msg.Sandboxes) != 2 {
		t.Fatalf("filtered list has %d", len(r.Msg.Sandboxes))
	}
	_, err := c.Client.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{PageToken: "garbage"}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("bad page token: %v", err)
	}
}

func TestImportThroughAPI(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	ctx := e2e.Ctx(t)
	ref, _ := image.ParseRef("root/busybox:latest")
	im, err := c.Images.Resolve(ref)
	if err != nil {
		t.Fatal(err)
	}
	archive := filepath.Join(t.TempDir(), "bb.tar")
	f, _ := os.Create(archive)
	if err := c.Images.Export(im, f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	f, _ = os.Open(archive)
	defer f.Close()
	fi, _ := f.Stat()
	out, err := c.Client.ImportImage(ctx, "root/copied:v1", f, fi.Size())
	if err != nil || out["digest"] != im.Digest.String() {
		t.Fatalf("import = %v, %v", out, err)
	}
	if _, err := c.Client.ImportImage(ctx, "other/x:1", strings.NewReader("x"), 1); err == nil || !strings.Contains(err.Error(), `paths start at "root"`) {
		t.Fatalf("import into a project outside the tree: %v", err)
	}
	if _, err := c.Client.ImportImage(ctx, "root/junk:1", strings.NewReader("not an archive at all"), 21); err == nil || !strings.Contains(err.Error(), "invalid_argument") {
		t.Fatalf("import of junk: %v", err)
	}
	s := e2e.FakeSpec()
	s.Image = "root/copied:v1"
	sb, err := c.Client.Create(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	var info map[string]any
	b, _ := json.Marshal(sb.Info)
	json.Unmarshal(b, &info)
	if sb.Info.ImageDigest != im.Digest.String() {
		t.Fatalf("sandbox image digest %s", sb.Info.ImageDigest)
	}
}

func TestTimeToLiveAndSetTimeout(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	ctx := e2e.Ctx(t)
	s := e2e.FakeSpec()
	s.TimeoutSeconds = 1
	sb, err := c.Client.Create(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	keep, err := c.Client.Create(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	firstExpiry := keep.Info.ExpiresAt.AsTime()
	set, err := c.Client.Sandboxes.SetSandboxTimeout(ctx, connect.NewRequest(&sandboxv1.SetSandboxTimeoutRequest{SandboxId: keep.ID, TimeoutSeconds: 600}))
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Until(set.Msg.Sandbox.ExpiresAt.AsTime()); d < 590*time.Second || d > 600*time.Second {
		t.Fatalf("after SetSandboxTimeout(600) the sandbox expires in %v", d)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		_, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
		if connect.CodeOf(err) == connect.CodeNotFound {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("sandbox outlived its time to live")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The extended sandbox's first expiry is now past by more than the
	// sweep (1 s) and a removal: had the new timeout not taken, it would
	// be gone.
	time.Sleep(time.Until(firstExpiry.Add(3 * time.Second)))
	if _, err := keep.Shell(ctx, "true"); err != nil {
		t.Fatalf("the sandbox whose timeout was extended is gone: %v", err)
	}
	got, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: keep.ID}))
	if err != nil || !got.Msg.Sandbox.ExpiresAt.AsTime().Equal(set.Msg.Sandbox.ExpiresAt.AsTime()) {
		t.Fatalf("expiry after the sweep: %v, %v; want %v", got, err, set.Msg.Sandbox.ExpiresAt.AsTime())
	}
}

// Through the API, a key of one project can do nothing to another
// project's sandbox or snapshot: every call answers as if it did not exist.
func TestOtherProjectsRefusedThroughTheAPI(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	ctx := e2e.Ctx(t)
	a := c.Project(t, "root", "a", nil)
	b := c.Project(t, "root", "b", nil)
	sb, err := a.Create(ctx, e2e.FakeSpec())
	if err != nil {
		t.Fatal(err)
	}
	snap, err := a.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: sb.ID}))
	if err != nil {
		t.Fatal(err)
	}
	snapID := snap.Msg.Snapshot.Id
	refused := func(what string, err error) {
		t.Helper()
		if code := connect.CodeOf(err); code != connect.CodeNotFound && code != connect.CodePermissionDenied {
			t.Errorf("%s by another project: %v, want not_found or permission_denied", what, err)
		}
	}
	s := b.Sandboxes
	_, err = s.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: sb.ID}))
	refused("pause", err)
	_, err = s.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: sb.ID}))
	refused("resume", err)
	_, err = s.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: sb.ID}))
	refused("snapshot", err)
	_, err = s.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: sb.ID, Count: 1}))
	refused("fork", err)
	_, err = s.SetSandboxTimeout(ctx, connect.NewRequest(&sandboxv1.SetSandboxTimeoutRequest{SandboxId: sb.ID, TimeoutSeconds: 60}))
	refused("set timeout", err)
	_, err = s.RestoreSnapshot(ctx, connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: snapID}))
	refused("restore", err)
	_, err = s.DeleteSnapshot(ctx, connect.NewRequest(&sandboxv1.DeleteSnapshotRequest{SnapshotId: snapID}))
	refused("delete snapshot", err)
	_, err = s.StopSandbox(ctx, connect.NewRequest(&sandboxv1.StopSandboxRequest{SandboxId: sb.ID}))
	refused("stop", err)
	if l, err := s.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{})); err != nil || len(l.Msg.Snapshots) != 0 {
		t.Errorf("root/b lists snapshots: %v %v", l, err)
	}
	_, err = s.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{SandboxId: sb.ID}))
	refused("list snapshots of the sandbox", err)
	// Nothing happened to them.
	got, err := a.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
	if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after the refused calls: %v %v", got, err)
	}
	if l, err := a.Sandboxes.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{})); err != nil || len(l.Msg.Snapshots) != 1 {
		t.Fatalf("root/a's snapshots after the refused calls: %v %v", l, err)
	}
}

package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/testutil"
)

// sharedStore is the image store `make images` fills, with root/py:3.11.
func sharedStore(t *testing.T) string {
	store := filepath.Join(testutil.RepoRoot(t), ".cache", "images")
	s, err := image.OpenStore(store)
	if err != nil {
		t.Skipf("no image store at %s: %v", store, err)
	}
	ref, _ := image.ParseRef("root/py:3.11")
	if _, err := s.Resolve(ref); err != nil {
		t.Skipf("root/py:3.11 is not built (make images): %v", err)
	}
	return store
}

func gvisorCluster(t *testing.T) *cluster {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	return startClusterWithStore(t, sharedStore(t), "gvisor", "container")
}

// heldState is a Python server that imports a module once, keeps a random
// value and a request counter in memory and listens on 127.0.0.1:8000.
const heldState = `
import http.server, json, os, random, sys
sys.path.insert(0, "/root")
import heavy  # counts its own imports in /root/imports
value = random.getrandbits(64)
hits = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global hits, value
        hits += 1
        if self.path.startswith("/set/"):
            value = int(self.path[5:])
        body = json.dumps({"value": value, "hits": hits, "pid": os.getpid(), "heavy": heavy.loaded_at}).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 8000), H).serve_forever()
`

const heavyModule = `
import decimal, fractions, statistics, email.parser, xml.dom.minidom, sqlite3, asyncio, time
loaded_at = time.time()
with open("/root/imports", "a") as f:
    f.write("x")
`

type serverState struct {
	Value uint64  `json:"value"`
	Hits  int     `json:"hits"`
	Pid   int     `json:"pid"`
	Heavy float64 `json:"heavy"`
}

func query(t *testing.T, sb *client.Sandbox, path string) serverState {
	t.Helper()
	r := shell(t, sb, "curl -s --max-time 5 http://127.0.0.1:8000"+path)
	var st serverState
	if err := json.Unmarshal(r.Stdout, &st); err != nil {
		t.Fatalf("%s: server answered %q %q: %v", sb.ID, r.Stdout, r.Stderr, err)
	}
	return st
}

func TestForkCarriesMemoryProcessesAndPorts(t *testing.T) {
	c := gvisorCluster(t)
	ctx := ctxT(t)
	src, err := c.client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/py:3.11", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 1024}})
	if err != nil {
		t.Fatal(err)
	}
	for path, body := range map[string]string{"/root/server.py": heldState, "/root/heavy.py": heavyModule} {
		if _, err := src.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: path, Data: []byte(body)})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := src.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: []string{"python3", "/root/server.py"}, Tag: "server"}})); err != nil {
		t.Fatal(err)
	}
	shell(t, src, "for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:8000/ && exit 0; sleep 0.1; done; exit 1")
	// A persistent shell with state in a variable, too.
	sess, err := src.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	src.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "cd /tmp && SECRET=$RANDOM$RANDOM"}))
	secret, _ := src.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "echo $SECRET"}))
	shell(t, src, "echo from-source > /root/before-fork")
	before := query(t, src, "/")

	resp, err := c.client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 3}))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("fork of 3: source paused %v", time.Duration(resp.Msg.SourcePauseUs)*time.Microsecond)
	var copies []*client.Sandbox
	for i, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			t.Fatalf("copy %d failed: %s: %s", i, r.ErrorCode, r.ErrorMessage)
		}
		if r.Sandbox.Spec.Backend != "gvisor" || r.Sandbox.SourceSnapshotId == "" {
			t.Fatalf("copy %d: %+v", i, r.Sandbox)
		}
		copies = append(copies, c.client.Sandbox(r.Sandbox.Id))
	}
	all := append([]*client.Sandbox{src}, copies...)
	machineIDs := map[string]bool{}
	for i, sb := range all {
		// The same process, its imported module and its value, without a
		// second import; the listening socket answers; the counter goes on.
		st := query(t, sb, "/")
		if st.Value != before.Value || st.Pid != before.Pid || st.Heavy != before.Heavy || st.Hits != before.Hits+1 {
			t.Fatalf("sandbox %d: server state %+v, before the fork %+v", i, st, before)
		}
		if got := strings.TrimSpace(string(shell(t, sb, "cat /root/imports").Stdout)); got != "x" {
			t.Fatalf("sandbox %d: module imported %d times", i, len(got))
		}
		sr, err := sb.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "echo $SECRET; pwd"}))
		if err != nil || string(sr.Msg.Stdout) != string(secret.Msg.Stdout)+"/tmp\n" {
			t.Fatalf("sandbox %d: session state %q %v, want %q", i, sr.Msg.GetStdout(), err, secret.Msg.Stdout)
		}
		if got := string(shell(t, sb, "cat /root/before-fork").Stdout); got != "from-source\n" {
			t.Fatalf("sandbox %d: file from before the fork reads %q", i, got)
		}
		// Fresh identity for the copies.
		if host := strings.TrimSpace(string(shell(t, sb, "hostname").Stdout)); host != sb.ID {
			t.Fatalf("sandbox %d: hostname %q, want %q", i, host, sb.ID)
		}
		machineIDs[strings.TrimSpace(string(shell(t, sb, "cat /etc/machine-id 2>/dev/null").Stdout))] = true
	}
	if len(machineIDs) < len(copies) {
		t.Fatalf("copies share machine ids: %v", machineIDs)
	}
	// Isolation in memory: a value changed in one copy stays there.
	query(t, copies[0], "/set/7")
	if st := query(t, copies[0], "/"); st.Value != 7 {
		t.Fatalf("copy 0 did not take the new value: %+v", st)
	}
	for i, sb := range []*client.Sandbox{src, copies[1], copies[2]} {
		if st := query(t, sb, "/"); st.Value != before.Value {
			t.Fatalf("sandbox %d sees copy 0's memory: %+v", i, st)
		}
	}
	// Isolation in files.
	shell(t, copies[1], "echo mine > /root/only-in-copy-1")
	for i, sb := range []*client.Sandbox{src, copies[0], copies[2]} {
		if got := string(shell(t, sb, "cat /root/only-in-copy-1 2>/dev/null || echo absent").Stdout); got != "absent\n" {
			t.Fatalf("sandbox %d sees copy 1's file: %q", i, got)
		}
	}
	// Stopping a copy leaves the others.
	if err := copies[2].Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if st := query(t, src, "/"); st.Value != before.Value {
		t.Fatalf("source after a copy stopped: %+v", st)
	}
}

func TestSnapshotsPauseAndUnsupportedBackend(t *testing.T) {
	c := gvisorCluster(t)
	ctx := ctxT(t)
	sb, err := c.client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	shell(t, sb, "echo snap > /root/f; (while true; do date +%s%N > /tmp/t; sleep 0.05; done) >/dev/null 2>&1 &")
	// Pause stops every process: the clock file stops moving.
	if _, err := c.client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: sb.ID})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.client.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: sb.ID})); err != nil {
		t.Fatal(err)
	}
	a := shell(t, sb, "cat /tmp/t").Stdout
	c.client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: sb.ID}))
	time.Sleep(500 * time.Millisecond)
	// This call resumes it first, transparently.
	b := shell(t, sb, "cat /tmp/t").Stdout
	if string(a) == "" || string(b) == "" {
		t.Fatal("no clock file")
	}
	snap, err := c.client.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: sb.ID}))
	if err != nil {
		t.Fatal(err)
	}
	id := snap.Msg.Snapshot.Id
	if got := shell(t, sb, "cat /root/f").Stdout; string(got) != "snap\n" {
		t.Fatalf("source after snapshot: %q", got)
	}
	restored, err := c.client.Sandboxes.RestoreSnapshot(ctx, connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: id}))
	if err != nil {
		t.Fatal(err)
	}
	if got := shell(t, c.client.Sandbox(restored.Msg.Sandbox.Id), "cat /root/f").Stdout; string(got) != "snap\n" {
		t.Fatalf("restored: %q", got)
	}
	list, _ := c.client.Sandboxes.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{}))
	if len(list.Msg.Snapshots) != 1 || list.Msg.Snapshots[0].SizeBytes == 0 {
		t.Fatalf("snapshots: %v", list.Msg.Snapshots)
	}
	snapDir := filepath.Join(c.cfg.StateDir, "edge", "snapshots", id)
	if _, err := os.Stat(snapDir); err != nil {
		t.Fatal(err)
	}
	if _, err := c.client.Sandboxes.DeleteSnapshot(ctx, connect.NewRequest(&sandboxv1.DeleteSnapshotRequest{SnapshotId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(snapDir); !os.IsNotExist(err) {
		t.Fatalf("snapshot storage not freed: %v", err)
	}
	// The container backend cannot snapshot memory here, and says why.
	cb, err := c.client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: cb.ID, Count: 1}))
	if connect.CodeOf(err) != connect.CodeUnimplemented || !strings.Contains(err.Error(), `backend "container" cannot snapshot memory`) {
		t.Fatalf("fork of a container: %v", err)
	}
	_, err = c.client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: sb.ID, Count: 101}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("fork of 101: %v", err)
	}
	_ = context.Background
}

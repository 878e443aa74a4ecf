package sandboxes

import (
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
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

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
	r := e2e.Shell(t, sb, "curl -s --max-time 5 http://127.0.0.1:8000"+path)
	var st serverState
	if err := json.Unmarshal(r.Stdout, &st); err != nil {
		t.Fatalf("%s: server answered %q %q: %v", sb.ID, r.Stdout, r.Stderr, err)
	}
	return st
}

// startHeldState starts the heldState server in sb and waits until it
// answers.
func startHeldState(t *testing.T, sb *client.Sandbox) {
	t.Helper()
	ctx := e2e.Ctx(t)
	for path, body := range map[string]string{"/root/server.py": heldState, "/root/heavy.py": heavyModule} {
		if _, err := sb.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: path, Data: []byte(body)})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := sb.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: []string{"python3", "/root/server.py"}, Tag: "server"}})); err != nil {
		t.Fatal(err)
	}
	e2e.Shell(t, sb, "for i in $(seq 100); do curl -s -o /dev/null http://127.0.0.1:8000/ && exit 0; sleep 0.1; done; exit 1")
}

func TestForkCarriesMemoryProcessesAndPorts(t *testing.T) {
	c := e2e.GvisorPyCluster(t)
	ctx := e2e.Ctx(t)
	src, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/py:3.11", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 1024}})
	if err != nil {
		t.Fatal(err)
	}
	startHeldState(t, src)
	// A persistent shell with state in a variable, too.
	sess, err := src.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if r, err := src.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "cd /tmp && SECRET=$RANDOM$RANDOM"})); err != nil || r.Msg.ExitCode != 0 {
		t.Fatalf("session: %v %v", r, err)
	}
	secret, err := src.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "echo $SECRET"}))
	if err != nil || len(strings.TrimSpace(string(secret.Msg.Stdout))) < 2 {
		t.Fatalf("session secret: %v %v", secret, err)
	}
	srcMachineID := strings.TrimSpace(string(e2e.Shell(t, src, "cat /etc/machine-id").Stdout))
	e2e.Shell(t, src, "echo from-source > /root/before-fork")
	before := query(t, src, "/")

	resp, err := c.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 3}))
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
		copies = append(copies, c.Client.Sandbox(r.Sandbox.Id))
	}
	all := append([]*client.Sandbox{src}, copies...)
	machineIDs := map[string]bool{}
	randomness := map[string]bool{}
	for i, sb := range all {
		// The same process, its imported module and its value, without a
		// second import; the listening socket answers; the counter goes on.
		st := query(t, sb, "/")
		if st.Value != before.Value || st.Pid != before.Pid || st.Heavy != before.Heavy || st.Hits != before.Hits+1 {
			t.Fatalf("sandbox %d: server state %+v, before the fork %+v", i, st, before)
		}
		if got := strings.TrimSpace(string(e2e.Shell(t, sb, "cat /root/imports").Stdout)); got != "x" {
			t.Fatalf("sandbox %d: module imported %d times", i, len(got))
		}
		sr, err := sb.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "echo $SECRET; pwd"}))
		if err != nil || string(sr.Msg.Stdout) != string(secret.Msg.Stdout)+"/tmp\n" {
			t.Fatalf("sandbox %d: session state %q %v, want %q", i, sr.Msg.GetStdout(), err, secret.Msg.Stdout)
		}
		if got := string(e2e.Shell(t, sb, "cat /root/before-fork").Stdout); got != "from-source\n" {
			t.Fatalf("sandbox %d: file from before the fork reads %q", i, got)
		}
		// Fresh identity for the copies.
		if host := strings.TrimSpace(string(e2e.Shell(t, sb, "hostname").Stdout)); host != sb.ID {
			t.Fatalf("sandbox %d: hostname %q, want %q", i, host, sb.ID)
		}
		machineIDs[strings.TrimSpace(string(e2e.Shell(t, sb, "cat /etc/machine-id").Stdout))] = true
		randomness[string(e2e.Shell(t, sb, "head -c 16 /dev/urandom | od -An -tx1").Stdout)] = true
	}
	if len(randomness) != len(all) {
		t.Fatalf("the kernel's random numbers repeat across the source and its copies: %v", randomness)
	}
	// Each copy has a machine id of its own: non-empty, different from the
	// source's and from every sibling's. (The source keeps its own; an
	// empty source id would pass for a new one, so it must not be empty.)
	if srcMachineID == "" {
		t.Fatal("the source has no machine id")
	}
	delete(machineIDs, srcMachineID)
	if len(machineIDs) != len(copies) || machineIDs[""] {
		t.Fatalf("copies' machine ids %v: want %d distinct non-empty ids, none the source's %q", machineIDs, len(copies), srcMachineID)
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
	e2e.Shell(t, copies[1], "echo mine > /root/only-in-copy-1")
	for i, sb := range []*client.Sandbox{src, copies[0], copies[2]} {
		if got := string(e2e.Shell(t, sb, "cat /root/only-in-copy-1 2>/dev/null || echo absent").Stdout); got != "absent\n" {
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
	c := e2e.GvisorCluster(t)
	ctx := e2e.Ctx(t)
	sb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	e2e.Shell(t, sb, "echo snap > /root/f; "+testutil.PauseProbe("/tmp/probe"))
	before := waitProbe(t, sb, "/tmp/probe", 3)
	// Pause freezes every process: the probe's loop stops for as long as
	// the sandbox is paused, which shows as a gap once it runs again.
	if _, err := c.Client.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: sb.ID})); err != nil {
		t.Fatal(err)
	}
	pausedAt := time.Now()
	got, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
	if err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("after pause: %v %v", got, err)
	}
	time.Sleep(time.Until(pausedAt.Add(frozenFor)))
	// This call resumes it first, transparently; the round after the one
	// it reads spans the pause.
	now := waitProbe(t, sb, "/tmp/probe", before.Rounds)
	after := waitProbe(t, sb, "/tmp/probe", now.Rounds+1)
	if after.LongGap < frozenFor-300*time.Millisecond {
		t.Fatalf("processes ran while paused: longest gap %v over a pause of %v", after.LongGap, frozenFor)
	}
	if got, err := c.Client.Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID})); err != nil || got.Msg.Sandbox.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after a call resumed it: %v %v", got, err)
	}
	snap, err := c.Client.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: sb.ID}))
	if err != nil {
		t.Fatal(err)
	}
	id := snap.Msg.Snapshot.Id
	if got := e2e.Shell(t, sb, "cat /root/f").Stdout; string(got) != "snap\n" {
		t.Fatalf("source after snapshot: %q", got)
	}
	restored, err := c.Client.Sandboxes.RestoreSnapshot(ctx, connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: id}))
	if err != nil {
		t.Fatal(err)
	}
	if got := e2e.Shell(t, c.Client.Sandbox(restored.Msg.Sandbox.Id), "cat /root/f").Stdout; string(got) != "snap\n" {
		t.Fatalf("restored: %q", got)
	}
	list, _ := c.Client.Sandboxes.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{}))
	if len(list.Msg.Snapshots) != 1 || list.Msg.Snapshots[0].SizeBytes == 0 {
		t.Fatalf("snapshots: %v", list.Msg.Snapshots)
	}
	snapDir := filepath.Join(c.Cfg.StateDir, "edge", "snapshots", id)
	if _, err := os.Stat(snapDir); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.Sandboxes.DeleteSnapshot(ctx, connect.NewRequest(&sandboxv1.DeleteSnapshotRequest{SnapshotId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(snapDir); !os.IsNotExist(err) {
		t.Fatalf("snapshot storage not freed: %v", err)
	}
	// The container backend cannot snapshot memory here, and says why.
	cb, err := c.Client.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: cb.ID, Count: 1}))
	if connect.CodeOf(err) != connect.CodeUnimplemented || !strings.Contains(err.Error(), `backend "container" cannot snapshot memory`) {
		t.Fatalf("fork of a container: %v", err)
	}
	_, err = c.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: sb.ID, Count: 101}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("fork of 101: %v", err)
	}
}

// frozenFor is how long pause tests keep a sandbox paused.
const frozenFor = 1500 * time.Millisecond

// waitProbe polls a testutil.PauseProbe file until it shows minRounds.
func waitProbe(t *testing.T, sb *client.Sandbox, file string, minRounds int) testutil.ProbeReading {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	var last string
	for time.Now().Before(deadline) {
		last = string(e2e.Shell(t, sb, "cat "+file+" 2>/dev/null || true").Stdout)
		if r, err := testutil.ParseProbe(last); err == nil && r.Rounds >= minRounds {
			return r
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s: pause probe did not reach %d rounds (last read %q)", sb.ID, minRounds, last)
	return testutil.ProbeReading{}
}

package sandboxes

import (
	"strings"
	"testing"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestForkAcrossEdges: on 3 gVisor edges, the source's edge has room for
// the source alone, so a fork of 8 places every copy on the other two
// edges, which pull the snapshot from the source's edge; every copy
// carries the source's process memory (a Python server's random value,
// pid, request count and imported module, a shell's variable), its files,
// and an identity of its own. A named snapshot restores on another edge
// the same way.
func TestForkAcrossEdges(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	c := e2e.StartClusterWith(t, e2e.PyStore(t), func(cfg *embed.Config) {
		cfg.Edges, cfg.APIServers = 3, 2
		cfg.EdgeCapacity = func(i int) capacity.Node {
			node := cfg.Capacity
			if i == 1 {
				node.MaxSandboxes = 1
			}
			return node
		}
	}, "gvisor", "container")
	ctx := e2e.Ctx(t)
	apis := e2e.APIClients(t, c, c.Key)
	spec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/py:3.11", Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 256}}
	// The source goes straight to edge 1, the one with room for one.
	made, err := c.Edges[0].Create(ctx, spec, "root")
	if err != nil {
		t.Fatal(err)
	}
	src := apis[0].Sandbox(made.Id)
	t.Cleanup(func() { src.Stop(e2e.Ctx(t)) }) //nolint:errcheck // cleanup
	srcNode := c.Edges[0].Node()
	startHeldState(t, src)
	sess, err := src.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if r, err := src.Sessions.RunInSession(ctx, connect.NewRequest(&agentv1.RunInSessionRequest{SessionId: sess.Msg.Session.Id, Command: "SECRET=$RANDOM$RANDOM$RANDOM"})); err != nil || r.Msg.ExitCode != 0 {
		t.Fatalf("session: %v %v", r, err)
	}
	secret := strings.TrimSpace(string(e2e.RunIn(t, src, sess.Msg.Session.Id, "echo $SECRET")))
	srcMachineID := strings.TrimSpace(string(e2e.Shell(t, src, "cat /etc/machine-id").Stdout))
	e2e.Shell(t, src, "echo from-source > /root/before-fork")
	before := query(t, src, "/")

	// Through the second apiserver, as any call may go. Each step has a
	// deadline of its own: under a CPU hog the source's start alone took
	// a minute.
	ctx = e2e.Ctx(t)
	resp, err := apis[1].Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 8}))
	if err != nil {
		t.Fatal(err)
	}
	var copies []*client.Sandbox
	perNode := map[sandboxid.NodeID]int{}
	for i, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			t.Fatalf("copy %d failed: %s: %s", i, r.ErrorCode, r.ErrorMessage)
		}
		_, node, _ := sandboxid.Parse(r.Sandbox.Id)
		perNode[node]++
		cp := apis[i%2].Sandbox(r.Sandbox.Id)
		copies = append(copies, cp)
		t.Cleanup(func() { cp.Stop(e2e.Ctx(t)) }) //nolint:errcheck // cleanup
	}
	t.Logf("fork of 8 across edges: copies per node %v, source paused %d us", perNode, resp.Msg.SourcePauseUs)
	if len(copies) != 8 || perNode[srcNode] != 0 || len(perNode) != 2 {
		t.Fatalf("8 copies with the source's edge full: %v (source on %s)", perNode, srcNode)
	}
	ids := map[string]bool{srcMachineID: true}
	for i, cp := range append([]*client.Sandbox{src}, copies...) {
		st := query(t, cp, "/")
		if st.Value != before.Value || st.Pid != before.Pid || st.Heavy != before.Heavy || st.Hits != before.Hits+1 {
			t.Fatalf("sandbox %d (%s): server state %+v, before the fork %+v", i, cp.ID, st, before)
		}
		if got := strings.TrimSpace(string(e2e.RunIn(t, cp, sess.Msg.Session.Id, "echo $SECRET"))); got != secret {
			t.Fatalf("sandbox %d: the shell's variable reads %q, want %q", i, got, secret)
		}
		if got := string(e2e.Shell(t, cp, "cat /root/before-fork; cat /root/imports").Stdout); got != "from-source\nx" {
			t.Fatalf("sandbox %d: files read %q", i, got)
		}
		if i > 0 {
			id := strings.TrimSpace(string(e2e.Shell(t, cp, "cat /etc/machine-id").Stdout))
			if id == "" || ids[id] {
				t.Fatalf("copy %d: machine id %q repeats the source's or a sibling's", i, id)
			}
			ids[id] = true
		}
	}
	// Nothing of the fork's transfer is left on the source's edge.
	ctx = e2e.Ctx(t)
	snaps, err := apis[0].Sandboxes.ListSnapshots(ctx, connect.NewRequest(&sandboxv1.ListSnapshotsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if len(snaps.Msg.Snapshots) != 0 {
		t.Fatalf("snapshots after the fork: %v", snaps.Msg.Snapshots)
	}

	// A named snapshot of the source restores on another edge (its own is
	// full), with the memory it had.
	query(t, src, "/set/4242")
	snap, err := apis[0].Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: src.ID, Name: "across"}))
	if err != nil {
		t.Fatal(err)
	}
	rr, err := apis[1].Sandboxes.RestoreSnapshot(ctx, connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: snap.Msg.Snapshot.Id}))
	if err != nil {
		t.Fatal(err)
	}
	restored := apis[0].Sandbox(rr.Msg.Sandbox.Id)
	t.Cleanup(func() { restored.Stop(e2e.Ctx(t)) }) //nolint:errcheck // cleanup
	if _, node, _ := sandboxid.Parse(restored.ID); node == srcNode {
		t.Fatalf("restore with the holder full ran on the holder %s", node)
	}
	if st := query(t, restored, "/"); st.Value != 4242 || st.Pid != before.Pid {
		t.Fatalf("restored on another edge: %+v", st)
	}
}

// TestMicrovmForkAcrossEdges: a microVM's fork, with its edge full, runs
// its copies on another edge, which pulls the snapshot (the guest's RAM,
// device state and disks) and restores it there: each copy has the
// source's shell variable (guest memory), its file, and a hostname and
// machine id of its own. A named snapshot restores there too.
func TestMicrovmForkAcrossEdges(t *testing.T) {
	vm := e2e.MicrovmOptions(t)
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Backends["microvm"] = vm
		cfg.Edges = 2
		cfg.EdgeCapacity = func(i int) capacity.Node {
			node := cfg.Capacity
			if i == 1 {
				node.MaxSandboxes = 1
			}
			return node
		}
	}, "microvm")
	ctx := e2e.Ctx(t)
	spec := &sandboxv1.SandboxSpec{Backend: "microvm", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}}
	made, err := c.Edges[0].Create(ctx, spec, "root")
	if err != nil {
		t.Fatal(err)
	}
	src := c.Client.Sandbox(made.Id)
	t.Cleanup(func() { src.Stop(e2e.Ctx(t)) }) //nolint:errcheck // cleanup
	srcNode := c.Edges[0].Node()
	sess, err := src.Sessions.CreateSession(ctx, connect.NewRequest(&agentv1.CreateSessionRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	secret := strings.TrimSpace(string(e2e.RunIn(t, src, sess.Msg.Session.Id, "SECRET=$RANDOM$RANDOM$RANDOM; echo $SECRET")))
	e2e.Shell(t, src, "echo from-source > /root/before-fork; sync")

	resp, err := c.Client.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 2}))
	if err != nil {
		t.Fatal(err)
	}
	var copies []*client.Sandbox
	for i, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			t.Fatalf("copy %d failed: %s: %s", i, r.ErrorCode, r.ErrorMessage)
		}
		if _, node, _ := sandboxid.Parse(r.Sandbox.Id); node == srcNode {
			t.Fatalf("copy %d ran on the source's full edge %s", i, node)
		}
		cp := c.Client.Sandbox(r.Sandbox.Id)
		copies = append(copies, cp)
		t.Cleanup(func() { cp.Stop(e2e.Ctx(t)) }) //nolint:errcheck // cleanup
	}
	if len(copies) != 2 {
		t.Fatalf("%d copies, want 2", len(copies))
	}
	t.Logf("microvm fork of 2 onto another edge: source paused %d us", resp.Msg.SourcePauseUs)
	seen := map[string]bool{}
	for i, cp := range append([]*client.Sandbox{src}, copies...) {
		if got := strings.TrimSpace(string(e2e.RunIn(t, cp, sess.Msg.Session.Id, "echo $SECRET"))); got != secret {
			t.Fatalf("sandbox %d: the shell's variable reads %q, want %q", i, got, secret)
		}
		got := strings.Fields(string(e2e.Shell(t, cp, "hostname; cat /etc/machine-id /root/before-fork").Stdout))
		if len(got) != 3 || got[0] != cp.ID || got[2] != "from-source" || seen[got[1]] {
			t.Fatalf("sandbox %d (%s): hostname, machine id, file = %q (machine ids so far %v)", i, cp.ID, got, seen)
		}
		seen[got[1]] = true
	}

	// A named snapshot restores on the other edge (the holder is full).
	e2e.RunIn(t, src, sess.Msg.Session.Id, "SECRET=named")
	snap, err := c.Client.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: src.ID, Name: "across"}))
	if err != nil {
		t.Fatal(err)
	}
	rr, err := c.Client.Sandboxes.RestoreSnapshot(ctx, connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: snap.Msg.Snapshot.Id}))
	if err != nil {
		t.Fatal(err)
	}
	restored := c.Client.Sandbox(rr.Msg.Sandbox.Id)
	t.Cleanup(func() { restored.Stop(e2e.Ctx(t)) }) //nolint:errcheck // cleanup
	if _, node, _ := sandboxid.Parse(restored.ID); node == srcNode {
		t.Fatalf("restore with the holder full ran on the holder %s", node)
	}
	if got := strings.TrimSpace(string(e2e.RunIn(t, restored, sess.Msg.Session.Id, "echo $SECRET"))); got != "named" {
		t.Fatalf("restored on another edge, the shell's variable reads %q", got)
	}
}

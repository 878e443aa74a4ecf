package controlplane

import (
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxspec"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestPlacementAcrossEdges runs 3 edges and 2 apiservers on the container
// backend: sandboxes spread over the edges, every call finds its sandbox
// by id through either apiserver, and an edge that refuses a create
// (full, though the view says it has room) sends the apiserver on to the
// next node.
func TestPlacementAcrossEdges(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Edges, cfg.APIServers, cfg.PlacementK = 3, 2, 3
		// Polls only when the test asks: the view is as stale as it wants.
		cfg.WatchInterval = time.Hour
		// Edge 1 looks the least loaded (the most CPU and memory) but
		// holds 4 sandboxes at most: ranked first until it is full.
		cfg.EdgeCapacity = func(i int) capacity.Node {
			node := cfg.Capacity
			if i == 1 {
				node.CPUCores, node.MemoryMB, node.MaxSandboxes = 64, 65536, 4
			}
			return node
		}
	}, "container")
	ctx := e2e.Ctx(t)
	if len(c.Edges) != 3 || len(c.APIURLs) != 2 {
		t.Fatalf("edges %d, apiservers %v", len(c.Edges), c.APIURLs)
	}
	full := string(c.Edges[0].Node())
	apis := e2e.APIClients(t, c, c.Key)
	spec := func() *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64}}
	}

	// Spread: 12 creates, alternating apiservers.
	perNode := map[string]int{}
	var made []*client.Sandbox
	for i := range 12 {
		sb, err := apis[i%2].Create(ctx, spec())
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		_, node, err := sandboxid.Parse(sb.ID)
		if err != nil {
			t.Fatal(err)
		}
		perNode[string(node)]++
		made = append(made, sb)
	}
	if len(perNode) != 3 || perNode[full] != 4 {
		t.Fatalf("12 sandboxes over 3 edges (the first holds 4): %v", perNode)
	}
	// Every call routes by id, through the other apiserver than made it.
	for i, sb := range made {
		other := apis[(i+1)%2].Sandbox(sb.ID)
		res, err := other.Shell(ctx, "echo $((6*7)) from $(hostname)")
		if err != nil || !strings.HasPrefix(string(res.GetStdout()), "42 from ") {
			t.Fatalf("exec in %s through the other apiserver: %+v, %v", sb.ID, res, err)
		}
		got, err := apis[(i+1)%2].Sandboxes.GetSandbox(ctx, connect.NewRequest(&sandboxv1.GetSandboxRequest{SandboxId: sb.ID}))
		_, node, _ := sandboxid.Parse(sb.ID)
		if err != nil || got.Msg.Sandbox.NodeId != string(node) {
			t.Fatalf("get %s: %v, %v", sb.ID, got, err)
		}
	}
	for _, sb := range made {
		if err := sb.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	c.Watcher.Poll(ctx)

	// Fill edge 1 behind the apiservers' backs: their view still shows it
	// empty and the least loaded, so each ranks it first; it refuses, and
	// the create lands on the next node.
	for i := range 4 {
		s := spec()
		if err := sandboxspec.Normalize(s, sandboxspec.DefaultLimits(), []string{"container"}); err != nil {
			t.Fatal(err)
		}
		sb, err := c.Edges[0].Create(ctx, s, "root")
		if err != nil {
			t.Fatalf("filling edge 1 (%d): %v", i, err)
		}
		t.Cleanup(func() { c.Client.Sandbox(sb.Id).Stop(e2e.Ctx(t)) }) //nolint:errcheck // best effort
	}
	for i, api := range apis {
		sb, err := api.Create(ctx, spec())
		if err != nil {
			t.Fatalf("create through apiserver %d with edge 1 full: %v", i+1, err)
		}
		if _, node, _ := sandboxid.Parse(sb.ID); string(node) == full {
			t.Fatalf("apiserver %d placed %s on the full edge", i+1, sb.ID)
		}
		sb.Stop(ctx) //nolint:errcheck // checked above
	}
}

// TestGvisorAcrossEdges: gVisor sandboxes on a cluster of 3 edges and 2
// apiservers spread over the edges, answer through either apiserver, and a
// fork through the other apiserver makes copies (on the source's edge)
// that carry the source's running process and in-memory files.
func TestGvisorAcrossEdges(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	testutil.RequireBinary(t, "busybox")
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.Edges, cfg.APIServers = 3, 2 }, "gvisor", "container")
	ctx := e2e.Ctx(t)
	apis := e2e.APIClients(t, c, c.Key)
	nodes := map[string]int{}
	var made []*client.Sandbox
	for i := range 6 {
		sb, err := apis[i%2].Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.25, MemoryMb: 256}})
		if err != nil {
			t.Fatalf("gvisor create %d: %v", i, err)
		}
		made = append(made, sb)
		_, node, _ := sandboxid.Parse(sb.ID)
		nodes[string(node)]++
	}
	if len(nodes) < 2 {
		t.Fatalf("6 gvisor sandboxes on %d edge(s): %v", len(nodes), nodes)
	}
	src := made[0]
	e2e.Shell(t, src, "echo kept-in-memory > /tmp/state")
	if _, err := src.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: []string{"sleep", "1000"}, Tag: "held"}})); err != nil {
		t.Fatal(err)
	}
	if r := e2e.Shell(t, src, "ps -o args | grep -c '^sleep 1000'"); string(r.GetStdout()) != "1\n" {
		t.Fatalf("the source's process: %q", r.GetStdout())
	}
	resp, err := apis[1].Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 2}))
	if err != nil {
		t.Fatalf("fork through the second apiserver: %v", err)
	}
	_, srcNode, _ := sandboxid.Parse(src.ID)
	for _, res := range resp.Msg.Results {
		if res.Sandbox == nil {
			t.Fatalf("fork copy failed: %s %s", res.ErrorCode, res.ErrorMessage)
		}
		cp := apis[0].Sandbox(res.Sandbox.Id)
		if _, node, _ := sandboxid.Parse(cp.ID); node != srcNode {
			t.Fatalf("copy %s not on the source's edge %s", cp.ID, srcNode)
		}
		r, err := cp.Shell(ctx, "cat /tmp/state; ps -o args | grep -c '^sleep 1000'")
		if err != nil || string(r.GetStdout()) != "kept-in-memory\n1\n" {
			t.Fatalf("copy %s: %q, %v", cp.ID, r.GetStdout(), err)
		}
		cp.Stop(ctx) //nolint:errcheck // checked enough
	}
	for _, sb := range made {
		sb.Stop(ctx) //nolint:errcheck // cleanup
	}
}

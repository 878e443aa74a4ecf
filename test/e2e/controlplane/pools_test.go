package controlplane

import (
	"strings"
	"testing"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/project"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/test/e2e"
)

// TestPoolsFollowTheClusterSetting sets a warm pool on two real edges and
// then takes it from one of them behind the cluster's back, as a node that
// lost its state directory or was away during the call: the apiservers'
// reconciler gives it back. A removal the node missed is carried out the
// same way.
func TestPoolsFollowTheClusterSetting(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "crun")
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Edges = 2
		cfg.PoolSyncEvery = time.Second // a setting is pushed once 3 s old
	}, "container")
	ctx := e2e.Ctx(t)
	res := &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: 64}
	nodes, err := c.Client.SetPool(ctx, "root/busybox:latest", "container", res, false, 1)
	if err != nil || len(nodes) != 2 || nodes[0].Error != "" || nodes[1].Error != "" {
		t.Fatalf("pool set: %v, %v", nodes, err)
	}
	kept, err := c.Client.ClusterPools(ctx)
	if err != nil || len(kept) != 1 || kept[0].Size != 1 || kept[0].Image != "root/busybox:latest" || kept[0].Source != "cluster" {
		t.Fatalf("the cluster's pools: %v, %v", kept, err)
	}
	out, errOut, code := e2e.RunCLI(t, e2e.DsecBinary(t), []string{"DSEC_API_URL=" + c.APIURL, "DSEC_API_KEY=" + c.Key}, "", "pool", "ls")
	if code != 0 || !strings.Contains(out, "(cluster)") || strings.Count(out, "root/busybox:latest") != 3 {
		t.Fatalf("dsec pool ls: want both nodes' pools and the cluster's setting: %q %q exit %d", out, errOut, code)
	}
	apiPool := func(e *edge.Edge) int32 {
		for _, p := range e.ListPools() {
			if p.Source == "api" && p.Image == "root/busybox:latest" {
				return p.Size
			}
		}
		return 0
	}
	waitSize := func(e *edge.Edge, want int32, why string) {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for apiPool(e) != want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: node %s holds a pool of %d after a minute, want %d", why, e.Node(), apiPool(e), want)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	away := c.Edges[1]
	k := kept[0] // the shape as the apiserver normalised it
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: k.Image,
		Resources: &sandboxv1.Resources{CpuCores: k.CpuCores, MemoryMb: k.MemoryMb, DiskMb: k.DiskMb, Pids: k.Pids, OpenFiles: k.OpenFiles}}
	if _, err := away.SetPool(spec, project.Root, 0); err != nil || apiPool(away) != 0 {
		t.Fatalf("taking the pool from the node behind the cluster's back: %v; it holds %d", err, apiPool(away))
	}
	began := time.Now()
	waitSize(away, 1, "a node that lost the pool")
	t.Logf("the node took the cluster's pool back after %v", time.Since(began).Round(time.Second))
	if apiPool(c.Edges[0]) != 1 {
		t.Fatalf("the other node's pool: %d", apiPool(c.Edges[0]))
	}

	// Removed through the API; the node that missed it still has it.
	if _, err := c.Client.SetPool(ctx, "root/busybox:latest", "container", res, false, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := away.SetPool(spec, project.Root, 1); err != nil || apiPool(away) != 1 {
		t.Fatalf("giving the node the pool behind the cluster's back: %v; it holds %d", err, apiPool(away))
	}
	waitSize(away, 0, "a node that missed the removal")
	if kept, err := c.Client.ClusterPools(ctx); err != nil || len(kept) != 0 {
		t.Fatalf("the cluster's pools after the removal: %v, %v", kept, err)
	}
}

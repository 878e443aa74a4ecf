package edge

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// waitPoolReady waits until e's pools hold n ready sandboxes.
func waitPoolReady(t *testing.T, e *Edge, n int) []sandboxid.ID {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for e.pools.readyCount() != n {
		if time.Now().After(deadline) {
			t.Fatalf("pool: %d ready, want %d", e.pools.readyCount(), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.pools.mu.Lock()
	defer e.pools.mu.Unlock()
	var ids []sandboxid.ID
	for _, list := range e.pools.ready {
		for _, sb := range list {
			ids = append(ids, sb.ID())
		}
	}
	return ids
}

// A warm pool's sandboxes are nobody's until a create of their image and
// shape claims one: it is then the create's, with the create's
// environment, metadata and project, and the pool starts another. A
// create of another shape starts its own. A restarted edge takes its
// pool's sandboxes back.
func TestPoolClaimsAndRefills(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 2}}
	e := f.open(t, smallCapacity())
	pooled := waitPoolReady(t, e, 2)
	if got := e.List("root"); len(got) != 0 {
		t.Fatalf("a pool's sandboxes are listed: %v", got)
	}
	if st := e.Status(); st.Allocated.Sandboxes != 0 {
		t.Fatalf("a pool's sandboxes are admitted: %+v", st.Allocated)
	}
	ctx := context.Background()
	want := spec()
	want.Env, want.Metadata, want.TimeoutSeconds = map[string]string{"MINE": "claimed"}, map[string]string{"k": "v"}, 120
	sb, err := e.Create(ctx, want, "root")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(pooled, sandboxid.ID(sb.Id)) {
		t.Fatalf("create made %s, not one of the pool's %v", sb.Id, pooled)
	}
	if sb.Project != "root" || sb.Spec.Metadata["k"] != "v" || sb.Spec.TimeoutSeconds != 120 {
		t.Fatalf("the claimed sandbox: %+v", sb)
	}
	c := agentClient(t, e, sb.Id, "root")
	r, err := c.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"sh", "-c", "echo $MINE $FROM_IMAGE $DSEC_SANDBOX_ID"}}}))
	if err != nil || string(r.Msg.Stdout) != "claimed yes "+sb.Id+"\n" {
		t.Fatalf("exec in the claimed sandbox: %q, %v", r.Msg.GetStdout(), err)
	}
	if st := e.Status(); st.Allocated.Sandboxes != 1 {
		t.Fatalf("the claimed sandbox is not admitted: %+v", st.Allocated)
	}
	refilled := waitPoolReady(t, e, 2)

	other := spec()
	other.Resources.MemoryMb = 512
	own, err := e.Create(ctx, other, "root")
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(refilled, sandboxid.ID(own.Id)) {
		t.Fatalf("a create of another shape claimed pool sandbox %s", own.Id)
	}

	e.Close()
	e2 := f.open(t, smallCapacity())
	if back := waitPoolReady(t, e2, 2); !sameIDs(back, refilled) {
		t.Fatalf("after a restart the pool holds %v, want its own %v", back, refilled)
	}
	if got, err := e2.Get(sb.Id, "root"); err != nil || got.Project != "root" {
		t.Fatalf("the claimed sandbox after a restart: %v, %v", got, err)
	}
}

// The node's own creates take the room a pool holds: the pool gives its
// sandboxes up, and fills again only into room left over.
func TestPoolYieldsToTheNodesOwn(t *testing.T) {
	f := newFixture(t, smallCapacity()) // 10 sandboxes
	f.edge.Close()
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 3}}
	e := f.open(t, smallCapacity())
	waitPoolReady(t, e, 3)
	other := spec()
	other.Resources.CpuCores, other.Resources.MemoryMb = 0.1, 128 // another shape: never claims
	for i := range 9 {
		if _, err := e.Create(context.Background(), other, "root"); err != nil {
			t.Fatalf("create %d with the pool holding %d: %v", i+1, e.pools.readyCount(), err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for e.pools.heldUsage().Sandboxes > 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the pool holds %d beside the node's 9 of 10", e.pools.heldUsage().Sandboxes)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, err := e.Create(context.Background(), other, "root"); err != nil {
		t.Fatalf("the tenth create: %v", err)
	}
}

func sameIDs(a, b []sandboxid.ID) bool {
	a, b = slices.Clone(a), slices.Clone(b)
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}

// A spec with a network has a pool key of its own (networked pools serve
// it); every resource names another.
func TestPoolKey(t *testing.T) {
	base := spec()
	base.Resources.DiskMb, base.Resources.Pids, base.Resources.OpenFiles = 64, 100, 1024
	key := poolKey(base, "sha256:a")
	if key == "" || poolKey(base, "sha256:b") == key {
		t.Fatalf("keys of two digests: %q", key)
	}
	networked := proto.Clone(base).(*sandboxv1.SandboxSpec)
	networked.Network = &sandboxv1.NetworkPolicy{}
	if k := poolKey(networked, "sha256:a"); k == "" || k == key {
		t.Fatalf("a spec with a network has pool key %q (without one %q)", k, key)
	}
	networked.Network = &sandboxv1.NetworkPolicy{Internet: true, Rules: []*sandboxv1.NetworkRule{{Cidr: "192.0.2.0/24"}}}
	if k := poolKey(networked, "sha256:a"); k != key+"|net" {
		t.Fatalf("the policy changed the pool key: %q", k)
	}
	for name, change := range map[string]func(*sandboxv1.Resources){
		"cpu": func(r *sandboxv1.Resources) { r.CpuCores++ }, "memory": func(r *sandboxv1.Resources) { r.MemoryMb++ },
		"disk": func(r *sandboxv1.Resources) { r.DiskMb++ }, "pids": func(r *sandboxv1.Resources) { r.Pids++ },
		"open files": func(r *sandboxv1.Resources) { r.OpenFiles++ },
	} {
		other := proto.Clone(base).(*sandboxv1.SandboxSpec)
		change(other.Resources)
		if poolKey(other, "sha256:a") == key {
			t.Errorf("another %s has the same pool key", name)
		}
	}
	other := proto.Clone(base).(*sandboxv1.SandboxSpec)
	other.Env, other.Metadata, other.TimeoutSeconds = map[string]string{"A": "1"}, map[string]string{"k": "v"}, 5
	if poolKey(other, "sha256:a") != key {
		t.Error("the environment, metadata or time to live changed the pool key")
	}
}

func TestParsePool(t *testing.T) {
	p, err := ParsePool("root/busybox:latest=8,backend=gvisor,cpu=0.25,memory=64,disk=128,project=root/team")
	if err != nil {
		t.Fatal(err)
	}
	r := p.Spec.Resources
	if p.Spec.Image != "root/busybox:latest" || p.Size != 8 || p.Spec.Backend != "gvisor" || p.Project != "root/team" || r.CpuCores != 0.25 || r.MemoryMb != 64 || r.DiskMb != 128 {
		t.Fatalf("parsed %+v %+v", p, r)
	}
	if p, err := ParsePool("root/x:1=1"); err != nil || p.Spec.Backend != "container" || p.Project != "root" || p.Spec.Network != nil {
		t.Fatalf("defaults: %+v %v", p, err)
	}
	if p, err := ParsePool("root/x:1=1,network=true"); err != nil || p.Spec.Network == nil || len(p.Spec.Network.Rules) != 0 || p.Spec.Network.Internet {
		t.Fatalf("network=true: %+v %v", p, err)
	}
	for in, want := range map[string]string{
		"root/x:1":                 "want IMAGE=SIZE",
		"=3":                       "want IMAGE=SIZE",
		"root/x:1=0":               "size",
		"root/x:1=2000":            "size",
		"root/x:1=2,cpu=-1":        "cpu",
		"root/x:1=2,cpu=NaN":       "cpu",
		"root/x:1=2,memory=":       "memory",
		"root/x:1=2,disk=big":      "disk",
		"root/x:1=2,net=on":        `"net=on"`,
		"root/x:1=2,network=":      "network",
		"root/x:1=2,network=maybe": "network",
	} {
		if _, err := ParsePool(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParsePool(%q) = %v, want an error naming %s", in, err, want)
		}
	}
}

func FuzzParsePool(f *testing.F) {
	f.Add("root/busybox:latest=8,backend=container,cpu=0.1,memory=64,disk=64")
	f.Add("a=1,cpu=1e309")
	f.Add(",,=,")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := ParsePool(s)
		if err == nil && (p.Size < 1 || p.Size > maxPoolSize || p.Spec.Image == "" || p.Spec.Resources == nil) {
			t.Fatalf("ParsePool(%q) accepted %+v", s, p)
		}
	})
}

// Drained, the pools remove their sandboxes and start no more.
// (fillOne is what the pools' loop calls each tick.)
func TestDrainPools(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 2}}
	e := f.open(t, smallCapacity())
	waitPoolReady(t, e, 2)
	e.DrainPools(context.Background())
	if e.pools.fillOne(context.Background()) {
		t.Fatal("drained pools started a sandbox")
	}
	if n := e.pools.heldUsage().Sandboxes; n != 0 {
		t.Fatalf("drained pools hold %d sandboxes", n)
	}
	if ents, _ := os.ReadDir(e.dirs.sandboxes()); len(ents) != 0 {
		t.Fatalf("drained pools left %d sandbox directories", len(ents))
	}
}

// A pool made smaller (here across a restart) gives up what it holds
// beyond its size; a pool no longer configured gives up all it holds.
func TestPoolTrimsWhatNoPoolWants(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 3}}
	e := f.open(t, smallCapacity())
	waitPoolReady(t, e, 3)
	e.Close()
	f.pools[0].Size = 1
	e = f.open(t, smallCapacity())
	waitPoolReady(t, e, 1)
	deadline := time.Now().Add(10 * time.Second)
	for e.pools.heldUsage().Sandboxes != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("a pool of 1 holds %d", e.pools.heldUsage().Sandboxes)
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.Close()
	f.pools = nil
	e = f.open(t, smallCapacity())
	if n := e.pools.heldUsage().Sandboxes; n != 0 {
		t.Fatalf("with no pool configured the node holds %d pool sandboxes", n)
	}
	if ents, _ := os.ReadDir(e.dirs.sandboxes()); len(ents) != 0 {
		t.Fatalf("%d sandbox directories left of a pool no longer configured", len(ents))
	}
}

// A pool set through the API overrides the flag's pool of the same image
// and shape, adds pools of its own, removes one with size 0, and stays so
// across a restart of the edge; bad settings are refused by field.
func TestSetPoolOverridesFlagsAndIsKept(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 1}}
	e := f.open(t, smallCapacity())
	waitPoolReady(t, e, 1)
	bigger := spec()
	bigger.Resources.MemoryMb *= 2
	if _, err := e.SetPool(spec(), "root", 3); err != nil {
		t.Fatal(err)
	}
	pools, err := e.SetPool(bigger, "root", 1)
	if err != nil {
		t.Fatal(err)
	}
	if len(pools) != 2 || pools[0].Size != 3 || pools[0].Source != "api" || pools[1].Size != 1 {
		t.Fatalf("pools after two settings: %v", pools)
	}
	waitPoolReady(t, e, 4)
	e.Close()
	e = f.open(t, smallCapacity())
	ids := waitPoolReady(t, e, 4)
	if len(e.ListPools()) != 2 {
		t.Fatalf("after a restart: %v", e.ListPools())
	}
	// Size 0 removes even a flag's pool, also after a restart.
	if _, err := e.SetPool(spec(), "root", 0); err != nil {
		t.Fatal(err)
	}
	waitPoolReady(t, e, 1)
	e.Close()
	e = f.open(t, smallCapacity())
	left := waitPoolReady(t, e, 1)
	if got := e.ListPools(); len(got) != 1 || got[0].MemoryMb != bigger.Resources.MemoryMb || !slices.Contains(ids, left[0]) {
		t.Fatalf("after removing the flag's pool and a restart: %v (ready %v of %v)", got, left, ids)
	}
	for _, c := range []struct {
		spec    *sandboxv1.SandboxSpec
		size    int
		wantErr string
	}{
		{spec(), -1, "size -1"},
		{spec(), maxPoolSize + 1, "size 1025"},
		{&sandboxv1.SandboxSpec{Image: "root/none:1", Backend: "fake"}, 1, "root/none:1"},
		{&sandboxv1.SandboxSpec{Image: spec().Image, Backend: "fake", Network: &sandboxv1.NetworkPolicy{}}, 1, "without sandbox networking"},
		{nil, 1, "spec: missing"},
		{&sandboxv1.SandboxSpec{Image: spec().Image, Backend: "fake", Devices: []string{"0000:01:00.0"}}, 1, "devices: a pool's sandboxes take no host device"},
	} {
		if _, err := e.SetPool(c.spec, "root", c.size); err == nil || !strings.Contains(err.Error(), c.wantErr) {
			t.Errorf("SetPool(%v, %d): %v, want an error naming %q", c.spec, c.size, err, c.wantErr)
		}
	}
	if got := e.ListPools(); len(got) != 1 {
		t.Fatalf("refused settings changed the pools: %v", got)
	}
	// Removing a pool only the API set leaves no entry behind (a flag's
	// pool of it added later is not hidden), also when its image is gone.
	gone := &sandboxv1.SandboxSpec{Image: "root/gone:1", Backend: "fake", Resources: spec().Resources}
	if _, err := e.SetPool(gone, "root", 0); err != nil {
		t.Fatalf("removing a pool of an image that is gone: %v", err)
	}
	if _, err := e.SetPool(bigger, "root", 0); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(filepath.Join(f.edge.cfg.StateDir, poolsFile))
	var saved []savedPool
	if err == nil {
		err = json.Unmarshal(data, &saved)
	}
	if err != nil || len(saved) != 1 || saved[0].Size != 0 {
		t.Fatalf("%s after removing the API's own pool: %s (%v); want only the flag pool's removal", poolsFile, data, err)
	}
}

// A pool sandbox that dies while it waits is found by the node's health
// checks, removed, and replaced: a claim never meets a dead one.
func TestPoolReplacesADeadSandbox(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 1}}
	e := f.open(t, smallCapacity())
	dead := waitPoolReady(t, e, 1)[0]
	f.fake.Crash(dead)
	deadline := time.Now().Add(20 * time.Second)
	for {
		ids := waitPoolReady(t, e, 1)
		if ids[0] != dead {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the dead pool sandbox is still the pool's")
		}
		time.Sleep(50 * time.Millisecond)
	}
	for {
		if _, err := os.Stat(e.dirs.sandbox(dead)); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dead pool sandbox's directory is left")
		}
		time.Sleep(50 * time.Millisecond)
	}
	sb, err := e.Create(context.Background(), spec(), "root")
	if err != nil || sandboxid.ID(sb.Id) == dead {
		t.Fatalf("a create after the death: %v, %v", sb, err)
	}
}

// After a claim the pools start nothing for refillPause, so the claimed
// sandbox's first commands do not share the node with a start; then they
// refill.
func TestPoolRefillWaitsAfterAClaim(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 1}}
	e := f.open(t, smallCapacity())
	waitPoolReady(t, e, 1)
	e.pools.pause.Store(int64(time.Hour))
	if _, err := e.Create(context.Background(), spec(), "root"); err != nil {
		t.Fatal(err)
	}
	if e.pools.fillOne(context.Background()) {
		t.Fatal("a pool started a sandbox right after a claim")
	}
	e.pools.claimedAt.Store(0) // the pause is over
	e.pools.poke()
	waitPoolReady(t, e, 1)
}

// Two pools whose tags name one digest, of one shape, share their
// sandboxes: the node keeps the sum of their sizes, a create of either
// claims from them, and each pool says it shares.
func TestPoolsOfOneDigestShareTheirSandboxes(t *testing.T) {
	f := newFixture(t, smallCapacity())
	f.edge.Close()
	tiny, err := f.store.Resolve(mustRef(t, "root/tiny:1"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.store.Tag(mustRef(t, "root/tiny:latest"), tiny.Digest); err != nil {
		t.Fatal(err)
	}
	latest := spec()
	latest.Image = "root/tiny:latest"
	f.pools = []Pool{{Spec: spec(), Project: "root", Size: 1}, {Spec: latest, Project: "root", Size: 2}}
	e := f.open(t, smallCapacity())
	waitPoolReady(t, e, 3)
	time.Sleep(300 * time.Millisecond) // a fill past the sum would show now
	if n := e.pools.heldUsage().Sandboxes; n != 3 {
		t.Fatalf("two pools of sizes 1 and 2 over one digest hold %d sandboxes, want 3", n)
	}
	for _, p := range e.ListPools() {
		if p.Ready != 3 || !strings.Contains(p.Note, "shares its sandboxes with the pools of") {
			t.Errorf("pool %s: ready %d, note %q; want the 3 shared and a note saying so", p.Image, p.Ready, p.Note)
		}
	}
	if _, err := e.Create(context.Background(), latest, "root"); err != nil {
		t.Fatal(err)
	}
	waitPoolReady(t, e, 3)
}

func mustRef(t *testing.T, s string) image.Ref {
	t.Helper()
	r, err := image.ParseRef(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// The cluster's settings carry their generation: one older than the node
// holds for the same pool (a late push, an apiserver whose state lags) is
// ignored, a versioned removal is kept so that an older setting does not
// bring the pool back, and both hold across a restart.
func TestClusterPoolSettingsOlderThanTheNodesAreIgnored(t *testing.T) {
	f := newFixture(t, smallCapacity())
	e := f.edge
	size := func() int32 {
		t.Helper()
		for _, p := range e.ListPools() {
			if p.Source == "api" {
				return p.Size
			}
		}
		return 0
	}
	if _, err := e.SetClusterPool(spec(), "root", 2, 200); err != nil {
		t.Fatal(err)
	}
	pools, err := e.SetClusterPool(spec(), "root", 5, 100)
	if err != nil || size() != 2 || len(pools) != 1 || pools[0].Size != 2 {
		t.Fatalf("an older setting: %v, %v; the pool has size %d, want 2", pools, err, size())
	}
	if _, err := e.SetClusterPool(spec(), "root", 0, 300); err != nil || size() != 0 {
		t.Fatalf("a newer removal: %v; size %d", err, size())
	}
	if _, err := e.SetClusterPool(spec(), "root", 3, 250); err != nil || size() != 0 {
		t.Fatalf("a setting older than the removal brought the pool back: %v; size %d", err, size())
	}
	e.Close()
	e = f.open(t, smallCapacity())
	if _, err := e.SetClusterPool(spec(), "root", 3, 250); err != nil || size() != 0 {
		t.Fatalf("after a restart, a setting older than the removal: %v; size %d", err, size())
	}
	if _, err := e.SetClusterPool(spec(), "root", 1, 400); err != nil || size() != 1 {
		t.Fatalf("a newer setting: %v; size %d", err, size())
	}
	// A setting without a generation (a node's own caller) always applies.
	if _, err := e.SetPool(spec(), "root", 4); err != nil || size() != 4 {
		t.Fatalf("an unversioned setting: %v; size %d", err, size())
	}
}

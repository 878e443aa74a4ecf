package controlplane

import (
	"bytes"
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/test/e2e"
)

// burst sends n creates at once and counts successes and quota refusals;
// any other error fails the test.
func burst(t *testing.T, cl *client.Client, n int, spec func() *sandboxv1.SandboxSpec) (ok, refused int) {
	t.Helper()
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, err := cl.Create(e2e.Ctx(t), spec())
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				ok++
			case connect.CodeOf(err) == connect.CodeResourceExhausted && strings.Contains(err.Error(), "quota of project"):
				refused++
			default:
				t.Errorf("create: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	return ok, refused
}

func sized(cpu float64, mem int64) func() *sandboxv1.SandboxSpec {
	return func() *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "fake", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: cpu, MemoryMb: mem}}
	}
}

// Concurrent creates never take a project past its quota, whichever limit
// binds, and the count stays right once the watcher's view catches up.
func TestQuotaHoldsUnderConcurrency(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	cases := []struct {
		name  string
		quota *iamv1.Quota
		spec  func() *sandboxv1.SandboxSpec
		want  int
	}{
		{"count", &iamv1.Quota{MaxSandboxes: 5}, sized(0.1, 64), 5},
		{"cpu", &iamv1.Quota{CpuCores: 2}, sized(0.5, 64), 4},
		{"memory", &iamv1.Quota{MemoryMb: 1024}, sized(0.1, 256), 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cl := c.Project(t, "root", "q-"+tc.name, tc.quota)
			ok, refused := burst(t, cl, 24, tc.spec)
			if ok != tc.want || refused != 24-tc.want {
				t.Fatalf("24 concurrent creates against a quota for %d: %d made, %d refused", tc.want, ok, refused)
			}
			// After the watcher has polled the edge (1 s), the quota is
			// still full: nothing was counted twice or lost.
			time.Sleep(1500 * time.Millisecond)
			if ok, _ := burst(t, cl, 3, tc.spec); ok != 0 {
				t.Fatalf("%d more made once the view caught up", ok)
			}
		})
	}
}

// A quota binds a whole subtree: creates in two children without quotas
// of their own share their parent's.
func TestNestedQuotaBindsTheSubtree(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	c.Project(t, "root", "n", &iamv1.Quota{MaxSandboxes: 3})
	x := c.Project(t, "root/n", "x", nil)
	y := c.Project(t, "root/n", "y", nil)
	var wg sync.WaitGroup
	var okX, okY int
	wg.Add(2)
	go func() { defer wg.Done(); okX, _ = burst(t, x, 10, sized(0.1, 64)) }()
	go func() { defer wg.Done(); okY, _ = burst(t, y, 10, sized(0.1, 64)) }()
	wg.Wait()
	if okX+okY != 3 {
		t.Fatalf("20 concurrent creates in two children of a project with a quota of 3: %d + %d made", okX, okY)
	}
}

// A fork asks for all its copies at once: refused whole when they do not
// fit, allowed when they do; the source counts.
func TestForkCountsAgainstQuota(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	cl := c.Project(t, "root", "f", &iamv1.Quota{MaxSandboxes: 3})
	ctx := e2e.Ctx(t)
	src, err := cl.Create(ctx, sized(0.1, 64)())
	if err != nil {
		t.Fatal(err)
	}
	_, err = cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 3}))
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "quota of project root/f") {
		t.Fatalf("fork of 3 with room for 2: %v", err)
	}
	r, err := cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: 2}))
	if err != nil || len(r.Msg.Results) != 2 || r.Msg.Results[0].Sandbox == nil || r.Msg.Results[1].Sandbox == nil {
		t.Fatalf("fork of 2 with room for 2: %v %v", r, err)
	}
	if _, err := cl.Create(ctx, sized(0.1, 64)()); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("create past the quota after a fork: %v", err)
	}
	_ = context.Background
}

// Creates one after another up to the quota all succeed, however the
// watcher's polls fall: each create here takes longer than a poll interval,
// so a poll always starts between the edge's admission and its answer.
// Such a poll counts the sandbox, and the apiserver counted it too until the
// next one: the third of three creates against a quota of three was refused.
func TestSequentialCreatesFillTheQuota(t *testing.T) {
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) {
		cfg.Backends["fake"] = map[string]string{"create_delay": "1200ms"}
	}, "fake")
	cl := c.Project(t, "root", "seq", &iamv1.Quota{MaxSandboxes: 3})
	ctx := e2e.Ctx(t)
	for i := 1; i <= 3; i++ {
		if _, err := cl.Create(ctx, sized(0.1, 64)()); err != nil {
			t.Fatalf("create %d of 3: %v", i, err)
		}
	}
	_, err := cl.Create(ctx, sized(0.1, 64)())
	if connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("a fourth create: %v, want the quota's refusal", err)
	}
}

// TestQuotaAcrossTwoAPIServers: 200 creates at once, half through each of
// two apiservers (the second reads IAM from its own non-voting replica and
// sends its reservations to the leader), against a quota of 50: exactly 50
// are made, and every other one is refused naming the project and limit.
func TestQuotaAcrossTwoAPIServers(t *testing.T) {
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.APIServers = 2 }, "fake")
	if len(c.APIURLs) != 2 {
		t.Fatalf("apiservers: %v", c.APIURLs)
	}
	ctx := e2e.Ctx(t)
	if _, err := c.Client.IAM.CreateProject(ctx, connect.NewRequest(&iamv1.CreateProjectRequest{Parent: "root", Name: "fifty", Quota: &iamv1.Quota{MaxSandboxes: 50}})); err != nil {
		t.Fatal(err)
	}
	key, err := c.Client.IAM.CreateAPIKey(ctx, connect.NewRequest(&iamv1.CreateAPIKeyRequest{Project: "root/fifty", Name: "k", Role: iamv1.Role_ROLE_MEMBER}))
	if err != nil {
		t.Fatal(err)
	}
	var clients []*client.Client
	for _, u := range c.APIURLs {
		cl, err := client.New(u, key.Msg.Secret)
		if err != nil {
			t.Fatal(err)
		}
		// The second apiserver's replica learns of the key within moments.
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if _, err = cl.IAM.WhoAmI(ctx, connect.NewRequest(&iamv1.WhoAmIRequest{})); err == nil || time.Now().After(deadline) {
				break
			}
		}
		if err != nil {
			t.Fatalf("%s: %v", u, err)
		}
		clients = append(clients, cl)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	made, refused := 0, 0
	start := make(chan struct{})
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			_, err := clients[i%2].Create(ctx, sized(0.1, 64)())
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				made++
			case connect.CodeOf(err) == connect.CodeResourceExhausted && strings.Contains(err.Error(), "quota of project root/fifty") && strings.Contains(err.Error(), "of 50 sandboxes"):
				refused++
			default:
				t.Errorf("create: %v", err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if made != 50 || refused != 150 {
		t.Fatalf("200 creates through 2 apiservers against a quota of 50: %d made, %d refused", made, refused)
	}
	// A removal through either apiserver gives its room back at once.
	list, err := clients[1].Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if err != nil || len(list.Msg.Sandboxes) != 50 {
		t.Fatalf("list through the second apiserver: %v, %v", list, err)
	}
	if err := clients[1].Sandbox(list.Msg.Sandboxes[0].Id).Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := clients[0].Create(ctx, sized(0.1, 64)()); err != nil {
		t.Fatalf("a create after one removal: %v", err)
	}
	if _, err := clients[0].Create(ctx, sized(0.1, 64)()); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("a create past the quota again: %v", err)
	}
}

// TestIdempotentCreatesAcrossAPIServers: creates with the same
// idempotency key, through either apiserver, at once or one after
// another, make one sandbox and all answer with it.
func TestIdempotentCreatesAcrossAPIServers(t *testing.T) {
	c := e2e.StartClusterWith(t, "", func(cfg *embed.Config) { cfg.APIServers = 2 }, "fake")
	ctx := e2e.Ctx(t)
	apis := e2e.APIClients(t, c, c.Key)
	create := func(cl *client.Client, key string) (string, error) {
		req := connect.NewRequest(&sandboxv1.CreateSandboxRequest{Spec: sized(0.1, 64)()})
		req.Header().Set(client.IdempotencyHeader, key)
		resp, err := cl.Sandboxes.CreateSandbox(ctx, req)
		if err != nil {
			return "", err
		}
		return resp.Msg.Sandbox.Id, nil
	}
	first, err := create(apis[0], "key-one")
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		again, err := create(apis[1], "key-one")
		if err == nil && again == first {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the same key through the other apiserver: %s, %v; want %s", again, err, first)
		}
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	ids := map[string]int{}
	for i := range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, err := create(apis[i%2], "key-two")
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Errorf("create %d with key-two: %v", i, err)
			}
			ids[id]++
		}()
	}
	wg.Wait()
	if len(ids) != 1 {
		t.Fatalf("10 creates with one key made %d sandboxes: %v", len(ids), ids)
	}
	list, err := apis[0].Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{}))
	if err != nil || len(list.Msg.Sandboxes) != 2 {
		t.Fatalf("sandboxes: %v, %v; want 2", list, err)
	}
	if _, err := create(apis[0], "bad key"); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("a key with a space: %v", err)
	}
}

// A storage quota binds what a subtree stores: an import stops at the room
// left (refused with the reason, nothing named), a snapshot is refused once
// the room is gone, the projects list shows the use, and removing an image
// gives its room back.
func TestStorageQuotaBindsImportsAndSnapshots(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	ctx := e2e.Ctx(t)
	member := c.Project(t, "root", "st", &iamv1.Quota{StorageMb: 2})
	archive := busyboxArchive(t, c)
	upload := func(name string) error {
		_, err := member.ImportImage(ctx, name, bytes.NewReader(archive.Bytes()), int64(archive.Len()))
		return err
	}
	if err := upload("root/st/one:1"); err != nil {
		t.Fatalf("an image of %d KiB into a 2 MiB quota: %v", archive.Len()>>10, err)
	}
	if err := upload("root/st/two:1"); err == nil || !strings.Contains(err.Error(), "resource_exhausted") || !strings.Contains(err.Error(), "storage quota of project root/st") {
		t.Fatalf("a second copy past the quota: %v, want refused naming the quota", err)
	}
	if _, err := c.Client.Images.GetImage(ctx, connect.NewRequest(&imagev1.GetImageRequest{Name: "root/st/two:1"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("the refused import is named: %v", err)
	}
	got, err := c.Client.IAM.GetProject(ctx, connect.NewRequest(&iamv1.GetProjectRequest{Path: "root/st"}))
	if err != nil || got.Msg.Project.Usage.StorageMb < 1 || got.Msg.Project.Usage.StorageMb > 2 || got.Msg.Project.Quota.StorageMb != 2 {
		t.Fatalf("the project's storage: %+v, %v; want 1-2 of 2 MiB", got, err)
	}
	// With the quota below what it holds, a snapshot is refused.
	if _, err := c.Client.IAM.SetQuota(ctx, connect.NewRequest(&iamv1.SetQuotaRequest{Path: "root/st", Quota: &iamv1.Quota{StorageMb: 1}})); err != nil {
		t.Fatal(err)
	}
	sb, err := member.Create(ctx, sized(0.1, 64)())
	if err != nil {
		t.Fatal(err)
	}
	snap := func() error {
		_, err := member.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: sb.ID}))
		return err
	}
	if err := snap(); connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "storage quota of project root/st") {
		t.Fatalf("a snapshot with no storage room: %v", err)
	}
	if _, err := member.Images.DeleteImage(ctx, connect.NewRequest(&imagev1.DeleteImageRequest{Name: "root/st/one:1"})); err != nil {
		t.Fatal(err)
	}
	if err := snap(); err != nil {
		t.Fatalf("a snapshot once the image is gone: %v", err)
	}
}

// busyboxArchive is the cluster's busybox image as an import archive.
func busyboxArchive(t *testing.T, c *e2e.Cluster) *bytes.Buffer {
	t.Helper()
	ref, _ := image.ParseRef("root/busybox:latest")
	im, err := c.Images.Resolve(ref)
	if err != nil {
		t.Fatal(err)
	}
	var archive bytes.Buffer
	if err := c.Images.Export(im, &archive); err != nil {
		t.Fatal(err)
	}
	return &archive
}

// Imports at the same moment see each other's room taken: four uploads of
// one image into a quota that holds one copy, each held halfway until all
// four have started, end with one stored and three refused naming the
// quota (each alone would fit).
func TestStorageQuotaHoldsAcrossConcurrentImports(t *testing.T) {
	c := e2e.StartCluster(t, "fake")
	ctx := e2e.Ctx(t)
	member := c.Project(t, "root", "par", &iamv1.Quota{StorageMb: 2})
	archive := busyboxArchive(t, c)
	if archive.Len() > 2<<20 || 2*archive.Len() <= 2<<20 {
		t.Fatalf("the busybox archive is %d KiB: the case wants one copy within 2 MiB and two past it", archive.Len()>>10)
	}
	const n = 4
	release := make(chan struct{})
	var halfway sync.WaitGroup
	halfway.Add(n)
	errs := make(chan error, n)
	for i := range n {
		body := &heldReader{data: archive.Bytes(), holdAt: archive.Len() / 2, release: release, reached: halfway.Done}
		go func() {
			_, err := member.ImportImage(ctx, "root/par/copy:"+string(rune('a'+i)), body, int64(archive.Len()))
			body.reachedOnce() // refused before it got halfway
			errs <- err
		}()
	}
	halfway.Wait()
	close(release)
	stored, refused := 0, 0
	for range n {
		switch err := <-errs; {
		case err == nil:
			stored++
		case strings.Contains(err.Error(), "storage quota of project root/par"):
			refused++
		default:
			t.Errorf("an import: %v, want stored or refused naming the quota", err)
		}
	}
	if stored != 1 || refused != n-1 {
		t.Fatalf("%d imports at once into a quota of one copy: %d stored, %d refused; want 1 and %d", n, stored, refused, n-1)
	}
}

// heldReader reads data, stopping at holdAt until release is closed; it
// calls reached once when it gets there.
type heldReader struct {
	data    []byte
	off     int
	holdAt  int
	release chan struct{}
	reached func()
	once    sync.Once
}

func (r *heldReader) reachedOnce() { r.once.Do(r.reached) }

func (r *heldReader) Read(p []byte) (int, error) {
	if r.off >= len(r.data) {
		return 0, io.EOF
	}
	end := len(r.data)
	if r.off < r.holdAt {
		end = r.holdAt
	} else {
		r.reachedOnce()
		<-r.release
	}
	n := copy(p, r.data[r.off:end])
	r.off += n
	return n, nil
}

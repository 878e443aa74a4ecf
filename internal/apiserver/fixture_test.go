package apiserver

import (
	"context"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edgeclient/edgefake"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/testutil"
	"github.com/opendsec/opendsec/internal/watcher"
)

// An apiserver on its own: a one-replica IAM (real Raft, on loopback),
// an image store holding root/tiny:1, edges in memory (edgefake) and a
// view of them the test sets. No edge, watcher or TLS between them runs.
type fixture struct {
	s      *Server
	iam    *iam.Service
	iamCfg iam.Config
	images *image.Store
	edges  []*edgefake.Edge
	view   staticView
}

// staticView is a watcher.Source whose view the test sets.
type staticView struct{ v atomic.Pointer[watcher.View] }

func (sv *staticView) View() *watcher.View { return sv.v.Load() }

func newFixture(t *testing.T, edges ...*edgefake.Edge) *fixture {
	t.Helper()
	dir := t.TempDir()
	ca, err := pki.LoadOrCreateCA(filepath.Join(dir, "pki"))
	if err != nil {
		t.Fatal(err)
	}
	cert, err := ca.Issue("iam-1", pki.RoleIAM, []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{edges: edges, iamCfg: iam.Config{Dir: filepath.Join(dir, "iam"), NodeID: "iam-1", Bind: "127.0.0.1:0", Bootstrap: true, SingleNode: true,
		ServerTLS: ca.ServerConfig(cert, pki.RoleIAM, pki.RoleAPIServer), ClientTLS: ca.ClientConfig(cert)}}
	f.openIAM(t)
	if _, err := f.iam.EnsureRoot(ctxFor(t)); err != nil {
		t.Fatal(err)
	}
	if f.images, err = image.OpenStore(filepath.Join(dir, "images")); err != nil {
		t.Fatal(err)
	}
	ref, _ := image.ParseRef("root/tiny:1")
	if _, err := f.images.Commit(ref, nil, nil, ocispec.ImageConfig{}); err != nil {
		t.Fatal(err)
	}
	f.view.v.Store(edgefake.View(edges...))
	f.newServer(t)
	return f
}

// openIAM opens the IAM replica (again: a new incarnation of it, as after
// a restart, when the replica is closed first).
func (f *fixture) openIAM(t *testing.T) {
	t.Helper()
	svc, err := iam.Open(f.iamCfg, testutil.Logger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { svc.Close() })
	if err := svc.WaitLeader(ctxFor(t)); err != nil {
		t.Fatal(err)
	}
	f.iam = svc
}

// newServer is a new apiserver on the fixture's IAM, images and edges.
func (f *fixture) newServer(t *testing.T) {
	f.s = New(Config{K: 2}, Deps{IAM: f.iam, Watcher: &f.view, Edges: edgefake.NewDialer(f.edges...), Images: f.images, Log: testutil.Logger(t)})
}

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// asRoot is ctx as the root project's admin key would reach a handler.
func asRoot(ctx context.Context) context.Context {
	return withPrincipal(ctx, iam.Principal{KeyID: "key-test", Project: "root", Role: fsm.RoleAdmin})
}

// create asks for a small sandbox of the fake backend, with an
// idempotency key if key is set.
func (f *fixture) create(ctx context.Context, key string) (*sandboxv1.Sandbox, error) {
	req := connect.NewRequest(&sandboxv1.CreateSandboxRequest{Spec: &sandboxv1.SandboxSpec{Backend: "fake", Image: "root/tiny:1",
		Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256}}})
	if key != "" {
		req.Header().Set("Idempotency-Key", key)
	}
	resp, err := (&sandboxService{f.s}).CreateSandbox(asRoot(ctx), req)
	if err != nil {
		return nil, err
	}
	return resp.Msg.Sandbox, nil
}

// entries are the quota ledger's entries, by id.
func (f *fixture) entries() map[string]fsm.Entry {
	out := map[string]fsm.Entry{}
	for _, e := range f.iam.State().Entries() {
		out[e.ID] = e
	}
	return out
}

// usage is a node's capacity of n sandboxes of 1 core and 256 MiB.
func usage(n int64) *edgev1.Usage {
	return &edgev1.Usage{Sandboxes: n, CpuCores: float64(n), MemoryMb: 256 * n}
}

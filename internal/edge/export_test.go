package edge

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/fake"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// peerEdge is a second edge on the fixture's image store, with its own
// state and fake backend, pulling with cert.
func (f *fixture) peerEdge(t *testing.T, ca *pki.CA, name string) (*Edge, *fake.Backend) {
	t.Helper()
	cert, err := ca.Issue(name, pki.RoleEdge, []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := fake.New(context.Background(), backend.Config{})
	e, err := New(context.Background(), Config{
		StateDir: filepath.Join(f.dir, name), AgentPath: filepath.Join(f.dir, "aether"), RunBase: f.runBase,
		Capacity: smallCapacity(), AgentTimeout: 5 * time.Second, PeerTLS: ca.ClientConfig(cert),
	}, Deps{Store: f.store, Backends: []backend.Backend{b}, Log: testutil.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e, b.(*fake.Backend)
}

func TestCopiesOnAnotherEdgePullTheSnapshot(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	ca, err := pki.LoadOrCreateCA(filepath.Join(f.dir, "pki"))
	if err != nil {
		t.Fatal(err)
	}
	// The source's edge, served over mutual TLS like a daemon's, counting
	// manifest requests.
	holderCert, _ := ca.Issue("holder", pki.RoleEdge, []string{"127.0.0.1"})
	var manifests atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/manifest") {
			manifests.Add(1)
		}
		f.edge.Handler().ServeHTTP(w, r)
	}))
	srv.TLS = ca.ServerConfig(holderCert, pki.RoleAPIServer, pki.RoleWatcher, pki.RoleEdge)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	addr := strings.TrimPrefix(srv.URL, "https://")
	other, _ := f.peerEdge(t, ca, "other")

	src, err := f.edge.Create(ctx, spec(), "root/a")
	if err != nil {
		t.Fatal(err)
	}
	fo, err := f.edge.Fork(ctx, src.Id, "root", ForkRequest{Count: 1, Export: true})
	if err != nil || fo.Export == nil || len(fo.Results) != 1 || fo.Results[0].Err != nil {
		t.Fatalf("fork with export: %+v, %v", fo, err)
	}
	x := fo.Export
	if x.SizeBytes <= 0 || x.Token == "" || !strings.HasPrefix(x.SnapshotId, "snap-"+string(f.edge.Node())) {
		t.Fatalf("export: %+v", x)
	}
	// A fork snapshot that is exported is not listed as the user's.
	if got := listSnapshots(t, f.edge, "root", ""); len(got) != 0 {
		t.Fatalf("fork snapshot listed: %v", got)
	}

	// Three concurrent restores on the other edge: one pull, three copies.
	source := &edgev1.SnapshotSource{Addr: addr, Token: x.Token}
	var wg sync.WaitGroup
	errs := make([]error, 3)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := other.Restore(ctx, x.SnapshotId, "root", "", RestoreOptions{}, source)
			if err == nil && (!strings.HasPrefix(sb.Id, string(other.Node())) || sb.Project != "root/a" || sb.SourceSnapshotId != x.SnapshotId) {
				err = errors.New("copy " + sb.Id + " in " + sb.Project)
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	if n := manifests.Load(); n != 1 {
		t.Fatalf("%d pulls for 3 concurrent restores, want 1", n)
	}
	if got := len(other.List("root")); got != 3 {
		t.Fatalf("other edge runs %d sandboxes, want 3", got)
	}
	// The fake's restore reads the snapshot's own file: it came over.
	if _, err := os.Stat(filepath.Join(other.snaps.PulledDir(snapIDOf(x)), "fake-snapshot")); err != nil {
		t.Fatal(err)
	}

	// Refusals: another project's scope, no token, a wrong token.
	if _, err := other.Restore(ctx, x.SnapshotId, "root/b", "", RestoreOptions{}, source); !errdefs.IsNotFound(err) {
		t.Fatalf("restore in another project's scope: %v", err)
	}
	if _, err := other.Restore(ctx, x.SnapshotId, "root", "", RestoreOptions{}, &edgev1.SnapshotSource{Addr: addr}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("no token: %v", err)
	}
	third, _ := f.peerEdge(t, ca, "third")
	if _, err := third.Restore(ctx, x.SnapshotId, "root", "", RestoreOptions{}, &edgev1.SnapshotSource{Addr: addr, Token: "bad"}); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("wrong token: %v", err)
	}
	// An edge's certificate reaches nothing else of an edge.
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/opendsec.edge.v1.EdgeService/ListSandboxes", strings.NewReader("{}"))
	req.Header.Set("Content-Type", "application/json")
	resp, err := peerClient(other.cfg.PeerTLS).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Fatalf("an edge certificate listing sandboxes: HTTP %d, want 403", resp.StatusCode)
	}

	// Released: the fork's snapshot is gone from the holder, and its
	// files are no longer served.
	if err := f.edge.ReleaseExport(x.SnapshotId, x.Token); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(f.edge.cfg.StateDir, "snapshots", x.SnapshotId)); !os.IsNotExist(err) {
		t.Fatalf("fork snapshot after release: %v", err)
	}
	if _, err := third.Restore(ctx, x.SnapshotId, "root", "", RestoreOptions{}, source); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("pull after release: %v", err)
	}
	// The pulled copy is dropped once idle; the copies keep running.
	other.snaps.Sweep(time.Now().Add(snapshots.PulledIdle + time.Second))
	if _, err := os.Stat(other.snaps.PulledDir(snapIDOf(x))); !os.IsNotExist(err) {
		t.Fatalf("pulled snapshot after the idle sweep: %v", err)
	}
	if got := len(other.List("root")); got != 3 {
		t.Fatalf("other edge runs %d sandboxes after the sweep, want 3", got)
	}
}

func snapIDOf(x *edgev1.SnapshotExport) sandboxid.SnapshotID {
	return sandboxid.SnapshotID(x.SnapshotId)
}

func TestExportLeaseEnds(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	src, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	fo, err := f.edge.Fork(ctx, src.Id, "root", ForkRequest{Export: true})
	if err != nil || fo.Export == nil || len(fo.Results) != 0 {
		t.Fatalf("fork of 0 with export: %+v, %v", fo, err)
	}
	// A named snapshot's export ends without deleting it.
	named, err := f.edge.Snapshot(ctx, src.Id, "root", "kept")
	if err != nil {
		t.Fatal(err)
	}
	nx, err := f.edge.Export(named.Id, "root")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.edge.Export(named.Id, "root/other"); !errdefs.IsNotFound(err) {
		t.Fatalf("export from another project's scope: %v", err)
	}
	f.edge.snaps.Sweep(time.Now().Add(snapshots.ExportLease + time.Second))
	if _, _, err := f.edge.snaps.ExportedFile(fo.Export.SnapshotId, fo.Export.Token); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("lapsed export still served: %v", err)
	}
	if _, _, err := f.edge.snaps.ExportedFile(named.Id, nx.Token); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("lapsed export still served: %v", err)
	}
	if _, err := os.Stat(filepath.Join(f.edge.cfg.StateDir, "snapshots", fo.Export.SnapshotId)); !os.IsNotExist(err) {
		t.Fatalf("lapsed fork snapshot: %v", err)
	}
	if got := listSnapshots(t, f.edge, "root", ""); len(got) != 1 || got[0].Id != named.Id {
		t.Fatalf("named snapshot after its export lapsed: %v", got)
	}
	if err := f.edge.ReleaseExport(named.Id, nx.Token); !errdefs.IsNotFound(err) {
		t.Fatalf("release of a lapsed export: %v", err)
	}
}

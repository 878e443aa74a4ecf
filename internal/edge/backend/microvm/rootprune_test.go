package microvm

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/testutil"
)

// A root disk goes once no guest or snapshot links to it and no create
// used it within the grace; one that a guest reaches by a symlink stays.
func TestPruneCacheRemovesRootsNothingLinks(t *testing.T) {
	state := t.TempDir()
	roots := filepath.Join(state, "roots")
	if err := os.MkdirAll(roots, 0o700); err != nil {
		t.Fatal(err)
	}
	b := &Backend{cfg: backend.Config{StateDir: state}, log: slog.New(slog.DiscardHandler), roots: map[string]*sync.Mutex{}}
	old := time.Now().Add(-time.Hour)
	root := func(key string) string {
		p := filepath.Join(roots, key+".ext4")
		if err := os.WriteFile(p, make([]byte, 64<<10), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, old, old); err != nil {
			t.Fatal(err)
		}
		return p
	}
	unused := root("unused")
	linked := root("linked")
	guest := filepath.Join(t.TempDir(), "root.ext4")
	if err := os.Link(linked, guest); err != nil {
		t.Fatal(err)
	}
	symlinked := root("symlinked")
	if err := shareRoot(filepath.Join(t.TempDir(), "no-such-disk"), symlinked, filepath.Join(t.TempDir(), "root.ext4")); err != nil {
		t.Fatal(err)
	}
	recent := root("recent")
	if err := os.Chtimes(recent, time.Now(), time.Now()); err != nil {
		t.Fatal(err)
	}
	freed, err := b.PruneCache(10 * time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if freed <= 0 {
		t.Fatalf("freed %d bytes, want the unused root's", freed)
	}
	for p, want := range map[string]bool{unused: false, linked: true, symlinked: true, recent: true} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Errorf("%s: kept %v, want %v", filepath.Base(p), err == nil, want)
		}
	}
	// Once the guest's link goes, so does its root.
	os.Remove(guest)
	if _, err := b.PruneCache(10 * time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(linked); err == nil {
		t.Fatal("a root no guest links to any more was kept")
	}
}

// On the real backend: the root disk Create built stays while its guest
// exists and goes with the guest's end; the next Create builds it again.
func TestPruneCacheOnTheBackendsOwnRoots(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	q := testQEMU(t)
	state := t.TempDir()
	b, err := New(context.Background(), backend.Config{StateDir: state, Log: testutil.Logger(t), Options: map[string]string{
		"qemu": q.Binary, "guest": filepath.Dir(q.Kernel), "init": q.Init, "templates": "off", // roots only
	}})
	if err != nil {
		t.Fatal(err)
	}
	env := backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	roots := func() []string {
		got, _ := filepath.Glob(filepath.Join(state, "roots", "*.ext4"))
		return got
	}
	create := func() *backend.Spec {
		spec := backendtest.NewSpec(t, env, "n1")
		if _, err := b.Create(ctx, spec); err != nil {
			t.Fatal(err)
		}
		return spec
	}
	spec := create()
	if len(roots()) != 1 {
		t.Fatalf("roots after a create: %v", roots())
	}
	pruner := b.(backend.CachePruner)
	if freed, err := pruner.PruneCache(0); err != nil || freed != 0 || len(roots()) != 1 {
		t.Fatalf("prune while its guest exists: freed %d, %v, roots %v", freed, err, roots())
	}
	if err := b.Destroy(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if freed, err := pruner.PruneCache(0); err != nil || freed <= 0 || len(roots()) != 0 {
		t.Fatalf("prune once its guest is gone: freed %d, %v, roots %v", freed, err, roots())
	}
	spec = create()
	defer b.Destroy(ctx, spec.ID) //nolint:errcheck // the test's guest
	if len(roots()) != 1 {
		t.Fatalf("a create after the prune made no root: %v", roots())
	}
}

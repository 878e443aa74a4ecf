package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// TestRestoreOnAnotherNode: a snapshot's files, copied elsewhere as
// another node pulls them (each a file of its own), restore on a backend
// with a state directory of its own after the first node's state is gone:
// nothing in the snapshot names a path of the node that took it. The copy
// has the guest memory (a file on the guest's tmpfs) and disk of the
// moment, and its own hostname.
func TestRestoreOnAnotherNode(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.ext4")
	q := testQEMU(t)
	env := backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	stateA := t.TempDir()
	a := factory(q)(t, stateA)
	src := backendtest.Start(t, a, env)
	src.Sh(t, "echo in-memory > /dev/shm/held; echo on-disk > /root/file; sync")
	taken := backend.SnapshotRef{ID: sandboxid.NewSnapshot(src.ID.Node()), Dir: filepath.Join(stateA, "snapshots", "s1")}
	if err := os.MkdirAll(taken.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := src.Link.Detach(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.(backend.Snapshotter).Snapshot(ctx, src.ID, taken); err != nil {
		t.Fatal(err)
	}
	pulled := backend.SnapshotRef{ID: taken.ID, Dir: filepath.Join(t.TempDir(), "pulled", string(taken.ID))}
	copyDir(t, taken.Dir, pulled.Dir)
	if err := a.Destroy(ctx, src.ID); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(stateA); err != nil { // the first node's roots, templates and snapshot
		t.Fatal(err)
	}

	b := factory(q)(t, t.TempDir())
	spec := backendtest.NewSpec(t, env, sandboxid.NewNodeID())
	cp := backendtest.Attach(t, b, spec)
	t.Cleanup(func() { b.Destroy(context.Background(), spec.ID) })
	h, err := b.(backend.Snapshotter).Restore(ctx, pulled, spec)
	if err != nil {
		t.Fatalf("restore on another node: %v", err)
	}
	if err := backendtest.WaitCopy(ctx, cp.Link, spec, h); err != nil {
		t.Fatalf("the copy on another node: %v", err)
	}
	if got := strings.Fields(cp.Sh(t, "hostname; cat /dev/shm/held /root/file")); len(got) != 3 || got[0] != string(spec.ID) || got[1] != "in-memory" || got[2] != "on-disk" {
		t.Fatalf("the copy on another node: hostname, its memory's file, its disk's file = %q", got)
	}

	// A snapshot of a guest under another accelerator is refused, named.
	desc := filepath.Join(pulled.Dir, "guest.json")
	data, err := os.ReadFile(desc)
	if err != nil {
		t.Fatal(err)
	}
	var g Guest
	if err := json.Unmarshal(data, &g); err != nil {
		t.Fatal(err)
	}
	g.Accel = map[string]string{"kvm": "tcg"}[b.(*Backend).Accel()]
	if g.Accel == "" {
		g.Accel = "kvm"
	}
	data, _ = json.Marshal(g)
	if err := os.WriteFile(desc, data, 0o600); err != nil {
		t.Fatal(err)
	}
	other := backendtest.NewSpec(t, env, sandboxid.NewNodeID())
	_, err = b.(backend.Snapshotter).Restore(ctx, pulled, other)
	if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "under "+g.Accel) {
		t.Fatalf("restore of a %s guest's snapshot on a %s node: %v", g.Accel, b.(*Backend).Accel(), err)
	}
}

// copyDir copies every file of src into dst (made), each a file of its
// own, as a pull writes them.
func copyDir(t *testing.T, src, dst string) {
	t.Helper()
	if err := os.MkdirAll(dst, 0o700); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		in, err := os.Open(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		out, err := os.Create(filepath.Join(dst, e.Name()))
		if err == nil {
			_, err = io.Copy(out, in)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
		}
		in.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
}

package snapshots

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// written is a snapshot of project written into st's directory, as the
// edge writes one after a checkpoint.
func written(t *testing.T, st *Store, project, name string, ephemeral bool) *Snapshot {
	t.Helper()
	spec := &sandboxv1.SandboxSpec{Image: "root/busybox:latest", Metadata: map[string]string{"k": "v"}}
	raw, err := protojson.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	s := &Snapshot{ID: sandboxid.NewSnapshot(st.node), Project: project, SourceSandbox: sandboxid.New(st.node), Backend: "fake",
		Spec: raw, SandboxSpec: spec, CreatedAt: time.Now().UTC(), Name: name, Ephemeral: ephemeral}
	s.Dir = st.Dir(s.ID)
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(s.Dir, "memory"), []byte("its memory"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.Save(); err != nil {
		t.Fatal(err)
	}
	return s
}

// A store started on what a previous run left keeps the snapshots whose
// description it reads, and one it cannot read (kept for a release that
// can, unlisted); it removes a half-written one (no description) and an
// interrupted fork's.
func TestLoadKeepsWhatItCanReadAndWhatANewerReleaseWrote(t *testing.T) {
	t.Parallel()
	stateDir, node := t.TempDir(), sandboxid.NewNodeID()
	before := New(node, stateDir, nil, testutil.Logger(t))
	named := written(t, before, "root/a", "kept", false)
	fork := written(t, before, "root/a", "", true)
	newer := written(t, before, "root/a", "newer", false)
	data, _ := os.ReadFile(filepath.Join(newer.Dir, File))
	var desc map[string]any
	if err := json.Unmarshal(data, &desc); err != nil {
		t.Fatal(err)
	}
	desc["layout"] = CurrentLayout() + 1
	data, _ = json.Marshal(desc)
	if err := os.WriteFile(filepath.Join(newer.Dir, File), data, 0o600); err != nil {
		t.Fatal(err)
	}
	half := filepath.Join(before.dir, string(sandboxid.NewSnapshot(node)))
	if err := os.MkdirAll(half, 0o700); err != nil {
		t.Fatal(err)
	}

	st := New(node, stateDir, nil, testutil.Logger(t))
	st.Load()
	if st.Len() != 1 {
		t.Fatalf("%d snapshots loaded, want 1", st.Len())
	}
	got, err := st.Lookup(string(named.ID), "root")
	if err != nil || got.Name != "kept" || got.SandboxSpec.GetMetadata()["k"] != "v" || got.Dir != named.Dir {
		t.Fatalf("the named snapshot: %+v %v", got, err)
	}
	for what, dir := range map[string]string{"a fork's": fork.Dir, "a half-written one": half} {
		if _, err := os.Stat(dir); !os.IsNotExist(err) {
			t.Errorf("%s directory: %v; want it removed", what, err)
		}
	}
	if _, err := os.Stat(filepath.Join(newer.Dir, "memory")); err != nil {
		t.Errorf("a newer release's snapshot: %v; want it kept", err)
	}
}

// A snapshot is seen only in its project's scope; a fork's is never
// listed or looked up; a name is taken once per project, also while its
// snapshot is being taken.
func TestSnapshotsAreSeenInTheirProjectsScope(t *testing.T) {
	t.Parallel()
	st := New(sandboxid.NewNodeID(), t.TempDir(), nil, testutil.Logger(t))
	a := written(t, st, "root/a", "n", false)
	st.Add(a)
	fork := written(t, st, "root/a", "", true)
	st.Add(fork)
	if _, err := st.Lookup(string(fork.ID), "root"); !errdefs.IsNotFound(err) {
		t.Fatalf("lookup of a fork's snapshot: %v", err)
	}
	if out, foreign := st.List("root/a", ""); len(out) != 1 || out[0].Id != string(a.ID) || foreign {
		t.Fatalf("list in root/a: %v (foreign %v)", out, foreign)
	}
	if out, foreign := st.List("root/b", string(a.SourceSandbox)); len(out) != 0 || !foreign {
		t.Fatalf("list of a's sandbox in root/b: %v (foreign %v); want none, and told it is another project's", out, foreign)
	}
	if _, err := st.Lookup(string(a.ID), "root/b"); !errdefs.IsNotFound(err) {
		t.Fatalf("lookup from another project: %v", err)
	}
	other := sandboxid.NewSnapshot(sandboxid.NewNodeID())
	if _, err := st.Lookup(string(other), "root"); !errdefs.IsNotFound(err) {
		t.Fatalf("lookup of another node's snapshot: %v", err)
	}
	if _, err := st.ReserveName("root/a", "n"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("a name project root/a has: %v", err)
	}
	release, err := st.ReserveName("root/b", "n")
	if err != nil {
		t.Fatalf("names are per project: %v", err)
	}
	if _, err := st.ReserveName("root/b", "n"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("a name being taken: %v", err)
	}
	release()
	release() // once only
	if r, err := st.ReserveName("root/b", "n"); err != nil {
		t.Fatalf("a name let go: %v", err)
	} else {
		r()
	}
}

// An export's token serves only its snapshot's files, until it is
// released or its lease ends; a fork's snapshot stays while one export of
// it is open and goes with its last, a named one stays.
func TestExportsServeTheirTokenUntilReleasedOrLapsed(t *testing.T) {
	t.Parallel()
	st := New(sandboxid.NewNodeID(), t.TempDir(), nil, testutil.Logger(t))
	fork := written(t, st, "root/a", "", true)
	named := written(t, st, "root/a", "n", false)
	st.Add(fork)
	st.Add(named)
	x, err := st.OpenExport(fork)
	if err != nil {
		t.Fatal(err)
	}
	other, err := st.OpenExport(fork)
	if err != nil {
		t.Fatal(err)
	}
	dir, m, err := st.ExportedFile(string(fork.ID), x.Token)
	if err != nil || dir != fork.Dir || m.Total() != int64(len("its memory")) {
		t.Fatalf("exported files: %q %v %v", dir, m, err)
	}
	if _, _, err := st.ExportedFile(string(named.ID), x.Token); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("another snapshot with the token: %v", err)
	}
	if err := st.ReleaseExport(string(fork.ID), "not-the-token"); !errdefs.IsNotFound(err) {
		t.Fatalf("release with a wrong token: %v", err)
	}
	if err := st.ReleaseExport(string(fork.ID), x.Token); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(fork.Dir); err != nil || st.Len() != 2 {
		t.Fatalf("a fork's snapshot with an export left: %v, %d held; want it kept", err, st.Len())
	}
	st.Sweep(time.Now().Add(ExportLease + time.Second)) // its last export lapses
	if _, _, err := st.ExportedFile(string(fork.ID), other.Token); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("a lapsed export: %v", err)
	}
	if _, err := os.Stat(fork.Dir); !os.IsNotExist(err) || st.Len() != 1 {
		t.Fatalf("a fork's snapshot after its last export lapsed: %v, %d held", err, st.Len())
	}

	y, err := st.Export(string(named.ID), "root")
	if err != nil {
		t.Fatal(err)
	}
	st.Sweep(time.Now().Add(ExportLease + time.Second))
	if _, _, err := st.ExportedFile(string(named.ID), y.Token); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Fatalf("a lapsed export: %v", err)
	}
	if _, err := os.Stat(named.Dir); err != nil || st.Len() != 1 {
		t.Fatalf("a named snapshot after its export lapsed: %v, %d held; want it kept", err, st.Len())
	}
}

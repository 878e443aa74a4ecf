package edge

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
)

// A node downgraded past a layout change keeps the sandboxes it cannot
// read, with their directories and veths, and sweeps nothing while they
// are there; upgraded again, it re-attaches them. A stray file among the
// sandboxes' directories is no record and is removed.
func TestARecordOfANewerLayoutIsKept(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	id := sandboxIDOf(sb)
	dir := f.edge.dirs.sandbox(id)
	f.edge.Close()
	editRecord(t, dir, func(m map[string]any) { m["layout"] = records.CurrentLayout() + 1 })

	e2 := f.open(t, smallCapacity())
	if got := e2.List("root"); len(got) != 0 {
		t.Fatalf("listed a record of a newer layout: %v", got)
	}
	if !exists(filepath.Join(dir, records.File)) {
		t.Fatal("the record of a newer layout was removed")
	}
	if !e2.recoveryIncomplete {
		t.Fatal("recovery says it read every record: it would sweep what the record names")
	}
	if got := networkedRecords(e2.records); len(got) != 1 || got[0] != string(id) {
		t.Fatalf("veths kept at start: %v; want the unreadable record's", got)
	}
	e2.Close()

	editRecord(t, dir, func(m map[string]any) { m["layout"] = records.CurrentLayout() })
	stray := filepath.Join(filepath.Dir(dir), "stray")
	if err := os.WriteFile(stray, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	e3 := f.open(t, smallCapacity())
	got, err := e3.Get(sb.Id, "root")
	if err != nil || got.State != sandboxv1.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("after the upgrade back: %v %v; want it running", got, err)
	}
	if e3.recoveryIncomplete || exists(stray) {
		t.Fatalf("a stray file: recovery incomplete %v, file kept %v; want it removed and the sweeps on", e3.recoveryIncomplete, exists(stray))
	}
}

// A snapshot's description follows the same rule: one an older release
// wrote (no layout) is read, one of a newer layout is kept unlisted until
// a release that reads it starts.
func TestSnapshotDescriptionLayouts(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	snap, err := f.edge.Snapshot(ctx, sb.Id, "root", "kept")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(f.edge.cfg.StateDir, "snapshots", snap.Id)
	f.edge.Close()
	listed := func(e *Edge) bool {
		t.Helper()
		snaps, err := e.ListSnapshots("root", "")
		if err != nil {
			t.Fatal(err)
		}
		return len(snaps) == 1 && snaps[0].Id == snap.Id && snaps[0].Name == "kept"
	}
	for _, step := range []struct {
		what   string
		layout any // nil: no layout, as before layouts
		listed bool
	}{
		{"written before layouts", nil, true},
		{"of a newer layout", snapshots.CurrentLayout() + 1, false},
		{"back to this release's layout", snapshots.CurrentLayout(), true},
	} {
		p := filepath.Join(dir, snapshots.File)
		data, err := os.ReadFile(p)
		if err != nil {
			t.Fatalf("%s: %v", step.what, err)
		}
		var m map[string]any
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatal(err)
		}
		delete(m, "layout")
		if step.layout != nil {
			m["layout"] = step.layout
		}
		data, _ = json.Marshal(m)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		e := f.open(t, smallCapacity())
		if got := listed(e); got != step.listed {
			t.Fatalf("snapshot description %s: listed %v, want %v", step.what, got, step.listed)
		}
		e.Close()
	}
}

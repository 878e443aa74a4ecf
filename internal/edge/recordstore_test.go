package edge

import (
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// layoutZero is testdata/record-layout0.json as it was read: the file was
// written by the release before layouts were numbered (its record.save),
// so that every later release is held to reading it.
func layoutZero() *record {
	return &record{
		Layout: len(recordUpgrades), ID: "n0d3n0d3-abcdefghijklmnop", Project: "root/team", State: statePaused,
		CreatedAt: time.Date(2026, 12, 3, 9, 0, 0, 0, time.UTC), ExpiresAt: time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC),
		ImageDigest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Handle:      &backend.Handle{Backend: "container", ID: "n0d3n0d3-abcdefghijklmnop"}, LayerDir: "/var/lib/opendsec/layers/l-1",
		PausedTask: true, Offloaded: "offload-1", TimeoutLeft: 90 * time.Second, NetAddr: "10.88.0.7", Reservation: "r-1", AgentKey: "k3y",
		spec: &sandboxv1.SandboxSpec{Backend: "container", Image: "root/python:3.12", TimeoutSeconds: 3600, Task: "rollout-7",
			Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 512}, Env: map[string]string{"A": "1"}},
	}
}

func sameRecord(t *testing.T, what string, got, want *record) {
	t.Helper()
	g, w := *got, *want
	g.Spec, w.Spec, g.spec, w.spec = nil, nil, nil, nil
	if !reflect.DeepEqual(g, w) {
		t.Fatalf("%s:\n got %+v\nwant %+v", what, g, w)
	}
	if !proto.Equal(got.spec, want.spec) {
		t.Fatalf("%s: spec %v, want %v", what, got.spec, want.spec)
	}
}

// Both stores keep what is put, read a record of the layout before
// numbering (as today's nodes hold them) upgraded, and keep one of a newer
// layout unread, with an error that says so.
func TestRecordStores(t *testing.T) {
	old, err := os.ReadFile("testdata/record-layout0.json")
	if err != nil {
		t.Fatal(err)
	}
	newer := strings.Replace(string(old), "{", `{"layout": 99,`, 1)
	stores := map[string]func(t *testing.T) (recordStore, func(id sandboxid.ID, data string)){
		"dir": func(t *testing.T) (recordStore, func(sandboxid.ID, string)) {
			root := t.TempDir()
			return dirRecords{root: root}, func(id sandboxid.ID, data string) {
				os.MkdirAll(filepath.Join(root, string(id)), 0o700) //nolint:errcheck // the write says
				if err := os.WriteFile(filepath.Join(root, string(id), recordFile), []byte(data), 0o600); err != nil {
					t.Fatal(err)
				}
			}
		},
		"memory": func(t *testing.T) (recordStore, func(sandboxid.ID, string)) {
			m := newMemRecords()
			return m, func(id sandboxid.ID, data string) { m.data[id] = []byte(data) }
		},
	}
	for name, open := range stores {
		t.Run(name, func(t *testing.T) {
			s, plant := open(t)
			if _, err := s.Get("n0d3n0d3-abcdefghijklmnop"); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("get of none: %v; want not exist", err)
			}
			plant("n0d3n0d3-abcdefghijklmnop", string(old))
			got, err := s.Get("n0d3n0d3-abcdefghijklmnop")
			if err != nil {
				t.Fatal(err)
			}
			sameRecord(t, "layout 0 as read", got, layoutZero())

			// Written back, it is this release's layout and reads the same.
			got.Message = "written again"
			if err := s.Put(got); err != nil {
				t.Fatal(err)
			}
			again, err := s.Get(got.ID)
			if err != nil {
				t.Fatal(err)
			}
			want := layoutZero()
			want.Message = "written again"
			sameRecord(t, "put and read again", again, want)

			plant("zzzzzzzz-newerlayoutrecord", newer)
			recs, bad := s.List()
			if len(recs) != 1 || recs[0].ID != got.ID {
				t.Fatalf("listed %v; want only %s", recs, got.ID)
			}
			err = bad["zzzzzzzz-newerlayoutrecord"]
			if len(bad) != 1 || !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "layout 99 was written by a newer release") {
				t.Fatalf("unreadable: %v; want the newer layout named", bad)
			}

			if err := s.Delete(got.ID); err != nil {
				t.Fatal(err)
			}
			if err := s.Delete(got.ID); err != nil {
				t.Fatalf("delete of none: %v", err)
			}
			if _, err := s.Get(got.ID); !errors.Is(err, fs.ErrNotExist) {
				t.Fatalf("get after delete: %v", err)
			}
		})
	}
}

// Bad layouts are refused by name, not read as layout 0.
func TestRecordLayoutErrors(t *testing.T) {
	for body, want := range map[string]string{
		`[]`:                             "not a JSON object",
		`{"layout":"one","id":"x"}`:      `layout "one"`,
		`{"layout":-1,"id":"x"}`:         "layout -1",
		`{"layout":1,"id":"x","spec":7}`: "spec",
	} {
		_, err := decodeRecord([]byte(body))
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v; want %q", body, err, want)
		}
	}
}

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
	dir := f.edge.sandboxDir(id)
	f.edge.Close()
	editRecord(t, dir, func(m map[string]any) { m["layout"] = len(recordUpgrades) + 1 })

	e2 := f.open(t, smallCapacity())
	if got := e2.List("root"); len(got) != 0 {
		t.Fatalf("listed a record of a newer layout: %v", got)
	}
	if !exists(filepath.Join(dir, recordFile)) {
		t.Fatal("the record of a newer layout was removed")
	}
	if !e2.recoveryIncomplete {
		t.Fatal("recovery says it read every record: it would sweep what the record names")
	}
	if got := e2.networkedRecords(); len(got) != 1 || got[0] != string(id) {
		t.Fatalf("veths kept at start: %v; want the unreadable record's", got)
	}
	e2.Close()

	editRecord(t, dir, func(m map[string]any) { m["layout"] = len(recordUpgrades) })
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

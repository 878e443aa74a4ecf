package records

import (
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
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// layoutZero is testdata/record-layout0.json as it was read: the file was
// written by the release before layouts were numbered (its record.save),
// so that every later release is held to reading it.
func layoutZero() *Record {
	return &Record{
		Layout: CurrentLayout(), ID: "n0d3n0d3-abcdefghijklmnop", Project: "root/team", State: StatePaused,
		CreatedAt: time.Date(2026, 12, 3, 9, 0, 0, 0, time.UTC), ExpiresAt: time.Date(2026, 12, 3, 10, 0, 0, 0, time.UTC),
		ImageDigest: "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Handle:      &backend.Handle{Backend: "container", ID: "n0d3n0d3-abcdefghijklmnop"}, LayerDir: "/var/lib/opendsec/layers/l-1",
		PausedTask: true, Offloaded: "offload-1", TimeoutLeft: 90 * time.Second, NetAddr: "10.88.0.7", Reservation: "r-1", AgentKey: "k3y",
		Spec: &sandboxv1.SandboxSpec{Backend: "container", Image: "root/python:3.12", TimeoutSeconds: 3600, Task: "rollout-7",
			Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 512}, Env: map[string]string{"A": "1"}},
	}
}

func sameRecord(t *testing.T, what string, got, want *Record) {
	t.Helper()
	g, w := *got, *want
	g.SpecJSON, w.SpecJSON, g.Spec, w.Spec = nil, nil, nil, nil
	if !reflect.DeepEqual(g, w) {
		t.Fatalf("%s:\n got %+v\nwant %+v", what, g, w)
	}
	if !proto.Equal(got.Spec, want.Spec) {
		t.Fatalf("%s: spec %v, want %v", what, got.Spec, want.Spec)
	}
}

// Both stores keep what is put, read a record of the layout before
// numbering (as today's nodes hold them) upgraded, and keep one of a newer
// layout unread, with an error that says so.
func TestRecordStores(t *testing.T) {
	t.Parallel()
	old, err := os.ReadFile("testdata/record-layout0.json")
	if err != nil {
		t.Fatal(err)
	}
	newer := strings.Replace(string(old), "{", `{"layout": 99,`, 1)
	stores := map[string]func(t *testing.T) (Store, func(id sandboxid.ID, data string)){
		"dir": func(t *testing.T) (Store, func(sandboxid.ID, string)) {
			root := t.TempDir()
			return Dir{Root: root}, func(id sandboxid.ID, data string) {
				os.MkdirAll(filepath.Join(root, string(id)), 0o700) //nolint:errcheck // the write says
				if err := os.WriteFile(filepath.Join(root, string(id), File), []byte(data), 0o600); err != nil {
					t.Fatal(err)
				}
			}
		},
		"memory": func(t *testing.T) (Store, func(sandboxid.ID, string)) {
			m := NewMem()
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
	t.Parallel()
	for body, want := range map[string]string{
		`[]`:                             "not a JSON object",
		`{"layout":"one","id":"x"}`:      `layout "one"`,
		`{"layout":-1,"id":"x"}`:         "layout -1",
		`{"layout":1,"id":"x","spec":7}`: "spec",
	} {
		_, err := decode([]byte(body))
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v; want %q", body, err, want)
		}
	}
}

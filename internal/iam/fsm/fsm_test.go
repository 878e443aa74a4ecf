package fsm

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func apply(t *testing.T, f *FSM, ct CommandType, body any) error {
	t.Helper()
	data, err := Encode(ct, body)
	if err != nil {
		t.Fatal(err)
	}
	return f.ApplyCommand(data)
}

func TestProjectTreeAndDelegatedQuotas(t *testing.T) {
	f := New()
	at := time.Unix(1000, 0)
	mustOK := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	mustOK(apply(t, f, CmdCreateProject, CreateProject{Name: "root", Quota: Quota{CPUCores: 16, MemoryMB: 32768}, At: at}))
	mustOK(apply(t, f, CmdCreateProject, CreateProject{Parent: "root", Name: "team", Quota: Quota{CPUCores: 8}, At: at}))
	mustOK(apply(t, f, CmdCreateProject, CreateProject{Parent: "root/team", Name: "run-1", Quota: Quota{CPUCores: 4, MaxSandboxes: 10}, At: at}))
	// A child may not exceed its parent, nor an ancestor further up.
	err := apply(t, f, CmdCreateProject, CreateProject{Parent: "root/team", Name: "greedy", Quota: Quota{CPUCores: 9}, At: at})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "over parent root/team's 8") {
		t.Fatalf("child over parent: %v", err)
	}
	err = apply(t, f, CmdCreateProject, CreateProject{Parent: "root/team", Name: "mem", Quota: Quota{MemoryMB: 40000}, At: at})
	if !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("child over grandparent: %v", err)
	}
	if q := f.Effective("root/team/run-1"); q.CPUCores != 4 || q.MemoryMB != 32768 || q.MaxSandboxes != 10 {
		t.Fatalf("effective quota %+v", q)
	}
	// Lowering a parent below a child's quota is refused.
	err = apply(t, f, CmdSetQuota, SetQuota{Path: "root/team", Quota: Quota{CPUCores: 2}})
	if !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("parent below child: %v", err)
	}
	mustOK(apply(t, f, CmdSetQuota, SetQuota{Path: "root/team", Quota: Quota{CPUCores: 6}}))
	if err := apply(t, f, CmdCreateProject, CreateProject{Parent: "root", Name: "team", At: at}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("duplicate: %v", err)
	}
	if err := apply(t, f, CmdCreateProject, CreateProject{Parent: "root", Name: "Bad Name", At: at}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("bad name: %v", err)
	}
	if err := apply(t, f, CmdDeleteProject, DeleteProject{Path: "root/team"}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("delete with child: %v", err)
	}
	mustOK(apply(t, f, CmdCreateKey, CreateKey{Key: Key{ID: "k1", Project: "root/team/run-1", Role: RoleMember, Hash: "h1", CreatedAt: at}}))
	if err := apply(t, f, CmdDeleteProject, DeleteProject{Path: "root/team/run-1"}); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("delete with key: %v", err)
	}
	if k, ok := f.KeyByHash("h1"); !ok || k.ID != "k1" {
		t.Fatal("key by hash")
	}
	mustOK(apply(t, f, CmdRevokeKey, RevokeKey{ID: "k1"}))
	if _, ok := f.KeyByHash("h1"); ok {
		t.Fatal("revoked key still found")
	}
	mustOK(apply(t, f, CmdDeleteProject, DeleteProject{Path: "root/team/run-1"}))
	if got := len(f.Subtree("root")); got != 2 {
		t.Fatalf("subtree has %d projects", got)
	}
}

func TestSnapshotRestore(t *testing.T) {
	f := New()
	apply(t, f, CmdCreateProject, CreateProject{Name: "root"})
	apply(t, f, CmdCreateKey, CreateKey{Key: Key{ID: "k", Project: "root", Role: RoleAdmin, Hash: "h"}})
	snap, _ := f.Snapshot()
	var buf bytes.Buffer
	snap.Persist(&sink{Buffer: &buf})
	g := New()
	if err := g.Restore(io.NopCloser(&buf)); err != nil {
		t.Fatal(err)
	}
	if _, ok := g.KeyByHash("h"); !ok {
		t.Fatal("key lost in snapshot")
	}
	if _, ok := g.Project("root"); !ok {
		t.Fatal("project lost in snapshot")
	}
}

func TestUnknownCommands(t *testing.T) {
	f := New()
	if err := f.ApplyCommand([]byte{byte(IgnoreUnknown | 77), '{', '}'}); err != nil {
		t.Fatalf("ignorable unknown command: %v", err)
	}
	defer func() {
		if recover() == nil {
			t.Fatal("an unknown command without the ignore bit must stop the replica")
		}
	}()
	f.ApplyCommand([]byte{77, '{', '}'})
}

type sink struct{ *bytes.Buffer }

func (s *sink) ID() string    { return "test" }
func (s *sink) Cancel() error { return nil }
func (s *sink) Close() error  { return nil }

var _ raft.SnapshotSink = (*sink)(nil)

func FuzzApplyCommand(f *testing.F) {
	root, _ := Encode(CmdCreateProject, CreateProject{Name: "root"})
	f.Add(root)
	key, _ := Encode(CmdCreateKey, CreateKey{Key: Key{ID: "a", Project: "root", Role: 1, Hash: "x"}})
	f.Add(key)
	pool, _ := Encode(CmdSetPool, SetPool{Pool: PoolSetting{Key: "root|root/a:1", Project: "root", Spec: []byte(`{"image":"root/a:1"}`), Size: 2}})
	f.Add(pool)
	f.Fuzz(func(t *testing.T, data []byte) {
		s := New()
		s.ApplyCommand(root) //nolint:errcheck
		if len(data) > 0 {
			known := CommandType(data[0])&^IgnoreUnknown >= CmdCreateProject && CommandType(data[0])&^IgnoreUnknown <= CmdRevokeKey
			if !known && CommandType(data[0])&IgnoreUnknown == 0 {
				return // stops the replica by design
			}
		}
		s.ApplyCommand(data) //nolint:errcheck // must not panic
		for _, p := range s.Subtree("root") {
			if p.Path != "root" && !strings.HasPrefix(p.Path, "root/") {
				t.Fatalf("project %q outside the tree", p.Path)
			}
		}
	})
}

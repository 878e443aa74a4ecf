package fsm

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// TestLedgerHoldsTheQuota: reservations are refused past a quota of the
// project or an ancestor, binding shares a reservation out to sandboxes,
// releases give room back, unbound reservations lapse, and a snapshot
// keeps it all.
func TestLedgerHoldsTheQuota(t *testing.T) {
	f := New()
	at := time.Unix(1000, 0)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(apply(t, f, CmdCreateProject, CreateProject{Name: "root", At: at}))
	must(apply(t, f, CmdCreateProject, CreateProject{Parent: "root", Name: "team", Quota: Quota{MaxSandboxes: 4, CPUCores: 2}, At: at}))
	must(apply(t, f, CmdCreateProject, CreateProject{Parent: "root/team", Name: "a", At: at}))
	one := Resources{Sandboxes: 1, CPUCores: 0.5, MemoryMB: 64}
	reserve := func(id, proj string, r Resources, at time.Time) error {
		return apply(t, f, CmdReserve, Reserve{Entry: Entry{ID: id, Project: proj, Res: r, At: at, Expires: at.Add(time.Minute)}})
	}
	must(reserve("rsv-1", "root/team/a", one, at))
	must(reserve("rsv-2", "root/team", Resources{Sandboxes: 2, CPUCores: 1, MemoryMB: 128}, at))
	// 3 sandboxes and 1.5 cores used: one more fits, a second does not,
	// and the refusal names the ancestor whose quota binds.
	must(reserve("rsv-3", "root/team/a", one, at))
	err := reserve("rsv-4", "root/team/a", one, at)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "quota of project root/team: 4 of 4 sandboxes in use") {
		t.Fatalf("past the quota: %v", err)
	}
	if u := f.Usage("root"); u.Sandboxes != 4 || u.MemoryMB != 256 {
		t.Fatalf("root's usage: %+v", u)
	}
	// A fork reserved 2, made 1: one share comes back.
	must(apply(t, f, CmdBind, Bind{ID: "rsv-2", SandboxIDs: []string{"n1-sb2"}, At: at}))
	if u := f.Usage("root/team"); u.Sandboxes != 3 || u.CPUCores != 1.5 {
		t.Fatalf("after binding 1 of 2: %+v", u)
	}
	must(apply(t, f, CmdBind, Bind{ID: "rsv-1", SandboxIDs: []string{"n1-sb1"}, At: at}))
	if err := apply(t, f, CmdBind, Bind{ID: "rsv-1", SandboxIDs: []string{"n1-sb1"}, At: at}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("bind twice: %v", err)
	}
	must(apply(t, f, CmdRelease, Release{IDs: []string{"n1-sb1", "n1-sb1", "no-such"}}))
	if u := f.Usage("root/team/a"); u.Sandboxes != 1 {
		t.Fatalf("after a release: %+v", u)
	}
	// rsv-3 was never bound: a reservation after its expiry lapses it.
	must(reserve("rsv-5", "root/team/a", one, at.Add(2*time.Minute)))
	if u := f.Usage("root/team"); u.Sandboxes != 2 {
		t.Fatalf("after rsv-3 lapsed: %+v, want n1-sb2 and rsv-5", u)
	}
	if err := reserve("rsv-5", "root/team/a", one, at); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("same reservation id twice: %v", err)
	}
	if err := reserve("rsv-6", "root/nope", one, at); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown project: %v", err)
	}

	snap, err := f.Snapshot()
	must(err)
	var buf bytes.Buffer
	must(snap.Persist(&sink{Buffer: &buf}))
	g := New()
	must(g.Restore(io.NopCloser(&buf)))
	if u := g.Usage("root/team"); u != f.Usage("root/team") || len(g.Entries()) != 2 {
		t.Fatalf("restored ledger: %+v %v, want %+v", u, g.Entries(), f.Usage("root/team"))
	}
}

// TestAdoptCountsUncountedSandboxes: a running sandbox with no entry is
// counted once, and adopting it again, or one that has an entry, changes
// nothing.
func TestAdoptCountsUncountedSandboxes(t *testing.T) {
	f := New()
	at := time.Unix(1000, 0)
	if err := apply(t, f, CmdCreateProject, CreateProject{Name: "root", At: at}); err != nil {
		t.Fatal(err)
	}
	one := Resources{Sandboxes: 1, CPUCores: 0.1, MemoryMB: 64}
	if err := apply(t, f, CmdReserve, Reserve{Entry: Entry{ID: "rsv-1", Project: "root", Res: one, At: at}}); err != nil {
		t.Fatal(err)
	}
	if err := apply(t, f, CmdBind, Bind{ID: "rsv-1", SandboxIDs: []string{"n1-a"}, At: at}); err != nil {
		t.Fatal(err)
	}
	adopt := Adopt{Entries: []Entry{{ID: "n1-a", Project: "root", Res: one}, {ID: "n1-b", Project: "root", Res: one}}}
	for range 2 {
		if err := apply(t, f, CmdAdopt, adopt); err != nil {
			t.Fatal(err)
		}
	}
	if u := f.Usage("root"); u.Sandboxes != 2 || u.CPUCores != 0.2 {
		t.Fatalf("usage after adopting one uncounted sandbox twice: %+v", u)
	}
}

package edge

import (
	"context"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// impostor runs a second agent against sandbox id's edge socket, as root
// in the sandbox could (a copy of the agent binary, or a key of its own
// making): every call it took would answer 418.
func impostor(t *testing.T, e *Edge, id string, key string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	d := &agentlink.Dialer{Path: filepath.Join(e.dirs.run(sandboxid.ID(id)), "edge.sock"), Authenticate: true,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusTeapot) })}
	d.SetKey(key)
	go d.Run(ctx)
}

// TestImpostorAgentsAreNeverServed: the edge talks only to the agent it
// started, through a restart of the edge and in a sandbox's copies.
func TestImpostorAgentsAreNeverServed(t *testing.T) {
	f := newFixture(t, smallCapacity())
	ctx := context.Background()
	sb, err := f.edge.Create(ctx, spec(), "root")
	if err != nil {
		t.Fatal(err)
	}
	impostor(t, f.edge, sb.Id, "")
	impostor(t, f.edge, sb.Id, agentlink.NewKey())
	calls := func(e *Edge, id, when string) {
		t.Helper()
		c := agentClient(t, e, id, "root")
		for i := 0; i < 30; i++ {
			if out, err := echo(t, c); err != nil || out != "yes "+id {
				t.Fatalf("%s: call %d: %q %v (answered by an impostor?)", when, i, out, err)
			}
		}
	}
	calls(f.edge, sb.Id, "impostors beside the agent")

	f.edge.Close()
	e2 := f.open(t, smallCapacity())
	impostor(t, e2, sb.Id, "")
	calls(e2, sb.Id, "after the edge's restart")

	snap, err := e2.Snapshot(ctx, sb.Id, "root", "")
	if err != nil {
		t.Fatal(err)
	}
	cp, err := e2.Restore(ctx, snap.Id, "root", "", RestoreOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	impostor(t, e2, cp.Id, "")
	calls(e2, cp.Id, "a restored copy")
}

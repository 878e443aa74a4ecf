package edge

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
)

// setAgentVersion makes the fixture's agent one that says v.
func (f *fixture) setAgentVersion(t *testing.T, v string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(f.dir, "aether"), []byte("#!/bin/sh\necho "+v+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
}

// An upgrade of the edge and its agent leaves running sandboxes with the
// agent they started with: each says its agent's version, those older than
// the edge's are marked outdated, new sandboxes get the new agent, and a
// copy of a snapshot taken before the upgrade runs the snapshot's.
func TestSandboxesSayTheirAgentsVersionAcrossAnUpgrade(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t, smallCapacity())
	f.setAgentVersion(t, "v1.0.0")
	f.edge.Close()
	f.edge = f.open(t, smallCapacity())
	before, err := f.edge.Create(ctx, spec(), "root/team")
	if err != nil {
		t.Fatal(err)
	}
	if before.AgentVersion != "v1.0.0" || before.AgentOutdated {
		t.Fatalf("before the upgrade: agent %q outdated %v, want v1.0.0 and current", before.AgentVersion, before.AgentOutdated)
	}
	snap, err := f.edge.Snapshot(ctx, before.Id, "root", "")
	if err != nil {
		t.Fatal(err)
	}

	f.setAgentVersion(t, "v1.1.0")
	f.edge.Close()
	f.edge = f.open(t, smallCapacity())
	check := func(what string, sb *sandboxv1.Sandbox, version string, outdated bool) {
		t.Helper()
		if sb.AgentVersion != version || sb.AgentOutdated != outdated {
			t.Fatalf("%s: agent %q outdated %v, want %q and %v", what, sb.AgentVersion, sb.AgentOutdated, version, outdated)
		}
	}
	kept, err := f.edge.Get(before.Id, "root")
	if err != nil {
		t.Fatal(err)
	}
	check("a sandbox made before the upgrade", kept, "v1.0.0", true)
	if out, err := echo(t, agentClient(t, f.edge, before.Id, "root")); err != nil || out == "" {
		t.Fatalf("the sandbox made before the upgrade does not answer: %q %v", out, err)
	}
	fresh, err := f.edge.Create(ctx, spec(), "root/team")
	if err != nil {
		t.Fatal(err)
	}
	check("a sandbox made after the upgrade", fresh, "v1.1.0", false)
	copied, err := f.edge.Restore(ctx, snap.Id, "root", "", RestoreOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	check("a copy of a snapshot taken before the upgrade", copied, "v1.0.0", true)
	var listed int
	for _, sb := range f.edge.List("root") {
		if sb.AgentOutdated {
			listed++
		}
	}
	if listed != 2 {
		t.Fatalf("the listing marks %d sandboxes outdated, want 2", listed)
	}
}

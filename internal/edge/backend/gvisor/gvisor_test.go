package gvisor

import (
	"context"
	"testing"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/testutil"
)

func env(t *testing.T) backendtest.Env {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "runsc")
	return backendtest.Env{Layers: backendtest.BusyboxLayers(t), Agent: testutil.AgentBinary(t), Isolated: true}
}

func factory(t *testing.T, stateDir string) backend.Backend {
	b, err := New(context.Background(), backend.Config{StateDir: stateDir, Log: testutil.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Probe(context.Background()); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestConformance(t *testing.T) {
	backendtest.Run(t, factory, env(t))
}

func TestSnapshotAndRestore(t *testing.T) {
	backendtest.RunSnapshot(t, factory, env(t))
}

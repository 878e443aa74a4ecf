package fake

import (
	"context"
	"testing"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
	"github.com/opendsec/opendsec/internal/testutil"
)

func TestConformance(t *testing.T) {
	testutil.RequireRootUser(t)
	backendtest.Run(t, func(t *testing.T, stateDir string) backend.Backend {
		b, err := New(context.Background(), backend.Config{StateDir: stateDir})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}, backendtest.Env{})
}

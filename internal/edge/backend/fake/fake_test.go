package fake

import (
	"context"
	"testing"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/backendtest"
)

func TestConformance(t *testing.T) {
	backendtest.Run(t, func(t *testing.T, stateDir string) backend.Backend {
		b, err := New(context.Background(), backend.Config{StateDir: stateDir})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}, backendtest.Env{})
}

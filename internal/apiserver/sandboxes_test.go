package apiserver

import (
	"errors"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestOnNodeNamesTheNodeOnceAndKeepsTheClass(t *testing.T) {
	t.Parallel()
	edgeErr := errdefs.FromConnect(errdefs.ToConnect(errdefs.ResourceExhausted("node full: 0.0 of 16.0 cpu cores free, 0.25 asked")))
	got := errdefs.OnNode("n1", edgeErr)
	if strings.Count(got.Error(), "n1") != 1 || !strings.HasPrefix(got.Error(), "node n1: node full") {
		t.Fatalf("error: %q", got)
	}
	if !errors.Is(got, errdefs.ErrResourceExhausted) {
		t.Fatal("the error class is lost")
	}
	if got := errdefs.OnNode("n2", errors.New("connection refused")).Error(); got != "node n2: connection refused" {
		t.Fatalf("transport error: %q", got)
	}
}

package apiserver

import (
	"errors"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestOnNodeNamesTheNodeOnce(t *testing.T) {
	edgeErr := errdefs.FromConnect(errdefs.ToConnect(errdefs.ResourceExhausted("node n1: 0.0 of 16.0 cpu cores free, 0.25 asked")))
	if got := onNode("n1", edgeErr).Error(); strings.Count(got, "node n1") != 1 {
		t.Fatalf("error names the node %d times: %q", strings.Count(got, "node n1"), got)
	}
	if !errors.Is(onNode("n1", edgeErr), errdefs.ErrResourceExhausted) {
		t.Fatal("the error class is lost")
	}
	if got := onNode("n2", errors.New("connection refused")).Error(); got != "node n2: connection refused" {
		t.Fatalf("transport error: %q", got)
	}
}

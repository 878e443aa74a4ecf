package sandbox

import (
	"strings"
	"testing"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// TestPolicyOfARecordThatDoesNotParse: a record whose policy this release
// cannot parse (written by another, or changed by hand) is an error that
// says so, never an empty policy attached in its place.
func TestPolicyOfARecordThatDoesNotParse(t *testing.T) {
	rec := &records.Record{Spec: &sandboxv1.SandboxSpec{Network: &sandboxv1.NetworkPolicy{
		Rules: []*sandboxv1.NetworkRule{{Cidr: "300.1.2.3/8", Protocol: "tcp", Ports: []string{"80"}}}}}}
	_, err := policyOf(rec)
	if errdefs.Code(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "recorded network policy") || !strings.Contains(err.Error(), "300.1.2.3/8") {
		t.Fatalf("policyOf of a rule that does not parse: %v; want FailedPrecondition naming the record's rule", err)
	}
	rec.Spec.Network.Rules[0].Cidr = "203.0.113.0/24"
	if p, err := policyOf(rec); err != nil || len(p.Rules) != 1 {
		t.Fatalf("policyOf of a good rule: %+v, %v", p, err)
	}
}

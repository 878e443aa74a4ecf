package sandboxspec

import (
	"errors"
	"strings"
	"testing"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestNormalizeCanonicalisesTheNetworkPolicyAndKeepsInbound(t *testing.T) {
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Network: &sandboxv1.NetworkPolicy{
		AllowPublicTraffic: true,
		Rules: []*sandboxv1.NetworkRule{
			{Domain: "PyPI.Example.org.", Protocol: "TCP", Ports: []string{"443"}},
			{Cidr: "10.1.0.0/16"},
			{Domain: "pypi.example.org", Protocol: "tcp", Ports: []string{"443"}}, // the first, again
		},
	}}
	if err := Normalize(spec, DefaultLimits(), []string{"container"}); err != nil {
		t.Fatal(err)
	}
	n := spec.Network
	if !n.AllowPublicTraffic || len(n.Rules) != 2 || n.Rules[0].Domain != "pypi.example.org" || n.Rules[0].Protocol != "tcp" || n.Rules[1].Cidr != "10.1.0.0/16" {
		t.Fatalf("normalized policy: %v", n)
	}
	spec.Network.Rules = append(spec.Network.Rules, &sandboxv1.NetworkRule{Cidr: "10.0.0.0/33"})
	err := Normalize(spec, DefaultLimits(), []string{"container"})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "network.rules[2]") {
		t.Fatalf("a bad CIDR: %v", err)
	}
}

func TestNetworkUpdateSaysExactlyWhatChanges(t *testing.T) {
	cur, err := NetworkPolicy(&sandboxv1.NetworkPolicy{Rules: []*sandboxv1.NetworkRule{{Domain: "a.example"}}})
	if err != nil {
		t.Fatal(err)
	}
	yes := true
	p, err := NetworkUpdate(cur, &sandboxv1.UpdateNetworkRequest{Add: []*sandboxv1.NetworkRule{{Cidr: "192.0.2.1"}}, Internet: &yes})
	if err != nil || len(p.Rules) != 2 || !p.Internet {
		t.Fatalf("add: %v %v", p, err)
	}
	if _, err := NetworkUpdate(cur, &sandboxv1.UpdateNetworkRequest{Rules: []*sandboxv1.NetworkRule{{Domain: "b.example"}}}); err == nil || !strings.Contains(err.Error(), "replace_rules") {
		t.Fatalf("rules without replace_rules: %v", err)
	}
	if _, err := NetworkUpdate(cur, &sandboxv1.UpdateNetworkRequest{Add: []*sandboxv1.NetworkRule{nil}}); err == nil || !strings.Contains(err.Error(), "add[0]") {
		t.Fatalf("a nil rule: %v", err)
	}
	p, err = NetworkUpdate(cur, &sandboxv1.UpdateNetworkRequest{ReplaceRules: true})
	if err != nil || len(p.Rules) != 0 {
		t.Fatalf("replace with nothing: %v %v", p, err)
	}
}

package sandboxnet

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/netpolicy"
)

func TestCheckPolicyRefusesClosedRules(t *testing.T) {
	n := Node{
		Subnet: netip.MustParsePrefix("10.88.0.0/20"),
		Addrs:  []netip.Addr{netip.MustParseAddr("192.0.2.7")},
		Closed: []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")},
	}
	cases := map[string]string{
		"169.254.169.254":  "metadata",
		"169.254.0.0/16":   "metadata",
		"192.0.2.7":        "node itself",
		"127.0.0.1":        "loopback",
		"198.51.100.64/26": "operator closed",
		"10.88.0.9":        "sandbox subnet",
	}
	for cidr, want := range cases {
		p, err := netpolicy.Parse("rules", false, []netpolicy.RuleSpec{{CIDR: "203.0.113.0/24"}, {CIDR: cidr, Protocol: "tcp", Ports: []string{"80"}}})
		if err != nil {
			t.Fatal(err)
		}
		err = n.CheckPolicy("network.rules", p)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "network.rules[1]") {
			t.Errorf("%s: %v, want refused as %q naming network.rules[1]", cidr, err, want)
		}
	}
	// Rules that only contain a closed range, domains and public
	// addresses pass.
	ok, _ := netpolicy.Parse("rules", true, []netpolicy.RuleSpec{{CIDR: "0.0.0.0/0"}, {CIDR: "192.0.0.0/8"}, {CIDR: "10.88.0.0/16"}, {Domain: "pypi.org"}, {CIDR: "203.0.113.9"}})
	if err := n.CheckPolicy("network.rules", ok); err != nil {
		t.Errorf("a policy naming no closed range: %v", err)
	}
	n.AllowClosed = true
	meta, _ := netpolicy.Parse("rules", false, []netpolicy.RuleSpec{{CIDR: "169.254.169.254"}, {CIDR: "192.0.2.7"}})
	if err := n.CheckPolicy("network.rules", meta); err != nil {
		t.Errorf("closed rules allowed by the operator: %v", err)
	}
	sub, _ := netpolicy.Parse("rules", false, []netpolicy.RuleSpec{{CIDR: "10.88.0.9"}})
	if err := n.CheckPolicy("network.rules", sub); err == nil {
		t.Error("a rule naming a sandbox's address passed with closed rules allowed: sandboxes never reach each other")
	}
}

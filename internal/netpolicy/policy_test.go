package netpolicy

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

func TestParseGivesCanonicalRules(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in   RuleSpec
		want string
	}{
		{RuleSpec{Domain: "PyPI.Example.org."}, "any pypi.example.org"},
		{RuleSpec{Domain: "*.example.org", Protocol: "TCP", Ports: []string{"443"}}, "tcp *.example.org:443"},
		{RuleSpec{Domain: "xn--bcher-kva.example", Protocol: "udp", Ports: []string{"53"}}, "udp xn--bcher-kva.example:53"},
		{RuleSpec{CIDR: "10.1.0.0/16", Ports: []string{"8080", "80-90", "91", "22"}}, "any 10.1.0.0/16:22,80-91,8080"},
		{RuleSpec{CIDR: "203.0.113.7"}, "any 203.0.113.7/32"},
		{RuleSpec{CIDR: "0.0.0.0/0", Protocol: "any", Ports: []string{"1-65535", "443"}}, "any 0.0.0.0/0:1-65535"},
		{RuleSpec{Domain: "mirror"}, "any mirror"},
	}
	for _, c := range cases {
		rules, err := ParseRules("network.rules", []RuleSpec{c.in})
		if err != nil {
			t.Errorf("%+v: %v", c.in, err)
			continue
		}
		if got := rules[0].String(); got != c.want {
			t.Errorf("%+v: got %q, want %q", c.in, got, c.want)
		}
		// The canonical text reads back as the same rule (the CLI's form).
		back, err := ParseRules("allow", []RuleSpec{RuleSpecFromText(c.want)})
		if err != nil || back[0].String() != c.want {
			t.Errorf("%q read back as %v, %v", c.want, back, err)
		}
	}
	for text, want := range map[string]string{
		"pypi.example.org": "any pypi.example.org", "tcp 10.0.0.9:80": "tcp 10.0.0.9/32:80",
		" udp *.example.org:53,5353 ": "udp *.example.org:53,5353", "192.0.2.0/24": "any 192.0.2.0/24",
	} {
		rules, err := ParseRules("allow", []RuleSpec{RuleSpecFromText(text)})
		if err != nil || rules[0].String() != want {
			t.Errorf("%q: got %v, %v; want %q", text, rules, err, want)
		}
	}
}

// Every refusal is InvalidArgument, names the rule's index and field, and
// says what is allowed.
func TestParseRefusesWithTheRuleAndTheReason(t *testing.T) {
	t.Parallel()
	cases := []struct {
		in   RuleSpec
		want []string
	}{
		{RuleSpec{}, []string{"rules[1]", "neither domain nor cidr"}},
		{RuleSpec{Domain: "a.org", CIDR: "10.0.0.0/8"}, []string{"both domain", "one of them"}},
		{RuleSpec{Domain: "exa mple.org"}, []string{`domain "exa mple.org"`, "letters, digits and hyphens"}},
		{RuleSpec{Domain: "a..org"}, []string{"empty label"}},
		{RuleSpec{Domain: "*.org"}, []string{"whole top-level domain"}},
		{RuleSpec{Domain: "a.*.org"}, []string{"whole first label"}},
		{RuleSpec{Domain: "*"}, []string{"whole first label"}},
		{RuleSpec{Domain: "-a.org"}, []string{"hyphen"}},
		{RuleSpec{Domain: "bücher.example"}, []string{"punycode"}},
		{RuleSpec{Domain: strings.Repeat("a", 64) + ".org"}, []string{"at most 63"}},
		{RuleSpec{Domain: strings.Repeat("abcdefgh.", 32) + "org"}, []string{"at most 253"}},
		{RuleSpec{Domain: "10.0.0.1"}, []string{"an address", "cidr"}},
		{RuleSpec{Domain: "a.123"}, []string{"all digits"}},
		{RuleSpec{CIDR: "10.0.0.1/8"}, []string{"host bits set", "10.0.0.0/8"}},
		{RuleSpec{CIDR: "10.0.0.0/33"}, []string{"not a CIDR"}},
		{RuleSpec{CIDR: "example.org"}, []string{"not an address or a CIDR"}},
		{RuleSpec{CIDR: "2001:db8::/32"}, []string{"IPv4 networking only"}},
		{RuleSpec{CIDR: "::ffff:10.0.0.1"}, []string{}},
		{RuleSpec{CIDR: "10.0.0.0/8", Protocol: "icmp"}, []string{`protocol "icmp"`, "tcp, udp"}},
		{RuleSpec{CIDR: "10.0.0.0/8", Ports: []string{"0"}}, []string{`port "0"`, "1-65535"}},
		{RuleSpec{CIDR: "10.0.0.0/8", Ports: []string{"65536"}}, []string{"1-65535"}},
		{RuleSpec{CIDR: "10.0.0.0/8", Ports: []string{"90-80"}}, []string{"first port is above the last"}},
		{RuleSpec{CIDR: "10.0.0.0/8", Ports: []string{"1-2-3"}}, []string{"range like 8000-8100"}},
		{RuleSpec{CIDR: "10.0.0.0/8", Ports: strings.Fields(strings.Repeat("1 ", MaxPortsPerRule+1))}, []string{"at most 16"}},
	}
	for _, c := range cases {
		// The bad rule is the second, so the index in the error is 1.
		_, err := ParseRules("network.rules", []RuleSpec{{Domain: "ok.example.org"}, c.in})
		if c.in.CIDR == "::ffff:10.0.0.1" {
			// A mapped IPv4 address is that IPv4 address.
			if err != nil {
				t.Errorf("%+v: %v", c.in, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("%+v: accepted", c.in)
			continue
		}
		if !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%+v: %v is not InvalidArgument", c.in, err)
		}
		for _, w := range append([]string{"network.rules[1]"}, c.want...) {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%+v: %q does not say %q", c.in, err, w)
			}
		}
	}
}

func TestParseLimitsTheRuleCount(t *testing.T) {
	t.Parallel()
	specs := make([]RuleSpec, MaxRules+1)
	for i := range specs {
		specs[i] = RuleSpec{CIDR: fmt.Sprintf("10.%d.%d.0/24", i/256, i%256)}
	}
	if _, err := ParseRules("network.rules", specs); err == nil || !strings.Contains(err.Error(), "at most 256") {
		t.Fatalf("%d rules: %v", len(specs), err)
	}
	if rules, err := ParseRules("network.rules", specs[:MaxRules]); err != nil || len(rules) != MaxRules {
		t.Fatalf("%d rules: %d, %v", MaxRules, len(rules), err)
	}
}

func TestDomainRulesMatchExactAndBelowAWildcard(t *testing.T) {
	t.Parallel()
	p, err := Parse("network.rules", false, []RuleSpec{{Domain: "example.org"}, {Domain: "*.pkg.example.org", Protocol: "tcp"}, {CIDR: "10.0.0.0/8"}})
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string]string{
		"example.org":          "[0]",
		"EXAMPLE.org.":         "[0]",
		"a.example.org":        "[]",
		"pkg.example.org":      "[]",
		"a.pkg.example.org":    "[1]",
		"a.b.pkg.example.org.": "[1]",
		"xpkg.example.org":     "[]",
		"example.org.evil.com": "[]",
		"":                     "[]",
	}
	for name, want := range cases {
		if got := fmt.Sprint(p.DomainRules(name)); got != want {
			t.Errorf("%q: rules %s, want %s", name, got, want)
		}
		if p.MayResolve(name) != (want != "[]") {
			t.Errorf("%q: MayResolve %v", name, p.MayResolve(name))
		}
	}
	if !(Policy{Internet: true}).MayResolve("anything.example") {
		t.Error("the internet shorthand does not resolve every name")
	}
}

func mustRules(t *testing.T, specs ...RuleSpec) []Rule {
	t.Helper()
	r, err := ParseRules("test", specs)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func rulesString(p Policy) string {
	var s []string
	for _, r := range p.Rules {
		s = append(s, r.String())
	}
	return strings.Join(s, "; ")
}

func TestApplyChangesExactlyWhatItSays(t *testing.T) {
	t.Parallel()
	a := mustRules(t, RuleSpec{Domain: "a.example.org"})[0]
	b := mustRules(t, RuleSpec{CIDR: "10.0.0.0/8", Protocol: "tcp", Ports: []string{"443"}})[0]
	c := mustRules(t, RuleSpec{CIDR: "10.0.0.0/8"})[0]
	p := Policy{Rules: []Rule{a, b}}

	got, err := p.Apply(Update{Add: []Rule{c, a}})
	if err != nil || rulesString(got) != "any a.example.org; tcp 10.0.0.0/8:443; any 10.0.0.0/8" {
		t.Fatalf("add: %q %v", rulesString(got), err)
	}
	got, err = p.Apply(Update{Remove: []Rule{b}})
	if err != nil || rulesString(got) != "any a.example.org" {
		t.Fatalf("remove: %q %v", rulesString(got), err)
	}
	// Removing the wider rule that is not there must not pass: the caller
	// believes it closed 10.0.0.0/8 on every port.
	if _, err := p.Apply(Update{Remove: []Rule{c}}); err == nil || !strings.Contains(err.Error(), `remove[0] "any 10.0.0.0/8": the policy has no such rule`) {
		t.Fatalf("remove of a rule not held: %v", err)
	}
	if rulesString(p) != "any a.example.org; tcp 10.0.0.0/8:443" {
		t.Fatalf("a refused update changed the policy: %q", rulesString(p))
	}
	on := true
	got, err = p.Apply(Update{Replace: &[]Rule{c}, Internet: &on})
	if err != nil || rulesString(got) != "any 10.0.0.0/8" || !got.Internet {
		t.Fatalf("replace: %q %v %v", rulesString(got), got.Internet, err)
	}
	if _, err := p.Apply(Update{Replace: &[]Rule{c}, Add: []Rule{a}}); err == nil {
		t.Fatal("replace with add was accepted")
	}
	many := make([]Rule, 0, MaxRules)
	for i := 0; i < MaxRules; i++ {
		many = append(many, mustRules(t, RuleSpec{CIDR: fmt.Sprintf("10.%d.%d.0/24", i/256, i%256)})[0])
	}
	if _, err := (Policy{Rules: many}).Apply(Update{Add: []Rule{a}}); err == nil || !strings.Contains(err.Error(), "at most 256") {
		t.Fatalf("an add past the limit: %v", err)
	}
}

// FuzzParseRules: no input panics; what is accepted is canonical (its
// String parses back to the same rule).
func FuzzParseRules(f *testing.F) {
	f.Add("pypi.example.org", "", "tcp", "443")
	f.Add("*.example.org", "", "", "8000-8100")
	f.Add("", "10.1.0.0/16", "udp", "53")
	f.Add("", "203.0.113.7", "any", "")
	f.Add("a..b", "::1", "icmp", "0-")
	f.Fuzz(func(t *testing.T, domain, cidr, proto, port string) {
		spec := RuleSpec{Domain: domain, CIDR: cidr, Protocol: proto}
		if port != "" {
			spec.Ports = strings.Split(port, ",")
		}
		rules, err := ParseRules("network.rules", []RuleSpec{spec})
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("%v is not InvalidArgument", err)
			}
			return
		}
		r := rules[0]
		back := RuleSpec{Domain: r.Domain, Protocol: r.Protocol.String()}
		if r.Domain == "" {
			back.CIDR = r.Prefix.String()
		}
		for _, p := range r.Ports {
			back.Ports = append(back.Ports, p.String())
		}
		again, err := ParseRules("network.rules", []RuleSpec{back})
		if err != nil || again[0].String() != r.String() {
			t.Fatalf("%q does not parse back to itself: %v %v", r, again, err)
		}
	})
}

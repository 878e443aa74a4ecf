// Package netpolicy is a sandbox's network policy as a create or an
// update carries it, and its checks (policy.go, update.go), and which
// names the DNS proxy may answer (match.go). It is pure: no host calls,
// so the apiserver checks policies without the node's network plumbing
// (internal/sandboxnet, which enforces them).
//
// A policy denies by default. It allows destinations by domain (exact, or
// every name below one with "*.example.org"), by CIDR, each optionally
// narrowed to a protocol and ports, and the shorthand "internet": every
// public address on any port. Whatever a policy allows, some addresses stay
// closed unless a rule names them (see sandboxnet's nft.go).
package netpolicy

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Limits on a policy's size: each rule is a few nftables rules and a set.
const (
	MaxRules        = 256
	MaxPortsPerRule = 16
	maxDomainLen    = 253
)

// Protocol narrows a rule to TCP or UDP; Any allows both, and other IP
// protocols (ICMP) too when the rule names no ports.
type Protocol uint8

// The protocols a rule can name.
const (
	Any Protocol = iota
	TCP
	UDP
)

func (p Protocol) String() string {
	switch p {
	case TCP:
		return "tcp"
	case UDP:
		return "udp"
	}
	return "any"
}

// PortRange is First..Last, both included.
type PortRange struct{ First, Last uint16 }

func (r PortRange) String() string {
	if r.First == r.Last {
		return strconv.Itoa(int(r.First))
	}
	return fmt.Sprintf("%d-%d", r.First, r.Last)
}

// Rule allows one destination: a domain's addresses as the DNS proxy
// answered them, or a CIDR.
type Rule struct {
	// Domain is a lower-case name without the final dot; "*.example.org"
	// allows every name below example.org (not example.org itself). Empty
	// for a CIDR rule.
	Domain string
	// Prefix is the CIDR of a CIDR rule, masked (valid only then).
	Prefix   netip.Prefix
	Protocol Protocol
	// Ports, sorted and merged; empty allows every port.
	Ports []PortRange
}

// String is the rule's canonical form, which identifies it in updates:
// "tcp pypi.example.org:443", "any 10.1.0.0/16", "udp *.example.org:53,5353".
func (r Rule) String() string {
	dst := r.Domain
	if dst == "" {
		dst = r.Prefix.String()
	}
	var b strings.Builder
	b.WriteString(r.Protocol.String())
	b.WriteByte(' ')
	b.WriteString(dst)
	for i, p := range r.Ports {
		if i == 0 {
			b.WriteByte(':')
		} else {
			b.WriteByte(',')
		}
		b.WriteString(p.String())
	}
	return b.String()
}

// Policy is a sandbox's whole network policy. The zero Policy allows nothing.
type Policy struct {
	// Internet allows every public address (not private, shared, link-local,
	// loopback, multicast or reserved ranges), any protocol and port.
	Internet bool
	Rules    []Rule
}

// RuleSpec is a rule as a request carries it: exactly one of Domain and
// CIDR; Protocol "tcp", "udp" or empty (both); Ports like "443" or
// "8000-8100", none for every port.
type RuleSpec struct {
	Domain   string
	CIDR     string
	Protocol string
	Ports    []string
}

// Parse checks a policy from a request. field names it in errors
// ("network.rules"); every error names the rule, the value and what is
// allowed.
func Parse(field string, internet bool, specs []RuleSpec) (Policy, error) {
	rules, err := ParseRules(field, specs)
	if err != nil {
		return Policy{}, err
	}
	return Policy{Internet: internet, Rules: rules}, nil
}

// ParseRules checks a list of rules (a policy's, or an update's), drops
// exact duplicates and keeps the order.
func ParseRules(field string, specs []RuleSpec) ([]Rule, error) {
	if len(specs) > MaxRules {
		return nil, errdefs.InvalidArgument("%s: %d rules, at most %d are allowed; use a CIDR or a *.domain rule to cover several", field, len(specs), MaxRules)
	}
	var rules []Rule
	seen := map[string]bool{}
	for i, s := range specs {
		r, err := parseRule(s)
		if err != nil {
			return nil, errdefs.InvalidArgument("%s[%d]: %v", field, i, err)
		}
		if k := r.String(); !seen[k] {
			seen[k] = true
			rules = append(rules, r)
		}
	}
	return rules, nil
}

func parseRule(s RuleSpec) (Rule, error) {
	var r Rule
	switch {
	case s.Domain != "" && s.CIDR != "":
		return r, fmt.Errorf("both domain %q and cidr %q: a rule has one of them", errdefs.Clip(s.Domain, 64), errdefs.Clip(s.CIDR, 64))
	case s.Domain != "":
		d, err := parseDomain(s.Domain)
		if err != nil {
			return r, fmt.Errorf("domain %q: %v", errdefs.Clip(s.Domain, 64), err)
		}
		r.Domain = d
	case s.CIDR != "":
		p, err := parseCIDR(s.CIDR)
		if err != nil {
			return r, fmt.Errorf("cidr %q: %v", errdefs.Clip(s.CIDR, 64), err)
		}
		r.Prefix = p
	default:
		return r, fmt.Errorf("neither domain nor cidr: a rule names one (\"pypi.example.org\", \"*.example.org\" or \"10.1.0.0/16\")")
	}
	switch strings.ToLower(s.Protocol) {
	case "", "any":
		r.Protocol = Any
	case "tcp":
		r.Protocol = TCP
	case "udp":
		r.Protocol = UDP
	default:
		return r, fmt.Errorf("protocol %q: want tcp, udp or empty for both", errdefs.Clip(s.Protocol, 64))
	}
	ports, err := parsePorts(s.Ports)
	if err != nil {
		return r, err
	}
	r.Ports = ports
	return r, nil
}

// parseDomain checks a name: ASCII letters, digits and hyphens in labels of
// 1 to 63, at most 253 in all, and a wildcard only as the whole first label.
func parseDomain(s string) (string, error) {
	d := strings.ToLower(strings.TrimSuffix(s, "."))
	wild := false
	if rest, ok := strings.CutPrefix(d, "*."); ok {
		wild, d = true, rest
	}
	if d == "" {
		return "", fmt.Errorf("empty name")
	}
	if len(d) > maxDomainLen {
		return "", fmt.Errorf("%d characters, at most %d", len(d), maxDomainLen)
	}
	if _, err := netip.ParseAddr(d); err == nil {
		return "", fmt.Errorf("an address, not a name: put it in cidr")
	}
	labels := strings.Split(d, ".")
	for _, l := range labels {
		if err := checkLabel(l); err != nil {
			return "", err
		}
	}
	if wild && len(labels) < 2 {
		return "", fmt.Errorf("*.%s would allow a whole top-level domain; name at least two labels (*.example.org)", d)
	}
	if strings.Trim(labels[len(labels)-1], "0123456789") == "" {
		return "", fmt.Errorf("the last label %q is all digits; an address goes in cidr", labels[len(labels)-1])
	}
	if wild {
		return "*." + d, nil
	}
	return d, nil
}

func checkLabel(l string) error {
	switch {
	case l == "":
		return fmt.Errorf("an empty label (two dots in a row, or a leading dot)")
	case len(l) > 63:
		return fmt.Errorf("label %q is %d characters, at most 63", errdefs.Clip(l, 64), len(l))
	case strings.Contains(l, "*"):
		return fmt.Errorf("a wildcard is only allowed as the whole first label (*.example.org)")
	case l[0] == '-' || l[len(l)-1] == '-':
		return fmt.Errorf("label %q starts or ends with a hyphen", l)
	}
	for _, c := range l {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-':
		case c > 0x7f:
			return fmt.Errorf("label %q is not ASCII; write an internationalised name in its xn-- (punycode) form", l)
		default:
			return fmt.Errorf("label %q has %q; names have letters, digits and hyphens", l, c)
		}
	}
	return nil
}

// errNoIPv6: sandboxes get IPv4 only in this version.
var errNoIPv6 = fmt.Errorf("an IPv6 destination; sandboxes have IPv4 networking only in this version")

// parseCIDR takes an IPv4 prefix (host bits zero) or a single address.
func parseCIDR(s string) (netip.Prefix, error) {
	if !strings.Contains(s, "/") {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Zone() != "" {
			return netip.Prefix{}, fmt.Errorf("not an address or a CIDR; want like 10.1.0.0/16 or 203.0.113.7")
		}
		if a = a.Unmap(); !a.Is4() {
			return netip.Prefix{}, errNoIPv6
		}
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	p, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("not a CIDR (%v); want like 10.1.0.0/16", err)
	}
	if !p.Addr().Is4() {
		return netip.Prefix{}, errNoIPv6
	}
	if m := p.Masked(); m != p {
		return netip.Prefix{}, fmt.Errorf("host bits set; write %s", m)
	}
	return p, nil
}

// parsePorts takes "443" and "8000-8100" forms and returns them sorted and
// merged.
func parsePorts(specs []string) ([]PortRange, error) {
	if len(specs) > MaxPortsPerRule {
		return nil, fmt.Errorf("%d ports, at most %d per rule; use a range (8000-8100)", len(specs), MaxPortsPerRule)
	}
	var out []PortRange
	for _, s := range specs {
		first, last, isRange := strings.Cut(strings.TrimSpace(s), "-")
		if !isRange {
			last = first
		}
		a, errA := parsePort(first)
		b, errB := parsePort(last)
		if errA != nil || errB != nil {
			return nil, fmt.Errorf("port %q: want a number 1-65535 or a range like 8000-8100", errdefs.Clip(s, 64))
		}
		if a > b {
			return nil, fmt.Errorf("port range %q: the first port is above the last", errdefs.Clip(s, 64))
		}
		out = append(out, PortRange{a, b})
	}
	slices.SortFunc(out, func(x, y PortRange) int { return int(x.First) - int(y.First) })
	merged := out[:0]
	for _, r := range out {
		if n := len(merged); n > 0 && int(r.First) <= int(merged[n-1].Last)+1 {
			merged[n-1].Last = max(merged[n-1].Last, r.Last)
			continue
		}
		merged = append(merged, r)
	}
	return merged, nil
}

func parsePort(s string) (uint16, error) {
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil || n == 0 {
		return 0, fmt.Errorf("bad port")
	}
	return uint16(n), nil
}

// RuleSpecFromText reads a rule in the form String writes, for command
// lines: "[tcp |udp ]DESTINATION[:PORTS]", e.g. "pypi.example.org",
// "tcp *.example.org:443", "udp 10.1.0.0/16:53,5353". It only splits the
// text; Parse checks the parts.
func RuleSpecFromText(s string) RuleSpec {
	var r RuleSpec
	s = strings.TrimSpace(s)
	if proto, rest, ok := strings.Cut(s, " "); ok {
		r.Protocol, s = proto, strings.TrimSpace(rest)
	}
	if dst, ports, ok := strings.Cut(s, ":"); ok {
		s = dst
		r.Ports = strings.Split(ports, ",")
	}
	if strings.ContainsAny(s, "/") || isIPv4Text(s) {
		r.CIDR = s
	} else {
		r.Domain = s
	}
	return r
}

func isIPv4Text(s string) bool {
	a, err := netip.ParseAddr(s)
	return err == nil && a.Is4()
}

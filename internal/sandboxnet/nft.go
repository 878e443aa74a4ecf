package sandboxnet

import (
	"fmt"
	"hash/fnv"
	"net/netip"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/netpolicy"
)

// Node is what the node's nftables table needs. Sandboxes reach the node
// through veths whose host side is named IfPrefix+…, with addresses from
// Subnet; the node routes and masquerades what their policies allow.
type Node struct {
	Table    string         // inet table the edge owns ("opendsec")
	Subnet   netip.Prefix   // the sandboxes' IPv4 addresses (and the gateway's)
	IfPrefix string         // host-side veth names start with it ("dsv")
	DNS      netip.AddrPort // the node's DNS proxy, as sandboxes reach it
	// Addrs are the node's own addresses, Closed further prefixes (the
	// control plane's hosts): both stay closed unless a rule names them.
	Addrs  []netip.Addr
	Closed []netip.Prefix
	// AllowClosed lets a rule name a closed address (an operator's
	// setting, AllowClosedFlag); without it CheckPolicy refuses such rules
	// and no chain opens one.
	AllowClosed bool
	// Flows bounds each sandbox's connections (zero: DefaultFlows).
	Flows FlowLimits
}

// FlowLimits bound one sandbox's connections, so one that opens
// thousands cannot fill the node's connection tracking table for its
// neighbours: new connections per second (with a burst) and connections
// open at once. What is over is refused like what the policy does not
// allow.
type FlowLimits struct {
	NewPerSecond int
	Burst        int
	Open         int
}

// DefaultFlows are the limits of a sandbox on a node that sets none: far
// above what package installs and test runs open, far below the 262 144
// connections of a default conntrack table.
var DefaultFlows = FlowLimits{NewPerSecond: 500, Burst: 2000, Open: 8192}

func (n Node) flows() FlowLimits {
	if n.Flows == (FlowLimits{}) {
		return DefaultFlows
	}
	return n.Flows
}

// Sandbox is one sandbox's place in the table.
type Sandbox struct {
	Name   string     // unique on the node (its id)
	HostIf string     // the host side of its veth
	Addr   netip.Addr // its IPv4 address, in Node.Subnet
	// Generation changes with every policy change (Network sets it), so
	// the DNS proxy knows when what it opened may be gone.
	Generation uint64
}

// closed is every prefix no policy opens unless a rule names it.
func (n Node) closed() []netip.Prefix {
	out := append([]netip.Prefix(nil), closedRanges...)
	for _, a := range n.Addrs {
		a = a.Unmap()
		out = append(out, netip.PrefixFrom(a, a.BitLen()))
	}
	return append(out, n.Closed...)
}

// NodeScript (re)creates the node's table, empty of sandboxes: the base
// chains send a sandbox's new connections, forwarded or to the node, to its
// own chain through the egress map, drop those of an interface not in it,
// let replies back and masquerade what leaves. What a policy does not allow
// is refused at once (a TCP reset, else ICMP administratively prohibited),
// so a client fails fast instead of waiting out its timeout. The edge runs it at start,
// then a SandboxScript for each sandbox it re-attached.
func NodeScript(n Node) string {
	var b strings.Builder
	t := "inet " + n.Table
	fmt.Fprintf(&b, "table %s {}\ndelete table %s\ntable %s {\n", t, t, t)
	b.WriteString(setDecl("closed4", v4only(n.closed())))
	b.WriteString(setDecl("private4", v4only(append(append(n.closed(), privateRanges...), n.Subnet))))
	b.WriteString("\tmap egress { type ifname : verdict; }\n")
	// sources pairs each sandbox's veth with its address; a packet from a
	// sandbox's veth with any other source (or IPv6) is dropped before
	// anything else, established flows included, so no sandbox can speak
	// for another.
	b.WriteString("\tset sources { type ifname . ipv4_addr; }\n")
	sb := quote(n.IfPrefix + "*")
	fmt.Fprintf(&b, `	chain forward {
		type filter hook forward priority filter; policy accept;
		iifname %[1]s meta nfproto ipv6 drop
		iifname %[1]s iifname . ip saddr != @sources drop
		ct state established,related accept
		iifname vmap @egress
		iifname %[1]s drop
		oifname %[1]s drop
	}
	chain input {
		type filter hook input priority filter; policy accept;
		iifname != %[1]s accept
		meta nfproto ipv6 drop
		iifname . ip saddr != @sources drop
		ct state established,related accept
		iifname vmap @egress
		drop
	}
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		ip saddr %[2]s oifname != %[1]s masquerade
	}
	chain refuse {
		meta l4proto tcp reject with tcp reset
		reject with icmpx type admin-prohibited
	}
}
`, sb, n.Subnet.Masked())
	return b.String()
}

// SandboxScript installs or replaces sb's chain for p in one nftables
// transaction: until it commits the old rules hold, after it the new
// ones. old, if not nil, is the policy being replaced: the address sets of
// its domain rules that p no longer has are deleted; those it keeps keep
// the addresses the proxy learned.
func SandboxScript(n Node, sb Sandbox, old *netpolicy.Policy, p netpolicy.Policy) string {
	var b strings.Builder
	t := "inet " + n.Table
	c := chainName(sb.Name)
	fmt.Fprintf(&b, "add chain %s %s\nflush chain %s %s\n", t, c, t, c)
	keep := map[string]bool{}
	for _, r := range p.Rules {
		if r.Domain != "" {
			s := setName(sb.Name, r)
			keep[s] = true
			fmt.Fprintf(&b, "add set %s %s { type ipv4_addr; flags timeout; }\n", t, s)
		}
	}
	add := func(format string, args ...any) {
		fmt.Fprintf(&b, "add rule %s %s ", t, c)
		fmt.Fprintf(&b, format, args...)
		b.WriteByte('\n')
	}
	// Its own address only, and IPv4 only: a sandbox that changed its
	// address or speaks IPv6 reaches nothing.
	add("meta nfproto ipv6 drop")
	add("ip saddr != %s drop", sb.Addr)
	// Only a connection's first packet comes here (replies and the rest
	// are accepted before the egress map), so these count connections.
	f := n.flows()
	add("limit rate over %d/second burst %d packets goto refuse", f.NewPerSecond, f.Burst)
	add("ct count over %d goto refuse", f.Open)
	// The node's DNS proxy, which knows the sandbox by that address.
	add("ip daddr %s meta l4proto { tcp, udp } th dport %d accept", n.DNS.Addr(), n.DNS.Port())
	// Rules that name a closed range come before the closing, where the
	// operator allows them; none that overlaps the sandboxes' own subnet does (an operator's closed
	// 10.0.0.0/8 named by a rule must not open the sandboxes in it).
	closed := n.closed()
	for _, r := range p.Rules {
		if n.AllowClosed && r.Domain == "" && within(r.Prefix, closed) && !r.Prefix.Overlaps(n.Subnet.Masked()) {
			add("%s accept", match(r, prefixExpr(r.Prefix)))
		}
	}
	add("ip daddr @closed4 goto refuse")
	add("ip daddr %s goto refuse", n.Subnet.Masked())
	for _, r := range p.Rules {
		switch {
		case r.Domain != "":
			add("%s accept", match(r, "ip daddr @"+setName(sb.Name, r)))
		default:
			add("%s accept", match(r, prefixExpr(r.Prefix)))
		}
	}
	if p.Internet {
		add("ip daddr != @private4 accept")
	}
	add("goto refuse")
	fmt.Fprintf(&b, "add element %s sources { %s . %s }\n", t, quote(sb.HostIf), sb.Addr)
	fmt.Fprintf(&b, "add element %s egress { %s : jump %s }\n", t, quote(sb.HostIf), c)
	if old != nil {
		for _, r := range old.Rules {
			if s := setName(sb.Name, r); r.Domain != "" && !keep[s] {
				fmt.Fprintf(&b, "delete set %s %s\n", t, s)
				keep[s] = true // a rule listed twice is deleted once
			}
		}
	}
	return b.String()
}

// RemoveScript takes sb out of the table: its map element, chain and
// address sets.
func RemoveScript(n Node, sb Sandbox, p netpolicy.Policy) string {
	var b strings.Builder
	t := "inet " + n.Table
	c := chainName(sb.Name)
	fmt.Fprintf(&b, "delete element %s egress { %s }\ndelete element %s sources { %s . %s }\nflush chain %s %s\ndelete chain %s %s\n", t, quote(sb.HostIf), t, quote(sb.HostIf), sb.Addr, t, c, t, c)
	seen := map[string]bool{}
	for _, r := range p.Rules {
		if s := setName(sb.Name, r); r.Domain != "" && !seen[s] {
			seen[s] = true
			fmt.Fprintf(&b, "delete set %s %s\n", t, s)
		}
	}
	return b.String()
}

// LearnScript adds IPv4 addresses the DNS proxy answered for a name to the
// sets of the domain rules (indexes into p.Rules) that allow it, for ttl.
// Other addresses are skipped: sandboxes have IPv4 only.
func LearnScript(n Node, sb Sandbox, p netpolicy.Policy, rules []int, addrs []netip.Addr, ttl time.Duration) string {
	var b strings.Builder
	t := "inet " + n.Table
	secs := max(int(ttl/time.Second), 1)
	for _, i := range rules {
		s := setName(sb.Name, p.Rules[i])
		for _, a := range addrs {
			if a = a.Unmap(); a.Is4() {
				fmt.Fprintf(&b, "add element %s %s { %s timeout %ds }\n", t, s, a, secs)
			}
		}
	}
	return b.String()
}

// match is the rule's match on dst, narrowed to its protocol and ports.
func match(r netpolicy.Rule, dst string) string {
	var l4 string
	switch r.Protocol {
	case netpolicy.TCP:
		l4 = "meta l4proto tcp"
	case netpolicy.UDP:
		l4 = "meta l4proto udp"
	default:
		if len(r.Ports) > 0 {
			l4 = "meta l4proto { tcp, udp }"
		}
	}
	if len(r.Ports) > 0 {
		ports := make([]string, len(r.Ports))
		for i, p := range r.Ports {
			ports[i] = p.String()
		}
		l4 += " th dport { " + strings.Join(ports, ", ") + " }"
	}
	return strings.TrimSpace(dst + " " + l4)
}

func prefixExpr(p netip.Prefix) string {
	if p.IsSingleIP() {
		return "ip daddr " + p.Addr().String()
	}
	return "ip daddr " + p.String()
}

func setDecl(name string, elems []netip.Prefix) string {
	s := fmt.Sprintf("\tset %s { type ipv4_addr; flags interval; auto-merge;", name)
	if len(elems) > 0 {
		parts := make([]string, len(elems))
		for i, e := range elems {
			parts[i] = e.String()
		}
		s += " elements = { " + strings.Join(parts, ", ") + " };"
	}
	return s + " }\n"
}

func v4only(ps []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range ps {
		if p.Addr().Is4() {
			out = append(out, p.Masked())
		}
	}
	return out
}

// chainName and setName are nftables identifiers: letters, digits and
// underscores only.
func chainName(sandbox string) string { return "sb_" + ident(sandbox) }

func setName(sandbox string, r netpolicy.Rule) string {
	h := fnv.New32a()
	h.Write([]byte(r.String()))
	return fmt.Sprintf("sb_%s_d%08x", ident(sandbox), h.Sum32())
}

func ident(s string) string {
	return strings.Map(func(c rune) rune {
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' {
			return c
		}
		return '_'
	}, s)
}

// quote makes an nftables string literal of an interface name (which the
// edge makes: letters, digits and the prefix's characters).
func quote(s string) string { return `"` + strings.ReplaceAll(s, `"`, "") + `"` }

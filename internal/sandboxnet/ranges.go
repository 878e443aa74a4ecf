package sandboxnet

import "net/netip"

// closedRanges stay closed to every sandbox unless a rule's CIDR lies
// within one of them (a rule that only contains one, like 0.0.0.0/0, does
// not open it): "this network", loopback, link-local (where cloud metadata
// services answer: 169.254.169.254), multicast, reserved and broadcast.
// The node's own addresses and the operator's extra ones (the control
// plane) join them per node. Sandboxes have IPv4 only, so IPv6 is closed
// whole.
var closedRanges = mustPrefixes(
	"0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
)

// privateRanges are not "the internet": the internet shorthand does not
// open them, a CIDR rule does. RFC 1918, shared (CGNAT, where some clouds
// put metadata: 100.100.100.200), the IETF and benchmarking blocks. (The
// documentation blocks, 203.0.113.0/24 and kin,
// count as public: nothing routes them, and tests stand them up as "the
// internet" in namespaces of their own.)
var privateRanges = mustPrefixes(
	"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24",
	"198.18.0.0/15",
)

func mustPrefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

// within reports whether p lies inside one of the prefixes.
func within(p netip.Prefix, in []netip.Prefix) bool {
	for _, q := range in {
		if q.Addr().Is4() == p.Addr().Is4() && q.Bits() <= p.Bits() && q.Contains(p.Addr()) {
			return true
		}
	}
	return false
}

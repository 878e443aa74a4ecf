package sandboxnet

import (
	"net/netip"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/netpolicy"
)

// AllowClosedFlag is the operator's setting that lets a rule name a closed
// address (the node's own, link-local and metadata, the control plane's);
// errors that refuse such a rule name it.
const AllowClosedFlag = "--sandbox-allow-closed-rules"

// closedKind says why prefix p stays closed, or "" if it does not: the
// first of the node's closed ranges that holds it.
func (n Node) closedKind(p netip.Prefix) string {
	if within(p, []netip.Prefix{n.Subnet.Masked()}) {
		return "the node's sandbox subnet " + n.Subnet.Masked().String() + ": sandboxes never reach one another"
	}
	for _, a := range n.Addrs {
		a = a.Unmap()
		if within(p, []netip.Prefix{netip.PrefixFrom(a, a.BitLen())}) {
			return "an address of the node itself, whose services sandboxes do not reach"
		}
	}
	for _, c := range closedRanges {
		if within(p, []netip.Prefix{c}) {
			return closedRangeName(c)
		}
	}
	for _, c := range n.Closed {
		if within(p, []netip.Prefix{c}) {
			return "within " + c.String() + ", which the operator closed (the control plane's hosts)"
		}
	}
	return ""
}

func closedRangeName(c netip.Prefix) string {
	switch c.String() {
	case "169.254.0.0/16":
		return "link-local 169.254.0.0/16, where cloud metadata services answer"
	case "127.0.0.0/8":
		return "loopback 127.0.0.0/8"
	case "0.0.0.0/8":
		return "\"this network\" 0.0.0.0/8"
	case "224.0.0.0/4":
		return "multicast 224.0.0.0/4"
	}
	return "reserved " + c.String()
}

// CheckPolicy refuses a policy with a CIDR rule that lies in a closed
// range (docs/design.md: node and metadata addresses stay closed), unless
// the operator allowed such rules on this node. A rule that only contains
// a closed range (0.0.0.0/0) is fine: it never opens it. field names the
// rules in errors ("network.rules"). The edge checks every policy it
// admits (a create, a copy, an update); whatever is installed, a chain
// opens no closed range unless the operator allowed it (nft.go).
func (n Node) CheckPolicy(field string, p netpolicy.Policy) error {
	for i, r := range p.Rules {
		if r.Domain != "" {
			continue
		}
		kind := n.closedKind(r.Prefix)
		if kind == "" {
			continue
		}
		if within(r.Prefix, []netip.Prefix{n.Subnet.Masked()}) {
			return errdefs.InvalidArgument("%s[%d] %q: %s", field, i, r.String(), kind)
		}
		if !n.AllowClosed {
			return errdefs.InvalidArgument("%s[%d] %q: %s; no sandbox policy may open it unless the node's operator allows such rules (%s)", field, i, r.String(), kind, AllowClosedFlag)
		}
	}
	return nil
}

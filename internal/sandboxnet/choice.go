package sandboxnet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/atomicfile"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// A node's sandbox network is a subnet and a veth prefix. Both derive
// from the node's id, but two nodes on one machine (two dsec up, or an
// edge beside the veths another left running) can derive the same: 1 in
// 1,024 pairs share a /20 of 10.64.0.0/10, and as many share a prefix. A
// node therefore takes the first free one from where its id points, and
// keeps what it took in its state directory, so that its sandboxes keep
// their addresses and veth names across restarts and upgrades.
//
// Free means: no interface of the machine starts with the prefix or has
// an address in the subnet, and no other node's table claims either (a
// node with no sandbox has no veth yet, but has loaded its table, whose
// masquerade rule names both). Nodes starting together choose one at a
// time (chooseLock).

// Choice is the subnet and veth prefix a node uses.
type Choice struct {
	Subnet   netip.Prefix `json:"subnet"`
	IfPrefix string       `json:"if_prefix"`
}

// hostIf is one of the node's interfaces with its IPv4 prefixes.
type hostIf struct {
	Name  string
	Addrs []netip.Prefix
}

// choose picks node's network. subnet is the operator's (zero: none);
// kept is what the node chose before (zero: nothing kept); own are the
// sandboxes it is about to re-attach; ifs are the node's interfaces.
//
// What was kept stands while the node's own sandboxes use it or while
// nothing else took it; sandboxes of a release that kept nothing use the
// id's own defaults. Otherwise the node takes the first prefix no
// interface starts with and the first /20 no interface's address is in,
// counting from where its id points.
func choose(node string, subnet netip.Prefix, kept Choice, own []string, ifs []hostIf, claimed []Choice) (Choice, error) {
	if len(node) < 2 {
		return Choice{}, errdefs.InvalidArgument("node name %q: want a node id (at least 2 characters)", node)
	}
	c := kept
	if c.IfPrefix == "" && len(own) > 0 {
		c = Choice{Subnet: defaultSubnet(node), IfPrefix: "s" + node[:2]}
	}
	if subnet.IsValid() {
		c.Subnet = subnet.Masked()
	}
	if c.IfPrefix != "" {
		err := check(c, own, ifs, claimed)
		if err == nil || len(own) > 0 {
			return c, err
		}
	}
	// A first choice, or a new one: nothing of the node's uses the one it
	// kept, and something else took it.
	c.IfPrefix = ""
	for i := range prefixCandidates {
		if p := prefixCandidate(node, i); !prefixUsed(p, ifs, claimed) {
			c.IfPrefix = p
			break
		}
	}
	if c.IfPrefix == "" {
		return Choice{}, errdefs.ResourceExhausted("sandbox network: every veth prefix s?? is some interface's; remove the veths of nodes that are gone")
	}
	if !subnet.IsValid() {
		c.Subnet = netip.Prefix{}
		for i := range subnetSlots {
			if p := subnetSlot(node, i); overlapping(p, nil, ifs, claimed) == "" {
				c.Subnet = p
				break
			}
		}
		if !c.Subnet.IsValid() {
			return Choice{}, errdefs.ResourceExhausted("sandbox network: every /20 of 10.64.0.0/10 overlaps one of the node's interfaces; set --sandbox-subnet")
		}
	}
	return c, check(c, nil, ifs, claimed)
}

// check refuses a choice whose prefix starts an interface that is not one
// of own's veths or is another node's claim, or whose subnet holds an
// address of such an interface or overlaps a claimed subnet.
func check(c Choice, own []string, ifs []hostIf, claimed []Choice) error {
	mine := map[string]bool{}
	for _, name := range own {
		mine[ifNameFor(c.IfPrefix, name)] = true
	}
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, c.IfPrefix) && !mine[i.Name] {
			return errdefs.FailedPrecondition("interface prefix %q: the node's interface %s has it; choose one no interface of the node starts with", c.IfPrefix, i.Name)
		}
	}
	for _, o := range claimed {
		if o.IfPrefix == c.IfPrefix {
			return errdefs.FailedPrecondition("interface prefix %q: another node's nftables table claims it", c.IfPrefix)
		}
	}
	if msg := overlapping(c.Subnet, mine, ifs, claimed); msg != "" {
		return errdefs.FailedPrecondition("sandbox subnet %s overlaps %s; choose another subnet", c.Subnet, msg)
	}
	return nil
}

// overlapping names the first address of an interface (not one of mine)
// inside subnet, or the first claimed subnet overlapping it, or is "".
func overlapping(subnet netip.Prefix, mine map[string]bool, ifs []hostIf, claimed []Choice) string {
	for _, i := range ifs {
		if mine[i.Name] {
			continue
		}
		for _, a := range i.Addrs {
			if a.Overlaps(subnet) {
				return fmt.Sprintf("%s on the node's interface %s", a, i.Name)
			}
		}
	}
	for _, o := range claimed {
		if o.Subnet.Overlaps(subnet) {
			return fmt.Sprintf("%s, another node's sandbox subnet (its veths start with %s)", o.Subnet, o.IfPrefix)
		}
	}
	return ""
}

func prefixUsed(p string, ifs []hostIf, claimed []Choice) bool {
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, p) {
			return true
		}
	}
	for _, o := range claimed {
		if o.IfPrefix == p {
			return true
		}
	}
	return false
}

// claims are the subnets and veth prefixes of the other nodes' tables on
// the machine (dsec_*, all but ownTable), read from their masquerade rule.
func claims(ctx context.Context, ownTable string) ([]Choice, error) {
	tables, err := output(ctx, nil, "nft", "list", "tables", "inet")
	if err != nil {
		return nil, err
	}
	var out []Choice
	for _, line := range strings.Split(tables, "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || f[0] != "table" || !strings.HasPrefix(f[2], "dsec_") || f[2] == ownTable {
			continue
		}
		chain, err := output(ctx, nil, "nft", "-t", "list", "chain", "inet", f[2], "postrouting")
		if err != nil {
			continue // gone meanwhile, or not a node's table
		}
		if c, ok := parseClaim(chain); ok {
			out = append(out, c)
		}
	}
	return out, nil
}

// parseClaim reads a node table's postrouting chain (NodeScript's
// `ip saddr SUBNET oifname != "PREFIX*" masquerade`).
func parseClaim(chain string) (Choice, bool) {
	for _, line := range strings.Split(chain, "\n") {
		f := strings.Fields(line)
		if len(f) != 7 || f[0] != "ip" || f[1] != "saddr" || f[3] != "oifname" || f[4] != "!=" || f[6] != "masquerade" {
			continue
		}
		p, err := netip.ParsePrefix(f[2])
		q := f[5]
		if len(q) < 4 || q[0] != '"' || !strings.HasSuffix(q, `*"`) {
			continue
		}
		prefix := q[1 : len(q)-2]
		if err != nil || !p.Addr().Is4() || prefix == "" || ident(prefix) != prefix {
			continue
		}
		return Choice{Subnet: p, IfPrefix: prefix}, true
	}
	return Choice{}, false
}

// chooseLock serialises the nodes of one machine from choosing to loading
// their table; unlock releases it.
func chooseLock() (unlock func(), err error) {
	const dir = "/run/lock"
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("sandbox network: lock %s: %w", dir, err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "opendsec-sandboxnet.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("sandbox network: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
		f.Close()
		return nil, fmt.Errorf("sandbox network: lock %s: %w", f.Name(), err)
	}
	return func() { f.Close() }, nil
}

const (
	subnetSlots = 1024 // the /20s of 10.64.0.0/10
	// prefixCandidates are "s" + two of prefixChars.
	prefixChars      = "0123456789abcdefghijklmnopqrstuvwxyz"
	prefixCandidates = len(prefixChars) * len(prefixChars)
)

// defaultSubnet is the node's /20 of 10.64.0.0/10, chosen by its name:
// the first of subnetSlot's candidates, and what nodes of releases that
// kept no choice use.
func defaultSubnet(node string) netip.Prefix { return subnetSlot(node, 0) }

// subnetSlot is the i-th /20 of 10.64.0.0/10 counting from node's.
func subnetSlot(node string, i int) netip.Prefix {
	h := fnv.New32a()
	h.Write([]byte(node))
	s := (h.Sum32()%subnetSlots + uint32(i)) % subnetSlots
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(64 + s>>4), byte(s&15) << 4, 0}), 20)
}

// prefixCandidate is the i-th veth prefix of node: "s" and its id's first
// two characters, then others counting from where its id points.
func prefixCandidate(node string, i int) string {
	if i == 0 && ident(node[:2]) == node[:2] {
		return "s" + node[:2]
	}
	h := fnv.New32a()
	h.Write([]byte(node))
	n := (int(h.Sum32()%uint32(prefixCandidates)) + i) % prefixCandidates
	return "s" + string(prefixChars[n/len(prefixChars)]) + string(prefixChars[n%len(prefixChars)])
}

// hostIfs lists the node's interfaces with their IPv4 addresses.
func hostIfs() ([]hostIf, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	out := make([]hostIf, 0, len(ifs))
	for _, i := range ifs {
		h := hostIf{Name: i.Name}
		as, _ := i.Addrs()
		for _, a := range as {
			if p, err := netip.ParsePrefix(a.String()); err == nil && p.Addr().Is4() {
				h.Addrs = append(h.Addrs, p)
			}
		}
		out = append(out, h)
	}
	return out, nil
}

// readChoice reads what a node kept in path; a missing file (or path "")
// is nothing kept.
func readChoice(path string) (Choice, error) {
	var c Choice
	if path == "" {
		return c, nil
	}
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return c, nil
	}
	if err != nil {
		return c, err
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return c, fmt.Errorf("sandbox network: %s: %w (remove it to choose anew, with no networked sandbox on the node)", path, err)
	}
	if !c.Subnet.Addr().Is4() || len(c.IfPrefix) == 0 || len(c.IfPrefix) > 3 || ident(c.IfPrefix) != c.IfPrefix {
		return c, fmt.Errorf("sandbox network: %s: subnet %q and prefix %q are not an IPv4 prefix and 1 to 3 letters or digits (remove it to choose anew, with no networked sandbox on the node)", path, c.Subnet, c.IfPrefix)
	}
	return c, nil
}

// keepChoice writes c to path (nothing for path "").
func keepChoice(path string, c Choice) error {
	if path == "" {
		return nil
	}
	data, err := json.Marshal(c)
	if err != nil {
		return err
	}
	return atomicfile.Write(path, append(data, '\n'), 0o600)
}

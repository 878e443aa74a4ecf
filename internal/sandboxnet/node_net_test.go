package sandboxnet

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/opendsec/opendsec/internal/netpolicy"
	"github.com/opendsec/opendsec/internal/testutil"
)

// A node whose id derives the subnet and prefix of another node's
// running sandboxes (the CI failure of 2026-12-07: 10.64.208.1/32 on a
// veth syndf…), beside a third node whose table claims the next ones,
// opens its network on the first free ones, keeps them, and opens on them
// again after a restart.
func TestOpenNodeStepsAroundAnotherNodesNetwork(t *testing.T) {
	tn := newTestNet(t)
	nodeNS := tn.ns("choice")
	const node = "yc6vww42"
	taken := defaultSubnet(node)
	// The other node's veth (this host has no dummy interfaces).
	tn.link(nodeNS, "syc00000000000a", netip.PrefixFrom(taken.Addr().Next(), 32).String(), tn.ns("other"), "eth0", netip.PrefixFrom(taken.Addr().Next().Next(), 32).String())
	// A node with no sandbox yet: only its table claims its network.
	claim := Choice{Subnet: subnetSlot(node, 1), IfPrefix: prefixCandidate(node, 1)}
	inNS(t, nodeNS, func() {
		_, err := Open(testutil.Context(t), Config{Table: "dsec_othernode", Subnet: claim.Subnet, IfPrefix: claim.IfPrefix, DNSPort: 53}, testutil.Logger(t))
		if err != nil {
			t.Fatal(err)
		}
	})
	state := filepath.Join(t.TempDir(), "network.json")
	ctx := testutil.Context(t)
	cfg := NodeConfig{StateFile: state, Upstream: []string{"127.0.0.1:53"}}

	open := func() (*Network, func()) {
		t.Helper()
		var wg sync.WaitGroup
		var n *Network
		var stop context.CancelFunc
		var err error
		inNS(t, nodeNS, func() { n, stop, err = OpenNode(ctx, node, cfg, nil, &wg, testutil.Logger(t)) })
		if err != nil {
			t.Fatalf("open beside another node's network: %v", err)
		}
		return n, func() {
			stop()
			wg.Wait()
			inNS(t, nodeNS, func() { _, err = n.Close(context.Background()) })
			if err != nil {
				t.Error(err)
			}
		}
	}
	n, closeN := open()
	got := n.Node()
	if got.Subnet != subnetSlot(node, 2) || got.IfPrefix == "syc" || got.IfPrefix == claim.IfPrefix {
		t.Fatalf("opened on %s with prefix %s; want the /20 after both others' %s and a prefix neither syc nor %s", got.Subnet, got.IfPrefix, subnetSlot(node, 2), claim.IfPrefix)
	}
	var l *Link
	var err error
	inNS(t, nodeNS, func() {
		l, err = n.Attach(ctx, fmt.Sprintf("t%d-choice", os.Getpid()%100000), netip.Addr{}, policy(t, false, netpolicy.RuleSpec{CIDR: "192.0.2.1", Protocol: "tcp", Ports: []string{"80"}}))
	})
	if err != nil {
		t.Fatal(err)
	}
	if !got.Subnet.Contains(l.Addr) || l.HostIf[:3] != got.IfPrefix {
		t.Errorf("sandbox on %s via %s; want an address in %s and a veth starting %s", l.Addr, l.HostIf, got.Subnet, got.IfPrefix)
	}
	inNS(t, nodeNS, func() { err = n.Detach(ctx, l) })
	if err != nil {
		t.Fatal(err)
	}
	closeN()
	if kept, err := readChoice(state); err != nil || kept != (Choice{Subnet: got.Subnet, IfPrefix: got.IfPrefix}) {
		t.Fatalf("kept %+v, %v; want what it opened on", kept, err)
	}
	again, closeAgain := open()
	defer closeAgain()
	if again.Node().Subnet != got.Subnet || again.Node().IfPrefix != got.IfPrefix {
		t.Errorf("after a restart: %s %s, want %s %s", again.Node().Subnet, again.Node().IfPrefix, got.Subnet, got.IfPrefix)
	}
}

// A sandbox's veth ends carry no IPv6 address: the kernel makes no
// link-local one when they come up (noIPv6LinkLocal).
func TestAttachedVethsHaveNoIPv6LinkLocal(t *testing.T) {
	tn := newTestNet(t)
	nodeNS := tn.ns("v6")
	ctx := testutil.Context(t)
	var n *Network
	var l *Link
	var err error
	inNS(t, nodeNS, func() {
		if n, err = Open(ctx, Config{Table: "dsec_v6", Subnet: netip.MustParsePrefix("10.91.0.0/16"), IfPrefix: "dsx", DNSPort: 53}, testutil.Logger(t)); err == nil {
			l, err = n.Attach(ctx, fmt.Sprintf("t%d-v6", os.Getpid()%100000), netip.Addr{}, policy(t, false))
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inNS(t, nodeNS, func() { n.Detach(context.Background(), l) }) })
	if out := tn.in(nodeNS, "ip", "-6", "addr", "show", "dev", l.HostIf); strings.Contains(out, "inet6") {
		t.Errorf("the node's end has IPv6 addresses:\n%s", out)
	}
	if out := tn.in(nsName(l.Name), "ip", "-6", "addr", "show", "dev", "eth0"); strings.Contains(out, "inet6") {
		t.Errorf("the sandbox's end has IPv6 addresses:\n%s", out)
	}
	if out := tn.in(nsName(l.Name), "ip", "-4", "addr", "show", "dev", "eth0"); !strings.Contains(out, l.Addr.String()+"/32") {
		t.Errorf("the sandbox's end lacks its address %s:\n%s", l.Addr, out)
	}
}

// A veth whose node end cannot be set up (here: its route to the sandbox
// exists already) is removed, not left for a retry to meet.
func TestMakeVethRemovesAHalfMadeVeth(t *testing.T) {
	tn := newTestNet(t)
	nodeNS := tn.ns("halfveth")
	tn.link(nodeNS, "dsyother", "10.93.0.1/32", tn.ns("halfpeer"), "eth0", "10.93.0.9/32")
	tn.in(nodeNS, "ip", "route", "add", "10.93.0.5/32", "dev", "dsyother")
	sbNS := fmt.Sprintf("dsec-t%d-halfveth", os.Getpid()%100000)
	if err := makeNetNS(sbNS); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeNetNS(sbNS) }) //nolint:errcheck // cleaning up
	var err error
	inNS(t, nodeNS, func() {
		err = makeVeth("dsyhalf", sbNS, netip.MustParseAddr("10.93.0.1"), netip.MustParseAddr("10.93.0.5"))
	})
	if err == nil || !strings.Contains(err.Error(), "route 10.93.0.5 to it") {
		t.Fatalf("makeVeth over an existing route: %v, want its route step's error", err)
	}
	if out := tn.in(nodeNS, "ip", "-br", "link"); strings.Contains(out, "dsyhalf") {
		t.Errorf("the half-made veth is still there:\n%s", out)
	}
}

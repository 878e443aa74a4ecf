package sandboxnet

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/testutil"
)

// Network attaches sandboxes in a node namespace the test makes (every
// command it runs is forked from a thread in that namespace): each gets a
// namespace, an address and its policy, reaches what the policy allows
// and not its neighbour, and Detach leaves nothing, its address free again.
func TestAttachAndDetachSandboxes(t *testing.T) {
	tn := newTestNet(t)
	node, inet := tn.ns("node"), tn.ns("inet")
	tn.link(node, "up0", "203.0.113.1/24", inet, "eth0", "203.0.113.10/24")
	serve(t, inet, "0.0.0.0:8080")
	serve(t, inet, "0.0.0.0:9090")
	ctx := context.Background()
	prefix := fmt.Sprintf("t%d-", os.Getpid()%100000)

	var nw *Network
	var err error
	inNS(t, node, func() {
		nw, err = Open(ctx, Config{Table: "opendsec", Subnet: netip.MustParsePrefix("10.89.0.0/16"), IfPrefix: "dst", DNSPort: 53,
			Addrs: []netip.Addr{netip.MustParseAddr("203.0.113.1")}}, testutil.Logger(t))
	})
	if err != nil {
		t.Fatal(err)
	}
	p := policy(t, false, RuleSpec{CIDR: "203.0.113.10", Protocol: "tcp", Ports: []string{"8080"}})
	attach := func(name string) *Link {
		t.Helper()
		var l *Link
		var err error
		inNS(t, node, func() { l, err = nw.Attach(ctx, prefix+name, netip.Addr{}, p) })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { inNS(t, node, func() { nw.Detach(ctx, l, p) }) })
		return l
	}
	a, b := attach("a"), attach("b")
	if a.Addr.String() != "10.89.0.2" || b.Addr.String() != "10.89.0.3" || a.Gateway.String() != "10.89.0.1" {
		t.Fatalf("addresses %s and %s, gateway %s", a.Addr, b.Addr, a.Gateway)
	}
	serve(t, nsName(b.Name), "0.0.0.0:8080")
	for addr, want := range map[string]string{"203.0.113.10:8080": "ok", "203.0.113.10:9090": "refused", b.Addr.String() + ":8080": "refused", "203.0.113.1:22": "refused"} {
		if got := dial(t, nsName(a.Name), addr); got != want {
			t.Errorf("%s: %s, want %s", addr, got, want)
		}
	}

	// A second attach under a name in use fails and gives its address back.
	inNS(t, node, func() { _, err = nw.Attach(ctx, b.Name, netip.Addr{}, p) })
	if err == nil || !strings.Contains(err.Error(), "make its network namespace") {
		t.Fatalf("attach under a name in use: %v", err)
	}
	inNS(t, node, func() { err = nw.Detach(ctx, a, p) })
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.NetNS); !os.IsNotExist(err) {
		t.Fatalf("the namespace file is left: %v", err)
	}
	if out := tn.in(node, "ip", "-o", "link"); strings.Contains(out, a.HostIf) {
		t.Fatalf("the veth is left: %s", out)
	}
	if c := attach("c"); c.Addr != a.Addr {
		t.Fatalf("a detached sandbox's address is not reused: got %s, want %s", c.Addr, a.Addr)
	}
	// Detaching again finds nothing left, is no error, and leaves the
	// address with the sandbox that has it now.
	inNS(t, node, func() { err = nw.Detach(ctx, a, p) })
	if err != nil {
		t.Fatalf("a second detach: %v", err)
	}
	if d := attach("d"); d.Addr == a.Addr {
		t.Fatalf("a second detach freed %s, which c holds", a.Addr)
	}
}

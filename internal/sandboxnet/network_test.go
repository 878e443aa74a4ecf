package sandboxnet

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/opendsec/opendsec/internal/netpolicy"
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
	serve(t, node, "0.0.0.0:7000") // the control plane, on the node
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
	p := policy(t, false, netpolicy.RuleSpec{CIDR: "203.0.113.10", Protocol: "tcp", Ports: []string{"8080"}})
	attach := func(name string) *Link {
		t.Helper()
		var l *Link
		var err error
		inNS(t, node, func() { l, err = nw.Attach(ctx, prefix+name, netip.Addr{}, p) })
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { inNS(t, node, func() { nw.Detach(ctx, l) }) })
		return l
	}
	a, b := attach("a"), attach("b")
	if a.Addr.String() != "10.89.0.2" || b.Addr.String() != "10.89.0.3" || a.Gateway.String() != "10.89.0.1" {
		t.Fatalf("addresses %s and %s, gateway %s", a.Addr, b.Addr, a.Gateway)
	}
	serve(t, nsName(b.Name), "0.0.0.0:8080")
	for addr, want := range map[string]string{"203.0.113.10:8080": "ok", "203.0.113.10:9090": "refused", b.Addr.String() + ":8080": "refused", "203.0.113.1:7000": "refused"} {
		if got := dial(t, nsName(a.Name), addr); got != want {
			t.Errorf("%s: %s, want %s", addr, got, want)
		}
	}

	// A second attach under a name in use fails and gives its address back.
	inNS(t, node, func() { _, err = nw.Attach(ctx, b.Name, netip.Addr{}, p) })
	if err == nil || !strings.Contains(err.Error(), "make its network namespace") {
		t.Fatalf("attach under a name in use: %v", err)
	}
	inNS(t, node, func() { err = nw.Detach(ctx, a) })
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a.NetNS); !os.IsNotExist(err) {
		t.Fatalf("the namespace file is left: %v", err)
	}
	if out := tn.in(node, "ip", "-o", "link"); strings.Contains(out, a.HostIf) {
		t.Fatalf("the veth is left: %s", out)
	}
	c := attach("c")
	if c.Addr != a.Addr {
		t.Fatalf("a detached sandbox's address is not reused: got %s, want %s", c.Addr, a.Addr)
	}
	// Detaching again finds nothing left, is no error, and leaves the
	// address with the sandbox that has it now.
	inNS(t, node, func() { err = nw.Detach(ctx, a) })
	if err != nil {
		t.Fatalf("a second detach: %v", err)
	}
	d := attach("d")
	if d.Addr == a.Addr {
		t.Fatalf("a second detach freed %s, which c holds", a.Addr)
	}
	// Close keeps the table while sandboxes are attached, and removes it
	// once none is.
	var removed bool
	inNS(t, node, func() { removed, err = nw.Close(ctx) })
	if err != nil || removed || !strings.Contains(tn.in(node, "nft", "list", "tables"), "opendsec") {
		t.Fatalf("close with sandboxes attached: removed %v, %v", removed, err)
	}
	for _, l := range []*Link{b, c, d} {
		inNS(t, node, func() { err = nw.Detach(ctx, l) })
		if err != nil {
			t.Fatal(err)
		}
	}
	inNS(t, node, func() { removed, err = nw.Close(ctx) })
	if err != nil || !removed || strings.Contains(tn.in(node, "nft", "list", "tables"), "opendsec") {
		t.Fatalf("close with none attached: removed %v, %v", removed, err)
	}
}

// The domain flow end to end in namespaces: a sandbox asks the node's DNS
// proxy on its gateway; an allowed name resolves and its address opens on
// the rule's port; a name not allowed does not resolve, and an address the
// proxy never answered stays refused.
func TestDomainPolicyThroughTheDNSProxy(t *testing.T) {
	tn := newTestNet(t)
	node, inet := tn.ns("node"), tn.ns("inet")
	tn.link(node, "up0", "203.0.113.1/24", inet, "eth0", "203.0.113.10/24")
	tn.in(inet, "ip", "addr", "add", "203.0.113.11/24", "dev", "eth0")
	serve(t, inet, "0.0.0.0:8080")
	serve(t, inet, "0.0.0.0:9090")
	up := upstream(t) // on the test's loopback, where the proxy's own queries go
	ctx := testutil.Context(t)

	var nw *Network
	var pc net.PacketConn
	var ln net.Listener
	var err error
	inNS(t, node, func() {
		if nw, err = Open(ctx, Config{Table: "opendsec", Subnet: netip.MustParsePrefix("10.90.0.0/16"), IfPrefix: "dsd", DNSPort: 53}, testutil.Logger(t)); err == nil {
			pc, ln, err = nw.ListenDNS(ctx)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	go NewDNSProxy(nodeResolver{nw, t, node}, []string{up}, testutil.Logger(t)).Serve(ctx, pc, ln)
	p := policy(t, false, netpolicy.RuleSpec{Domain: "pkg.example.org", Protocol: "tcp", Ports: []string{"8080"}})
	var l *Link
	inNS(t, node, func() { l, err = nw.Attach(ctx, fmt.Sprintf("t%d-dns", os.Getpid()%100000), netip.Addr{}, p) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inNS(t, node, func() { nw.Detach(context.Background(), l) }) })
	sbNS := nsName(l.Name)

	resolve := func(name string) (*dns.Msg, error) {
		var r *dns.Msg
		var err error
		inNS(t, sbNS, func() {
			r, _, err = (&dns.Client{Timeout: 3 * time.Second}).Exchange(new(dns.Msg).SetQuestion(name, dns.TypeA), l.Gateway.String()+":53")
		})
		return r, err
	}
	if got := dial(t, sbNS, "203.0.113.11:8080"); got != "refused" {
		t.Fatalf("before the name was resolved: %s", got)
	}
	r, err := resolve("pkg.example.org.")
	if err != nil || r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 {
		t.Fatalf("pkg.example.org through the proxy: %v %v", r, err)
	}
	for addr, want := range map[string]string{"203.0.113.11:8080": "ok", "203.0.113.11:9090": "refused", "203.0.113.10:8080": "refused"} {
		if got := dial(t, sbNS, addr); got != want {
			t.Errorf("after resolving: %s: %s, want %s", addr, got, want)
		}
	}
	if r, err := resolve("evil.example.com."); err != nil || r.Rcode != dns.RcodeNameError {
		t.Fatalf("a name not allowed: %v %v", r, err)
	}

	// Detach removes the sets of the policy the link has now, an updated
	// one's too, without being told it.
	p2 := policy(t, false, netpolicy.RuleSpec{Domain: "other.example.org"})
	inNS(t, node, func() { err = nw.Update(ctx, l, p2) })
	if err != nil {
		t.Fatal(err)
	}
	if got, err := nw.Policy(l); err != nil || len(got.Rules) != 1 || got.Rules[0].Domain != "other.example.org" {
		t.Fatalf("the link's policy after the update: %+v, %v", got, err)
	}
	sets := func() string { return tn.in(node, "nft", "list", "sets", "inet") }
	if out := sets(); !strings.Contains(out, setName(l.Name, p2.Rules[0])) {
		t.Fatalf("the updated policy's set is missing:\n%s", out)
	}
	inNS(t, node, func() { err = nw.Detach(ctx, l) })
	if err != nil {
		t.Fatal(err)
	}
	if out := sets(); strings.Contains(out, setName(l.Name, p.Rules[0])) || strings.Contains(out, setName(l.Name, p2.Rules[0])) {
		t.Fatalf("sets of the sandbox are left after its detach:\n%s", out)
	}
	if _, err := nw.Policy(l); err == nil {
		t.Fatal("a detached link still has a policy")
	}
}

// nodeResolver runs Network's nft commands in the test's node namespace
// (an edge runs in the node's own, so there any thread will do).
type nodeResolver struct {
	*Network
	t    *testing.T
	node string
}

func (r nodeResolver) Learn(ctx context.Context, sb Sandbox, p netpolicy.Policy, rules []int, addrs []netip.Addr, ttl time.Duration) error {
	var err error
	inNS(r.t, r.node, func() { err = r.Network.Learn(ctx, sb, p, rules, addrs, ttl) })
	return err
}

// The table checks new connections only, so an update that takes access
// away cuts the sandbox's open connections, one that adds keeps them, and
// a detach leaves no flow of the address behind.
func TestNarrowingUpdatesCutOpenConnections(t *testing.T) {
	tn := newTestNet(t)
	node, inet := tn.ns("node"), tn.ns("inet")
	tn.link(node, "up0", "203.0.113.1/24", inet, "eth0", "203.0.113.10/24")
	// An echo server that keeps its connections.
	var l net.Listener
	var err error
	inNS(t, inet, func() { l, err = net.Listen("tcp", "0.0.0.0:9191") })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(c, c); c.Close() }() //nolint:errcheck // ends with the client
		}
	}()
	ctx := context.Background()
	var nw *Network
	inNS(t, node, func() {
		nw, err = Open(ctx, Config{Table: "opendsec", Subnet: netip.MustParsePrefix("10.89.0.0/16"), IfPrefix: "dst", DNSPort: 53}, testutil.Logger(t))
	})
	if err != nil {
		t.Fatal(err)
	}
	p1 := policy(t, false, netpolicy.RuleSpec{CIDR: "203.0.113.10", Protocol: "tcp", Ports: []string{"9191"}})
	var link *Link
	inNS(t, node, func() { link, err = nw.Attach(ctx, fmt.Sprintf("t%d-flows", os.Getpid()%100000), netip.Addr{}, p1) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { inNS(t, node, func() { nw.Detach(ctx, link) }) })
	var conn net.Conn
	inNS(t, nsName(link.Name), func() { conn, err = net.DialTimeout("tcp", "203.0.113.10:9191", 2*time.Second) })
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	echo := func() error {
		conn.SetDeadline(time.Now().Add(2 * time.Second)) //nolint:errcheck // a net.Conn
		if _, err := conn.Write([]byte("x")); err != nil {
			return err
		}
		b := make([]byte, 1)
		_, err := io.ReadFull(conn, b)
		return err
	}
	if err := echo(); err != nil {
		t.Fatalf("before any update: %v", err)
	}
	update := func(p netpolicy.Policy) {
		t.Helper()
		inNS(t, node, func() { err = nw.Update(ctx, link, p) })
		if err != nil {
			t.Fatal(err)
		}
	}
	p2 := policy(t, false, netpolicy.RuleSpec{CIDR: "203.0.113.10", Protocol: "tcp", Ports: []string{"9191"}}, netpolicy.RuleSpec{CIDR: "198.51.100.0/24"})
	update(p2)
	if err := echo(); err != nil {
		t.Fatalf("after an update that only adds: %v", err)
	}
	p3 := policy(t, false, netpolicy.RuleSpec{CIDR: "198.51.100.0/24"})
	update(p3)
	if err := echo(); err == nil {
		t.Fatal("a connection the policy no longer allows still works after the update")
	}
	// Allowed again, a new connection: it is tracked until the detach.
	update(p1)
	conn.Close()
	inNS(t, nsName(link.Name), func() { conn, err = net.DialTimeout("tcp", "203.0.113.10:9191", 2*time.Second) })
	if err != nil {
		t.Fatal(err)
	}
	if err := echo(); err != nil {
		t.Fatalf("a new connection after the rule came back: %v", err)
	}
	if out := tn.in(node, "conntrack", "-L", "-f", "ipv4", "-s", link.Addr.String()); !strings.Contains(out, link.Addr.String()) {
		t.Fatalf("the open connection is not tracked:\n%s", out)
	}
	inNS(t, node, func() { err = nw.Detach(ctx, link) })
	if err != nil {
		t.Fatal(err)
	}
	if out := tn.in(node, "conntrack", "-L", "-f", "ipv4", "-s", link.Addr.String()); strings.Contains(out, link.Addr.String()) {
		t.Fatalf("flows of a detached sandbox's address are left:\n%s", out)
	}
}

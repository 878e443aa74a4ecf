package sandboxnet

import (
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/netpolicy"
)

// enforcement builds, in namespaces of its own, a node routing two
// sandboxes and an "internet" (203.0.113.0/24, plus a private 10.77.0.0/24
// and a metadata address behind it), loads the node's table, and returns
// what a test needs.
type enforcement struct {
	net      *testNet
	node, s1 string
	s2, inet string
	n        Node
	sb       Sandbox
}

func newEnforcement(t *testing.T) *enforcement {
	tn := newTestNet(t)
	e := &enforcement{net: tn}
	e.node, e.s1 = tn.ns("node"), tn.ns("s1")
	s2, inet := tn.ns("s2"), tn.ns("inet")
	e.s2, e.inet = s2, inet
	tn.in(e.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
	// Each sandbox: a veth with the gateway's /32 on the node side and a
	// route to the sandbox's /32, as the edge makes them.
	for i, s := range []string{e.s1, s2} {
		host, addr := "dsvt"+string(rune('1'+i)), "10.88.0."+string(rune('2'+i))
		tn.link(e.node, host, "10.88.0.1/32", s, "eth0", addr+"/32")
		tn.in(e.node, "ip", "route", "add", addr+"/32", "dev", host)
		tn.in(s, "ip", "route", "add", "10.88.0.1/32", "dev", "eth0")
		tn.in(s, "ip", "route", "add", "default", "via", "10.88.0.1")
	}
	tn.link(e.node, "up0", "203.0.113.1/24", inet, "eth0", "203.0.113.10/24")
	for _, a := range []string{"203.0.113.11/24", "10.77.0.10/24", "169.254.169.254/32"} {
		tn.in(inet, "ip", "addr", "add", a, "dev", "eth0")
	}
	tn.in(e.node, "ip", "route", "add", "10.77.0.0/24", "via", "203.0.113.10")
	tn.in(e.node, "ip", "route", "add", "169.254.169.254/32", "via", "203.0.113.10")
	serve(t, inet, "0.0.0.0:8080")
	serve(t, inet, "0.0.0.0:9090")
	serve(t, e.node, "0.0.0.0:7000") // the control plane, on the node
	serve(t, s2, "0.0.0.0:8080")     // another sandbox
	e.n = Node{
		Table: "opendsec", Subnet: netip.MustParsePrefix("10.88.0.0/16"), IfPrefix: "dsvt",
		DNS: netip.MustParseAddrPort("10.88.0.1:53"), Addrs: []netip.Addr{netip.MustParseAddr("203.0.113.1")},
		// An operator's closed range around the sandboxes' subnet: a rule
		// naming it must not open the sandboxes.
		Closed: []netip.Prefix{netip.MustParsePrefix("10.88.0.0/15")},
	}
	e.sb = Sandbox{Name: "node1-sandbox1", HostIf: "dsvt1", Addr: netip.MustParseAddr("10.88.0.2")}
	if err := tn.nft(e.node, NodeScript(e.n)); err != nil {
		t.Fatal(err)
	}
	// Not in the map yet: the sandbox reaches nothing.
	if got := dial(t, e.s1, "203.0.113.10:8080"); got != "timeout" {
		t.Fatalf("a sandbox with no chain: %s, want timeout (dropped)", got)
	}
	return e
}

func (e *enforcement) set(t *testing.T, old *netpolicy.Policy, p netpolicy.Policy) {
	t.Helper()
	if err := e.net.nft(e.node, SandboxScript(e.n, e.sb, old, p)); err != nil {
		t.Fatal(err)
	}
}

// expect dials each address from the sandbox and compares the outcomes.
func (e *enforcement) expect(t *testing.T, step string, want map[string]string) {
	t.Helper()
	for addr, w := range want {
		if got := dial(t, e.s1, addr); got != w {
			t.Errorf("%s: %s: %s, want %s", step, addr, got, w)
		}
	}
}

func policy(t *testing.T, internet bool, specs ...netpolicy.RuleSpec) netpolicy.Policy {
	t.Helper()
	p, err := netpolicy.Parse("network.rules", internet, specs)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// The node's table enforces a policy: exactly the CIDRs and ports it
// names, the internet shorthand without private, closed or node
// addresses, closed ranges only when a rule names them, never another
// sandbox, and each update at once.
func TestPolicyEnforcedInNamespaces(t *testing.T) {
	e := newEnforcement(t)
	closed := map[string]string{
		"169.254.169.254:8080": "refused", // metadata
		"203.0.113.1:7000":     "refused", // the node's control plane
		"10.88.0.1:7000":       "refused", // the node, through the gateway address
		"10.88.0.3:8080":       "refused", // another sandbox
	}
	p1 := policy(t, false, netpolicy.RuleSpec{CIDR: "203.0.113.10", Protocol: "tcp", Ports: []string{"8080"}}, netpolicy.RuleSpec{CIDR: "10.77.0.0/24"})
	e.set(t, nil, p1)
	e.expect(t, "cidr rules", map[string]string{
		"203.0.113.10:8080": "ok", "203.0.113.10:9090": "refused", "203.0.113.11:8080": "refused", "10.77.0.10:9090": "ok",
	})
	e.expect(t, "cidr rules", closed)
	// Root in the sandbox takes another address: nothing it sends from it
	// gets through, not even to what its policy allows.
	e.net.in(e.s1, "ip", "addr", "add", "10.88.0.9/32", "dev", "eth0")
	if got := dialFrom(t, e.s1, "10.88.0.9", "203.0.113.10:8080"); got != "timeout" {
		t.Errorf("from a spoofed source: %s, want timeout (dropped)", got)
	}

	on, off := true, false
	p2, _ := p1.Apply(netpolicy.Update{Internet: &on})
	e.set(t, &p1, p2)
	e.expect(t, "internet", map[string]string{"203.0.113.11:8080": "ok", "203.0.113.11:9090": "ok"})
	e.expect(t, "internet", closed)

	// A rule that only contains a closed range opens the rest of it, not it.
	wide := policy(t, false, netpolicy.RuleSpec{CIDR: "0.0.0.0/0", Protocol: "tcp", Ports: []string{"8080", "7000"}})
	e.set(t, &p2, wide)
	e.expect(t, "0.0.0.0/0", map[string]string{"203.0.113.11:8080": "ok", "10.77.0.10:8080": "ok", "10.77.0.10:9090": "refused"})
	e.expect(t, "0.0.0.0/0", closed)

	// Rules that name a closed address are refused, and open nothing if
	// installed all the same, unless the operator allows them; then they
	// open it, and the sandboxes' subnet stays closed even so.
	named := policy(t, false,
		netpolicy.RuleSpec{CIDR: "169.254.169.254", Protocol: "tcp", Ports: []string{"8080"}},
		netpolicy.RuleSpec{CIDR: "203.0.113.1", Protocol: "tcp", Ports: []string{"7000"}},
		netpolicy.RuleSpec{CIDR: "10.88.0.3"},
		netpolicy.RuleSpec{CIDR: "10.88.0.0/15"})
	if err := e.n.CheckPolicy("rules", named); err == nil || !strings.Contains(err.Error(), "metadata") || !strings.Contains(err.Error(), AllowClosedFlag) {
		t.Errorf("a rule naming the metadata address: %v, want refused naming it and %s", err, AllowClosedFlag)
	}
	e.set(t, &wide, named)
	e.expect(t, "named, not allowed", map[string]string{"169.254.169.254:8080": "refused", "203.0.113.1:7000": "refused"})
	e.n.AllowClosed = true
	if err := e.n.CheckPolicy("rules", named); err == nil || !strings.Contains(err.Error(), "sandbox subnet") {
		t.Errorf("a rule naming the sandboxes' subnet, closed rules allowed: %v, want refused", err)
	}
	e.set(t, &named, named)
	e.expect(t, "named", map[string]string{
		"169.254.169.254:8080": "ok", "203.0.113.1:7000": "ok", "10.88.0.3:8080": "refused", "203.0.113.10:8080": "refused",
	})

	p3, err := p2.Apply(netpolicy.Update{Remove: []netpolicy.Rule{p1.Rules[1]}, Internet: &off})
	if err != nil {
		t.Fatal(err)
	}
	e.set(t, &named, p3)
	e.expect(t, "removed", map[string]string{"10.77.0.10:9090": "refused", "203.0.113.11:8080": "refused", "203.0.113.10:8080": "ok"})

	if err := e.net.nft(e.node, RemoveScript(e.n, e.sb, p3)); err != nil {
		t.Fatal(err)
	}
	e.expect(t, "removed sandbox", map[string]string{"203.0.113.10:8080": "timeout"})
	if out := e.net.in(e.node, "nft", "list", "table", "inet", "opendsec"); strings.Contains(out, "sb_") {
		t.Fatalf("the sandbox's chain or sets are left:\n%s", out)
	}
}

// Domain rules open the addresses the DNS proxy learned, on their ports,
// for the answer's TTL; an update that drops a domain rule drops its set.
func TestDomainRulesOpenLearnedAddressesForTheirTTL(t *testing.T) {
	e := newEnforcement(t)
	p := policy(t, false, netpolicy.RuleSpec{Domain: "pkg.example.org", Protocol: "tcp", Ports: []string{"9090"}}, netpolicy.RuleSpec{Domain: "*.example.org", Protocol: "tcp", Ports: []string{"8080"}})
	e.set(t, nil, p)
	e.expect(t, "nothing learned", map[string]string{"203.0.113.11:9090": "refused", "203.0.113.10:8080": "refused"})

	learn := func(name string, addr string, ttl time.Duration) {
		t.Helper()
		script := LearnScript(e.n, e.sb, p, p.DomainRules(name), []netip.Addr{netip.MustParseAddr(addr), netip.MustParseAddr("2001:db8::1")}, ttl)
		if err := e.net.nft(e.node, script); err != nil {
			t.Fatal(err)
		}
	}
	learn("pkg.example.org", "203.0.113.11", time.Minute)
	learn("a.example.org", "203.0.113.10", time.Second)
	e.expect(t, "learned", map[string]string{
		// pkg.example.org is allowed by both rules, a.example.org by the
		// wildcard only.
		"203.0.113.11:9090": "ok", "203.0.113.11:8080": "ok",
		"203.0.113.10:8080": "ok", "203.0.113.10:9090": "refused",
	})
	time.Sleep(2500 * time.Millisecond)
	e.expect(t, "after a 1 s TTL", map[string]string{"203.0.113.10:8080": "refused", "203.0.113.11:9090": "ok"})

	only := policy(t, false, netpolicy.RuleSpec{Domain: "*.example.org", Protocol: "tcp", Ports: []string{"8080"}})
	e.set(t, &p, only)
	out := e.net.in(e.node, "nft", "list", "sets", "inet")
	if strings.Contains(out, setName(e.sb.Name, p.Rules[0])) || !strings.Contains(out, setName(e.sb.Name, p.Rules[1])) {
		t.Fatalf("after dropping the pkg.example.org rule, sets:\n%s", out)
	}
	// The kept rule keeps what it learned.
	e.expect(t, "rule dropped", map[string]string{"203.0.113.11:9090": "refused", "203.0.113.11:8080": "ok"})
}

// A sandbox that holds too many connections, or opens them too fast, is
// refused past its limits; a neighbour's connections are not.
func TestFlowLimitsRefuseOneSandboxAndNotItsNeighbour(t *testing.T) {
	e := newEnforcement(t)
	p := policy(t, false, netpolicy.RuleSpec{CIDR: "203.0.113.10", Protocol: "tcp"})
	sb2 := Sandbox{Name: "node1-sandbox2", HostIf: "dsvt2", Addr: netip.MustParseAddr("10.88.0.3")}
	install := func(f FlowLimits) {
		t.Helper()
		e.n.Flows = f
		e.set(t, nil, p)
		if err := e.net.nft(e.node, SandboxScript(e.n, sb2, nil, p)); err != nil {
			t.Fatal(err)
		}
	}
	// A server that keeps what it accepts open until told.
	var mu sync.Mutex
	var held []net.Conn
	var l net.Listener
	var err error
	inNS(t, e.inet, func() { l, err = net.Listen("tcp", "0.0.0.0:9191") })
	if err != nil {
		t.Fatal(err)
	}
	release := func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
		held = nil
	}
	t.Cleanup(func() { l.Close(); release() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()

	// Open connections: three held, the fourth refused; the neighbour's pass.
	install(FlowLimits{NewPerSecond: 1000, Burst: 1000, Open: 3})
	var mine []net.Conn
	inNS(t, e.s1, func() {
		for i := 0; i < 3; i++ {
			c, err := net.DialTimeout("tcp", "203.0.113.10:9191", 2*time.Second)
			if err != nil {
				t.Errorf("held connection %d: %v", i, err)
				return
			}
			mine = append(mine, c)
		}
	})
	if got := dial(t, e.s1, "203.0.113.10:8080"); got != "refused" {
		t.Errorf("a fourth connection while three are open: %s, want refused", got)
	}
	if got := dial(t, e.s2, "203.0.113.10:8080"); got != "ok" {
		t.Errorf("the neighbour while the first holds its limit: %s, want ok", got)
	}
	for _, c := range mine {
		c.Close()
	}
	release()

	// New connections: the burst, then one a second.
	install(FlowLimits{NewPerSecond: 1, Burst: 4, Open: 1000})
	results := map[string]int{}
	for i := 0; i < 10; i++ {
		results[dial(t, e.s1, "203.0.113.10:8080")]++
	}
	if results["ok"] < 3 || results["ok"] > 6 || results["refused"] < 4 {
		t.Errorf("10 quick connections with a burst of 4: %v", results)
	}
	for i := 0; i < 3; i++ {
		if got := dial(t, e.s2, "203.0.113.10:8080"); got != "ok" {
			t.Errorf("the neighbour's connection %d while the first is limited: %s", i, got)
		}
	}
	time.Sleep(2500 * time.Millisecond)
	if got := dial(t, e.s1, "203.0.113.10:8080"); got != "ok" {
		t.Errorf("after the rate refilled: %s, want ok", got)
	}
}

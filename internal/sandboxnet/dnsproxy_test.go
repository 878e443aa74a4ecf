package sandboxnet

import (
	"context"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/opendsec/opendsec/internal/netpolicy"
	"github.com/opendsec/opendsec/internal/testutil"
)

// fakeResolver knows one sandbox at 127.0.0.1 and records what it learns.
type fakeResolver struct {
	pol     netpolicy.Policy
	gen     uint64
	mu      sync.Mutex
	learned []string
}

func (f *fakeResolver) Sandbox(addr netip.Addr) (Sandbox, netpolicy.Policy, bool) {
	if addr != netip.MustParseAddr("127.0.0.1") {
		return Sandbox{}, netpolicy.Policy{}, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return Sandbox{Name: "sb1", Addr: addr, Generation: f.gen}, f.pol, true
}

func (f *fakeResolver) Learn(_ context.Context, _ Sandbox, p netpolicy.Policy, rules []int, addrs []netip.Addr, ttl time.Duration) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, i := range rules {
		f.learned = append(f.learned, p.Rules[i].String()+" "+fmtAddrs(addrs)+" "+ttl.String())
	}
	return nil
}

// seen is what was learned so far (the proxy learns on its own
// goroutines).
func (f *fakeResolver) seen() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.learned...)
}

func fmtAddrs(a []netip.Addr) string {
	s := make([]string, len(a))
	for i, x := range a {
		s[i] = x.String()
	}
	return strings.Join(s, ",")
}

// upstream serves a small zone on loopback.
func upstream(t *testing.T) string {
	t.Helper()
	zone := map[string][]string{
		"pkg.example.org.":  {"pkg.example.org. 5 IN A 203.0.113.11"},
		"www.example.org.":  {"www.example.org. 600 IN CNAME cdn.example.net.", "cdn.example.net. 120 IN A 203.0.113.12", "cdn.example.net. 120 IN A 203.0.113.13"},
		"evil.example.com.": {"evil.example.com. 60 IN A 203.0.113.66"},
	}
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg).SetReply(q)
		if q.Question[0].Qtype == dns.TypeA {
			for _, r := range zone[strings.ToLower(q.Question[0].Name)] {
				rr, _ := dns.NewRR(r)
				m.Answer = append(m.Answer, rr)
			}
		}
		w.WriteMsg(m)
	})}
	go srv.ActivateAndServe()
	t.Cleanup(func() { srv.Shutdown() })
	return pc.LocalAddr().String()
}

func startProxy(t *testing.T, res Resolver) string {
	t.Helper()
	addr, _ := startCountedProxy(t, res)
	return addr
}

// startCountedProxy is startProxy, with the counts of its answers.
func startCountedProxy(t *testing.T, res Resolver) (string, *DNSCounts) {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	p := NewDNSProxy(res, []string{upstream(t)}, testutil.Logger(t))
	p.counts = &DNSCounts{}
	go p.Serve(ctx, pc, ln)
	return pc.LocalAddr().String(), p.counts
}

func ask(t *testing.T, proxy, name string, qtype uint16) *dns.Msg {
	t.Helper()
	m := new(dns.Msg).SetQuestion(name, qtype)
	r, _, err := (&dns.Client{Timeout: 3 * time.Second}).Exchange(m, proxy)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return r
}

func ede(m *dns.Msg) string {
	if o := m.IsEdns0(); o != nil {
		for _, opt := range o.Option {
			if e, ok := opt.(*dns.EDNS0_EDE); ok {
				return e.ExtraText
			}
		}
	}
	return ""
}

func TestDNSProxyAnswersAllowedNamesAndOpensTheirAddresses(t *testing.T) {
	res := &fakeResolver{pol: policy(t, false,
		netpolicy.RuleSpec{Domain: "pkg.example.org", Protocol: "tcp", Ports: []string{"443"}},
		netpolicy.RuleSpec{Domain: "*.example.org"})}
	proxy, counts := startCountedProxy(t, res)

	r := ask(t, proxy, "PKG.example.org.", dns.TypeA)
	if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 1 || r.Answer[0].(*dns.A).A.String() != "203.0.113.11" {
		t.Fatalf("pkg.example.org: %v", r)
	}
	// Allowed by both rules; a 5 s TTL is held at least 30 s, plus 30 s.
	want := []string{"tcp pkg.example.org:443 203.0.113.11 1m0s", "any *.example.org 203.0.113.11 1m0s"}
	r = ask(t, proxy, "www.example.org.", dns.TypeA)
	if r.Rcode != dns.RcodeSuccess || len(r.Answer) != 3 {
		t.Fatalf("www.example.org: %v", r)
	}
	// Kept no longer than the addresses stay open (150 s, less 30).
	if ttl := r.Answer[0].Header().Ttl; ttl != 120 {
		t.Fatalf("the CNAME's TTL of 600 s came through as %d, want 120", ttl)
	}
	// The CNAME's target addresses are opened, for the shortest TTL.
	want = append(want, "any *.example.org 203.0.113.12,203.0.113.13 2m30s")
	if got := strings.Join(res.seen(), "; "); got != strings.Join(want, "; ") {
		t.Fatalf("learned %q, want %q", got, want)
	}

	r = ask(t, proxy, "evil.example.com.", dns.TypeA)
	if r.Rcode != dns.RcodeNameError || len(r.Answer) != 0 || !strings.Contains(ede(r), "does not allow evil.example.com") {
		t.Fatalf("a name not allowed: rcode %d, answer %v, %q", r.Rcode, r.Answer, ede(r))
	}
	if r := ask(t, proxy, "pkg.example.org.", dns.TypeAAAA); r.Rcode != dns.RcodeSuccess || len(r.Answer) != 0 {
		t.Fatalf("AAAA: %v", r)
	}
	if got := res.seen(); len(got) != 3 {
		t.Fatalf("a refused or AAAA query opened something: %q", got)
	}
	// From an address no sandbox has: refused.
	c := &dns.Client{Timeout: 3 * time.Second, Dialer: &net.Dialer{LocalAddr: &net.UDPAddr{IP: net.ParseIP("127.0.0.2")}}}
	r, _, err := c.Exchange(new(dns.Msg).SetQuestion("pkg.example.org.", dns.TypeA), proxy)
	if err != nil || r.Rcode != dns.RcodeRefused {
		t.Fatalf("a query from no sandbox: %v %v", r, err)
	}
	// Each answer counted by outcome (the edge's metrics).
	for o, want := range map[DNSOutcome]uint64{DNSAnswered: 3, DNSPolicyRefused: 1, DNSUnknownSource: 1, DNSRateLimited: 0, DNSMalformed: 0, DNSFailed: 0} {
		if got := counts.Count(o); got != want {
			t.Errorf("answers %s: %d, want %d", DNSOutcomes[o], got, want)
		}
	}
}

func TestDNSProxyRateLimitsASandbox(t *testing.T) {
	proxy := startProxy(t, &fakeResolver{pol: policy(t, false, netpolicy.RuleSpec{Domain: "pkg.example.org"})})
	refused := 0
	for i := 0; i < queryBurst+50; i++ {
		if r := ask(t, proxy, "nope.example.com.", dns.TypeA); r.Rcode == dns.RcodeRefused {
			refused++
			if !strings.Contains(ede(r), "rate limited") {
				t.Fatalf("refused without the reason: %q", ede(r))
			}
		}
	}
	if refused == 0 {
		t.Fatalf("%d queries in a burst, none refused", queryBurst+50)
	}
}

// A repeated answer costs no nftables transaction while what it opened
// holds; a policy change (a new generation: its sets may be new) opens it
// again.
func TestDNSProxyOpensARepeatedAnswerOncePerPolicy(t *testing.T) {
	res := &fakeResolver{pol: policy(t, false, netpolicy.RuleSpec{Domain: "pkg.example.org"})}
	proxy := startProxy(t, res)
	count := func() int { return len(res.seen()) }
	for i := 0; i < 3; i++ {
		ask(t, proxy, "pkg.example.org.", dns.TypeA)
	}
	if n := count(); n != 1 {
		t.Fatalf("three answers opened %d times, want once", n)
	}
	res.mu.Lock()
	res.gen++
	res.mu.Unlock()
	ask(t, proxy, "pkg.example.org.", dns.TypeA)
	if n := count(); n != 2 {
		t.Fatalf("after a policy change: opened %d times in all, want 2", n)
	}
}

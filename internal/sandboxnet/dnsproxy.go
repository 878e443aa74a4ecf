package sandboxnet

import (
	"context"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"

	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/netpolicy"
)

// Resolver answers for the DNS proxy which sandbox sent a query (by its
// source address) and with which policy, and opens the addresses the proxy
// answered. Network plus the edge's sandbox table implement it.
type Resolver interface {
	// Sandbox returns the sandbox that has addr and its current policy.
	Sandbox(addr netip.Addr) (Sandbox, netpolicy.Policy, bool)
	// Learn opens addrs for the domain rules (indexes into p.Rules) for ttl.
	Learn(ctx context.Context, sb Sandbox, p netpolicy.Policy, rules []int, addrs []netip.Addr, ttl time.Duration) error
}

// DNSProxy answers sandboxes' DNS queries: names their policy allows are
// resolved by the node's upstream servers, and the IPv4 addresses of the
// answer are opened (for the answer's TTL) before the sandbox gets it;
// other names get NXDOMAIN with the reason as an extended error (RFC 8914,
// "Prohibited"). AAAA queries get no addresses: sandboxes have IPv4 only.
// Each sandbox is rate limited.
type DNSProxy struct {
	res      Resolver
	upstream []string // host:port
	log      *slog.Logger
	client   *dns.Client

	mu          sync.Mutex
	buckets     map[netip.Addr]*bucket // guarded by mu
	rate, burst float64                // guarded by mu
	// opened remembers until when an address is open for a rule of a
	// sandbox's policy generation, so a repeated answer costs no nftables
	// transaction. Guarded by mu.
	opened map[openKey]time.Time
	// counts, if set, counts the answers by outcome.
	counts *DNSCounts
}

type openKey struct {
	sandbox string
	gen     uint64
	rule    int
	addr    netip.Addr
}

// Answers' TTLs are clamped: at least minTTL (a connection right after a
// short-lived answer must still be let through), at most maxTTL.
const (
	minTTL = 30 * time.Second
	maxTTL = time.Hour
	// Per sandbox: queryRate a second on average, bursts of queryBurst.
	queryRate  = 50
	queryBurst = 200
)

// DNSOutcome is how the proxy answered a query.
type DNSOutcome int

// The outcomes, in DNSOutcomes' order.
const (
	DNSAnswered      DNSOutcome = iota // resolved upstream (or an empty answer for a type sandboxes do not need)
	DNSPolicyRefused                   // NXDOMAIN: the sandbox's policy does not allow the name
	DNSRateLimited                     // REFUSED: over the sandbox's query rate
	DNSUnknownSource                   // REFUSED: not from a sandbox of this node
	DNSMalformed                       // FORMERR: not one question, or not a query
	DNSFailed                          // SERVFAIL: the upstream or the firewall update failed
	dnsOutcomes
)

// DNSOutcomes names the outcomes (the edge's metric labels).
var DNSOutcomes = [dnsOutcomes]string{"answered", "policy_refused", "rate_limited", "unknown_source", "malformed", "failed"}

// DNSCounts counts the proxy's answers by outcome.
type DNSCounts struct{ n [dnsOutcomes]atomic.Uint64 }

func (c *DNSCounts) add(o DNSOutcome) {
	if c != nil {
		c.n[o].Add(1)
	}
}

// Count is how many queries were answered with o.
func (c *DNSCounts) Count(o DNSOutcome) uint64 { return c.n[o].Load() }

// NewDNSProxy makes a proxy that resolves through upstream ("host:port").
func NewDNSProxy(res Resolver, upstream []string, log *slog.Logger) *DNSProxy {
	return &DNSProxy{
		res: res, upstream: upstream, log: log, buckets: map[netip.Addr]*bucket{}, opened: map[openKey]time.Time{}, rate: queryRate, burst: queryBurst,
		client: &dns.Client{Timeout: 3 * time.Second},
	}
}

// Serve answers on the UDP and TCP listeners until ctx ends.
func (p *DNSProxy) Serve(ctx context.Context, udp net.PacketConn, tcp net.Listener) {
	servers := []*dns.Server{{PacketConn: udp, Handler: p}, {Listener: tcp, Handler: p}}
	for _, s := range servers {
		go s.ActivateAndServe() //nolint:errcheck // ends at Shutdown
	}
	<-ctx.Done()
	for _, s := range servers {
		s.Shutdown() //nolint:errcheck // closing
	}
}

// ServeDNS answers one query.
func (p *DNSProxy) ServeDNS(w dns.ResponseWriter, q *dns.Msg) {
	resp, outcome := p.answer(w.RemoteAddr(), q)
	p.counts.add(outcome)
	w.WriteMsg(resp) //nolint:errcheck // the sandbox went away
}

// answer answers q and says how (a DNSOutcome).
func (p *DNSProxy) answer(from net.Addr, q *dns.Msg) (*dns.Msg, DNSOutcome) {
	m := new(dns.Msg)
	if len(q.Question) != 1 || q.Opcode != dns.OpcodeQuery {
		return m.SetRcode(q, dns.RcodeFormatError), DNSMalformed
	}
	ap, err := netip.ParseAddrPort(from.String())
	if err != nil {
		return m.SetRcode(q, dns.RcodeRefused), DNSUnknownSource
	}
	addr := ap.Addr().Unmap()
	sb, pol, ok := p.res.Sandbox(addr)
	if !ok {
		return m.SetRcode(q, dns.RcodeRefused), DNSUnknownSource
	}
	if !p.allow(addr) {
		return refused(q, "rate limited: too many queries a second from this sandbox"), DNSRateLimited
	}
	qq := q.Question[0]
	name := strings.ToLower(qq.Name)
	if !pol.MayResolve(name) {
		return refusedName(q, "the sandbox's network policy does not allow "+strings.TrimSuffix(name, ".")), DNSPolicyRefused
	}
	switch qq.Qtype {
	case dns.TypeA, dns.TypeCNAME:
	default:
		// IPv4 only (AAAA), and nothing else a sandbox needs from
		// names it may reach: an empty answer.
		return m.SetReply(q), DNSAnswered
	}
	up, err := p.exchange(q)
	if err != nil {
		p.log.Warn("DNS upstream failed", logging.SandboxID, sb.Name, "name", name, logging.Error, err)
		return m.SetRcode(q, dns.RcodeServerFailure), DNSFailed
	}
	var addrs []netip.Addr
	ttl := maxTTL
	for _, rr := range up.Answer {
		if a, ok := rr.(*dns.A); ok {
			if ip, ok := netip.AddrFromSlice(a.A.To4()); ok {
				addrs = append(addrs, ip)
				ttl = min(ttl, time.Duration(a.Hdr.Ttl)*time.Second)
			}
		}
	}
	if rules := pol.DomainRules(name); len(addrs) > 0 && len(rules) > 0 {
		// Opened before the sandbox has the answer, for a little longer
		// than it may keep it.
		open := max(ttl, minTTL) + minTTL
		left, ok := p.stillOpen(sb, rules, addrs, open)
		if !ok {
			if err := p.res.Learn(context.Background(), sb, pol, rules, addrs, open); err != nil {
				p.log.Error("open the addresses of an answer", logging.SandboxID, sb.Name, "name", name, logging.Error, err)
				return m.SetRcode(q, dns.RcodeServerFailure), DNSFailed
			}
			p.markOpen(sb, rules, addrs, open)
			left = open
		}
		// The sandbox may keep the answer no longer than the addresses
		// stay open (less a margin for the connection it makes).
		keep := uint32(max((left-minTTL)/time.Second, 1))
		for _, rr := range up.Answer {
			rr.Header().Ttl = min(rr.Header().Ttl, keep)
		}
	}
	up.Id = q.Id
	return up, DNSAnswered
}

func (p *DNSProxy) exchange(q *dns.Msg) (*dns.Msg, error) {
	var last error
	for _, u := range p.upstream {
		r, _, err := p.client.Exchange(q, u)
		if err == nil {
			return r, nil
		}
		last = err
	}
	return nil, last
}

// refusedName is NXDOMAIN with an extended error saying why.
func refusedName(q *dns.Msg, why string) *dns.Msg {
	m := new(dns.Msg).SetRcode(q, dns.RcodeNameError)
	return withEDE(m, dns.ExtendedErrorCodeProhibited, why)
}

func refused(q *dns.Msg, why string) *dns.Msg {
	m := new(dns.Msg).SetRcode(q, dns.RcodeRefused)
	return withEDE(m, dns.ExtendedErrorCodeProhibited, why)
}

func withEDE(m *dns.Msg, code uint16, why string) *dns.Msg {
	o := new(dns.OPT)
	o.Hdr.Name, o.Hdr.Rrtype = ".", dns.TypeOPT
	o.SetUDPSize(dns.DefaultMsgSize)
	o.Option = append(o.Option, &dns.EDNS0_EDE{InfoCode: code, ExtraText: why})
	m.Extra = append(m.Extra, o)
	return m
}

// bucket is a token bucket.
type bucket struct {
	tokens float64
	last   time.Time
}

func (p *DNSProxy) allow(addr netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	b := p.buckets[addr]
	if b == nil {
		b = &bucket{tokens: p.burst, last: now}
		p.buckets[addr] = b
	}
	b.tokens = min(p.burst, b.tokens+now.Sub(b.last).Seconds()*p.rate)
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}

// stillOpen reports whether every address stays open for every rule for
// at least half of ttl; if not, the answer is opened again (adding a set
// element again sets its timeout anew).
// It also returns how long they all stay open.
func (p *DNSProxy) stillOpen(sb Sandbox, rules []int, addrs []netip.Addr, ttl time.Duration) (time.Duration, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	left := ttl
	for _, r := range rules {
		for _, a := range addrs {
			left = min(left, p.opened[openKey{sb.Name, sb.Generation, r, a}].Sub(now))
		}
	}
	return left, left >= ttl/2
}

func (p *DNSProxy) markOpen(sb Sandbox, rules []int, addrs []netip.Addr, ttl time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for k, t := range p.opened { // drop what lapsed, so the map stays small
		if t.Before(now) {
			delete(p.opened, k)
		}
	}
	for _, r := range rules {
		for _, a := range addrs {
			p.opened[openKey{sb.Name, sb.Generation, r, a}] = now.Add(ttl)
		}
	}
}

// Limit sets each sandbox's query rate (a second) and burst.
func (p *DNSProxy) Limit(rate, burst float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rate, p.burst = rate, burst
}

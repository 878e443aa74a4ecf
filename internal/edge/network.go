package edge

import (
	"bufio"
	"context"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/netpolicy"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// Sandbox networking [ours; the paper filters with eBPF]. A sandbox
// created with a network policy gets its own network namespace, a veth to
// the node and an address from the node's sandbox subnet; the node's
// nftables table enforces its policy and a DNS proxy on the gateway
// address answers only the names it allows (internal/sandboxnet). One
// without a policy has loopback only. The table, the interface prefix and
// the subnet are the node's own (derived from its id), so several edges
// on one machine do not meet.

// NetworkConfig turns on sandbox networking.
type NetworkConfig struct {
	// Subnet holds the node's sandbox addresses; default: a /20 in
	// 10.64.0.0/10 chosen by the node id.
	Subnet netip.Prefix
	// Upstream are the DNS servers (host:port) the proxy asks; default:
	// the node's /etc/resolv.conf.
	Upstream []string
	// Closed are further prefixes no sandbox reaches unless a rule names
	// them: the control plane's hosts.
	Closed []netip.Prefix
	// AllowClosed lets a policy's rule name a closed address: the node's
	// own, link-local (cloud metadata), Closed (an operator's setting,
	// sandboxnet.AllowClosedFlag). Off, such rules are refused.
	AllowClosed bool
	// DNSPort is the proxy's port on the gateway; default 53 (resolv.conf
	// cannot name another).
	DNSPort uint16
}

// openNetwork loads node's table and starts the DNS proxy (wg counts it,
// stopDNS ends it). own names the sandboxes recover is about to re-attach.
func openNetwork(ctx context.Context, node sandboxid.NodeID, cfg NetworkConfig, own []string, wg *sync.WaitGroup, log *slog.Logger) (n *sandboxnet.Network, stopDNS context.CancelFunc, err error) {
	h := fnv.New32a()
	h.Write([]byte(node))
	sum := h.Sum32()
	if !cfg.Subnet.IsValid() {
		i := sum % 1024 // a /20 of 10.64.0.0/10
		cfg.Subnet = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(64 + i>>4), byte(i&15) << 4, 0}), 20)
	}
	if cfg.DNSPort == 0 {
		cfg.DNSPort = 53
	}
	if len(cfg.Upstream) == 0 {
		up, err := resolvConfServers("/etc/resolv.conf")
		if err != nil {
			return nil, nil, err
		}
		cfg.Upstream = up
	}
	prefix := "s" + string(node)[:2]
	addrs, err := nodeAddrs(prefix, cfg.Subnet)
	if err != nil {
		return nil, nil, err
	}
	n, err = sandboxnet.Open(ctx, sandboxnet.Config{
		Table: "dsec_" + string(node), Subnet: cfg.Subnet, IfPrefix: prefix, DNSPort: cfg.DNSPort,
		Addrs: addrs, Closed: cfg.Closed, AllowClosed: cfg.AllowClosed, Own: own,
	}, log)
	if err != nil {
		return nil, nil, err
	}
	udp, tcp, err := n.ListenDNS(ctx)
	if err != nil {
		return nil, nil, err
	}
	dctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	wg.Add(1)
	go func() {
		defer wg.Done()
		sandboxnet.NewDNSProxy(n, cfg.Upstream, log).Serve(dctx, udp, tcp)
	}()
	log.Info("sandbox network ready", "subnet", cfg.Subnet, "dns", n.Node().DNS, "upstream", cfg.Upstream)
	return n, cancel, nil
}

// nodeAddrs are the node's IPv4 addresses (closed to sandboxes), from
// every interface but the sandboxes' veths. One inside subnet is an
// error: its traffic and the sandboxes' would mix.
func nodeAddrs(prefix string, subnet netip.Prefix) ([]netip.Addr, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	var out []netip.Addr
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, prefix) {
			continue
		}
		as, _ := i.Addrs()
		for _, a := range as {
			p, err := netip.ParsePrefix(a.String())
			if err != nil || !p.Addr().Is4() {
				continue
			}
			if p.Overlaps(subnet) {
				return nil, errdefs.FailedPrecondition("sandbox subnet %s overlaps %s on the node's interface %s; choose another subnet", subnet, p, i.Name)
			}
			out = append(out, p.Addr())
		}
	}
	return out, nil
}

// resolvConfServers reads the name servers of a resolv.conf as host:53.
func resolvConfServers(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("sandbox DNS: no upstream given and %w", err)
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "nameserver" {
			if a, err := netip.ParseAddr(fields[1]); err == nil && a.Is4() {
				out = append(out, netip.AddrPortFrom(a, 53).String())
			}
		}
	}
	if len(out) == 0 {
		return nil, errdefs.FailedPrecondition("sandbox DNS: no upstream given and %s names no IPv4 name server", path)
	}
	return out, nil
}

// networkedRecords lists the sandboxes whose records say they are
// attached, for Open to accept their veths.
func networkedRecords(store records.Store) []string {
	recs, unreadable := store.List()
	var out []string
	for _, rec := range recs {
		if rec.Spec.Network != nil {
			out = append(out, string(rec.ID))
		}
	}
	// A record this release cannot read keeps its veth, for the release
	// that can.
	for id := range unreadable {
		if id != "" { // "": the directory itself could not be read
			out = append(out, string(id))
		}
	}
	return out
}

// policyOf is the sandbox's policy as its record holds it. It was checked
// when the sandbox was accepted, so an error means a record this release
// reads differently (or one changed by hand): the sandbox gets no network
// rather than a policy other than its own.
func policyOf(rec *records.Record) (netpolicy.Policy, error) {
	p, err := sandboxspec.NetworkPolicy(rec.Spec.Network)
	if err != nil {
		// Not a wrap: the parser's InvalidArgument would be the class, and
		// the request at hand is not what is wrong.
		return p, errdefs.FailedPrecondition("its recorded network policy: %v", err)
	}
	return p, nil
}

// checkPolicy refuses a policy the node's network n keeps closed (a rule
// naming its own address or the metadata service's), before anything is
// made.
func checkPolicy(n sandboxNetwork, field string, network *sandboxv1.NetworkPolicy) error {
	if network == nil || n == nil {
		return nil
	}
	p, err := sandboxspec.NetworkPolicy(network)
	if err != nil {
		return err
	}
	return n.Node().CheckPolicy(field, p)
}

// attachNetwork gives a sandbox whose spec asks for a network its
// namespace and policy, and records its address. Callers hold sb.mu.
func (sb *sandbox) attachNetwork(ctx context.Context) error {
	if sb.rec.Spec.Network == nil {
		return nil
	}
	if sb.nodeNet == nil {
		return errdefs.FailedPrecondition("network: node %s runs without sandbox networking (%s); create the sandbox without a network policy", sb.node, sb.nodeNetOff)
	}
	p, err := policyOf(sb.rec)
	if err != nil {
		return err
	}
	l, err := sb.nodeNet.Attach(ctx, string(sb.id), netip.Addr{}, p)
	if err != nil {
		return err
	}
	sb.net = l
	sb.rec.NetAddr = l.Addr.String()
	return sb.save()
}

// adoptNetwork takes back a recovered sandbox's attachment. Callers hold
// sb.mu.
func (sb *sandbox) adoptNetwork(ctx context.Context) error {
	if sb.rec.Spec.Network == nil {
		return nil
	}
	if sb.nodeNet == nil {
		return errdefs.FailedPrecondition("its network cannot be re-attached: the edge now runs without sandbox networking (%s)", sb.nodeNetOff)
	}
	addr, err := netip.ParseAddr(sb.rec.NetAddr)
	if err != nil {
		return errdefs.FailedPrecondition("its record has no network address (%q)", sb.rec.NetAddr)
	}
	p, err := policyOf(sb.rec)
	if err != nil {
		return err
	}
	l, err := sb.nodeNet.Adopt(ctx, string(sb.id), addr, p)
	if err != nil {
		return err
	}
	sb.net = l
	return nil
}

// detachNetwork removes what attachNetwork made (or what a crash before
// the record named the address left). Callers hold sb.mu.
func (sb *sandbox) detachNetwork(ctx context.Context) error {
	if sb.nodeNet == nil || sb.rec.Spec.Network == nil {
		return nil
	}
	var err error
	if sb.net != nil {
		err = sb.nodeNet.Detach(ctx, sb.net)
	} else {
		err = sb.nodeNet.Forget(ctx, string(sb.id))
	}
	if err != nil {
		return fmt.Errorf("detach sandbox %s from the network: %w", sb.id, err)
	}
	sb.net = nil
	return nil
}

// UpdateNetwork changes a running or paused sandbox's policy by exactly
// what the request says.
func (e *Edge) UpdateNetwork(ctx context.Context, req *sandboxv1.UpdateNetworkRequest, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(req.GetSandboxId(), scope)
	if err != nil {
		return nil, err
	}
	return sb.updateNetwork(ctx, req)
}

// updateNetwork changes sb's policy by exactly what req says and returns
// its description as it then is.
func (sb *sandbox) updateNetwork(ctx context.Context, req *sandboxv1.UpdateNetworkRequest) (*sandboxv1.Sandbox, error) {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if sb.rec.State != records.StateRunning && sb.rec.State != records.StatePaused {
		return nil, errdefs.FailedPrecondition("sandbox %s is %s", sb.id, sb.rec.State)
	}
	if sb.rec.Spec.Network == nil || sb.net == nil {
		return nil, errdefs.FailedPrecondition("sandbox %s has no network (loopback only); a network policy is chosen at create", sb.id)
	}
	old, err := sb.nodeNet.Policy(sb.net)
	if err != nil {
		return nil, err
	}
	p, err := sandboxspec.NetworkUpdate(old, req)
	if err != nil {
		return nil, err
	}
	if err := sb.nodeNet.Node().CheckPolicy("the updated policy's rules", p); err != nil {
		return nil, err
	}
	if err := sb.nodeNet.Update(ctx, sb.net, p); err != nil {
		return nil, errdefs.Wrap(errdefs.ErrUnavailable, err, "update the network policy of %s", sb.id)
	}
	sb.rec.Spec.Network = sandboxspec.NetworkPolicyProto(p, sb.rec.Spec.Network)
	if err := sb.save(); err != nil {
		return nil, err
	}
	sb.log.Info("sandbox network policy updated", "rules", len(p.Rules), "internet", p.Internet)
	return sb.published(), nil
}

// sandboxNetwork is the node's sandbox network as a sandbox uses it
// (sandboxnet.Network).
type sandboxNetwork interface {
	Attach(ctx context.Context, name string, addr netip.Addr, p netpolicy.Policy) (*sandboxnet.Link, error)
	Adopt(ctx context.Context, name string, addr netip.Addr, p netpolicy.Policy) (*sandboxnet.Link, error)
	Policy(l *sandboxnet.Link) (netpolicy.Policy, error)
	Update(ctx context.Context, l *sandboxnet.Link, p netpolicy.Policy) error
	Reset(ctx context.Context, l *sandboxnet.Link) error
	Detach(ctx context.Context, l *sandboxnet.Link) error
	Forget(ctx context.Context, name string) error
	Node() sandboxnet.Node
}

// asSandboxNetwork is n for its sandboxes; nil (not a nil pointer in an
// interface) without one.
func asSandboxNetwork(n *sandboxnet.Network) sandboxNetwork {
	if n == nil {
		return nil
	}
	return n
}

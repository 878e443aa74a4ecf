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
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
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

// checkPolicy refuses a policy the node's network n keeps closed (a rule
// naming its own address or the metadata service's), before anything is
// made.
func checkPolicy(n sandbox.Network, field string, network *sandboxv1.NetworkPolicy) error {
	if network == nil || n == nil {
		return nil
	}
	p, err := sandboxspec.NetworkPolicy(network)
	if err != nil {
		return err
	}
	return n.Node().CheckPolicy(field, p)
}

// UpdateNetwork changes a running or paused sandbox's policy by exactly
// what the request says.
func (e *Edge) UpdateNetwork(ctx context.Context, req *sandboxv1.UpdateNetworkRequest, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(req.GetSandboxId(), scope)
	if err != nil {
		return nil, err
	}
	return sb.UpdateNetwork(ctx, req)
}

// asSandboxNetwork is n for its sandboxes; nil (not a nil pointer in an
// interface) without one.
func asSandboxNetwork(n *sandboxnet.Network) sandbox.Network {
	if n == nil {
		return nil
	}
	return n
}

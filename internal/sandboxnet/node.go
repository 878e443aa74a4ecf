package sandboxnet

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

	"github.com/opendsec/opendsec/internal/errdefs"
)

// NodeConfig is a node's sandbox networking, as its operator sets it.
type NodeConfig struct {
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

// OpenNode opens the sandbox network of the node named node: its table,
// interface prefix and default subnet derive from the name, so several
// nodes on one machine do not meet. It loads the table and starts the DNS
// proxy (wg counts it, stopDNS ends it). own names the sandboxes whose
// veths are kept: those the node is about to re-attach.
func OpenNode(ctx context.Context, node string, cfg NodeConfig, own []string, wg *sync.WaitGroup, log *slog.Logger) (n *Network, stopDNS context.CancelFunc, err error) {
	if len(node) < 2 {
		return nil, nil, errdefs.InvalidArgument("node name %q: want a node id (at least 2 characters)", node)
	}
	if !cfg.Subnet.IsValid() {
		cfg.Subnet = defaultSubnet(node)
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
	prefix := "s" + node[:2]
	addrs, err := nodeAddrs(prefix, cfg.Subnet)
	if err != nil {
		return nil, nil, err
	}
	n, err = Open(ctx, Config{
		Table: "dsec_" + node, Subnet: cfg.Subnet, IfPrefix: prefix, DNSPort: cfg.DNSPort,
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
		p := NewDNSProxy(n, cfg.Upstream, log)
		p.counts = &n.dnsCounts
		p.Serve(dctx, udp, tcp)
	}()
	log.Info("sandbox network ready", "subnet", cfg.Subnet, "dns", n.Node().DNS, "upstream", cfg.Upstream)
	return n, cancel, nil
}

// defaultSubnet is the node's /20 of 10.64.0.0/10, chosen by its name.
func defaultSubnet(node string) netip.Prefix {
	h := fnv.New32a()
	h.Write([]byte(node))
	i := h.Sum32() % 1024
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(64 + i>>4), byte(i&15) << 4, 0}), 20)
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

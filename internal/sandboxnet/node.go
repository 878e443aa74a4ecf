package sandboxnet

import (
	"bufio"
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// NodeConfig is a node's sandbox networking, as its operator sets it.
type NodeConfig struct {
	// Subnet holds the node's sandbox addresses; default: a /20 in
	// 10.64.0.0/10 chosen by the node id (the next free one if another
	// interface of the node has an address in it).
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
	// StateFile keeps the subnet and veth prefix the node uses, so its
	// sandboxes keep them across restarts (empty: kept nowhere). A subnet
	// the operator set is kept too: without the flag, the node stays on
	// it; a flag naming another moves it.
	StateFile string
	// DNSPort is the proxy's port on the gateway; default 53 (resolv.conf
	// cannot name another).
	DNSPort uint16
}

// OpenNode opens the sandbox network of the node named node: its table
// derives from the name, its interface prefix and subnet from the name
// too unless another node on the machine has them (choose), so several
// nodes on one machine do not meet. It loads the table and starts the DNS
// proxy (wg counts it, stopDNS ends it). own names the sandboxes whose
// veths are kept: those the node is about to re-attach.
func OpenNode(ctx context.Context, node string, cfg NodeConfig, own []string, wg *sync.WaitGroup, log *slog.Logger) (n *Network, stopDNS context.CancelFunc, err error) {
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
	if err := checkTools(); err != nil {
		return nil, nil, err
	}
	kept, err := readChoice(cfg.StateFile)
	if err != nil {
		return nil, nil, err
	}
	unlock, err := chooseLock()
	if err != nil {
		return nil, nil, err
	}
	defer unlock()
	ifs, err := hostIfs()
	if err != nil {
		return nil, nil, err
	}
	claimed, err := claims(ctx, "dsec_"+node)
	if err != nil {
		return nil, nil, fmt.Errorf("sandbox network: read the other nodes' tables: %w", err)
	}
	c, err := choose(node, cfg.Subnet, kept, own, ifs, claimed)
	if err != nil {
		return nil, nil, err
	}
	if kept.IfPrefix != "" && (c.IfPrefix != kept.IfPrefix || !cfg.Subnet.IsValid() && c.Subnet != kept.Subnet) {
		log.Warn("sandbox network chosen anew: no sandbox of the node used the one it kept, and another interface or node took it", "kept_subnet", kept.Subnet, "kept_prefix", kept.IfPrefix, "subnet", c.Subnet, "prefix", c.IfPrefix)
	}
	n, err = Open(ctx, Config{
		Table: "dsec_" + node, Subnet: c.Subnet, IfPrefix: c.IfPrefix, DNSPort: cfg.DNSPort,
		Addrs: nodeAddrs(c.IfPrefix, ifs), Closed: cfg.Closed, AllowClosed: cfg.AllowClosed, Own: own,
	}, log)
	if err != nil {
		return nil, nil, err
	}
	if err := keepChoice(cfg.StateFile, c); err != nil {
		return nil, nil, fmt.Errorf("sandbox network: keep its subnet and prefix: %w", err)
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
	log.Info("sandbox network ready", "subnet", c.Subnet, "veth_prefix", c.IfPrefix, "dns", n.Node().DNS, "upstream", cfg.Upstream)
	return n, cancel, nil
}

// nodeAddrs are the node's IPv4 addresses (closed to sandboxes), from
// every interface but the sandboxes' veths (choose has refused a subnet
// holding one of them).
func nodeAddrs(prefix string, ifs []hostIf) []netip.Addr {
	var out []netip.Addr
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, prefix) {
			continue
		}
		for _, p := range i.Addrs {
			out = append(out, p.Addr())
		}
	}
	return out
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

package sandboxnet

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/netpolicy"
)

// Config is the node's side of sandbox networking.
type Config struct {
	// Table is the nftables table the edge owns (family inet).
	Table string
	// Subnet holds the sandboxes' addresses; its first address is the
	// gateway every sandbox routes through (and where the DNS proxy
	// listens).
	Subnet netip.Prefix
	// IfPrefix starts the host-side veth names (at most 3 characters:
	// interface names have 15).
	IfPrefix string
	// DNSPort is the DNS proxy's port on the gateway address.
	DNSPort uint16
	// Addrs are the node's own addresses and Closed further prefixes (the
	// control plane's hosts): closed unless a rule names them.
	Addrs  []netip.Addr
	Closed []netip.Prefix
	// AllowClosed lets a policy's rule name a closed address (the
	// operator's AllowClosedFlag).
	AllowClosed bool
	// Flows bounds each sandbox's connections (zero: DefaultFlows).
	Flows FlowLimits
	// Own names the sandboxes the edge is about to re-attach (Adopt):
	// their veths may exist already and carry IfPrefix.
	Own []string
}

// Network attaches sandboxes to the node: a network namespace each, a veth
// into it, an address from the subnet, and the nftables chain of its
// policy. Network namespaces are named files in /var/run/netns, so `ip
// netns exec` reaches them for debugging.
type Network struct {
	node Node
	gw   netip.Addr
	log  *slog.Logger
	// nft runs the sandboxes' nftables updates, batched (nftbatch.go).
	nft *nftBatch
	// dnsCounts counts the DNS proxy's answers (DNSQueries).
	dnsCounts DNSCounts

	mu       sync.Mutex
	used     map[netip.Addr]string   // address → sandbox; guarded by mu
	attached map[netip.Addr]attached // guarded by mu
	gen      uint64                  // guarded by mu
}

// attached is what the DNS proxy needs of an attached sandbox.
type attached struct {
	sb  Sandbox
	pol netpolicy.Policy
}

// Open loads the node's table (which drops any sandbox chains a previous
// run left: the edge re-attaches the sandboxes it recovers) and turns on
// forwarding.
func Open(ctx context.Context, cfg Config, log *slog.Logger) (*Network, error) {
	if !cfg.Subnet.Addr().Is4() || cfg.Subnet.Bits() > 24 || cfg.Subnet.Bits() < 8 {
		return nil, errdefs.InvalidArgument("sandbox subnet %s: want an IPv4 prefix from /8 to /24", cfg.Subnet)
	}
	if len(cfg.IfPrefix) == 0 || len(cfg.IfPrefix) > 3 || ident(cfg.IfPrefix) != cfg.IfPrefix {
		return nil, errdefs.InvalidArgument("interface prefix %q: want 1 to 3 letters or digits", cfg.IfPrefix)
	}
	// The prefix decides which interfaces the table treats as sandboxes':
	// one of the node's own would lose its traffic.
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	own := map[string]bool{}
	for _, name := range cfg.Own {
		own[ifNameFor(cfg.IfPrefix, name)] = true
	}
	for _, i := range ifs {
		if strings.HasPrefix(i.Name, cfg.IfPrefix) && !own[i.Name] {
			return nil, errdefs.InvalidArgument("interface prefix %q: the node's interface %s has it; choose one no interface of the node starts with", cfg.IfPrefix, i.Name)
		}
	}
	if err := checkTools(); err != nil {
		return nil, err
	}
	gw := cfg.Subnet.Masked().Addr().Next()
	n := &Network{
		node: Node{Table: cfg.Table, Subnet: cfg.Subnet.Masked(), IfPrefix: cfg.IfPrefix, DNS: netip.AddrPortFrom(gw, cfg.DNSPort), Addrs: cfg.Addrs, Closed: cfg.Closed, AllowClosed: cfg.AllowClosed, Flows: cfg.Flows},
		gw:   gw, log: log, nft: newNFTBatch(nft), used: map[netip.Addr]string{gw: "\x00gateway"}, attached: map[netip.Addr]attached{},
	}
	if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
		return nil, fmt.Errorf("turn on IPv4 forwarding: %w", err)
	}
	if err := nft(ctx, NodeScript(n.node)); err != nil {
		return nil, fmt.Errorf("load the node's nftables table %s: %w", cfg.Table, err)
	}
	return n, nil
}

// checkTools finds the programs sandbox networking runs: nft, conntrack,
// and ip, which the VM backends run to make their taps in a sandbox's
// namespace.
func checkTools() error {
	for _, tool := range []string{"ip", "nft", "conntrack"} {
		if _, err := exec.LookPath(tool); err != nil {
			return errdefs.FailedPrecondition("sandbox networking needs %s (Debian packages iproute2, nftables and conntrack): %v", tool, err)
		}
	}
	return nil
}

// Close removes the node's table when no sandbox is attached (the
// sandboxes of a running edge need it; an edge that restarts loads it
// anew). It reports whether it removed it.
func (n *Network) Close(ctx context.Context) (bool, error) {
	n.mu.Lock()
	busy := len(n.attached) > 0
	n.mu.Unlock()
	if busy {
		return false, nil
	}
	if err := nft(ctx, "delete table inet "+n.node.Table+"\n"); err != nil && !isGone(err) {
		return false, err
	}
	return true, nil
}

// Node is the table's description (for scripts and the DNS proxy).
func (n *Network) Node() Node { return n.node }

// Link is a sandbox's attachment.
type Link struct {
	Sandbox
	// NetNS is the path of its network namespace.
	NetNS string
	// Gateway is the address it routes through and sends DNS to.
	Gateway netip.Addr
}

// nsName and ifName are the names the node gives a sandbox's namespace and
// the host side of its veth.
func nsName(sandbox string) string { return "dsec-" + ident(sandbox) }

func (n *Network) ifName(sandbox string) string { return ifNameFor(n.node.IfPrefix, sandbox) }

func ifNameFor(prefix, sandbox string) string {
	h := fnv.New64a()
	h.Write([]byte(sandbox))
	return fmt.Sprintf("%s%016x", prefix, h.Sum64())[:15]
}

// link describes name's attachment with addr.
func (n *Network) link(name string, addr netip.Addr) *Link {
	return &Link{Sandbox: Sandbox{Name: name, HostIf: n.ifName(name), Addr: addr}, NetNS: filepath.Join("/var/run/netns", nsName(name)), Gateway: n.gw}
}

// allocate takes the next free address for name, or addr if it is given
// (an edge re-attaching a sandbox keeps its address).
func (n *Network) allocate(name string, addr netip.Addr) (netip.Addr, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if addr.IsValid() {
		if !n.node.Subnet.Contains(addr) {
			return addr, errdefs.InvalidArgument("address %s: not in the sandbox subnet %s", addr, n.node.Subnet)
		}
		if addr == n.gw || !n.node.Subnet.Contains(addr.Next()) || addr == n.node.Subnet.Masked().Addr() {
			return addr, errdefs.InvalidArgument("address %s: the subnet's network, gateway or broadcast address", addr)
		}
		if owner, ok := n.used[addr]; ok && owner != name {
			return addr, errdefs.AlreadyExists("address %s is %s's", addr, owner)
		}
		n.used[addr] = name
		return addr, nil
	}
	for a := n.gw.Next(); n.node.Subnet.Contains(a); a = a.Next() {
		if _, ok := n.used[a]; !ok && a.Next().IsValid() && n.node.Subnet.Contains(a.Next()) { // not the broadcast address
			n.used[a] = name
			return a, nil
		}
	}
	return netip.Addr{}, errdefs.ResourceExhausted("sandbox subnet %s: no address left", n.node.Subnet)
}

// release frees addr if name holds it (a late second detach must not free
// the address of the sandbox that has it now).
func (n *Network) release(addr netip.Addr, name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.used[addr] == name {
		delete(n.used, addr)
	}
}

// Attach makes name's namespace and veth, with addr (or the next free
// address when addr is the zero value), and installs policy p. On failure
// nothing of it is left.
func (n *Network) Attach(ctx context.Context, name string, addr netip.Addr, p netpolicy.Policy) (_ *Link, err error) {
	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()
	if addr, err = n.allocate(name, addr); err != nil {
		return nil, err
	}
	undo = append(undo, func() { n.release(addr, name) })
	l := n.link(name, addr)
	if err := makeNetNS(nsName(name)); err != nil {
		return nil, fmt.Errorf("attach %s: make its network namespace: %w", name, err)
	}
	undo = append(undo, func() { removeNetNS(nsName(name)) }) //nolint:errcheck // undoing
	if err := makeVeth(l.HostIf, nsName(name), n.gw, addr); err != nil {
		return nil, fmt.Errorf("attach %s: make its veth %s: %w", name, l.HostIf, err)
	}
	undo = append(undo, func() { removeVeth(l.HostIf) }) //nolint:errcheck // undoing
	if err := setInside(nsName(name), n.gw, addr); err != nil {
		return nil, fmt.Errorf("attach %s: set its address and routes: %w", name, err)
	}
	if err := n.nft.do(SandboxScript(n.node, l.Sandbox, nil, p)); err != nil {
		return nil, fmt.Errorf("install the network policy of %s: %w", name, err)
	}
	n.setAttached(l.Sandbox, p)
	return l, nil
}

// Reset gives l's namespace its address and routes again, as Attach set
// them. A runtime that takes the interface over removes them (gVisor's
// netstack takes eth0's address and routes from the host's view when it
// starts), so one restored in the same namespace (an offloaded sandbox
// brought back in place) would find an interface without either and come
// back with loopback only.
func (n *Network) Reset(ctx context.Context, l *Link) error {
	if err := setInside(nsName(l.Name), n.gw, l.Addr); err != nil {
		return fmt.Errorf("reset the network of %s: %w", l.Name, err)
	}
	return nil
}

// Adopt takes back a sandbox whose namespace and veth outlived the edge
// (Open dropped its chain): its address addr, and policy p installed anew.
func (n *Network) Adopt(ctx context.Context, name string, addr netip.Addr, p netpolicy.Policy) (_ *Link, err error) {
	if addr, err = n.allocate(name, addr); err != nil {
		return nil, err
	}
	l := n.link(name, addr)
	if _, err := os.Stat(l.NetNS); err != nil {
		n.release(addr, name)
		return nil, errdefs.FailedPrecondition("re-attach %s: its network namespace is gone: %v", name, err)
	}
	if _, err := net.InterfaceByName(l.HostIf); err != nil {
		n.release(addr, name)
		return nil, errdefs.FailedPrecondition("re-attach %s: its veth %s is gone: %v", name, l.HostIf, err)
	}
	if err := n.nft.do(SandboxScript(n.node, l.Sandbox, nil, p)); err != nil {
		n.release(addr, name)
		return nil, fmt.Errorf("re-install the network policy of %s: %w", name, err)
	}
	n.setAttached(l.Sandbox, p)
	return l, nil
}

// Forget removes name's veth and namespace, a part already gone being no
// error: the last steps of Detach, and alone the removal of a sandbox whose
// attachment was never recorded (an edge that crashed between Attach and
// saving the address), of which the node's table, reloaded by Open, has
// nothing.
func (n *Network) Forget(ctx context.Context, name string) error {
	var errs []error
	if err := removeVeth(n.ifName(name)); err != nil {
		errs = append(errs, fmt.Errorf("remove the veth of %s: %w", name, err))
	}
	if err := removeNetNS(nsName(name)); err != nil {
		errs = append(errs, fmt.Errorf("remove the network namespace of %s: %w", name, err))
	}
	return errors.Join(errs...)
}

// setAttached records sb's policy, under a new generation: the sets of its
// domain rules may have been made anew, so what the DNS proxy remembers
// having opened no longer holds.
func (n *Network) setAttached(sb Sandbox, p netpolicy.Policy) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.gen++
	sb.Generation = n.gen
	n.attached[sb.Addr] = attached{sb, p}
}

// Policy is the policy attached link l has now.
func (n *Network) Policy(l *Link) (netpolicy.Policy, error) {
	n.mu.Lock()
	a, ok := n.attached[l.Addr]
	n.mu.Unlock()
	if !ok || a.sb.Name != l.Name {
		return netpolicy.Policy{}, errdefs.FailedPrecondition("network of %s: it is not attached", l.Name)
	}
	return a.pol, nil
}

// Update replaces l's policy with p in one transaction.
// The link must be attached (an update after a Detach would bring back a
// chain for an address another sandbox may have now). Callers serialise a
// sandbox's Update and Detach.
func (n *Network) Update(ctx context.Context, l *Link, p netpolicy.Policy) error {
	old, err := n.Policy(l)
	if err != nil {
		return err
	}
	if err := n.nft.do(SandboxScript(n.node, l.Sandbox, &old, p)); err != nil {
		return err
	}
	n.setAttached(l.Sandbox, p)
	if narrows(old, p) {
		// The table checks new connections only: open ones the policy no
		// longer allows are cut (all of the sandbox's own, as which still
		// hold is not known for domain rules; a client reconnects under
		// the new policy).
		return forgetFlows(ctx, l.Addr, false)
	}
	return nil
}

// narrows reports whether p allows anything less than old does.
func narrows(old, p netpolicy.Policy) bool {
	if old.Internet && !p.Internet {
		return true
	}
	kept := map[string]bool{}
	for _, r := range p.Rules {
		kept[r.String()] = true
	}
	for _, r := range old.Rules {
		if !kept[r.String()] {
			return true
		}
	}
	return false
}

// forgetFlows deletes the connection tracking entries a sandbox's address
// started (and, with inbound, those to it), so no flow outlives the
// policy or the sandbox that opened it: the next holder of a reused
// address must not inherit them.
func forgetFlows(ctx context.Context, addr netip.Addr, inbound bool) error {
	dirs := []string{"-s"}
	if inbound {
		dirs = append(dirs, "-d")
	}
	for _, d := range dirs {
		out, err := exec.CommandContext(ctx, "conntrack", "-D", "-f", "ipv4", d, addr.String()).CombinedOutput()
		// Exit status 1 with "0 flow entries have been deleted": none was there.
		if err != nil && !strings.Contains(string(out), "flow entries have been deleted") {
			return fmt.Errorf("conntrack -D %s %s: %v: %s", d, addr, err, strings.TrimSpace(string(out)))
		}
	}
	return nil
}

// Sandbox is the attached sandbox that has addr, and its policy (the DNS
// proxy's Resolver).
func (n *Network) Sandbox(addr netip.Addr) (Sandbox, netpolicy.Policy, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	a, ok := n.attached[addr]
	return a.sb, a.pol, ok
}

// Learn opens addrs, which the DNS proxy answered for a name that rules
// (indexes into p.Rules) allow, for ttl.
func (n *Network) Learn(ctx context.Context, sb Sandbox, p netpolicy.Policy, rules []int, addrs []netip.Addr, ttl time.Duration) error {
	return n.nft.do(LearnScript(n.node, sb, p, rules, addrs, ttl))
}

// Detach removes what Attach made, under the policy the link has now (as
// Attach, Adopt and Update recorded it: the caller need not parse it
// again). It goes on past a failed step and returns every failure; a
// part already gone is not one. After a failure the link stays attached,
// so a retry removes the rest.
func (n *Network) Detach(ctx context.Context, l *Link) error {
	n.mu.Lock()
	a, ok := n.attached[l.Addr]
	ok = ok && a.sb.Name == l.Name
	if ok {
		delete(n.attached, l.Addr)
	}
	n.mu.Unlock()
	var p netpolicy.Policy // a link no longer attached has no sets left
	if ok {
		p = a.pol
	}
	var errs []error
	if err := n.nft.do(RemoveScript(n.node, l.Sandbox, p)); err != nil && !isGone(err) {
		errs = append(errs, fmt.Errorf("remove the network policy of %s: %w", l.Name, err))
	}
	if err := n.Forget(ctx, l.Name); err != nil {
		errs = append(errs, err)
	}
	if err := forgetFlows(ctx, l.Addr, true); err != nil {
		errs = append(errs, err)
	}
	if len(errs) == 0 {
		n.release(l.Addr, l.Name)
	} else {
		n.mu.Lock()
		if _, taken := n.attached[l.Addr]; ok && !taken && n.used[l.Addr] == l.Name {
			n.attached[l.Addr] = a // its address is not released: still its own
		}
		n.mu.Unlock()
		n.log.Error("detach a sandbox from the network", logging.SandboxID, l.Name, logging.Error, errors.Join(errs...))
	}
	return errors.Join(errs...)
}

// isGone: "No such file or directory", "Cannot find device": what Detach
// would remove is already gone.
func isGone(err error) bool {
	s := err.Error()
	return strings.Contains(s, "No such file or directory") || strings.Contains(s, "Cannot find device") || strings.Contains(s, "does not exist")
}

// nft runs an nftables script as one transaction.
func nft(ctx context.Context, script string) error {
	return run(ctx, strings.NewReader(script), "nft", "-f", "-")
}

func run(ctx context.Context, stdin *strings.Reader, name string, args ...string) error {
	_, err := output(ctx, stdin, name, args...)
	return err
}

// output runs a command and returns what it printed.
func output(ctx context.Context, stdin *strings.Reader, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	if stdin != nil {
		cmd.Stdin = stdin
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// ListenDNS opens the DNS proxy's sockets on the gateway address. The
// address is on the node only while a sandbox is attached (it is on every
// veth), so the sockets are bound with IP_FREEBIND.
func (n *Network) ListenDNS(ctx context.Context) (net.PacketConn, net.Listener, error) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_FREEBIND, 1) }); err != nil {
			return err
		}
		return serr
	}}
	addr := n.node.DNS.String()
	pc, err := lc.ListenPacket(ctx, "udp4", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("DNS proxy: %w", err)
	}
	ln, err := lc.Listen(ctx, "tcp4", addr)
	if err != nil {
		pc.Close()
		return nil, nil, fmt.Errorf("DNS proxy: %w", err)
	}
	return pc, ln, nil
}

// DNSQueries counts the node's DNS proxy's answers by outcome.
func (n *Network) DNSQueries() *DNSCounts { return &n.dnsCounts }

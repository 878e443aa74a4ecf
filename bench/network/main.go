// Command network benchmarks sandbox networking (internal/sandboxnet) in
// namespaces of its own, in one run: attaching a sandbox with no policy and
// with a 20-rule policy against the bare iproute2 commands that make the
// same namespace and veth (no nftables), and the DNS proxy's answers per
// second against asking the upstream server directly. Needs root, ip and
// nft. Nothing it sends leaves the namespaces it makes and loopback.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/miekg/dns"

	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/internal/netpolicy"
	"github.com/opendsec/opendsec/internal/sandboxnet"
)

func main() {
	reps := flag.Int("reps", 20, "attaches of each kind (interleaved)")
	dnsFor := flag.Duration("dns-for", 2*time.Second, "how long each DNS measurement runs")
	inNode := flag.Bool("in-node", false, "internal: already in the node namespace the bench made")
	store := flag.String("store", "", "image store with the image; empty skips create through the platform")
	agent := flag.String("agent", "bin/aether", "aether binary")
	img := flag.String("image", "root/busybox:latest", "image of the platform create measurement")
	runscNet := flag.String("runsc-network", "bin/runsc-net", "the newer runsc, for fork with networking (empty skips it)")
	flag.Parse()
	var err error
	if *inNode {
		err = run(context.Background(), *reps, *dnsFor)
		if err == nil && *store != "" {
			err = benchPlatformCreate(context.Background(), *store, *agent, *img, *reps)
		}
		if err == nil && *store != "" && *runscNet != "" {
			var abs string
			if abs, err = filepath.Abs(*runscNet); err == nil {
				err = benchForkNetwork(context.Background(), *store, *agent, abs, *img, max(*reps/3, 3))
			}
		}
	} else {
		err = inOwnNode(os.Args[1:])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// inOwnNode runs the bench again inside a network namespace it makes (the
// "node"), so its nftables table, forwarding and DNS proxy touch nothing of
// the host's, and removes the namespace after.
func inOwnNode(args []string) error {
	node := fmt.Sprintf("dsbench-node-%d", os.Getpid())
	if err := sh("ip", "netns", "add", node); err != nil {
		return err
	}
	defer sh("ip", "netns", "del", node) //nolint:errcheck // cleanup
	if err := sh("ip", "-n", node, "link", "set", "lo", "up"); err != nil {
		return err
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	// nsenter, not ip netns exec: that remounts /sys, which hides the
	// cgroup hierarchies the runtimes need.
	cmd := exec.Command("nsenter", append([]string{"--net=/var/run/netns/" + node, "--", self, "-in-node"}, args...)...)
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	return cmd.Run()
}

// inNS runs fn in network namespace ns.
func inNS(ns string, fn func() error) error {
	return sandboxnet.InNetNS(filepath.Join("/var/run/netns", ns), fn)
}

func sh(args ...string) error {
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		return fmt.Errorf("%s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func run(ctx context.Context, reps int, dnsFor time.Duration) error {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	nw, err := sandboxnet.Open(ctx, sandboxnet.Config{Table: "opendsec", Subnet: netip.MustParsePrefix("10.91.0.0/16"), IfPrefix: "dsb", DNSPort: 53,
		// Each DNS query is a new flow; the bench asks far faster than a
		// sandbox's default limit allows, to measure the proxy itself.
		Flows: sandboxnet.FlowLimits{NewPerSecond: 1 << 20, Burst: 1 << 20, Open: 1 << 20}}, log)
	if err != nil {
		return err
	}
	var specs []netpolicy.RuleSpec
	for i := 0; i < 10; i++ {
		specs = append(specs, netpolicy.RuleSpec{Domain: fmt.Sprintf("host%d.example.org", i), Protocol: "tcp", Ports: []string{"443"}})
		specs = append(specs, netpolicy.RuleSpec{CIDR: fmt.Sprintf("10.%d.0.0/16", 100+i), Ports: []string{"80", "8000-8100"}})
	}
	twenty, err := netpolicy.Parse("rules", false, specs)
	if err != nil {
		return err
	}
	var bare, empty, full, detach []time.Duration
	for i := 0; i < reps; i++ {
		// bare: the same iproute2 commands, no nftables.
		name := fmt.Sprintf("dsbench-bare-%d", i)
		if err := func() error {
			start := time.Now()
			if err := sh("ip", "netns", "add", name); err != nil {
				return err
			}
			if err := batch("", fmt.Sprintf("link add dsbbare%d type veth peer name eth0 netns %s\naddr add 10.92.0.1/32 dev dsbbare%d\nlink set dsbbare%d up\nroute add 10.92.0.2/32 dev dsbbare%d\n", i, name, i, i, i)); err != nil {
				return err
			}
			if err := batch(name, "link set lo up\naddr add 10.92.0.2/32 dev eth0\nlink set eth0 up\nroute add 10.92.0.1/32 dev eth0\nroute add default via 10.92.0.1\n"); err != nil {
				return err
			}
			bare = append(bare, time.Since(start))
			sh("ip", "link", "del", fmt.Sprintf("dsbbare%d", i)) //nolint:errcheck // cleanup
			return sh("ip", "netns", "del", name)
		}(); err != nil {
			return err
		}
		for _, c := range []struct {
			p   netpolicy.Policy
			out *[]time.Duration
		}{{netpolicy.Policy{}, &empty}, {twenty, &full}} {
			if err := func() error {
				start := time.Now()
				l, err := nw.Attach(ctx, fmt.Sprintf("bench-%d-%d", i, len(c.p.Rules)), netip.Addr{}, c.p)
				if err != nil {
					return err
				}
				*c.out = append(*c.out, time.Since(start))
				start = time.Now()
				err = nw.Detach(ctx, l)
				detach = append(detach, time.Since(start))
				return err
			}(); err != nil {
				return err
			}
		}
	}
	fmt.Println("sandbox network attach, median (p90), in one run; machine:", hostname())
	row := func(what string, d []time.Duration, ref []time.Duration) {
		fmt.Printf("  %-44s %8s (%s)", what, benchstat.Ms(benchstat.Pct(d, 50), 1), benchstat.Ms(benchstat.Pct(d, 90), 1))
		if ref != nil {
			fmt.Printf("  %.2fx", float64(benchstat.Pct(d, 50))/float64(benchstat.Pct(ref, 50)))
		}
		fmt.Println()
	}
	row("bare ip netns add + veth + addresses", bare, nil)
	row("Attach, no policy (vs bare)", empty, bare)
	row("Attach, 20-rule policy (vs no policy)", full, empty)
	row("Detach", detach, nil)
	if err := benchDNS(ctx, nw, dnsFor); err != nil {
		return err
	}
	return benchStream(ctx, nw, dnsFor)
}

func batch(ns, cmds string) error {
	args := []string{"-batch", "-"}
	if ns != "" {
		args = append([]string{"-n", ns}, args...)
	}
	cmd := exec.Command("ip", args...)
	cmd.Stdin = strings.NewReader(cmds)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}

// benchDNS measures answers per second, one client asking in a loop from
// a sandbox: through the proxy for an allowed name (its address opened in
// nftables), for a refused name, and straight from the upstream server.
func benchDNS(ctx context.Context, nw *sandboxnet.Network, d time.Duration) error {
	up, stop, err := upstream()
	if err != nil {
		return err
	}
	defer stop()
	pc, ln, err := nw.ListenDNS(ctx)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	proxy := sandboxnet.NewDNSProxy(nw, []string{up}, log)
	proxy.Limit(1e9, 1e9) // the proxy's own cost, not its per-sandbox limit
	go proxy.Serve(ctx, pc, ln)
	p, err := netpolicy.Parse("rules", false, []netpolicy.RuleSpec{{Domain: "pkg.example.org", Protocol: "tcp", Ports: []string{"443"}}})
	if err != nil {
		return err
	}
	l, err := nw.Attach(ctx, "bench-dns", netip.Addr{}, p)
	if err != nil {
		return err
	}
	defer nw.Detach(context.Background(), l) //nolint:errcheck // cleanup
	sbNS := filepath.Base(l.NetNS)
	rate := func(ns, server, name string) (float64, error) {
		var n int
		ask := func() error {
			c := &dns.Client{Timeout: 2 * time.Second}
			start := time.Now()
			for time.Since(start) < d {
				if _, _, err := c.Exchange(new(dns.Msg).SetQuestion(name, dns.TypeA), server); err != nil {
					return err
				}
				n++
			}
			return nil
		}
		var err error
		if ns == "" {
			err = ask()
		} else {
			err = inNS(ns, ask)
		}
		return float64(n) / d.Seconds(), err
	}
	gw := l.Gateway.String() + ":53"
	allowed, err := rate(sbNS, gw, "pkg.example.org.")
	if err != nil {
		return err
	}
	refusedName, err := rate(sbNS, gw, "other.example.com.")
	if err != nil {
		return err
	}
	direct, err := rate("", up, "pkg.example.org.")
	if err != nil {
		return err
	}
	fmt.Printf("DNS answers per second, one client asking in a loop for %v:\n", d)
	fmt.Printf("  %-44s %8.0f\n", "upstream, asked directly on the node", direct)
	fmt.Printf("  %-44s %8.0f  %.2fx\n", "proxy, allowed name (answer opened in nft)", allowed, allowed/direct)
	fmt.Printf("  %-44s %8.0f  %.2fx\n", "proxy, name not allowed (NXDOMAIN)", refusedName, refusedName/direct)
	return nil
}

// upstream serves one name on the node's loopback.
func upstream() (string, func(), error) {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg).SetReply(q)
		if rr, err := dns.NewRR(q.Question[0].Name + " 300 IN A 203.0.113.11"); err == nil && q.Question[0].Qtype == dns.TypeA {
			m.Answer = append(m.Answer, rr)
		}
		w.WriteMsg(m) //nolint:errcheck // bench
	})}
	go srv.ActivateAndServe()                                      //nolint:errcheck // until stop
	return pc.LocalAddr().String(), func() { srv.Shutdown() }, nil //nolint:errcheck // bench
}

// benchStream compares a TCP stream and a request/response round trip from
// a sandbox to an allowed server behind the node (two veths, forwarding,
// the policy's chain, masquerading) with the same between two namespaces
// joined by one veth.
func benchStream(ctx context.Context, nw *sandboxnet.Network, d time.Duration) error {
	id := os.Getpid()
	inet, a, b := fmt.Sprintf("dsbench-inet-%d", id), fmt.Sprintf("dsbench-a-%d", id), fmt.Sprintf("dsbench-b-%d", id)
	for _, ns := range []string{inet, a, b} {
		if err := sh("ip", "netns", "add", ns); err != nil {
			return err
		}
		defer sh("ip", "netns", "del", ns) //nolint:errcheck // cleanup
	}
	setup := [][]string{
		{"ip", "link", "add", "upbench", "type", "veth", "peer", "name", "eth0", "netns", inet},
		{"ip", "addr", "add", "203.0.113.1/24", "dev", "upbench"}, {"ip", "link", "set", "upbench", "up"},
		{"ip", "-n", inet, "addr", "add", "203.0.113.10/24", "dev", "eth0"}, {"ip", "-n", inet, "link", "set", "eth0", "up"},
		{"ip", "-n", a, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", b},
		{"ip", "-n", a, "addr", "add", "10.93.0.1/30", "dev", "eth0"}, {"ip", "-n", a, "link", "set", "eth0", "up"},
		{"ip", "-n", b, "addr", "add", "10.93.0.2/30", "dev", "eth0"}, {"ip", "-n", b, "link", "set", "eth0", "up"},
	}
	for _, c := range setup {
		if err := sh(c...); err != nil {
			return err
		}
	}
	p, err := netpolicy.Parse("rules", false, []netpolicy.RuleSpec{{CIDR: "203.0.113.10", Protocol: "tcp", Ports: []string{"5001"}}})
	if err != nil {
		return err
	}
	l, err := nw.Attach(ctx, "bench-stream", netip.Addr{}, p)
	if err != nil {
		return err
	}
	defer nw.Detach(context.Background(), l) //nolint:errcheck // cleanup
	// Single runs on a small machine swing by +-30 %: alternate short
	// rounds of both and compare medians.
	const rounds = 9
	round := d / rounds * 2
	fmt.Printf("TCP from a sandbox to an allowed server behind the node, against two namespaces joined by a veth (%d alternating rounds of %v):\n", rounds, round)
	var plainMB, ourMB []float64
	var plainRTT, ourRTT []time.Duration
	for i := 0; i < rounds; i++ {
		mb, rtt, err := stream(b, "10.93.0.2:5001", a, round)
		if err != nil {
			return err
		}
		plainMB, plainRTT = append(plainMB, mb), append(plainRTT, rtt)
		mb, rtt, err = stream(inet, "203.0.113.10:5001", filepath.Base(l.NetNS), round)
		if err != nil {
			return err
		}
		ourMB, ourRTT = append(ourMB, mb), append(ourRTT, rtt)
	}
	om, pm := median(ourMB), median(plainMB)
	fmt.Printf("  %-44s %8.0f MB/s  vs %6.0f MB/s  %.2fx (rounds: ours %.0f-%.0f, plain %.0f-%.0f)\n", "stream throughput, median", om, pm, om/pm, slices.Min(ourMB), slices.Max(ourMB), slices.Min(plainMB), slices.Max(plainMB))
	or, pr := benchstat.Pct(ourRTT, 50), benchstat.Pct(plainRTT, 50)
	fmt.Printf("  %-44s %8s      vs %9s  %.2fx\n", "1-byte round trip, median", benchstat.Ms(or, 3), benchstat.Ms(pr, 3), float64(or)/float64(pr))
	return nil
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// stream serves on addr in serverNS and, from clientNS, writes for d and
// then does 2000 one-byte round trips: MB/s and the median round trip.
func stream(serverNS, addr, clientNS string, d time.Duration) (float64, time.Duration, error) {
	var l net.Listener
	if err := inNS(serverNS, func() (err error) { l, err = net.Listen("tcp", addr); return err }); err != nil {
		return 0, 0, err
	}
	defer l.Close()
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				buf := make([]byte, 1<<16)
				for {
					n, err := c.Read(buf)
					if err != nil {
						return
					}
					if n == 1 { // a round trip: echo
						c.Write(buf[:1]) //nolint:errcheck // bench
					}
				}
			}()
		}
	}()
	var mbps float64
	var rtts []time.Duration
	err := inNS(clientNS, func() error {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			return err
		}
		defer c.Close()
		buf := make([]byte, 1<<16)
		var sent int
		start := time.Now()
		for time.Since(start) < d {
			n, err := c.Write(buf)
			if err != nil {
				return err
			}
			sent += n
		}
		mbps = float64(sent) / time.Since(start).Seconds() / 1e6
		r, err := net.Dial("tcp", addr)
		if err != nil {
			return err
		}
		defer r.Close()
		one := []byte{1}
		for i := 0; i < 2000; i++ {
			t0 := time.Now()
			if _, err := r.Write(one); err != nil {
				return err
			}
			if _, err := io.ReadFull(r, one); err != nil {
				return err
			}
			rtts = append(rtts, time.Since(t0))
		}
		return nil
	})
	return mbps, benchstat.Pct(rtts, 50), err
}

package main

import (
	"context"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/gateway/e2b"
	"github.com/opendsec/opendsec/internal/sandboxnet"
)

func cmdUp(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("up", flag.ExitOnError)
	stateDir := fs.String("state-dir", "", "directory for all state (required)")
	listen := fs.String("listen", embed.DefaultListen, "client API address")
	backends := fs.String("backends", "container,gvisor,microvm,vm", "comma-separated backends to enable (container, gvisor, microvm, vm); one that cannot run on this node (microvm or vm where no VMM boots) is listed with the reason by dsec nodes")
	edges := fs.Int("edges", 1, "how many edges to run, each its own node (a one-machine cluster)")
	bf := addBackendFlags(fs)
	cpuOver := fs.Float64("cpu-overcommit", capacity.DefaultCPUOvercommit, "the sum of the sandboxes' CPU limits may be this many times the cores")
	memOver := fs.Float64("memory-overcommit", capacity.DefaultMemoryOvercommit, "the sum of their memory limits this many times the memory")
	maxSandboxes := fs.Int64("max-sandboxes", 0, "sandboxes each edge admits at most (0: what the host's memory, tasks and file descriptors allow)")
	cacheLimit := fs.Int64("layer-cache-limit", 0, "MiB the node's unpacked image layers may take; beyond it the least recently used ones no sandbox needs are removed (0: no limit; layers mounted from their EROFS forms take no node disk)")
	unpack := fs.Bool("unpack-layers", false, "keep new layers without their EROFS forms, so that nodes unpack them (for kernels without EROFS)")
	diskOver := fs.Float64("disk-overcommit", 1, "above 1, the sandboxes' disk limits may add up to this many times the free space of the layers' disk; a sandbox that fills it then loses its neighbours' writes; 1: every layer can be written in full")
	agent := fs.String("agent", "", "path of the aether binary (default: next to dsec, then PATH)")
	images := fs.String("image-store", "", "shared image store directory (default: STATE/images)")
	lf := addLogFlags(fs)
	rf := addRegistryFlags(fs)
	e2bListen := fs.String("e2b-listen", embed.DefaultGatewayListen, "address of the E2B-compatible gateway; empty for none")
	clientCerts := fs.Bool("client-certs", false, "with --tls: require clients to present a certificate of the cluster's CA (mutual TLS); client.env names the admin's as DSEC_CLIENT_CERT and DSEC_CLIENT_KEY")
	useTLS := fs.Bool("tls", false, "serve the client API over TLS with a certificate of the cluster's CA (client.env names the CA as DSEC_CA_FILE); without it the API is plain HTTP, fit for loopback only")
	metricsListen := fs.String("metrics-listen", "127.0.0.1:0", "address serving every component's Prometheus metrics at /metrics (written into client.env as DSEC_METRICS_URL; port 0 picks a free one; empty: none)")
	e2bImage := fs.String("e2b-base-image", "root/py:3.11", "the image E2B's template \"base\" names")
	e2bCIImage := fs.String("e2b-code-interpreter-image", "root/code-interpreter:latest", "the image E2B's template \"code-interpreter-v1\" names")
	sandboxNet := fs.Bool("sandbox-network", true, "give sandboxes that ask for it a network (needs iproute2 and nftables)")
	subnet := fs.String("sandbox-subnet", "", "IPv4 prefix of the sandboxes' addresses (default: the one the node used last, else a /20 in 10.64.0.0/10 chosen by the node id, the next free one if another interface or node has it)")
	allowClosed := fs.Bool("sandbox-allow-closed-rules", false, "let a sandbox's policy name a closed address (the node's own, link-local and cloud metadata, the control plane's); off, such rules are refused")
	dnsUpstream := fs.String("sandbox-dns", "", "comma-separated DNS servers (host:port) the sandboxes' DNS proxy asks (default: /etc/resolv.conf's)")
	var pools poolFlag
	fs.Var(&pools, "pool", poolHelp)
	fs.Parse(args)
	if *stateDir == "" {
		return fmt.Errorf("up: --state-dir is required")
	}
	agentPath, err := findAgent(*agent)
	if err != nil {
		return err
	}
	cfg := embed.Config{StateDir: *stateDir, Listen: *listen, AgentPath: agentPath, ImageStore: *images, Registries: rf.config(), Backends: map[string]map[string]string{},
		GatewayListen: *e2bListen, MetricsListen: *metricsListen, TLS: *useTLS, ClientCerts: *clientCerts, Gateway: e2b.Config{BaseImage: *e2bImage, CodeInterpreterImage: *e2bCIImage}, Edges: *edges,
		CPUOvercommit: *cpuOver, MemoryOvercommit: *memOver, MaxSandboxes: *maxSandboxes, DiskOvercommit: *diskOver, LayerCacheLimit: *cacheLimit << 20, UnpackLayers: *unpack, Pools: pools}
	if *edges < 1 || *edges > 64 {
		return fmt.Errorf("up: --edges %d: want 1 to 64", *edges)
	}
	if *sandboxNet {
		nc, err := networkConfig(*subnet, *dnsUpstream, *allowClosed)
		if err != nil {
			return err
		}
		cfg.Network = nc
	}
	for _, b := range strings.Split(*backends, ",") {
		if b = strings.TrimSpace(b); b != "" {
			cfg.Backends[b] = bf.options(b)
		}
	}
	log := lf.logger()
	c, err := embed.Start(ctx, cfg, registry(), log)
	if err != nil {
		return err
	}
	defer c.Close()
	usable, unusable := c.Edge.BackendNames()
	var nodes []string
	for _, e := range c.Edges {
		nodes = append(nodes, string(e.Node()))
	}
	log.Info("opendsec is up", "api", c.APIURL, "e2b_gateway", c.GatewayURL, "metrics", c.MetricsURL, "client_env", c.ClientEnv, "nodes", nodes, "backends", usable, "unavailable", unusable)
	fmt.Fprintf(os.Stderr, "\nOpenDsec is up at %s. In another shell:\n  . %s\n  dsec run --image root/busybox:latest -- echo hello\n\n", c.APIURL, c.ClientEnv)
	<-ctx.Done()
	log.Info("shutting down; sandboxes keep running and are re-attached by the next dsec up")
	return nil
}

// findAgent locates the aether binary.
func findAgent(flagValue string) (string, error) {
	if flagValue != "" {
		return filepath.Abs(flagValue)
	}
	if self, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(self), "aether")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("up: aether not found next to dsec; build it (make build) or pass --agent")
}

// networkConfig parses the sandbox network flags.
func networkConfig(subnet, dns string, allowClosed bool) (*sandboxnet.NodeConfig, error) {
	nc := &sandboxnet.NodeConfig{AllowClosed: allowClosed}
	if subnet != "" {
		p, err := netip.ParsePrefix(subnet)
		if err != nil {
			return nil, fmt.Errorf("up: --sandbox-subnet %q: %v", subnet, err)
		}
		nc.Subnet = p
	}
	for _, s := range strings.Split(dns, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		if _, err := netip.ParseAddrPort(s); err != nil {
			return nil, fmt.Errorf("up: --sandbox-dns %q: want host:port with an IP address: %v", s, err)
		}
		nc.Upstream = append(nc.Upstream, s)
	}
	return nc, nil
}

// findRunscNet locates the newer runsc: the flag's path, else runsc-net
// next to dsec (make build links it there); "" for none.
func findRunscNet(flagValue string) string {
	switch flagValue {
	case "none":
		return ""
	case "":
	default:
		p, _ := filepath.Abs(flagValue)
		return p
	}
	if self, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(self), "runsc-net")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return ""
}

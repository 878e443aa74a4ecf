package main

import (
	"context"
	"flag"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/pki"
)

// cmdEdge runs an edge alone: the daemon of one node.
func cmdEdge(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("edge", flag.ExitOnError)
	stateDir := fs.String("state-dir", "", "the node's state directory (required)")
	listen := fs.String("listen", "127.0.0.1:7080", "address the apiservers and watchers reach")
	images := fs.String("image-store", "", "the shared image store directory (required)")
	backends := fs.String("backends", "container,gvisor,microvm,vm", "comma-separated backends to enable (one that cannot run here is reported with the reason)")
	bf := addBackendFlags(fs)
	cpuOver := fs.Float64("cpu-overcommit", capacity.DefaultCPUOvercommit, "the sum of the sandboxes' CPU limits may be this many times the cores")
	memOver := fs.Float64("memory-overcommit", capacity.DefaultMemoryOvercommit, "the sum of their memory limits this many times the memory")
	maxSandboxes := fs.Int64("max-sandboxes", 0, "sandboxes the node admits at most (0: what its memory, tasks and file descriptors allow)")
	cacheLimit := fs.Int64("layer-cache-limit", 0, "MiB the node's unpacked image layers may take; beyond it the least recently used ones no sandbox needs are removed (0: no limit)")
	diskOver := fs.Float64("disk-overcommit", 1, "above 1, the sandboxes' disk limits may add up to this many times the free space of the layers' disk; a sandbox that fills it then loses its neighbours' writes; 1: every layer can be written in full")
	diskLedger := fs.String("disk-ledger", "/run/opendsec/disk-ledger", "directory where the edges of this host count what each promised of a disk they share; empty: this edge counts only its own sandboxes")
	agent := fs.String("agent", "", "path of the aether binary (default: next to dsec)")
	runBase := fs.String("run-base", "", "directory of the agents' sockets (default /run/opendsec)")
	sandboxNet := fs.Bool("sandbox-network", true, "give sandboxes that ask for it a network (needs iproute2 and nftables)")
	subnet := fs.String("sandbox-subnet", "", "IPv4 prefix of the sandboxes' addresses (default: the one the node used last, else a /20 chosen by the node id)")
	allowClosed := fs.Bool("sandbox-allow-closed-rules", false, "let a sandbox's policy name a closed address (the node's own, link-local and cloud metadata, the control plane's); off, such rules are refused")
	dnsUpstream := fs.String("sandbox-dns", "", "comma-separated DNS servers the sandboxes' DNS proxy asks")
	tf := addTLSFlags(fs, "this edge's certificate (dsec ca issue --role edge)")
	lf := addLogFlags(fs)
	metricsListen := addMetricsFlag(fs)
	var pools poolFlag
	fs.Var(&pools, "pool", poolHelp)
	fs.Parse(args)
	if *stateDir == "" || *images == "" {
		return fmt.Errorf("edge: --state-dir and --image-store: required")
	}
	ident, err := tf.identity(pki.RoleEdge)
	if err != nil {
		return fmt.Errorf("edge: %w", err)
	}
	agentPath, err := findAgent(*agent)
	if err != nil {
		return err
	}
	log := lf.logger()
	store, err := image.OpenStore(*images)
	if err != nil {
		return err
	}
	store.SetLogger(log)
	opts := map[string]map[string]string{}
	for _, b := range strings.Split(*backends, ",") {
		if b = strings.TrimSpace(b); b != "" {
			opts[b] = bf.options(b)
		}
	}
	bs, err := registry().Open(ctx, microvm.WithRootStore(opts, store.VMRootDir()), filepath.Join(*stateDir, "backends"), log)
	if err != nil {
		return err
	}
	cfg := edge.ServeConfig{
		Config: edge.Config{StateDir: *stateDir, AgentPath: agentPath, RunBase: *runBase, CPUOvercommit: *cpuOver, MemoryOvercommit: *memOver, MaxSandboxes: *maxSandboxes, DiskOvercommit: *diskOver, DiskLedgerDir: *diskLedger, LayerCacheLimit: *cacheLimit << 20, Pools: pools, PeerTLS: ident.ClientConfig()},
		// Other edges pull exported snapshots (cross-node fork and restore).
		Listen: *listen, TLS: ident.ServerConfig(pki.RoleAPIServer, pki.RoleWatcher, pki.RoleEdge),
	}
	if *sandboxNet {
		if cfg.Network, err = networkConfig(*subnet, *dnsUpstream, *allowClosed); err != nil {
			return err
		}
	}
	reg, err := serveMetrics(ctx, *metricsListen, log)
	if err != nil {
		return err
	}
	return edge.Serve(ctx, cfg, edge.Deps{Store: store, Backends: bs, Log: log.With(logging.Component, "edge"), Metrics: reg})
}

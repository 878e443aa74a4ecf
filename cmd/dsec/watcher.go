package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/watcher"
)

// cmdWatcher runs a watcher alone: it polls every edge and serves the
// aggregate to the apiservers (dsec apiserver --watcher).
func cmdWatcher(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("watcher", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:7090", "address the apiservers reach")
	edges := fs.String("edges", "", "comma-separated edge addresses (host:port) to poll (required)")
	interval := fs.Duration("interval", 0, "poll interval (default 1s)")
	tf := addTLSFlags(fs, "this watcher's certificate (dsec ca issue --role watcher)")
	lf := addLogFlags(fs)
	metricsListen := addMetricsFlag(fs)
	fs.Parse(args)
	if *edges == "" {
		return fmt.Errorf("watcher: --edges: required")
	}
	ident, err := tf.identity(pki.RoleWatcher)
	if err != nil {
		return fmt.Errorf("watcher: %w", err)
	}
	cfg := watcher.ServeConfig{
		Config: watcher.Config{Edges: splitList(*edges), Interval: *interval},
		Listen: *listen, TLS: ident.ServerConfig(pki.RoleAPIServer), EdgeTLS: ident.ClientConfig(),
	}
	log := lf.logger()
	reg, err := serveMetrics(ctx, *metricsListen, log)
	if err != nil {
		return err
	}
	cfg.Metrics = reg
	return watcher.Serve(ctx, cfg, log)
}

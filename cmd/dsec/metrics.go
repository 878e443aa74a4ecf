package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/opendsec/opendsec/internal/metrics"
)

// addMetricsFlag adds --metrics-listen to a daemon's flags.
func addMetricsFlag(fs *flag.FlagSet) *string {
	return fs.String("metrics-listen", "", "address serving the process's Prometheus metrics at /metrics (plain HTTP; empty: none)")
}

// serveMetrics serves a new registry at addr until ctx ends and returns it
// for the daemon's components; with no address it returns nil (metrics
// made but served nowhere).
func serveMetrics(ctx context.Context, addr string, log *slog.Logger) (prometheus.Registerer, error) {
	if addr == "" {
		return nil, nil
	}
	reg := metrics.NewRegistry()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics.Handler(reg))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("metrics server stopped", "err", err)
		}
	}()
	go func() {
		<-ctx.Done()
		srv.Close() //nolint:errcheck // shutting down
	}()
	log.Info("metrics served", "url", "http://"+ln.Addr().String()+"/metrics")
	return reg, nil
}

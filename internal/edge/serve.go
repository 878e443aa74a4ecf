package edge

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/version"
)

// ServeConfig runs an edge as its own daemon (dsec edge).
type ServeConfig struct {
	Config
	// Listen is the address apiservers and watchers reach (host:port).
	Listen string
	// TLS is the server side of mutual TLS: the edge's certificate, and
	// the roles that may call it.
	TLS *tls.Config
	// Ready, if set, is called with the listening address.
	Ready func(addr string)
}

// Serve runs an edge until ctx ends. Its sandboxes keep running after it
// stops (or is killed); the next start re-attaches them.
func Serve(ctx context.Context, cfg ServeConfig, deps Deps) error {
	if cfg.TLS == nil {
		return errors.New("edge: mutual TLS is required (--ca, --cert, --key)")
	}
	e, err := New(ctx, cfg.Config, deps)
	if err != nil {
		return err
	}
	defer e.Close()
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("edge: listen %s: %w", cfg.Listen, err)
	}
	srv := &http.Server{Handler: e.Handler(), TLSConfig: cfg.TLS, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.ServeTLS(ln, "", "") }()
	usable, unusable := e.BackendNames()
	e.log.Info("edge up", logging.NodeID, e.Node(), "version", version.Version, "addr", ln.Addr().String(), "backends", usable, "unavailable", unusable)
	if cfg.Ready != nil {
		cfg.Ready(ln.Addr().String())
	}
	select {
	case <-ctx.Done():
	case err := <-served:
		return fmt.Errorf("edge: serve: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	srv.Shutdown(sctx) //nolint:errcheck // best effort at shutdown
	return nil
}

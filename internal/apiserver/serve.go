package apiserver

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/version"
	"github.com/opendsec/opendsec/internal/watcher"
	"github.com/prometheus/client_golang/prometheus"
)

// ServeConfig runs an apiserver as its own daemon (dsec apiserver). It
// reads IAM from its own non-voting replica, which sends writes to the
// leader, and keeps a watcher's view of the edges.
type ServeConfig struct {
	Config
	// Listen is the client API address.
	Listen string
	// TLS, if set, serves the client API over TLS (API keys on top).
	TLS *tls.Config
	// Edges are the edges' addresses; EdgeTLS the client side of mutual
	// TLS to them.
	Edges   []string
	EdgeTLS *tls.Config
	// IAM is the replica's configuration (Dir, NodeID, Bind, TLS);
	// IAMPeers are voters to join through on its first start.
	IAM      iam.Config
	IAMPeers []string
	// ImageStore is the shared image directory.
	ImageStore string
	// WatchInterval is the watcher's poll interval (default 1 s).
	WatchInterval time.Duration
	// Watchers are watcher daemons to read the view from (over EdgeTLS's
	// certificate); empty: this apiserver polls the edges itself. With
	// watchers it still polls the edges when none has answered for 3
	// intervals.
	Watchers []string
	// Ready, if set, is called with the API's URL.
	Ready func(url string)
	// Metrics registers the apiserver's metrics, its IAM read replica's
	// and its watcher's (nil: none).
	Metrics prometheus.Registerer
}

// Serve runs an apiserver until ctx ends.
func Serve(ctx context.Context, cfg ServeConfig, log *slog.Logger) error {
	log = logging.OrDiscard(log)
	if len(cfg.Edges) == 0 || cfg.EdgeTLS == nil {
		return errors.New("apiserver: --edges and mutual TLS to them are required")
	}
	store, err := image.OpenStore(cfg.ImageStore)
	if err != nil {
		return err
	}
	store.SetLogger(log.With(logging.Component, "images"))
	rep, err := iam.Open(cfg.IAM, log)
	if err != nil {
		return err
	}
	defer rep.Close()
	if err := rep.JoinVia(ctx, cfg.IAMPeers, false); err != nil {
		return err
	}
	wait, cancel := context.WithTimeout(ctx, time.Minute)
	err = rep.CatchUp(wait, 0)
	cancel()
	if err != nil {
		return err
	}
	pool := edgeclient.NewPool(cfg.EdgeTLS)
	w := watcher.New(watcher.Config{Edges: cfg.Edges, Interval: cfg.WatchInterval}, pool, log)
	w.Poll(ctx)
	var view watcher.Source = w
	if len(cfg.Watchers) > 0 {
		r := watcher.NewRemote(watcher.RemoteConfig{Watchers: cfg.Watchers, TLS: cfg.EdgeTLS, Local: w, Interval: cfg.WatchInterval}, log)
		r.Fetch(ctx)
		go r.Run(ctx)
		view = r
	} else {
		go w.Run(ctx)
	}
	if cfg.Metrics != nil {
		cfg.Metrics.MustRegister(iam.Collector(rep), watcher.Collector(w))
	}
	s := New(cfg.Config, Deps{IAM: rep, Watcher: view, Edges: pool, Images: store, Log: log, Metrics: cfg.Metrics})
	go s.Run(ctx)
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("apiserver: listen %s: %w", cfg.Listen, err)
	}
	var protos http.Protocols
	protos.SetHTTP1(true)
	scheme := "https"
	if cfg.TLS == nil {
		protos.SetUnencryptedHTTP2(true)
		scheme = "http"
	} else {
		protos.SetHTTP2(true)
	}
	srv := &http.Server{Handler: s.Handler(), Protocols: &protos, TLSConfig: cfg.TLS, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() {
		if cfg.TLS != nil {
			served <- srv.ServeTLS(ln, "", "")
			return
		}
		served <- srv.Serve(ln)
	}()
	url := scheme + "://" + ln.Addr().String()
	log.Info("apiserver up", "version", version.Version, "url", url, "edges", len(cfg.Edges), "healthy", len(view.View().Healthy()), "watchers", cfg.Watchers, "iam_replica", rep.Addr())
	if cfg.Ready != nil {
		cfg.Ready(url)
	}
	select {
	case <-ctx.Done():
	case err := <-served:
		return fmt.Errorf("apiserver: serve: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	srv.Shutdown(sctx) //nolint:errcheck // best effort at shutdown
	return nil
}

package watcher

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	watcherv1 "github.com/opendsec/opendsec/api/gen/opendsec/watcher/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/watcher/v1/watcherv1connect"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/rpcopts"
	"github.com/opendsec/opendsec/internal/version"
	"github.com/prometheus/client_golang/prometheus"
)

// ServeConfig runs a watcher as its own daemon (dsec watcher).
type ServeConfig struct {
	Config
	// Listen is the address apiservers reach (host:port).
	Listen string
	// TLS is the server side of mutual TLS (apiservers may call);
	// EdgeTLS the client side towards the edges.
	TLS, EdgeTLS *tls.Config
	// Ready, if set, is called with the listening address.
	Ready func(addr string)
	// Metrics registers the watcher's metrics (nil: none).
	Metrics prometheus.Registerer
}

// Serve polls the edges and serves the view until ctx ends. It keeps
// nothing on disk: after a restart the first round of polls rebuilds it.
func Serve(ctx context.Context, cfg ServeConfig, log *slog.Logger) error {
	if cfg.TLS == nil || cfg.EdgeTLS == nil {
		return errors.New("watcher: mutual TLS is required (--ca, --cert, --key)")
	}
	if len(cfg.Edges) == 0 {
		return errors.New("watcher: --edges: at least one edge address is required")
	}
	w := New(cfg.Config, edgeclient.NewPool(cfg.EdgeTLS), log)
	if cfg.Metrics != nil {
		cfg.Metrics.MustRegister(Collector(w))
	}
	w.Poll(ctx)
	go w.Run(ctx)
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("watcher: listen %s: %w", cfg.Listen, err)
	}
	srv := &http.Server{Handler: Handler(w), TLSConfig: cfg.TLS, ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.ServeTLS(ln, "", "") }()
	w.log.Info("watcher up", "version", version.Version, "addr", ln.Addr().String(), "edges", len(cfg.Edges), "healthy", len(w.View().Healthy()))
	if cfg.Ready != nil {
		cfg.Ready(ln.Addr().String())
	}
	select {
	case <-ctx.Done():
	case err := <-served:
		return fmt.Errorf("watcher: serve: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	srv.Shutdown(sctx) //nolint:errcheck // best effort at shutdown
	return nil
}

// Handler serves WatcherService from w's view.
func Handler(w *Watcher) http.Handler {
	mux := http.NewServeMux()
	mux.Handle(watcherv1connect.NewWatcherServiceHandler(viewServer{w}, rpcopts.Handler(connect.WithInterceptors(errdefs.Interceptor()))...))
	return mux
}

type viewServer struct{ w *Watcher }

func (s viewServer) GetView(ctx context.Context, _ *connect.Request[watcherv1.GetViewRequest]) (*connect.Response[watcherv1.GetViewResponse], error) {
	return connect.NewResponse(&watcherv1.GetViewResponse{Nodes: ViewToProto(s.w.View())}), nil
}

// ViewToProto is a view on the wire.
func ViewToProto(v *View) []*watcherv1.NodeView {
	out := make([]*watcherv1.NodeView, 0, len(v.Nodes))
	for _, n := range v.Nodes {
		nv := &watcherv1.NodeView{NodeId: n.ID, Addr: n.Addr, Healthy: n.Healthy, Error: n.Err, PolledAt: timestamppb.New(n.PolledAt), Status: n.Status}
		if !n.UnhealthySince.IsZero() {
			nv.UnhealthySince = timestamppb.New(n.UnhealthySince)
		}
		out = append(out, nv)
	}
	return out
}

// ViewFromProto is a view read from a watcher. Nodes without an id (never
// reached) are left out, as a local poll leaves them.
func ViewFromProto(nodes []*watcherv1.NodeView) *View {
	v := &View{byID: map[string]*NodeView{}}
	for _, n := range nodes {
		if n.NodeId == "" || v.byID[n.NodeId] != nil {
			continue
		}
		nv := &NodeView{ID: n.NodeId, Addr: n.Addr, Healthy: n.Healthy, Err: n.Error, PolledAt: n.PolledAt.AsTime(), Status: n.Status}
		if n.UnhealthySince != nil {
			nv.UnhealthySince = n.UnhealthySince.AsTime()
		}
		v.Nodes = append(v.Nodes, nv)
		v.byID[nv.ID] = nv
	}
	return v
}

// Package apiserver is the only path from clients to sandboxes [paper]. It
// authenticates every call through IAM, checks quotas, places new sandboxes,
// and routes everything else to the edge encoded in the sandbox id. It keeps
// no per-sandbox state, so any number of copies can run side by side.
package apiserver

import (
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/api/gen/opendsec/iam/v1/iamv1connect"
	"github.com/opendsec/opendsec/api/gen/opendsec/image/v1/imagev1connect"
	"github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1/sandboxv1connect"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/metrics"
	"github.com/opendsec/opendsec/internal/rpcopts"
	"github.com/opendsec/opendsec/internal/sandboxspec"
	"github.com/opendsec/opendsec/internal/watcher"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures an apiserver.
type Config struct {
	// Limits bound requests; the node-capacity maxima come from the view.
	Limits sandboxspec.Limits
	// K is the power-of-k sample size.
	K int
	// MaxTries is how many nodes a create tries before giving up.
	MaxTries int
	// Registries is how image pulls and pushes reach registries.
	Registries RegistryConfig
	// PoolSyncEvery is how often the nodes' pools are brought to the
	// cluster's settings (0: DefaultPoolSyncEvery; poolsync.go).
	PoolSyncEvery time.Duration
}

// EdgeDialer hands out the connection to an edge by its address
// (*edgeclient.Pool; an in-memory edge in tests, edgeclient/edgefake).
type EdgeDialer interface {
	Get(addr string) *edgeclient.Conn
}

var _ EdgeDialer = (*edgeclient.Pool)(nil)

// Deps are the apiserver's collaborators.
type Deps struct {
	IAM     *iam.Service
	Watcher watcher.Source
	Edges   EdgeDialer
	Images  *image.Store
	Log     *slog.Logger
	// Metrics registers the apiserver's Prometheus metrics (nil: none).
	Metrics prometheus.Registerer
}

// Server serves the client-facing API.
type Server struct {
	cfg      Config
	iam      *iam.Service
	watcher  watcher.Source
	edges    EdgeDialer
	images   *image.Store
	log      *slog.Logger
	inflight *inflight
	// storageHolds are the imports and snapshots under way (storage.go).
	storageHolds *storageHolds
	rpcStats     *metrics.RPC
	placeStats   *placeStats

	// missingSince is when each node of the view was first seen
	// unreachable; only the reconciler (Run) touches it.
	missingSince map[string]time.Time
	// pools is the pool reconciler's memory (poolsync.go).
	pools poolSync

	rngMu sync.Mutex
	rng   *rand.Rand // guarded by rngMu
}

// New returns a server.
func New(cfg Config, deps Deps) *Server {
	if cfg.Limits.MaxCPUCores == 0 {
		cfg.Limits = sandboxspec.DefaultLimits()
	}
	if cfg.MaxTries == 0 {
		cfg.MaxTries = 3
	}
	if cfg.PoolSyncEvery <= 0 {
		cfg.PoolSyncEvery = DefaultPoolSyncEvery
	}
	return &Server{
		cfg: cfg, iam: deps.IAM, watcher: deps.Watcher, edges: deps.Edges, images: deps.Images,
		log: logging.OrDiscard(deps.Log).With(logging.Component, "apiserver"), inflight: newInflight(), storageHolds: newStorageHolds(), missingSince: map[string]time.Time{},
		pools:      poolSync{refused: map[string]string{}, unmatched: map[string]time.Time{}},
		rng:        rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
		rpcStats:   metrics.NewRPC(deps.Metrics, "apiserver"),
		placeStats: newPlaceStats(deps.Metrics),
	}
}

// Handler serves every client-facing route.
func (s *Server) Handler() http.Handler {
	opts := rpcopts.Handler(
		connect.WithInterceptors(s.rpcStats.Interceptor(), faultInterceptor{}, authInterceptor{s}, errdefs.Interceptor()),
		connect.WithReadMaxBytes(maxControlBytes),
	)
	mux := http.NewServeMux()
	control := func(path string, h http.Handler) { mux.Handle(path, s.authFirst(h, maxControlBytes)) }
	control(sandboxv1connect.NewSandboxServiceHandler(&sandboxService{s}, opts...))
	control(iamv1connect.NewIAMServiceHandler(&iamService{s}, opts...))
	control(imagev1connect.NewImageServiceHandler(&imageService{s}, opts...))
	mux.HandleFunc("POST /v1/images:import", s.importImage)
	ports := s.portProxy()
	mux.Handle(PortPath, ports)
	mux.Handle(strings.TrimSuffix(PortPath, "/{path...}"), ports)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok\n")) })
	proxy := s.agentProxy()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// These headers are ours to set; a client's are never trusted.
		for _, h := range headers.Internal {
			r.Header.Del(h)
		}
		if headers.IsAgentPath(r.URL.Path) {
			proxy.ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	})
}

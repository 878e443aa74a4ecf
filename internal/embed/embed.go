// Package embed runs a whole OpenDsec cluster in one process, as etcd's
// embed does: a cluster CA, one IAM replica, one edge, a watcher and an
// apiserver, with all state under one directory. `dsec up` and the
// end-to-end tests use it; the same components run alone in a cluster.
// Component-to-component traffic still goes over real mutual TLS.
package embed

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/apiserver"
	"github.com/opendsec/opendsec/internal/atomicfile"
	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/gateway/e2b"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/metrics"
	"github.com/opendsec/opendsec/internal/pki"
	"github.com/opendsec/opendsec/internal/sandboxnet"
	"github.com/opendsec/opendsec/internal/watcher"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures an all-in-one cluster.
type Config struct {
	StateDir string
	// Listen is the client API address.
	Listen string
	// ImageStore is the shared image directory; default StateDir/images.
	ImageStore string
	// Registries is how image pulls and pushes reach registries.
	Registries apiserver.RegistryConfig
	// AgentPath is the aether binary.
	AgentPath string
	// Backends to enable, with their options.
	Backends map[string]map[string]string
	// Capacity overrides the edge's capacity (zero: the host's, with
	// CPUOvercommit and MemoryOvercommit; 0 for the defaults).
	Capacity         capacity.Node
	CPUOvercommit    float64
	MemoryOvercommit float64
	// MaxSandboxes is each edge's edge.Config.MaxSandboxes.
	MaxSandboxes int64
	// DiskOvercommit is the edges' (edge.Config.DiskOvercommit).
	DiskOvercommit float64
	// RunBase is the edge's short directory for agent sockets.
	RunBase string
	// LayerCacheLimit bounds each edge's unpacked layers, in bytes
	// (edge.Config.LayerCacheLimit); 0: no limit.
	LayerCacheLimit int64
	// UnpackLayers keeps new layers without their EROFS forms, so that
	// nodes unpack them (internal/image/erofs.go).
	UnpackLayers bool
	// WarmLayers is how many empty writable layers the edge keeps ready
	// (edge.Config.WarmLayers); -1 for none.
	WarmLayers int
	// Pools are each edge's warm pools (edge.Config.Pools).
	Pools []edge.Pool
	// MetricsListen serves every component's Prometheus metrics at
	// /metrics (written into the client env as DSEC_METRICS_URL); empty
	// serves none.
	MetricsListen string
	// NoMetrics makes the components keep no metrics at all (bench/metrics
	// measures what they cost).
	NoMetrics bool
	// TLS serves the client API over TLS with a certificate of the
	// cluster's CA, which client.env names as DSEC_CA_FILE; without it the
	// API is plain HTTP (fit for loopback only).
	TLS bool
	// ClientCerts, with TLS, makes the client API require mutual TLS: a
	// client certificate of the cluster's CA, which dsec up issues for its
	// admin and client.env names (DSEC_CLIENT_CERT, DSEC_CLIENT_KEY).
	ClientCerts bool
	// GatewayListen is the E2B-compatible gateway's address; empty runs
	// no gateway.
	GatewayListen string
	// Network turns on sandbox networking on the edge (nil: sandboxes
	// have loopback only).
	Network *sandboxnet.NodeConfig
	// Gateway sets the gateway's base image, backend and default user;
	// its URL, key and secret are the cluster's.
	Gateway e2b.Config
	// Edges is how many edges run (default 1), each with its own node id,
	// state directory (StateDir/edge, then StateDir/edge-2, ...) and
	// listener: a cluster of several nodes on one machine.
	Edges int
	// EdgeCapacity, if set, gives edge i (from 1) its own capacity.
	EdgeCapacity func(i int) capacity.Node
	// WatchInterval is the watcher's poll interval (default 1 s).
	WatchInterval time.Duration
	// PoolSyncEvery is how often the apiservers bring the nodes' pools to
	// the cluster's settings (default apiserver.DefaultPoolSyncEvery).
	PoolSyncEvery time.Duration
	// PlacementK is the apiservers' power-of-k sample (default the
	// apiserver's).
	PlacementK int
	// APIServers is how many apiservers run (default 1). Each one after
	// the first listens on its own loopback port and reads IAM from its
	// own non-voting replica, whose writes (quota reservations included)
	// go to the leader over the Raft port, as in a cluster of machines.
	APIServers int
}

// DefaultListen is where `dsec up` serves clients.
const DefaultListen = "127.0.0.1:7070"

// DefaultGatewayListen is where `dsec up` serves E2B's SDKs.
const DefaultGatewayListen = "127.0.0.1:7071"

// Cluster is a running all-in-one cluster.
type Cluster struct {
	APIURL string
	// APIURLs are every apiserver's URL, APIURL first.
	APIURLs []string
	// GatewayURL is the E2B-compatible gateway, when one runs.
	GatewayURL string
	// MetricsURL serves the components' Prometheus metrics, when asked.
	MetricsURL string
	// CAFile is the cluster CA's certificate, which clients verify the
	// API's TLS with (Config.TLS; empty without).
	CAFile string
	// ClientCert and ClientKey are the admin's client certificate and key
	// (Config.ClientCerts; empty without).
	ClientCert, ClientKey string
	apiTLS                *tls.Config // the client API's, with Config.TLS
	// Metrics is the registry every component of the cluster registers on.
	Metrics *prometheus.Registry
	reg     prometheus.Registerer // Metrics, or nil with Config.NoMetrics
	// ClientEnv is the file holding DSEC_API_URL and DSEC_API_KEY (and
	// E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY with a gateway).
	ClientEnv string
	// Edge is the first of Edges.
	Edge   *edge.Edge
	Edges  []*edge.Edge
	IAM    *iam.Service
	Images *image.Store
	// Watcher is the apiservers' view of the edges (Poll refreshes it).
	Watcher *watcher.Watcher

	log     *slog.Logger
	cancel  context.CancelFunc
	servers []*http.Server
	gateway *e2b.Gateway
	readers []*iam.Service // the other apiservers' IAM replicas
}

// Start brings every component up and returns once the API answers.
func Start(ctx context.Context, cfg Config, reg *backend.Registry, log *slog.Logger) (*Cluster, error) {
	log = logging.OrDiscard(log)
	if cfg.StateDir == "" {
		return nil, errors.New("state dir: required")
	}
	if cfg.Listen == "" {
		cfg.Listen = DefaultListen
	}
	if cfg.ImageStore == "" {
		cfg.ImageStore = filepath.Join(cfg.StateDir, "images")
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return nil, err
	}
	ca, err := pki.LoadOrCreateCA(filepath.Join(cfg.StateDir, "pki"))
	if err != nil {
		return nil, err
	}
	store, err := image.OpenStore(cfg.ImageStore)
	if err != nil {
		return nil, err
	}
	store.SetLogger(log.With(logging.Component, "images"))
	store.SetEROFS(!cfg.UnpackLayers)
	runCtx, cancel := context.WithCancel(context.Background())
	c := &Cluster{Images: store, log: log, cancel: cancel, Metrics: metrics.NewRegistry()}
	if !cfg.NoMetrics {
		c.reg = c.Metrics
	}
	ok := false
	defer func() {
		if !ok {
			c.Close()
		}
	}()

	// IAM: one replica, bootstrapped on first start.
	iamCert, err := ca.Issue("iam-1", pki.RoleIAM, []string{"127.0.0.1", "localhost"})
	if err != nil {
		return nil, err
	}
	c.IAM, err = iam.Open(iam.Config{
		Dir: filepath.Join(cfg.StateDir, "iam"), NodeID: "iam-1", Bind: "127.0.0.1:0",
		ServerTLS: ca.ServerConfig(iamCert, pki.RoleIAM), ClientTLS: ca.ClientConfig(iamCert),
		Bootstrap: true, SingleNode: true,
	}, log)
	if err != nil {
		return nil, err
	}
	secret, err := c.IAM.EnsureRoot(ctx)
	if err != nil {
		return nil, err
	}

	// Edges with the enabled backends, each served over mutual TLS.
	var edgeAddrs []string
	for i := 1; i <= max(cfg.Edges, 1); i++ {
		e, addr, err := c.startEdge(ctx, i, cfg, reg, ca, store)
		if err != nil {
			return nil, fmt.Errorf("edge %d: %w", i, err)
		}
		c.Edges = append(c.Edges, e)
		edgeAddrs = append(edgeAddrs, addr)
	}
	c.Edge = c.Edges[0]

	// Watcher and apiserver share one mTLS pool to the edge.
	apiCert, err := ca.Issue("apiserver", pki.RoleAPIServer, nil)
	if err != nil {
		return nil, err
	}
	pool := edgeclient.NewPool(ca.ClientConfig(apiCert))
	w := watcher.New(watcher.Config{Edges: edgeAddrs, Interval: cfg.WatchInterval}, pool, log)
	w.Poll(ctx)
	if n := len(w.View().Healthy()); n != len(edgeAddrs) {
		return nil, fmt.Errorf("%d of %d embedded edges answered the watcher", n, len(edgeAddrs))
	}
	c.Watcher = w
	go w.Run(runCtx)
	if c.reg != nil {
		c.reg.MustRegister(watcher.Collector(w))
		metrics.Instance(c.reg, "iam-1").MustRegister(iam.Collector(c.IAM))
	}

	api := apiserver.New(apiserver.Config{K: cfg.PlacementK, Registries: cfg.Registries, PoolSyncEvery: cfg.PoolSyncEvery}, apiserver.Deps{IAM: c.IAM, Watcher: w, Edges: pool, Images: store, Log: log, Metrics: metrics.Instance(c.reg, "apiserver-1")})
	go api.Run(runCtx)
	apiLn, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", cfg.Listen, err)
	}
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	if cfg.TLS {
		protos.SetHTTP2(true)
		cert, err := ca.Issue("apiserver-public", pki.RoleAPIServer, []string{"127.0.0.1", "localhost", hostOf(apiLn.Addr().String())})
		if err != nil {
			return nil, err
		}
		c.apiTLS, c.CAFile = ca.PublicServerConfig(cert), ca.CertFile()
		if cfg.ClientCerts {
			if _, err := ca.Issue("client-admin", pki.RoleClient, nil); err != nil {
				return nil, err
			}
			c.ClientCert, c.ClientKey = ca.PairFiles("client-admin")
			// Certificates of the role client only: the components' own
			// (edges, IAM) are for their links, not the client API.
			c.apiTLS.ClientCAs, c.apiTLS.ClientAuth = ca.Pool, tls.RequireAndVerifyClientCert
			c.apiTLS.VerifyPeerCertificate = pki.RequireRole(pki.RoleClient)
		}
	} else if cfg.ClientCerts {
		return nil, errors.New("client certificates (--client-certs) need TLS (--tls)")
	} else {
		log.Info("the client API is plain HTTP: fit for loopback only (dsec up --tls serves it over TLS)", logging.Component, "embed")
	}
	apiSrv := &http.Server{Handler: api.Handler(), Protocols: &protos, TLSConfig: c.apiTLS, ReadHeaderTimeout: 10 * time.Second}
	c.APIURL = c.serveAPI(apiSrv, apiLn)
	c.APIURLs = []string{c.APIURL}
	for i := 2; i <= cfg.APIServers; i++ {
		if err := c.startAPIServer(ctx, runCtx, i, cfg, ca, w, pool, store, &protos); err != nil {
			return nil, fmt.Errorf("apiserver %d: %w", i, err)
		}
	}

	if cfg.GatewayListen != "" {
		if err := c.startGateway(ctx, cfg, ca); err != nil {
			return nil, err
		}
	}
	if cfg.MetricsListen != "" {
		ln, err := net.Listen("tcp", cfg.MetricsListen)
		if err != nil {
			return nil, fmt.Errorf("metrics: listen %s: %w", cfg.MetricsListen, err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", metrics.Handler(c.Metrics))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		c.serve(srv, func() error { return srv.Serve(ln) })
		c.MetricsURL = "http://" + ln.Addr().String() + "/metrics"
	}

	c.ClientEnv = filepath.Join(cfg.StateDir, "client.env")
	if err := c.writeClientEnv(ctx, secret); err != nil {
		return nil, err
	}
	ok = true
	return c, nil
}

func (c *Cluster) serve(srv *http.Server, run func() error) {
	c.servers = append(c.servers, srv)
	go func() {
		if err := run(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			c.log.Error("server stopped", logging.Error, err)
		}
	}()
}

// writeClientEnv writes the client settings. A new cluster's admin key goes
// there; on a restart the file is kept unless the URL changed or it is gone,
// in which case a fresh admin key is made.
func (c *Cluster) writeClientEnv(ctx context.Context, secret string) error {
	if secret == "" {
		if data, err := os.ReadFile(c.ClientEnv); err == nil {
			key := envValue(string(data), "DSEC_API_KEY")
			if _, err := c.IAM.Authenticate(key); err == nil {
				secret = key
			}
		}
	}
	if secret == "" {
		_, s, err := c.IAM.CreateKey(ctx, "root", "admin", 2, iam.FormatDsec)
		if err != nil {
			return err
		}
		secret = s
	}
	content := fmt.Sprintf("# OpenDsec client settings, written by dsec up. Source it: . %s\nexport DSEC_API_URL=%s\nexport DSEC_API_KEY=%s\n", c.ClientEnv, c.APIURL, secret)
	if c.CAFile != "" {
		content += "# The CA that signed the API's certificate:\nexport DSEC_CA_FILE=" + c.CAFile + "\n"
	}
	if c.ClientCert != "" {
		content += "# The client certificate the API requires (mutual TLS):\nexport DSEC_CLIENT_CERT=" + c.ClientCert + "\nexport DSEC_CLIENT_KEY=" + c.ClientKey + "\n"
	}
	if c.MetricsURL != "" {
		content += "# Every component's Prometheus metrics:\nexport DSEC_METRICS_URL=" + c.MetricsURL + "\n"
	}
	if c.GatewayURL != "" {
		key, err := c.keyFile(ctx, filepath.Join(filepath.Dir(c.ClientEnv), "gateway", "e2b-user.key"), "e2b", iam.FormatE2B)
		if err != nil {
			return err
		}
		content += fmt.Sprintf("# E2B's SDKs, through the gateway:\nexport E2B_API_URL=%s\nexport E2B_SANDBOX_URL=%s\nexport E2B_API_KEY=%s\n", c.GatewayURL, c.GatewayURL, key)
	}
	// Scripts and tests wait for the file to appear, then read it.
	return atomicfile.Write(c.ClientEnv, []byte(content), 0o600)
}

func envValue(content, name string) string {
	for _, line := range strings.Split(content, "\n") {
		line = strings.TrimPrefix(strings.TrimSpace(line), "export ")
		if v, ok := strings.CutPrefix(line, name+"="); ok {
			return strings.Trim(v, `"'`)
		}
	}
	return ""
}

// Close stops the components. Sandboxes keep running; the next Start
// re-attaches them.
func (c *Cluster) Close() {
	c.cancel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for i := len(c.servers) - 1; i >= 0; i-- {
		c.servers[i].Shutdown(ctx) //nolint:errcheck // best effort at shutdown
	}
	if c.gateway != nil {
		c.gateway.Close()
	}
	for _, e := range c.Edges {
		e.Close()
	}
	for _, r := range c.readers {
		r.Close()
	}
	if c.IAM != nil {
		c.IAM.Close()
	}
}

// serveAPI serves an apiserver on ln, over TLS if the cluster has it, and
// returns its URL.
func (c *Cluster) serveAPI(srv *http.Server, ln net.Listener) string {
	if c.apiTLS != nil {
		c.serve(srv, func() error { return srv.ServeTLS(ln, "", "") })
		return "https://" + ln.Addr().String()
	}
	c.serve(srv, func() error { return srv.Serve(ln) })
	return "http://" + ln.Addr().String()
}

// hostOf is the host of a "host:port" address.
func hostOf(addr string) string {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return h
}

// Package e2b is the E2B-compatible gateway [ours]: programs written for
// E2B's SDKs run against OpenDsec after setting E2B_API_URL, E2B_SANDBOX_URL
// and E2B_API_KEY to the gateway. It serves E2B's control-plane REST API and
// envd's protocol (the process and filesystem Connect services and the
// /files and /health routes) on one port, and is only a client of our own
// public API: control-plane calls carry the caller's API key (IAM accepts
// keys in E2B's "e2b_" format), sandbox calls are authorised by envd access
// tokens the gateway signs and made with the gateway's own service key.
// It keeps no state but the polling file watchers of the calls in flight.
package e2b

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/api/gen/opendsec/iam/v1/iamv1connect"
	"github.com/opendsec/opendsec/api/gen/opendsec/image/v1/imagev1connect"
	"github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1/sandboxv1connect"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/rpcopts"
	"github.com/prometheus/client_golang/prometheus"
)

// Config configures a gateway.
type Config struct {
	// APIURL is our apiserver.
	APIURL string
	// APICAFile, if set, is a CA (PEM) the apiserver's TLS certificate is
	// verified against, besides the system's.
	APICAFile string
	// APIClientCert and APIClientKey, if set, are the certificate (PEM)
	// the gateway presents to an apiserver that requires mutual TLS.
	APIClientCert, APIClientKey string
	// ServiceKey is the gateway's own API key (an ADMIN key of the root
	// project), used for calls inside sandboxes after an access token check.
	ServiceKey string
	// TokenSecret signs envd access tokens.
	TokenSecret []byte
	// BaseImage is what the template "base" means.
	BaseImage string
	// CodeInterpreterImage is what the template "code-interpreter-v1" (E2B's
	// Code Interpreter SDKs' default) means: an image whose service
	// speaks their protocol on port 49999.
	CodeInterpreterImage string
	// Backend runs E2B sandboxes (gvisor: pause and fork work).
	Backend string
	// DefaultUser runs commands and owns files when the SDK names none.
	DefaultUser string
	// Domain is what create answers as the sandbox domain: E2B's SDKs
	// reach port P of sandbox ID at host "P-ID.Domain" (getHost), which
	// the gateway serves. Empty: the SDK's own default (E2B_DOMAIN).
	Domain string
	// TemplateDir keeps the files E2B's template builds upload (default:
	// a directory of the system's temporary directory).
	TemplateDir string
	// BuildBackend runs template builds' steps: one whose sandboxes can be
	// committed (default container).
	BuildBackend string
	// MaxUpload bounds one uploaded file set of a template build (default
	// 4 GiB).
	MaxUpload int64
	// Metrics registers the gateway's Prometheus metrics (nil: none).
	Metrics prometheus.Registerer
}

// EnvdVersion is the envd version the gateway reports. The SDKs turn
// features on by it; 0.6.4 is default user, stdin, close-stdin,
// octet-stream uploads, watch events with entry info and watches that
// allow network mounts, and file metadata (0.6.2).
const EnvdVersion = "0.6.4"

// clientID is the constant E2B reports for every sandbox's client.
const clientID = "opendsec"

// Gateway serves E2B's APIs.
type Gateway struct {
	cfg      Config
	log      *slog.Logger
	sandbox  sandboxv1connect.SandboxServiceClient
	process  agentv1connect.ProcessServiceClient
	files    agentv1connect.FilesystemServiceClient
	agent    agentv1connect.AgentServiceClient
	iam      iamv1connect.IAMServiceClient
	images   imagev1connect.ImageServiceClient
	watchers *watchers
	creating keyLocks // per caller and Idempotency-Key
	builds   *templateBuilds
	stats    *gatewayStats

	// ctx ends with Close: template builds run under it.
	ctx    context.Context
	cancel context.CancelFunc

	mu       sync.Mutex
	projects map[string]knownProject // by the hash of an API key
	swept    time.Time               // uploads, last
}

// New returns a gateway talking to the apiserver at cfg.APIURL.
func New(cfg Config, log *slog.Logger) (*Gateway, error) {
	if cfg.APIURL == "" || cfg.ServiceKey == "" || len(cfg.TokenSecret) < 16 {
		return nil, errors.New("gateway: APIURL, ServiceKey and a TokenSecret of at least 16 bytes are required")
	}
	if cfg.BaseImage == "" {
		cfg.BaseImage = "root/py:3.11"
	}
	if cfg.CodeInterpreterImage == "" {
		cfg.CodeInterpreterImage = "root/code-interpreter:latest"
	}
	if cfg.Backend == "" {
		cfg.Backend = "gvisor"
	}
	if cfg.DefaultUser == "" {
		cfg.DefaultUser = "user"
	}
	if cfg.TemplateDir == "" {
		cfg.TemplateDir = filepath.Join(os.TempDir(), "dsec-e2b-templates")
	}
	if err := privateDir(cfg.TemplateDir); err != nil {
		return nil, fmt.Errorf("gateway: template uploads: %w", err)
	}
	if cfg.BuildBackend == "" {
		cfg.BuildBackend = "container"
	}
	if cfg.MaxUpload == 0 {
		cfg.MaxUpload = 4 << 30
	}
	// HTTP/2 to the apiserver: with prior knowledge over plain HTTP, by
	// ALPN over TLS.
	var protos http.Protocols
	if strings.HasPrefix(cfg.APIURL, "http://") {
		protos.SetUnencryptedHTTP2(true)
	} else {
		protos.SetHTTP1(true)
		protos.SetHTTP2(true)
	}
	tlsConfig, err := cfg.apiTLS().Config()
	if err != nil {
		return nil, fmt.Errorf("gateway: the link to the apiserver: %w", err)
	}
	if tlsConfig == nil {
		tlsConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	tr := &http.Transport{
		TLSClientConfig:     tlsConfig,
		Protocols:           &protos,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 64,
		HTTP2:               &http.HTTP2Config{MaxConcurrentStreams: 1000},
	}
	hc := &http.Client{Transport: &callerTransport{next: tr, serviceKey: cfg.ServiceKey}}
	base := strings.TrimRight(cfg.APIURL, "/")
	ctx, cancel := context.WithCancel(context.Background())
	return &Gateway{
		ctx: ctx, cancel: cancel, builds: newTemplateBuilds(), projects: map[string]knownProject{}, stats: newGatewayStats(cfg.Metrics),
		iam:    iamv1connect.NewIAMServiceClient(hc, base),
		images: imagev1connect.NewImageServiceClient(hc, base),
		cfg:    cfg, log: logging.OrDiscard(log).With(logging.Component, "gateway"),
		sandbox:  sandboxv1connect.NewSandboxServiceClient(hc, base),
		process:  agentv1connect.NewProcessServiceClient(hc, base),
		files:    agentv1connect.NewFilesystemServiceClient(hc, base),
		agent:    agentv1connect.NewAgentServiceClient(hc, base),
		watchers: newWatchers(),
	}, nil
}

// Handler serves both APIs: a request naming a sandbox in E2b-Sandbox-Id is
// for envd, anything else for the control plane.
func (g *Gateway) Handler() http.Handler {
	ports := g.portProxy()
	control := g.controlMux()
	envd := g.envdMux(ports)
	stats := g.stats
	if stats == nil {
		stats = newGatewayStats(nil)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if port, id, ok := parseSandboxHost(r.Host); ok {
			stats.count(w, r, "sandbox host", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ports(w, r, port, id) }))
			return
		}
		if err := checkText(r); err != nil {
			writeError(w, err)
			return
		}
		if r.Header.Get("E2b-Sandbox-Id") == "" && isSigned(r) {
			// A signed file URL through E2B_SANDBOX_URL names no sandbox.
			id, err := g.sandboxBySignature(r.Context(), r)
			if err != nil {
				writeError(w, err)
				return
			}
			r.Header.Set("E2b-Sandbox-Id", id)
		}
		if r.Header.Get("E2b-Sandbox-Id") != "" {
			stats.count(w, r, "envd", envd)
			return
		}
		stats.count(w, r, "", control)
	})
}

// checkText refuses a request whose query or E2B headers are not UTF-8:
// they become protobuf strings, which must be.
func checkText(r *http.Request) error {
	for k, vs := range r.URL.Query() {
		for _, v := range append(vs, k) {
			if !utf8.ValidString(v) {
				return errdefs.InvalidArgument("query parameter %q: not UTF-8", strings.ToValidUTF8(k, "?"))
			}
		}
	}
	for _, h := range []string{"E2b-Sandbox-Id", "Idempotency-Key", "Authorization", "X-API-Key", "X-Access-Token"} {
		if !utf8.ValidString(r.Header.Get(h)) {
			return errdefs.InvalidArgument("header %s: not UTF-8", h)
		}
	}
	return nil
}

// Close stops background work (polling watchers, template builds).
func (g *Gateway) Close() {
	g.cancel()
	g.watchers.closeAll()
}

// The caller of an outgoing call travels in its context: the user's key
// for control-plane calls, or the service key and a sandbox id for calls
// inside a sandbox.
type callerKey struct{}

type caller struct {
	apiKey  string
	sandbox string
}

func asUser(ctx context.Context, apiKey string) context.Context {
	return context.WithValue(ctx, callerKey{}, caller{apiKey: apiKey})
}

func inSandbox(ctx context.Context, sandboxID string) context.Context {
	return context.WithValue(ctx, callerKey{}, caller{sandbox: sandboxID})
}

type callerTransport struct {
	next       http.RoundTripper
	serviceKey string
}

func (t *callerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c, _ := r.Context().Value(callerKey{}).(caller)
	r = r.Clone(r.Context())
	if c.sandbox != "" {
		r.Header.Set("Authorization", "Bearer "+t.serviceKey)
		r.Header.Set(headers.SandboxID, c.sandbox)
	} else {
		r.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	return t.next.RoundTrip(r)
}

// accessToken is the envd access token of a sandbox: an HMAC of its id, so
// it is the same before and after a pause, and needs no storage.
func (g *Gateway) accessToken(sandboxID string) string {
	m := hmac.New(sha256.New, g.cfg.TokenSecret)
	m.Write([]byte("envd-access/" + sandboxID))
	return hex.EncodeToString(m.Sum(nil))
}

func (g *Gateway) validToken(sandboxID, token string) bool {
	return subtle.ConstantTimeCompare([]byte(g.accessToken(sandboxID)), []byte(token)) == 1
}

// envdMaxMessage bounds one message of the envd services.
const envdMaxMessage = 24 << 20

// connectOpts are the handler options of the envd services.
func connectOpts() []connect.HandlerOption {
	return rpcopts.Handler(connect.WithReadMaxBytes(envdMaxMessage))
}

// privateDir makes dir (mode 0700) unless it is there, and refuses one
// that another user could read or change: uploaded files are tenants'
// sources, and a build trusts what it finds there.
func privateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return fmt.Errorf("%s is not a directory (a symlink?)", dir)
	case !ok || int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s belongs to another user", dir)
	case fi.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("%s is open to other users (mode %o; want 0700)", dir, fi.Mode().Perm())
	}
	return nil
}

// apiTLS names the files of the gateway's TLS to the apiserver.
func (c Config) apiTLS() client.TLSFiles {
	return client.TLSFiles{CA: c.APICAFile, Cert: c.APIClientCert, Key: c.APIClientKey}
}

// Package client is the Go client of OpenDsec: the same API as the Python
// SDK, for Go programs and for the dsec command line.
//
//	c, err := client.FromEnv() // DSEC_API_URL, DSEC_API_KEY
//	sb, err := c.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/py:3.11"})
//	out, err := sb.Shell(ctx, "python3 -c 'print(6*7)'")
package client

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/api/gen/opendsec/iam/v1/iamv1connect"
	"github.com/opendsec/opendsec/api/gen/opendsec/image/v1/imagev1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1/sandboxv1connect"
)

// Client talks to an apiserver.
type Client struct {
	URL       string
	key       string
	tlsConf   *tls.Config // the TLS its calls use (nil: the system's roots, no client certificate)
	http      *http.Client
	Sandboxes sandboxv1connect.SandboxServiceClient
	IAM       iamv1connect.IAMServiceClient
	Images    imagev1connect.ImageServiceClient
	// CreateWait bounds how long Create sends a create again while the
	// answers say to (a fleet with no room now, an apiserver that died);
	// 0 is a minute.
	CreateWait time.Duration
	// OnCreateRetry, when set, hears each such answer and the pause
	// before the next attempt (the CLI prints it).
	OnCreateRetry func(err error, pause time.Duration)
}

// New returns a client for the apiserver at url, or the apiservers at a
// comma-separated list of URLs (it fails over between them), using API key
// key.
func New(rawURL, key string) (*Client, error) { return newClient(rawURL, key, nil) }

// newClient is New with TLS configured as conf (nil: the system's roots).
func newClient(rawURL, key string, conf *tls.Config) (*Client, error) {
	endpoints, err := parseEndpoints(rawURL)
	if err != nil {
		return nil, err
	}
	if key == "" {
		return nil, errors.New("client: no API key (set DSEC_API_KEY)")
	}
	base := endpoints[0].String()
	hc := &http.Client{Transport: authTransport{key: key, next: &failover{endpoints: endpoints, next: withCertHint(endpoints[0].Scheme, conf, transportFor(endpoints[0].Scheme, conf))}}}
	return &Client{
		URL: base, key: key, http: hc, tlsConf: conf,
		Sandboxes: sandboxv1connect.NewSandboxServiceClient(hc, base),
		IAM:       iamv1connect.NewIAMServiceClient(hc, base),
		Images:    imagev1connect.NewImageServiceClient(hc, base),
	}, nil
}

// FromEnv builds a client from DSEC_API_URL and DSEC_API_KEY, trusting
// DSEC_CA_FILE's CA too when it is set (a cluster's own CA, which
// `dsec up --tls` writes there) and presenting DSEC_CLIENT_CERT (with
// DSEC_CLIENT_KEY) to apiservers that require mutual TLS.
func FromEnv() (*Client, error) {
	u := os.Getenv("DSEC_API_URL")
	if u == "" {
		return nil, errors.New("client: DSEC_API_URL is not set (source the client.env that dsec up wrote)")
	}
	return NewWithTLS(u, os.Getenv("DSEC_API_KEY"), TLSFilesFromEnv())
}

// NewWithCA is New for apiservers whose certificates the CA in caFile (PEM)
// signed, besides the system's.
func NewWithCA(rawURL, key, caFile string) (*Client, error) {
	return NewWithTLS(rawURL, key, TLSFiles{CA: caFile})
}

// transportFor speaks HTTP/2: with prior knowledge over plain HTTP, by ALPN
// over TLS.
func transportFor(scheme string, conf *tls.Config) http.RoundTripper {
	var protos http.Protocols
	if scheme == "http" {
		protos.SetUnencryptedHTTP2(true)
	} else {
		protos.SetHTTP1(true)
		protos.SetHTTP2(true)
	}
	if conf == nil {
		conf = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	return &http.Transport{
		Protocols:           &protos,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		TLSClientConfig:     conf.Clone(),
		MaxIdleConnsPerHost: 16,
		HTTP2:               &http.HTTP2Config{MaxConcurrentStreams: 1000},
	}
}

type authTransport struct {
	key     string
	sandbox string
	next    http.RoundTripper
}

func (a authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+a.key)
	if a.sandbox != "" {
		r.Header.Set("Dsec-Sandbox-Id", a.sandbox)
	}
	return a.next.RoundTrip(r)
}

// Sandbox is a handle on one sandbox's agent.
type Sandbox struct {
	ID       string
	Info     *sandboxv1.Sandbox
	c        *Client
	Process  agentv1connect.ProcessServiceClient
	Files    agentv1connect.FilesystemServiceClient
	Sessions agentv1connect.SessionServiceClient
	Agent    agentv1connect.AgentServiceClient
}

// Sandbox returns a handle on an existing sandbox.
func (c *Client) Sandbox(id string) *Sandbox {
	at := c.http.Transport.(authTransport)
	at.sandbox = id
	hc := &http.Client{Transport: at}
	return &Sandbox{
		ID: id, c: c,
		Process:  agentv1connect.NewProcessServiceClient(hc, c.URL),
		Files:    agentv1connect.NewFilesystemServiceClient(hc, c.URL),
		Sessions: agentv1connect.NewSessionServiceClient(hc, c.URL),
		Agent:    agentv1connect.NewAgentServiceClient(hc, c.URL),
	}
}

// Create starts a sandbox and returns its handle once its agent answers.
func (c *Client) Create(ctx context.Context, spec *sandboxv1.SandboxSpec) (*Sandbox, error) {
	// The same key on every attempt: a retry (after a broken connection,
	// or an answer marked retryable, such as a key being taken over from
	// an apiserver that died) answers with the sandbox an earlier attempt
	// made, or makes one if none did.
	key := newIdempotencyKey()
	var resp *connect.Response[sandboxv1.CreateSandboxResponse]
	var err error
	deadline := time.Now().Add(c.createWait())
	for pause := 200 * time.Millisecond; ; pause = min(2*pause, 2*time.Second) {
		req := connect.NewRequest(&sandboxv1.CreateSandboxRequest{Spec: spec})
		req.Header().Set(IdempotencyHeader, key)
		resp, err = c.Sandboxes.CreateSandbox(ctx, req)
		if err == nil || !retryable(err) {
			break
		}
		wait := pause
		if after, ok := retryAfter(err); ok {
			wait = spread(after)
		}
		if time.Now().Add(wait).After(deadline) {
			break
		}
		if c.OnCreateRetry != nil {
			c.OnCreateRetry(err, wait)
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(wait):
		}
	}
	if err != nil {
		return nil, err
	}
	sb := c.Sandbox(resp.Msg.Sandbox.Id)
	sb.Info = resp.Msg.Sandbox
	return sb, nil
}

// createRetry is how long Create tries again while it gets retryable
// answers, unless Client.CreateWait says otherwise.
const createRetry = time.Minute

func (c *Client) createWait() time.Duration {
	if c.CreateWait > 0 {
		return c.CreateWait
	}
	return createRetry
}

// retryAfter is the pause a server asked for with Retry-After (whole
// seconds): a fleet with no room for the create now.
func retryAfter(err error) (time.Duration, bool) {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return 0, false
	}
	secs, perr := strconv.Atoi(ce.Meta().Get(retryAfterHeader))
	if perr != nil || secs < 0 {
		return 0, false
	}
	return time.Duration(secs) * time.Second, true
}

// spread is d within ±25 %, so a burst's refused creates do not all come
// back in the same instant.
func spread(d time.Duration) time.Duration {
	return d*3/4 + rand.N(d/2+1)
}

// retryHeader marks a server's error as worth sending the same request
// again for (internal/errdefs.RetryHeader); retryAfterHeader says after
// how long (internal/errdefs.RetryAfterHeader).
const (
	retryHeader      = "Dsec-Retry"
	retryAfterHeader = "Retry-After"
)

// retryable reports an error the server marked so, or one that never came
// from a server (the connection failed).
func retryable(err error) bool {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return false
	}
	if !connect.IsWireError(ce) {
		return ce.Code() == connect.CodeUnavailable
	}
	return ce.Meta().Get(retryHeader) == "1"
}

// Stop stops and removes the sandbox.
func (s *Sandbox) Stop(ctx context.Context) error {
	_, err := s.c.Sandboxes.StopSandbox(ctx, connect.NewRequest(&sandboxv1.StopSandboxRequest{SandboxId: s.ID}))
	return err
}

// Run runs argv to completion.
func (s *Sandbox) Run(ctx context.Context, cfg *agentv1.ProcessConfig) (*agentv1.RunResponse, error) {
	resp, err := s.Process.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: cfg}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// Shell runs a command line with /bin/sh -c.
func (s *Sandbox) Shell(ctx context.Context, command string) (*agentv1.RunResponse, error) {
	return s.Run(ctx, &agentv1.ProcessConfig{Args: []string{"/bin/sh", "-c", command}})
}

// ImportImage uploads an image archive (OCI layout or docker save tar).
func (c *Client) ImportImage(ctx context.Context, name string, r io.Reader, size int64) (map[string]any, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.URL+"/v1/images:import?name="+url.QueryEscape(name), r)
	if err != nil {
		return nil, err
	}
	req.ContentLength = size
	req.Header.Set("Content-Type", "application/x-tar")
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return nil, fmt.Errorf("import: %s: %w", resp.Status, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("import: %v: %v", out["code"], out["message"])
	}
	return out, nil
}

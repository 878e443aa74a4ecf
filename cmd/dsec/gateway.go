package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/gateway/e2b"
)

// cmdGateway runs the E2B-compatible gateway alone, in front of any
// apiserver (dsec up runs one itself).
func cmdGateway(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("gateway", flag.ExitOnError)
	apiURL := fs.String("api-url", os.Getenv("DSEC_API_URL"), "the apiserver (default $DSEC_API_URL)")
	listen := fs.String("listen", "127.0.0.1:7071", "address E2B's SDKs reach (their E2B_API_URL and E2B_SANDBOX_URL)")
	keyFile := fs.String("service-key-file", "", "file holding the gateway's API key, an ADMIN key of the root project (required)")
	secretFile := fs.String("token-secret-file", "", "file holding the secret that signs envd access tokens; created if missing (required)")
	baseImage := fs.String("base-image", "root/py:3.11", "the image E2B's template \"base\" names")
	ciImage := fs.String("code-interpreter-image", "root/code-interpreter:latest", "the image E2B's template \"code-interpreter-v1\" names")
	backend := fs.String("backend", "gvisor", "backend of E2B sandboxes (gvisor can pause and fork)")
	user := fs.String("default-user", "user", "user that runs commands when the SDK names none")
	apiCA := fs.String("api-ca", os.Getenv("DSEC_CA_FILE"), "CA (PEM) the apiserver's TLS certificate is verified against besides the system's (default $DSEC_CA_FILE)")
	apiCert := fs.String("api-client-cert", os.Getenv("DSEC_CLIENT_CERT"), "certificate (PEM) the gateway presents to an apiserver that requires mutual TLS (default $DSEC_CLIENT_CERT)")
	apiKey := fs.String("api-client-key", os.Getenv("DSEC_CLIENT_KEY"), "the key of --api-client-cert (default $DSEC_CLIENT_KEY)")
	templateDir := fs.String("template-dir", "", "directory (0700) for the files E2B template builds upload (default: template-uploads beside the token secret file)")
	buildBackend := fs.String("build-backend", "container", "backend that runs E2B template builds' steps (one that can commit: container or microvm)")
	tlsCert := fs.String("tls-cert", "", "serve HTTPS with this certificate (PEM; it should name the gateway's host and *.DOMAIN for sandbox hosts); default plain HTTP")
	tlsKey := fs.String("tls-key", "", "the key of --tls-cert (PEM)")
	clientCA := fs.String("client-ca", "", "with --tls-cert: also require clients to present a certificate this CA (PEM) signed (mutual TLS)")
	lf := addLogFlags(fs)
	metricsListen := addMetricsFlag(fs)
	fs.Parse(args)
	if *apiURL == "" || *keyFile == "" || *secretFile == "" {
		return errors.New("gateway: --api-url (or DSEC_API_URL), --service-key-file and --token-secret-file are required")
	}
	serverTLS, err := publicTLS(*tlsCert, *tlsKey, *clientCA)
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	key, err := os.ReadFile(*keyFile)
	if err != nil {
		return fmt.Errorf("gateway: service key: %w", err)
	}
	if *templateDir == "" {
		*templateDir = filepath.Join(filepath.Dir(*secretFile), "template-uploads")
	}
	secret, err := e2b.LoadOrCreateSecret(*secretFile)
	if err != nil {
		return fmt.Errorf("gateway: token secret: %w", err)
	}
	log := lf.logger()
	reg, err := serveMetrics(ctx, *metricsListen, log)
	if err != nil {
		return err
	}
	gw, err := e2b.New(e2b.Config{
		Metrics: reg,
		APIURL:  *apiURL, ServiceKey: strings.TrimSpace(string(key)), TokenSecret: secret,
		BaseImage: *baseImage, CodeInterpreterImage: *ciImage, Backend: *backend, DefaultUser: *user,
		TemplateDir: *templateDir, BuildBackend: *buildBackend, APICAFile: *apiCA, APIClientCert: *apiCert, APIClientKey: *apiKey,
	}, log)
	if err != nil {
		return err
	}
	defer gw.Close()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return fmt.Errorf("gateway: listen %s: %w", *listen, err)
	}
	srv := e2b.NewServer(gw)
	scheme := "http"
	if serverTLS != nil {
		srv.TLSConfig, scheme = serverTLS, "https"
		srv.Protocols.SetHTTP2(true)
		ln = tls.NewListener(ln, serverTLS)
	}
	// Serve takes the TLS listener's connections as ServeTLS would (HTTP/2
	// by ALPN, the client's certificate checked at the handshake).
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		srv.Shutdown(sctx) //nolint:errcheck // best effort at shutdown
	}()
	url := scheme + "://" + ln.Addr().String()
	log.Info("E2B gateway is up", "url", url, "api", *apiURL)
	fmt.Fprintf(os.Stderr, "\nE2B's SDKs reach OpenDsec with:\n  export E2B_API_URL=%s E2B_SANDBOX_URL=%s E2B_API_KEY=<an e2b_ key: dsec key create --format e2b>\n\n", url, url)
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

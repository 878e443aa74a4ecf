package embed

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/gateway/e2b"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/pki"
)

// startGateway runs the E2B-compatible gateway as a client of the
// apiserver, with its own service key and token secret kept under
// StateDir/gateway so access tokens stay valid across restarts.
func (c *Cluster) startGateway(ctx context.Context, cfg Config, ca *pki.CA) error {
	dir := filepath.Join(cfg.StateDir, "gateway")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	serviceKey, err := c.keyFile(ctx, filepath.Join(dir, "service.key"), "e2b-gateway", iam.FormatDsec)
	if err != nil {
		return err
	}
	secret, err := e2b.LoadOrCreateSecret(filepath.Join(dir, "token.secret"))
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.GatewayListen)
	if err != nil {
		return fmt.Errorf("gateway: listen %s: %w", cfg.GatewayListen, err)
	}
	gcfg := cfg.Gateway
	gcfg.APIURL, gcfg.ServiceKey, gcfg.TokenSecret = c.APIURL, serviceKey, secret
	gcfg.Metrics = c.reg
	gcfg.APICAFile, gcfg.APIClientCert, gcfg.APIClientKey = c.CAFile, c.ClientCert, c.ClientKey
	if gcfg.TemplateDir == "" {
		gcfg.TemplateDir = filepath.Join(dir, "template-uploads")
	}
	if gcfg.Domain == "" {
		// Sandbox hosts "PORT-ID.localhost:GATEWAYPORT": *.localhost is the
		// loopback address (RFC 6761) to curl and browsers; other clients
		// send to the gateway's address with that Host header.
		gcfg.Domain = "localhost:" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	}
	gw, err := e2b.New(gcfg, c.log)
	if err != nil {
		ln.Close()
		return err
	}
	c.gateway = gw
	srv := e2b.NewServer(gw)
	if c.apiTLS == nil {
		c.serve(srv, func() error { return srv.Serve(ln) })
		c.GatewayURL = "http://" + ln.Addr().String()
	} else {
		// With TLS the gateway is HTTPS too, under a certificate of the
		// cluster's CA that also names the sandbox hosts (PORT-ID.localhost).
		cert, err := ca.Issue("gateway-public", pki.RoleAPIServer, []string{"127.0.0.1", "localhost", "*.localhost", hostOf(ln.Addr().String())})
		if err != nil {
			ln.Close()
			return err
		}
		srv.TLSConfig = ca.PublicServerConfig(cert)
		srv.Protocols.SetHTTP2(true)
		c.serve(srv, func() error { return srv.ServeTLS(ln, "", "") })
		c.GatewayURL = "https://" + ln.Addr().String()
	}
	c.log.Info("E2B gateway is up", "url", c.GatewayURL, logging.Component, "embed")
	return nil
}

// keyFile returns the root ADMIN key kept in path, making a new one when
// the file is missing or its key no longer authenticates.
func (c *Cluster) keyFile(ctx context.Context, path, name string, format iam.KeyFormat) (string, error) {
	if data, err := os.ReadFile(path); err == nil {
		key := strings.TrimSpace(string(data))
		if _, err := c.IAM.Authenticate(key); err == nil {
			return key, nil
		}
	}
	_, key, err := c.IAM.CreateKey(ctx, "root", name, 2, format)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return "", err
	}
	return key, os.WriteFile(path, []byte(key+"\n"), 0o600)
}

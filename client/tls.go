package client

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
)

// TLSFiles name what a client's TLS takes beyond the system's roots.
type TLSFiles struct {
	// CA is a CA certificate (PEM) the apiservers' certificates may be
	// signed by, besides the system's roots (DSEC_CA_FILE).
	CA string
	// Cert and Key are a client certificate and its key (PEM), for
	// apiservers that require mutual TLS (DSEC_CLIENT_CERT,
	// DSEC_CLIENT_KEY).
	Cert, Key string
}

// TLSFilesFromEnv reads DSEC_CA_FILE, DSEC_CLIENT_CERT and DSEC_CLIENT_KEY.
func TLSFilesFromEnv() TLSFiles {
	return TLSFiles{CA: os.Getenv("DSEC_CA_FILE"), Cert: os.Getenv("DSEC_CLIENT_CERT"), Key: os.Getenv("DSEC_CLIENT_KEY")}
}

// Config is the TLS configuration the files make; nil when they name
// nothing (the system's roots, no client certificate).
func (f TLSFiles) Config() (*tls.Config, error) {
	if f == (TLSFiles{}) {
		return nil, nil
	}
	conf := &tls.Config{MinVersion: tls.VersionTLS12}
	if f.CA != "" {
		pem, err := os.ReadFile(f.CA)
		if err != nil {
			return nil, fmt.Errorf("client: the CA file (DSEC_CA_FILE): %w", err)
		}
		pool, err := x509.SystemCertPool()
		if err != nil {
			pool = x509.NewCertPool()
		}
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("client: the CA file %s holds no PEM certificate", f.CA)
		}
		conf.RootCAs = pool
	}
	switch {
	case f.Cert != "" && f.Key != "":
		cert, err := tls.LoadX509KeyPair(f.Cert, f.Key)
		if err != nil {
			return nil, fmt.Errorf("client: the client certificate (DSEC_CLIENT_CERT %s, DSEC_CLIENT_KEY %s): %w", f.Cert, f.Key, err)
		}
		conf.Certificates = []tls.Certificate{cert}
	case f.Cert != "" || f.Key != "":
		return nil, errors.New("client: DSEC_CLIENT_CERT and DSEC_CLIENT_KEY go together: set both or neither")
	}
	return conf, nil
}

// NewWithTLS is New with the TLS the files name.
func NewWithTLS(rawURL, key string, f TLSFiles) (*Client, error) {
	conf, err := f.Config()
	if err != nil {
		return nil, err
	}
	return newClient(rawURL, key, conf)
}

// noCertHint is added to the errors of a connection an https apiserver
// closed after TLS when the client presents no certificate: what one that
// requires client certificates does (TLS 1.3 says so only after the
// handshake, often as a closed connection).
const noCertHint = "an apiserver that requires client certificates closes connections without one: set DSEC_CLIENT_CERT and DSEC_CLIENT_KEY"

// certHint adds noCertHint to such errors.
type certHint struct{ next http.RoundTripper }

func (h certHint) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := h.next.RoundTrip(r)
	if err != nil && (brokenConn(err) || strings.Contains(err.Error(), "certificate required")) {
		return nil, fmt.Errorf("%w (%s)", err, noCertHint)
	}
	return resp, err
}

// withCertHint wraps rt in certHint when the client reaches https
// endpoints without a certificate.
func withCertHint(scheme string, conf *tls.Config, rt http.RoundTripper) http.RoundTripper {
	if scheme != "https" || (conf != nil && len(conf.Certificates) > 0) {
		return rt
	}
	return certHint{rt}
}

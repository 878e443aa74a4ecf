package pki

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"
)

// Identity is a component's certificate and key and the CA bundle it
// trusts, read from files (dsec ca issue) and read again when a file
// changes: replacing the files rotates a certificate, or adds a new CA next
// to the old one, with no restart, and sandboxes never notice [ours]. New
// handshakes use the new files; open connections keep theirs.
type Identity struct {
	caFile, certFile, keyFile string

	mu      sync.Mutex
	checked time.Time       // guarded by mu
	stamp   [3]time.Time    // guarded by mu; the files' modification times
	cert    tls.Certificate // guarded by mu
	pool    *x509.CertPool  // guarded by mu
}

// recheckEvery is how often an Identity looks at its files.
var recheckEvery = time.Second

// LoadIdentity reads a CA bundle (one or more PEM certificates), a
// certificate and its key.
func LoadIdentity(caFile, certFile, keyFile string) (*Identity, error) {
	id := &Identity{caFile: caFile, certFile: certFile, keyFile: keyFile}
	if _, _, err := id.current(); err != nil {
		return nil, err
	}
	return id, nil
}

// Role is the role in the identity's certificate.
func (id *Identity) Role() string {
	cert, _, _ := id.current()
	if cert.Leaf == nil || len(cert.Leaf.Subject.OrganizationalUnit) == 0 {
		return ""
	}
	return cert.Leaf.Subject.OrganizationalUnit[0]
}

// current returns the certificate and pool, re-reading the files at most
// once a second when their modification time changed.
func (id *Identity) current() (tls.Certificate, *x509.CertPool, error) {
	id.mu.Lock()
	defer id.mu.Unlock()
	if id.pool != nil && time.Since(id.checked) < recheckEvery {
		return id.cert, id.pool, nil
	}
	id.checked = time.Now()
	var stamp [3]time.Time
	for i, f := range []string{id.caFile, id.certFile, id.keyFile} {
		st, err := os.Stat(f)
		if err != nil {
			if id.pool != nil {
				return id.cert, id.pool, nil // mid-rotation: keep the last good files
			}
			return tls.Certificate{}, nil, err
		}
		stamp[i] = st.ModTime()
	}
	if id.pool != nil && stamp == id.stamp {
		return id.cert, id.pool, nil
	}
	cert, pool, err := readIdentity(id.caFile, id.certFile, id.keyFile)
	if err != nil {
		if id.pool != nil {
			return id.cert, id.pool, nil
		}
		return tls.Certificate{}, nil, err
	}
	id.cert, id.pool, id.stamp = cert, pool, stamp
	return cert, pool, nil
}

func readIdentity(caFile, certFile, keyFile string) (tls.Certificate, *x509.CertPool, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("certificate %s, key %s: %w", certFile, keyFile, err)
	}
	data, err := os.ReadFile(caFile)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("CA bundle: %w", err)
	}
	pool := x509.NewCertPool()
	n := 0
	for block, rest := pem.Decode(data); block != nil; block, rest = pem.Decode(rest) {
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return tls.Certificate{}, nil, fmt.Errorf("CA bundle %s: %w", caFile, err)
		}
		pool.AddCert(c)
		n++
	}
	if n == 0 {
		return tls.Certificate{}, nil, fmt.Errorf("CA bundle %s: no PEM certificate", caFile)
	}
	if _, err := cert.Leaf.Verify(x509.VerifyOptions{Roots: pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("certificate %s is not signed by a CA of %s: %w", certFile, caFile, err)
	}
	return cert, pool, nil
}

// ServerConfig requires a client certificate from a CA of the bundle with
// one of roles.
func (id *Identity) ServerConfig(roles ...string) *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{"h2", "http/1.1"},
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			cert, pool, err := id.current()
			if err != nil {
				return nil, err
			}
			return &tls.Config{
				MinVersion: tls.VersionTLS13, NextProtos: []string{"h2", "http/1.1"},
				Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequireAndVerifyClientCert, ClientCAs: pool,
				VerifyPeerCertificate: requireRole(roles),
			}, nil
		},
	}
}

// PublicServerConfig serves the identity's certificate to clients that
// bring none (an apiserver's client API: callers authenticate with API
// keys and verify the certificate against the CA, DSEC_CA_FILE).
func (id *Identity) PublicServerConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2", "http/1.1"},
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			cert, _, err := id.current()
			if err != nil {
				return nil, err
			}
			return &cert, nil
		},
	}
}

// ClientConfig presents the identity's certificate and trusts only the
// CA bundle.
func (id *Identity) ClientConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{"h2"},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			cert, _, err := id.current()
			return &cert, err
		},
		// The server's chain is checked below against the current bundle.
		InsecureSkipVerify: true, //nolint:gosec // verified in VerifyConnection
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, pool, err := id.current()
			if err != nil {
				return err
			}
			if len(cs.PeerCertificates) == 0 {
				return errors.New("pki: the server sent no certificate")
			}
			inter := x509.NewCertPool()
			for _, c := range cs.PeerCertificates[1:] {
				inter.AddCert(c)
			}
			_, err = cs.PeerCertificates[0].Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, DNSName: cs.ServerName})
			return err
		},
	}
}

// PeerHasRole reports whether the verified client certificate of a
// connection has one of roles.
func PeerHasRole(cs *tls.ConnectionState, roles ...string) bool {
	for _, chain := range cs.VerifiedChains {
		if len(chain) > 0 && slices.ContainsFunc(chain[0].Subject.OrganizationalUnit, func(ou string) bool { return slices.Contains(roles, ou) }) {
			return true
		}
	}
	return false
}

// RequireRole is a tls.Config.VerifyPeerCertificate that accepts only a
// peer certificate carrying one of roles.
func RequireRole(roles ...string) func([][]byte, [][]*x509.Certificate) error {
	return requireRole(roles)
}

func requireRole(roles []string) func([][]byte, [][]*x509.Certificate) error {
	return func(_ [][]byte, chains [][]*x509.Certificate) error {
		for _, chain := range chains {
			if len(chain) > 0 && slices.ContainsFunc(chain[0].Subject.OrganizationalUnit, func(ou string) bool { return slices.Contains(roles, ou) }) {
				return nil
			}
		}
		return fmt.Errorf("pki: client certificate has none of the roles %v", roles)
	}
}

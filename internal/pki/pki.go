// Package pki is the cluster's own certificate authority [ours]: every
// component-to-component connection is mutual TLS with certificates it
// issues, and a certificate's organisational unit names the component's role
// (apiserver, watcher, edge), which servers check.
package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/atomicfile"
)

// Roles a certificate can carry.
const (
	RoleAPIServer = "apiserver"
	RoleWatcher   = "watcher"
	RoleEdge      = "edge"
	RoleIAM       = "iam"
	RoleGateway   = "gateway"
	// RoleClient is a user's or tool's certificate for an apiserver that
	// requires mutual TLS of its clients; no component accepts it.
	RoleClient = "client"
)

// Roles is every role, for messages and checks.
var Roles = []string{RoleAPIServer, RoleWatcher, RoleEdge, RoleIAM, RoleGateway, RoleClient}

// CA is a loaded authority.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	Pool *x509.CertPool
	dir  string
}

// LoadOrCreateCA opens the CA in dir, creating it on first use.
func LoadOrCreateCA(dir string) (*CA, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	certPath, keyPath := filepath.Join(dir, "ca.crt"), filepath.Join(dir, "ca.key")
	if _, err := os.Stat(certPath); errors.Is(err, fs.ErrNotExist) {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, err
		}
		tmpl := &x509.Certificate{
			SerialNumber:          serial(),
			Subject:               pkix.Name{CommonName: "opendsec cluster CA"},
			NotBefore:             time.Now().Add(-time.Hour),
			NotAfter:              time.Now().AddDate(10, 0, 0),
			IsCA:                  true,
			BasicConstraintsValid: true,
			KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		if err != nil {
			return nil, err
		}
		if err := writePair(certPath, keyPath, der, key); err != nil {
			return nil, err
		}
	}
	cert, key, err := readPair(certPath, keyPath)
	if err != nil {
		return nil, fmt.Errorf("cluster CA: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{Cert: cert, Key: key, Pool: pool, dir: dir}, nil
}

// CertFile returns the path of the CA certificate.
func (ca *CA) CertFile() string { return filepath.Join(ca.dir, "ca.crt") }

// Issue returns a certificate for name with role, valid for server and
// client use, reusing one issued before. hosts are the DNS names and IPs a
// server answers on.
func (ca *CA) Issue(name, role string, hosts []string) (tls.Certificate, error) {
	certPath, keyPath := ca.PairFiles(name)
	if cert, key, err := readPair(certPath, keyPath); err == nil && cert.NotAfter.After(time.Now().Add(24*time.Hour)) && coversHosts(cert, hosts) &&
		slices.Contains(cert.Subject.OrganizationalUnit, role) {
		return tls.Certificate{Certificate: [][]byte{cert.Raw}, PrivateKey: key, Leaf: cert}, nil
	}
	return ca.Renew(name, role, hosts)
}

// PairFiles are where the certificate and key of name are kept.
func (ca *CA) PairFiles(name string) (certFile, keyFile string) {
	return filepath.Join(ca.dir, name+".crt"), filepath.Join(ca.dir, name+".key")
}

// Renew issues a new certificate for name with role, replacing any
// earlier one (rotation: components holding an Identity pick it up).
func (ca *CA) Renew(name, role string, hosts []string) (tls.Certificate, error) {
	if !slices.Contains(Roles, role) {
		return tls.Certificate{}, fmt.Errorf("role %q: want one of %v", role, Roles)
	}
	if name == "" || name == "ca" || strings.ContainsAny(name, "/\\") || strings.HasPrefix(name, ".") {
		return tls.Certificate{}, fmt.Errorf("name %q: want a plain file name other than \"ca\"", name)
	}
	usage := []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	if role == RoleClient {
		// A user's certificate: it can never pose as a server.
		if len(hosts) > 0 {
			return tls.Certificate{}, fmt.Errorf("role client: a client certificate names no hosts (it is not valid for serving); drop --host %v", hosts)
		}
		usage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	}
	certPath, keyPath := ca.PairFiles(name)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: name, OrganizationalUnit: []string{role}},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().AddDate(1, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  usage,
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return tls.Certificate{}, err
	}
	if err := writePair(certPath, keyPath, der, key); err != nil {
		return tls.Certificate{}, err
	}
	leaf, _ := x509.ParseCertificate(der)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

func coversHosts(cert *x509.Certificate, hosts []string) bool {
	for _, h := range hosts {
		if cert.VerifyHostname(h) != nil {
			return false
		}
	}
	return true
}

// ServerConfig requires a client certificate from the CA with one of roles.
func (ca *CA) ServerConfig(cert tls.Certificate, roles ...string) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    ca.Pool,
		// HTTP/1.1 for requests to sandboxes' ports that upgrade (WebSocket,
		// port tunnels); every RPC uses h2.
		NextProtos:            []string{"h2", "http/1.1"},
		VerifyPeerCertificate: requireRole(roles),
	}
}

// PublicServerConfig serves cert to clients that bring no certificate
// (the client API and the E2B gateway, whose callers authenticate with API
// keys); they verify it against the CA (client.env's DSEC_CA_FILE).
func (ca *CA) PublicServerConfig(cert tls.Certificate) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS12,
		Certificates: []tls.Certificate{cert},
		NextProtos:   []string{"h2", "http/1.1"},
	}
}

// ClientConfig presents cert and trusts only the CA.
func (ca *CA) ClientConfig(cert tls.Certificate) *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{cert},
		RootCAs:      ca.Pool,
		NextProtos:   []string{"h2"},
	}
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

func writePair(certPath, keyPath string, der []byte, key *ecdsa.PrivateKey) error {
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := atomicfile.Write(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		return err
	}
	return atomicfile.Write(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
}

func readPair(certPath, keyPath string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cb, err := os.ReadFile(certPath)
	if err != nil {
		return nil, nil, err
	}
	kb, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, nil, err
	}
	cblock, _ := pem.Decode(cb)
	kblock, _ := pem.Decode(kb)
	if cblock == nil || kblock == nil {
		return nil, nil, errors.New("bad PEM")
	}
	cert, err := x509.ParseCertificate(cblock.Bytes)
	if err != nil {
		return nil, nil, err
	}
	key, err := x509.ParseECPrivateKey(kblock.Bytes)
	if err != nil {
		return nil, nil, err
	}
	return cert, key, nil
}

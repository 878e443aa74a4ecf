package pki

import (
	"crypto/tls"
	"crypto/x509"
	"net"
	"strings"
	"testing"
	"time"
)

func TestMutualTLSChecksRoles(t *testing.T) {
	ca, err := LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	edge, _ := ca.Issue("edge", RoleEdge, []string{"127.0.0.1"})
	api, _ := ca.Issue("apiserver", RoleAPIServer, nil)
	other, _ := ca.Issue("gw", RoleGateway, nil)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", ca.ServerConfig(edge, RoleAPIServer, RoleWatcher))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.(*tls.Conn).Handshake() //nolint:errcheck
			c.Close()
		}
	}()
	dial := func(cert tls.Certificate) error {
		c, err := tls.Dial("tcp", ln.Addr().String(), ca.ClientConfig(cert))
		if err != nil {
			return err
		}
		defer c.Close()
		// TLS 1.3 reports a rejected client certificate on the first read.
		_, err = c.Read(make([]byte, 1))
		if err != nil && err.Error() == "EOF" {
			return nil
		}
		return err
	}
	if err := dial(api); err != nil {
		t.Fatalf("apiserver rejected: %v", err)
	}
	if err := dial(other); err == nil {
		t.Fatal("a gateway certificate was accepted by the edge")
	}
	// A certificate from another CA is refused.
	ca2, _ := LoadOrCreateCA(t.TempDir())
	foreign, _ := ca2.Issue("apiserver", RoleAPIServer, nil)
	cfg := ca.ClientConfig(foreign)
	c, err := tls.Dial("tcp", ln.Addr().String(), cfg)
	if err == nil {
		_, err = c.Read(make([]byte, 1))
		c.Close()
		if err == nil || err.Error() == "EOF" {
			t.Fatal("foreign certificate accepted")
		}
	}
	var _ net.Listener = ln
}

// TestIdentityRotatesWithoutRestart: a server and a client reading their
// files (dsec ca issue) pick up a renewed certificate on the next
// handshake, and still refuse a wrong role or another CA.
func TestIdentityRotatesWithoutRestart(t *testing.T) {
	recheckEvery = 0
	t.Cleanup(func() { recheckEvery = time.Second })
	dir := t.TempDir()
	ca, _ := LoadOrCreateCA(dir)
	if _, err := ca.Issue("edge-1", RoleEdge, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ca.Issue("api-1", RoleAPIServer, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := ca.Issue("gw-1", RoleGateway, nil); err != nil {
		t.Fatal(err)
	}
	load := func(name string) *Identity {
		crt, key := ca.PairFiles(name)
		id, err := LoadIdentity(ca.CertFile(), crt, key)
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	server, client := load("edge-1"), load("api-1")
	ln, err := tls.Listen("tcp", "127.0.0.1:0", server.ServerConfig(RoleAPIServer))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if c.(*tls.Conn).Handshake() == nil {
					c.Write([]byte("k")) //nolint:errcheck
				}
			}()
		}
	}()
	// serverSerial handshakes as id and returns the server's serial.
	serverSerial := func(id *Identity) (string, error) {
		c, err := tls.Dial("tcp", ln.Addr().String(), id.ClientConfig())
		if err != nil {
			return "", err
		}
		defer c.Close()
		if _, err := c.Read(make([]byte, 1)); err != nil {
			return "", err
		}
		return c.ConnectionState().PeerCertificates[0].SerialNumber.String(), nil
	}
	first, err := serverSerial(client)
	if err != nil {
		t.Fatalf("first handshake: %v", err)
	}
	if _, err := ca.Renew("edge-1", RoleEdge, []string{"127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := ca.Renew("api-1", RoleAPIServer, nil); err != nil {
		t.Fatal(err)
	}
	second, err := serverSerial(client)
	if err != nil || second == first {
		t.Fatalf("after rotation: serial %s (was %s), %v", second, first, err)
	}
	if _, err := serverSerial(load("gw-1")); err == nil {
		t.Fatal("a gateway certificate was accepted where only apiservers may connect")
	}
	other, _ := LoadOrCreateCA(t.TempDir())
	other.Issue("api-x", RoleAPIServer, nil) //nolint:errcheck
	crt, key := other.PairFiles("api-x")
	if _, err := LoadIdentity(ca.CertFile(), crt, key); err == nil {
		t.Fatal("LoadIdentity took a certificate the bundle's CA did not sign")
	}
	foreign, err := LoadIdentity(other.CertFile(), crt, key)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := serverSerial(foreign); err == nil {
		t.Fatal("a certificate of another CA was accepted")
	}
	if _, err := ca.Renew("x", "admin", nil); err == nil {
		t.Fatal("Renew took an unknown role")
	}
}

// A client certificate names no host and is valid for clients only: it
// cannot pose as any server of the cluster.
func TestClientCertificatesCannotServe(t *testing.T) {
	ca, err := LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ca.Issue("bad", RoleClient, []string{"127.0.0.1"}); err == nil || !strings.Contains(err.Error(), "names no hosts") {
		t.Fatalf("a client certificate with a host: %v", err)
	}
	cert, err := ca.Issue("alice", RoleClient, nil)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(cert.Certificate[0])
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err == nil {
		t.Fatal("a client certificate verifies as a server's")
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.Pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
		t.Fatalf("a client certificate does not verify as a client's: %v", err)
	}
	if err := RequireRole(RoleClient)(nil, [][]*x509.Certificate{{leaf}}); err != nil {
		t.Fatalf("RequireRole(client) refuses a client certificate: %v", err)
	}
	edge, _ := ca.Issue("edge-1", RoleEdge, []string{"127.0.0.1"})
	edgeLeaf, _ := x509.ParseCertificate(edge.Certificate[0])
	if err := RequireRole(RoleClient)(nil, [][]*x509.Certificate{{edgeLeaf}}); err == nil {
		t.Fatal("RequireRole(client) takes an edge's certificate")
	}
}

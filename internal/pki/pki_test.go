package pki

import (
	"crypto/tls"
	"net"
	"testing"
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

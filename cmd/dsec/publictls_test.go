package main

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/pki"
)

// The gateway's TLS flags: none is plain HTTP; a certificate without its
// key, an unreadable pair or a CA file without a certificate are refused
// naming the flag; with --client-ca a client without a certificate of
// that CA is refused at the handshake and one with it is served.
func TestPublicTLSFlags(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	serverCert, err := ca.Issue("gw", pki.RoleAPIServer, []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := ca.PairFiles("gw")
	junk := filepath.Join(dir, "junk.pem")
	os.WriteFile(junk, []byte("not a certificate"), 0o600)
	if cfg, err := publicTLS("", "", ""); cfg != nil || err != nil {
		t.Fatalf("no flags: %v %v, want plain HTTP", cfg, err)
	}
	for _, bad := range []struct{ cert, key, ca, want string }{
		{certFile, "", "", "--tls-key"},
		{"", "", ca.CertFile(), "--client-ca needs them"},
		{junk, keyFile, "", "--tls-cert " + junk},
		{certFile, keyFile, junk, "--client-ca " + junk + ": no PEM"},
		{certFile, keyFile, filepath.Join(dir, "missing.pem"), "--client-ca"},
	} {
		if _, err := publicTLS(bad.cert, bad.key, bad.ca); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("publicTLS(%q, %q, %q): %v, want an error naming %q", bad.cert, bad.key, bad.ca, err, bad.want)
		}
	}

	cfg, err := publicTLS(certFile, keyFile, ca.CertFile())
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.Write([]byte("ok")) }))
	srv.TLS = cfg
	srv.StartTLS()
	defer srv.Close()
	roots := x509.NewCertPool()
	roots.AddCert(serverCert.Leaf)
	pem, _ := os.ReadFile(ca.CertFile())
	roots.AppendCertsFromPEM(pem)
	get := func(certs ...tls.Certificate) error {
		c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: certs}}}
		resp, err := c.Get(srv.URL)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	if err := get(); err == nil {
		t.Fatal("a client without a certificate was served under --client-ca")
	}
	other, err := pki.LoadOrCreateCA(filepath.Join(dir, "other"))
	if err != nil {
		t.Fatal(err)
	}
	foreign, _ := other.Issue("someone", pki.RoleAPIServer, []string{"127.0.0.1"})
	if err := get(foreign); err == nil {
		t.Fatal("a client certificate of another CA was accepted")
	}
	client, _ := ca.Issue("user", pki.RoleAPIServer, []string{"127.0.0.1"})
	if err := get(client); err != nil {
		t.Fatalf("a client certificate of the CA: %v", err)
	}
}

// The apiserver's --client-ca needs --client-tls, and says so before it
// starts anything.
func TestAPIServerClientCANeedsTLS(t *testing.T) {
	err := cmdAPIServer(t.Context(), []string{"--id", "api-1", "--state-dir", t.TempDir(), "--edges", "127.0.0.1:1", "--iam", "127.0.0.1:2",
		"--image-store", t.TempDir(), "--client-ca", "/nonexistent/ca.pem"})
	if err == nil || !strings.Contains(err.Error(), "--client-ca /nonexistent/ca.pem needs --client-tls") {
		t.Fatalf("--client-ca without --client-tls: %v", err)
	}
}

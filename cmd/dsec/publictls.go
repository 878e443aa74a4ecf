package main

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// publicTLS is the TLS a server that clients outside the cluster reach
// serves with given certificates (not the cluster CA's): nil without a
// certificate (plain HTTP), and with clientCA, mutual TLS that requires a
// client certificate that CA signed.
func publicTLS(certFile, keyFile, clientCA string) (*tls.Config, error) {
	switch {
	case certFile == "" && keyFile == "" && clientCA == "":
		return nil, nil
	case certFile == "" || keyFile == "":
		return nil, errors.New("--tls-cert and --tls-key go together (and --client-ca needs them)")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("--tls-cert %s / --tls-key %s: %w", certFile, keyFile, err)
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2", "http/1.1"}}
	if clientCA != "" {
		pool, err := loadCAPool(clientCA)
		if err != nil {
			return nil, fmt.Errorf("--client-ca %w", err)
		}
		cfg.ClientCAs, cfg.ClientAuth = pool, tls.RequireAndVerifyClientCert
	}
	return cfg, nil
}

// loadCAPool reads the CA certificates (PEM) clients' certificates must
// chain to.
func loadCAPool(file string) (*x509.CertPool, error) {
	pem, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("%s: no PEM certificate in it", file)
	}
	return pool, nil
}

// Package edgeclient keeps one HTTP/2 connection pool per edge, over mutual
// TLS, for the apiserver and the watcher.
package edgeclient

import (
	"crypto/tls"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/api/gen/opendsec/edge/v1/edgev1connect"
)

// Conn reaches one edge.
type Conn struct {
	Addr    string
	BaseURL string
	HTTP    *http.Client
	Edge    edgev1connect.EdgeServiceClient
	// Ports carries requests to sandboxes' ports over HTTP/1.1, so a
	// request can upgrade (WebSocket, port tunnels).
	Ports http.RoundTripper
}

// Pool hands out a Conn per edge address.
type Pool struct {
	tls *tls.Config

	mu    sync.Mutex
	conns map[string]*Conn // guarded by mu
}

// NewPool returns a pool dialling with tlsConfig (the cluster CA and this
// component's certificate).
func NewPool(tlsConfig *tls.Config) *Pool {
	return &Pool{tls: tlsConfig, conns: map[string]*Conn{}}
}

// Get returns the Conn for addr ("host:port").
func (p *Pool) Get(addr string) *Conn {
	p.mu.Lock()
	defer p.mu.Unlock()
	if c, ok := p.conns[addr]; ok {
		return c
	}
	var protos http.Protocols
	protos.SetHTTP2(true)
	tr := &http.Transport{
		TLSClientConfig:     p.tls.Clone(),
		Protocols:           &protos,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		TLSHandshakeTimeout: 10 * time.Second,
		HTTP2:               &http.HTTP2Config{MaxConcurrentStreams: 4096, SendPingTimeout: 15 * time.Second},
	}
	hc := &http.Client{Transport: tr}
	base := "https://" + addr
	var h1 http.Protocols
	h1.SetHTTP1(true)
	h1tls := p.tls.Clone()
	h1tls.NextProtos = []string{"http/1.1"}
	ports := &http.Transport{
		TLSClientConfig: h1tls, Protocols: &h1, MaxIdleConnsPerHost: 64,
		IdleConnTimeout: 90 * time.Second, TLSHandshakeTimeout: 10 * time.Second,
	}
	c := &Conn{Addr: addr, BaseURL: base, HTTP: hc, Edge: edgev1connect.NewEdgeServiceClient(hc, base, connect.WithGRPC()), Ports: ports}
	p.conns[addr] = c
	return c
}

package e2b

import (
	"net/http"
	"time"
)

// NewServer is the gateway's HTTP server: HTTP/1.1 and, as E2B's SDKs
// speak to plain-HTTP URLs, HTTP/2 with prior knowledge. There is no write
// timeout: command output and watches stream for as long as they run.
func NewServer(g *Gateway) *http.Server {
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	return &http.Server{
		Handler:           g.Handler(),
		Protocols:         &protos,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       5 * time.Minute,
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: 1000},
	}
}

package iam

import (
	"crypto/tls"
	"net"
	"time"

	"github.com/hashicorp/raft"
)

// tlsLayer is Raft's stream layer over mutual TLS.
type tlsLayer struct {
	ln     net.Listener
	client *tls.Config
}

var _ raft.StreamLayer = (*tlsLayer)(nil)

func (l *tlsLayer) Accept() (net.Conn, error) { return l.ln.Accept() }
func (l *tlsLayer) Close() error              { return l.ln.Close() }
func (l *tlsLayer) Addr() net.Addr            { return l.ln.Addr() }

func (l *tlsLayer) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	cfg := l.client.Clone()
	if host, _, err := net.SplitHostPort(string(addr)); err == nil && cfg.ServerName == "" {
		cfg.ServerName = host
	}
	return tls.DialWithDialer(d, "tcp", string(addr), cfg)
}

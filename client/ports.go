package client

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// PortURL is the base URL of port inside the sandbox, through the
// apiserver: PortURL(8000) + "docs" reaches /docs of a server on 8000.
// Requests to it need the API key (PortClient adds it) unless the
// sandbox was created with allow_public_traffic.
func (s *Sandbox) PortURL(port int) string {
	return s.c.URL + "/v1/sandboxes/" + url.PathEscape(s.ID) + "/ports/" + strconv.Itoa(port) + "/"
}

// PortClient is an HTTP client that sends the API key with every request
// (as X-API-Key, so the sandbox's own Authorization header passes).
func (s *Sandbox) PortClient() *http.Client {
	at := s.c.http.Transport.(authTransport)
	return &http.Client{Transport: keyHeader{key: at.key, next: transportFor(strings.SplitN(s.c.URL, ":", 2)[0], s.c.tlsConf)}}
}

type keyHeader struct {
	key  string
	next http.RoundTripper
}

func (k keyHeader) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("X-API-Key", k.key)
	return k.next.RoundTrip(r)
}

// TunnelProtocol is the Upgrade token the edge answers with a raw TCP
// connection to the port.
const TunnelProtocol = "dsec-tcp"

// DialPort opens a TCP connection to port inside the sandbox, through the
// apiserver and the edge (an HTTP/1.1 upgrade): what dsec port-forward
// does for each local connection.
func (s *Sandbox) DialPort(ctx context.Context, port int) (net.Conn, error) {
	u, err := url.Parse(s.PortURL(port))
	if err != nil {
		return nil, err
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), map[string]string{"http": "80", "https": "443"}[u.Scheme])
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", host)
	if err != nil {
		return nil, err
	}
	if u.Scheme == "https" {
		tc := tls.Client(conn, &tls.Config{ServerName: u.Hostname(), NextProtos: []string{"http/1.1"}})
		if err := tc.HandshakeContext(ctx); err != nil {
			conn.Close()
			return nil, err
		}
		conn = tc
	}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl) //nolint:errcheck // cleared below
	}
	at := s.c.http.Transport.(authTransport)
	fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: %s\r\nX-API-Key: %s\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", u.RequestURI(), u.Host, at.key, TunnelProtocol)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("port %d of %s: %w", port, s.ID, err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		conn.Close()
		return nil, fmt.Errorf("port %d of %s: %s: %s", port, s.ID, resp.Status, strings.TrimSpace(string(body)))
	}
	conn.SetDeadline(time.Time{}) //nolint:errcheck // the tunnel has no deadline of its own
	return &bufferedConn{Conn: conn, r: br}, nil
}

// bufferedConn reads what the response reader buffered first.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufferedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

// CloseWrite half-closes the tunnel when the connection can.
func (c *bufferedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

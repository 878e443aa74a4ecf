package client

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"syscall"
)

// Apiservers are stateless and interchangeable [ours]: a client takes one
// URL or a comma-separated list (DSEC_API_URL=https://a:7070,https://b:7070),
// sends each request to the apiserver that last answered, and moves on to
// the next one when a request could not be sent (connection refused, no
// route, dial timeout) or, for a request that is safe to repeat, when the
// connection broke before the answer. Safe to repeat: reads (Get*, List*,
// WhoAmI) and creates, which carry an idempotency key the apiserver dedupes
// in IAM's ledger (a retried create answers with the sandbox the first one
// made, whichever apiserver it reached).

// IdempotencyHeader carries a create's idempotency key.
const IdempotencyHeader = "Idempotency-Key"

// parseEndpoints reads one URL or a comma-separated list of them; all must
// share a scheme and a path.
func parseEndpoints(raw string) ([]*url.URL, error) {
	var out []*url.URL
	for _, part := range strings.Split(raw, ",") {
		part = strings.TrimRight(strings.TrimSpace(part), "/")
		if part == "" {
			continue
		}
		u, err := url.Parse(part)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("client: API URL %q: want http://host:port or https://host:port (several: comma-separated)", part)
		}
		if len(out) > 0 && (u.Scheme != out[0].Scheme || u.Path != out[0].Path) {
			return nil, fmt.Errorf("client: API URLs %q and %q: all must have the same scheme and path", out[0], u)
		}
		out = append(out, u)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("client: API URL %q: empty", raw)
	}
	return out, nil
}

// failover sends a request to one endpoint after another.
type failover struct {
	endpoints []*url.URL
	next      http.RoundTripper

	mu  sync.Mutex
	cur int // guarded by mu: the endpoint that last answered
}

func (f *failover) RoundTrip(r *http.Request) (*http.Response, error) {
	f.mu.Lock()
	start := f.cur
	f.mu.Unlock()
	// A body that can be sent again (a unary call's) is read once, and
	// each attempt gets its own reader: an attempt that failed may still
	// be reading the one it was given.
	var payload []byte
	if len(f.endpoints) > 1 && r.GetBody != nil && r.Body != nil && r.Body != http.NoBody {
		data, err := io.ReadAll(r.Body)
		r.Body.Close()
		if err != nil {
			return nil, err
		}
		payload = data
	}
	var last error
	for i := range f.endpoints {
		idx := (start + i) % len(f.endpoints)
		req := r.Clone(r.Context())
		switch {
		case payload != nil:
			req.Body = io.NopCloser(bytes.NewReader(payload))
			req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(payload)), nil }
		case i > 0 && r.Body != nil && r.Body != http.NoBody:
			return nil, last // a stream's body cannot be sent twice
		}
		req.URL.Scheme, req.URL.Host, req.Host = f.endpoints[idx].Scheme, f.endpoints[idx].Host, ""
		resp, err := f.next.RoundTrip(req)
		if err == nil {
			if idx != start {
				f.mu.Lock()
				f.cur = idx
				f.mu.Unlock()
			}
			return resp, nil
		}
		last = err
		if r.Context().Err() != nil || !(notSent(err) || (safeToRepeat(r) && brokenConn(err))) {
			return nil, err
		}
	}
	return nil, last
}

// notSent reports an error that means the request never left: the
// connection could not be made.
func notSent(err error) bool {
	var op *net.OpError
	return (errors.As(err, &op) && op.Op == "dial") || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH)
}

// brokenConn reports a connection that broke under a request. HTTP/2's
// transport says so in words: "client conn could not be established" when
// the server closed before its first SETTINGS (the request may have been
// written by then), "client connection lost" later.
func brokenConn(err error) bool {
	var op *net.OpError
	msg := err.Error()
	return errors.As(err, &op) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		strings.Contains(msg, "EOF") || strings.Contains(msg, "connection reset") ||
		strings.Contains(msg, "http2: client conn could not be established") || strings.Contains(msg, "http2: client connection lost")
}

// safeToRepeat reports a request whose second arrival changes nothing.
func safeToRepeat(r *http.Request) bool {
	if r.Header.Get(IdempotencyHeader) != "" {
		return true
	}
	i := strings.LastIndexByte(r.URL.Path, '/')
	method := r.URL.Path[i+1:]
	return r.Method == http.MethodGet || strings.HasPrefix(method, "Get") || strings.HasPrefix(method, "List") || method == "WhoAmI"
}

// newIdempotencyKey returns a random key for one create.
func newIdempotencyKey() string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		panic("client: crypto/rand failed: " + err.Error())
	}
	return hex.EncodeToString(b)
}

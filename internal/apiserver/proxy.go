package apiserver

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/rpcproxy"
)

// routeKey carries the chosen edge and scope from the handler to the proxy.
type routeKey struct{}

type route struct {
	edge  *edgeclient.Conn
	scope string
	// waitUntil bounds the wait for an edge that refuses connections.
	waitUntil time.Time
}

// viaEdge sends a request over the chosen edge's connection pool.
type viaEdge struct{}

// edgeRestartWait is how long a call into a sandbox waits for its edge
// to listen again: a restart (an upgrade) refuses connections for a
// moment, and only that edge can serve the sandbox.
const edgeRestartWait = 30 * time.Second

// RoundTrip sends r; while the edge refuses the connection, it tries
// again until edgeRestartWait or the call's deadline, if nothing of the
// request was sent (a refused dial reads no body) or the body can be
// sent again (a buffered unary call's). The transport read the body only
// if it first tried a pooled connection the restarting edge had dropped;
// it goes on to dial only for a request that connection never delivered,
// and a refused dial delivers none, so the call has not run.
func (viaEdge) RoundTrip(r *http.Request) (*http.Response, error) {
	rt := r.Context().Value(routeKey{}).(route)
	t := rt.edge.HTTP.Transport
	hasBody := r.Body != nil && r.Body != http.NoBody
	body := &watchedBody{ReadCloser: r.Body}
	if hasBody {
		r.Body = body
	}
	deadline := rt.waitUntil
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, time.Second) {
		resp, err := t.RoundTrip(r)
		resend := !body.read.Load() || r.GetBody != nil
		if err == nil || !errors.Is(err, syscall.ECONNREFUSED) || !resend || time.Now().Add(wait).After(deadline) {
			body.done(err)
			return resp, err
		}
		if hasBody && body.read.Load() {
			again, gerr := r.GetBody()
			if gerr != nil {
				body.done(err)
				return resp, err
			}
			body = &watchedBody{ReadCloser: again}
			r.Body = body
		}
		select {
		case <-r.Context().Done():
			body.done(err)
			return nil, err
		case <-time.After(wait):
		}
	}
}

// watchedBody says whether anything read the request's body, and keeps
// a transport that failed before reading it from closing it (it closes
// the body on every error) while the request may be sent again.
type watchedBody struct {
	io.ReadCloser
	read, closeLater, final, closed atomic.Bool
}

func (b *watchedBody) Read(p []byte) (int, error) {
	b.read.Store(true)
	return b.ReadCloser.Read(p)
}

func (b *watchedBody) Close() error {
	if b.read.Load() || b.final.Load() {
		b.closed.Store(true)
		return b.ReadCloser.Close()
	}
	b.closeLater.Store(true)
	return nil
}

// done ends the retries with the last attempt's error: a failed one's
// close, held back, happens now; a sent one's transport closes the body
// itself when it is through with it.
func (b *watchedBody) done(err error) {
	b.final.Store(true)
	if err != nil && b.closeLater.Load() && !b.closed.Load() && b.ReadCloser != nil {
		b.closed.Store(true)
		b.ReadCloser.Close() //nolint:errcheck // the transport's close, held back
	}
}

// agentProxy authenticates an agent RPC and forwards it to the edge that
// owns the sandbox, adding the caller's project scope.
func (s *Server) agentProxy() http.Handler {
	ew := connect.NewErrorWriter()
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			rt := pr.In.Context().Value(routeKey{}).(route)
			target, _ := url.Parse(rt.edge.BaseURL)
			pr.SetURL(target)
			pr.Out.Header.Set(headers.Scope, rt.scope)
			pr.Out.Header.Del("Authorization")
			pr.Out.Header.Del("X-API-Key")
		},
		Transport:     viaEdge{},
		FlushInterval: -1,
		BufferPool:    &rpcproxy.BufferPool{},
		ErrorLog:      slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			rt := r.Context().Value(routeKey{}).(route)
			ew.Write(w, r, errdefs.ToConnect(errdefs.Unavailable("edge %s: %v", rt.edge.Addr, err))) //nolint:errcheck // the client went away
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := s.authenticate(r.Header)
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		id := r.Header.Get(headers.SandboxID)
		if id == "" {
			ew.Write(w, r, errdefs.ToConnect(errdefs.InvalidArgument("header %s: missing; it names the sandbox", headers.SandboxID))) //nolint:errcheck // the client went away
			return
		}
		c, waitUntil, err := s.callEdge(id)
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		if err := rpcproxy.BufferUnary(r, maxRequestBytes); err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		rpcproxy.FullDuplex(w)
		proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), routeKey{}, route{edge: c, scope: p.Project, waitUntil: waitUntil})))
	})
}

package apiserver

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"

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
}

// viaEdge sends a request over the chosen edge's connection pool.
type viaEdge struct{}

func (viaEdge) RoundTrip(r *http.Request) (*http.Response, error) {
	return r.Context().Value(routeKey{}).(route).edge.HTTP.Transport.RoundTrip(r)
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
		c, err := s.sandboxEdge(id)
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		if err := rpcproxy.BufferUnary(r, maxRequestBytes); err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		rpcproxy.FullDuplex(w)
		proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), routeKey{}, route{edge: c, scope: p.Project})))
	})
}

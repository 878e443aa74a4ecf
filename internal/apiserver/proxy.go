package apiserver

import (
	"net/http"
	"net/http/httputil"
	"net/url"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
)

// agentProxy authenticates an agent RPC and forwards it to the edge that
// owns the sandbox, adding the caller's project scope.
func (s *Server) agentProxy() http.Handler {
	ew := connect.NewErrorWriter()
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
		target, _ := url.Parse(c.BaseURL)
		proxy := &httputil.ReverseProxy{
			Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(target)
				pr.Out.Header.Set(headers.Scope, p.Project)
				pr.Out.Header.Del("Authorization")
				pr.Out.Header.Del("X-API-Key")
			},
			Transport:     c.HTTP.Transport,
			FlushInterval: -1,
			ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
				ew.Write(w, r, errdefs.ToConnect(errdefs.Unavailable("edge %s: %v", c.Addr, err))) //nolint:errcheck // the client went away
			},
		}
		proxy.ServeHTTP(w, r)
	})
}

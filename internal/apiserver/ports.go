package apiserver

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/rpcproxy"
)

// PortPath is the route to a port inside a sandbox:
// /v1/sandboxes/{id}/ports/{port}/{path...}. Anything after the port is
// the path the sandbox's server sees.
const PortPath = "/v1/sandboxes/{id}/ports/{port}/{path...}"

// PortURL is the base URL of a sandbox's port on an apiserver at base.
func PortURL(base, id string, port int) string {
	return strings.TrimRight(base, "/") + "/v1/sandboxes/" + url.PathEscape(id) + "/ports/" + strconv.Itoa(port) + "/"
}

// portProxy forwards HTTP (WebSocket and port tunnels included) to a port
// inside a sandbox, through the edge that owns it. An API key in
// X-API-Key, or a valid one as an Authorization bearer, makes it a call
// of that key's project; without one the request goes as public, and only
// a sandbox created with allow_public_traffic answers it. The key never
// reaches the sandbox; an Authorization header that is not a key does.
func (s *Server) portProxy() http.Handler {
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			rt := pr.In.Context().Value(routeKey{}).(portRoute)
			target, _ := url.Parse(rt.edge.BaseURL)
			pr.SetURL(target)
			pr.Out.URL.Path = "/" + pr.In.PathValue("path")
			pr.Out.URL.RawPath = ""
			pr.Out.Host = pr.In.Host
			pr.Out.Header.Set(headers.SandboxID, pr.In.PathValue("id"))
			pr.Out.Header.Set(headers.SandboxPort, pr.In.PathValue("port"))
			if rt.scope != "" {
				pr.Out.Header.Set(headers.Scope, rt.scope)
			} else {
				pr.Out.Header.Set(headers.Public, "1")
			}
			pr.Out.Header.Del("X-API-Key")
			if rt.bearerWasKey {
				pr.Out.Header.Del("Authorization")
			}
		},
		Transport:     viaEdgePorts{},
		FlushInterval: -1,
		ErrorLog:      slog.NewLogLogger(s.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			rt := r.Context().Value(routeKey{}).(portRoute)
			errdefs.WriteHTTP(w, errdefs.Unavailable("edge %s: %v", rt.edge.Addr, err))
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var rt portRoute
		if key := r.Header.Get("X-API-Key"); key != "" {
			p, err := s.iam.Authenticate(key)
			if err != nil {
				errdefs.WriteHTTP(w, err)
				return
			}
			rt.scope = p.Project
		} else if bearer, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			if p, err := s.iam.Authenticate(strings.TrimSpace(bearer)); err == nil {
				rt.scope, rt.bearerWasKey = p.Project, true
			}
		}
		c, err := s.sandboxEdge(r.PathValue("id"))
		if err != nil {
			errdefs.WriteHTTP(w, err)
			return
		}
		rt.edge = c
		rpcproxy.FullDuplex(w)
		proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), routeKey{}, rt)))
	})
}

// portRoute is route plus whether the Authorization header held the key.
type portRoute struct {
	route
	bearerWasKey bool
}

// viaEdgePorts sends a request over the chosen edge's HTTP/1.1 pool.
type viaEdgePorts struct{}

func (viaEdgePorts) RoundTrip(r *http.Request) (*http.Response, error) {
	return r.Context().Value(routeKey{}).(portRoute).edge.Ports.RoundTrip(r)
}

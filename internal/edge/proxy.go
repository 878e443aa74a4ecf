package edge

import (
	"net/http"
	"net/http/httputil"
	"net/url"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
)

// AgentProxy forwards agent RPCs to the sandbox named in the request header,
// resuming it first if it is paused.
func (e *Edge) AgentProxy() http.Handler {
	ew := connect.NewErrorWriter()
	agentURL := &url.URL{Scheme: "http", Host: "agent"}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sb, err := e.lookup(r.Header.Get(headers.SandboxID), r.Header.Get(headers.Scope))
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		rt, err := e.ensureRunning(r.Context(), sb)
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		proxy := &httputil.ReverseProxy{
			Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(agentURL)
				pr.Out.Host = "agent"
				pr.Out.Header.Del(headers.Scope)
				pr.Out.Header.Del(headers.SandboxID)
			},
			Transport:     rt,
			FlushInterval: -1,
			ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
				if r.Context().Err() == nil {
					e.log.Warn("agent call failed", logging.SandboxID, sb.id, logging.Error, err)
				}
				ew.Write(w, r, errdefs.ToConnect(errdefs.Unavailable("sandbox %s: agent unreachable: %v", sb.id, err))) //nolint:errcheck // the client went away
			},
		}
		proxy.ServeHTTP(w, r)
	})
}

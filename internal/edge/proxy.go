package edge

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/rpcproxy"
)

type linkKey struct{}

// viaLink sends a request over the agent link put in its context.
type viaLink struct{}

func (viaLink) RoundTrip(r *http.Request) (*http.Response, error) {
	return r.Context().Value(linkKey{}).(http.RoundTripper).RoundTrip(r)
}

// agentMaxRequest bounds a unary agent call's body; the agent allows 20 MiB.
const agentMaxRequest = 20 << 20

// AgentProxy forwards agent RPCs to the sandbox named in the request header,
// resuming it first if it is paused (unless the call carries NoResume).
func (e *Edge) AgentProxy() http.Handler {
	ew := connect.NewErrorWriter()
	agentURL := &url.URL{Scheme: "http", Host: "agent"}
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(agentURL)
			pr.Out.Host = "agent"
			pr.Out.Header.Del(headers.Scope)
			pr.Out.Header.Del(headers.SandboxID)
			pr.Out.Header.Del(headers.NoResume)
		},
		Transport:     viaLink{},
		FlushInterval: -1,
		BufferPool:    &rpcproxy.BufferPool{},
		// A stream cut by a stopping sandbox is normal; keep it out of stderr.
		ErrorLog: slog.NewLogLogger(e.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			id := r.Header.Get(headers.SandboxID)
			if r.Context().Err() == nil {
				e.log.Warn("agent call failed", logging.SandboxID, id, logging.Error, err)
			}
			ew.Write(w, r, errdefs.ToConnect(errdefs.Unavailable("sandbox %s: agent unreachable: %v", id, err))) //nolint:errcheck // the client went away
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sb, err := e.lookup(r.Header.Get(headers.SandboxID), r.Header.Get(headers.Scope))
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		if err := rpcproxy.BufferUnary(r, agentMaxRequest); err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		rt, err := e.ensureRunning(r.Context(), sb, r.Header.Get(headers.NoResume) == "")
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		proxy.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), linkKey{}, rt)))
	})
}

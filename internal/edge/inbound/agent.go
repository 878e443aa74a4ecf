package inbound

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"sync/atomic"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/rpcproxy"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

type callKey struct{}

// agentCall is what the proxy knows about a call it forwards.
type agentCall struct {
	id       sandboxid.ID
	link     *agentlink.Link
	detaches uint64           // the link's Detaches when the call began
	failed   *atomic.Bool     // set when the agent did not answer it
	sb       *sandbox.Sandbox // whose limits every answer counts
}

// viaLink sends a request over the agent link put in its context.
type viaLink struct{}

func (viaLink) RoundTrip(r *http.Request) (*http.Response, error) {
	return r.Context().Value(callKey{}).(agentCall).link.RoundTrip(r)
}

// agentMaxRequest bounds a unary agent call's body; the agent allows 20 MiB.
const agentMaxRequest = 20 << 20

// AgentCalls forwards agent RPCs to the sandbox named in the request
// header (found with lookup, in the caller's scope), resuming it first if
// it is paused (unless the call carries NoResume).
func AgentCalls(lookup func(id, scope string) (*sandbox.Sandbox, error), log *slog.Logger) http.Handler {
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
		Transport: viaLink{},
		// Every answer carries the agent's limit counts: the sandbox
		// takes them, the caller does not see them.
		ModifyResponse: func(resp *http.Response) error {
			resp.Request.Context().Value(callKey{}).(agentCall).sb.CountLimits(resp.Header)
			resp.Header.Del(headers.LimitEvents)
			return nil
		},
		FlushInterval: -1,
		BufferPool:    &rpcproxy.BufferPool{},
		// A stream cut by a stopping sandbox is normal; keep it out of stderr.
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			call := r.Context().Value(callKey{}).(agentCall)
			call.failed.Store(true)
			if call.link.Detaches() != call.detaches {
				// Expected: a snapshot or fork cuts the agent's connection.
				ew.Write(w, r, errdefs.ToConnect(errdefs.Unavailable("sandbox %s: a snapshot or fork of the sandbox reset its agent connection during this call; processes it started keep running (reattach with Process.Connect); retry other calls", call.id))) //nolint:errcheck // the client went away
				return
			}
			if errors.Is(err, errdefs.ErrFailedPrecondition) {
				// The sandbox was found dead (Link.Fail): say why.
				ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
				return
			}
			if errors.Is(err, context.DeadlineExceeded) {
				ew.Write(w, r, connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("sandbox %s: the call's deadline passed", call.id))) //nolint:errcheck // the client went away
				return
			}
			if r.Context().Err() == nil {
				log.Warn("agent call failed", logging.SandboxID, call.id, logging.Error, err)
			}
			ew.Write(w, r, errdefs.ToConnect(errdefs.Unavailable("sandbox %s: agent unreachable: %v", call.id, err))) //nolint:errcheck // the client went away
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sb, err := lookup(r.Header.Get(headers.SandboxID), r.Header.Get(headers.Scope))
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		if err := rpcproxy.BufferUnary(r, agentMaxRequest); err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		ctx := r.Context()
		// The call's own deadline holds here too, whatever the agent does.
		if d, ok := rpcproxy.CallTimeout(r.Header); ok {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, d)
			defer cancel()
		}
		if rpcproxy.IsUnary(r) {
			release, err := sb.AcquireCall(ctx)
			if err != nil {
				w.Header().Set("Retry-After", strconv.Itoa(sandbox.RetryAfter))
				ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
				return
			}
			defer release()
		}
		link, err := sb.EnsureRunning(r.Context(), r.Header.Get(headers.NoResume) == "")
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		call := agentCall{id: sb.ID(), link: link, detaches: link.Detaches(), failed: &atomic.Bool{}, sb: sb}
		defer func() { sb.CallEnded(!call.failed.Load()) }()
		ctx = context.WithValue(ctx, callKey{}, call)
		rpcproxy.FullDuplex(w)
		proxy.ServeHTTP(w, r.WithContext(ctx))
	})
}

package apiserver

import (
	"context"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam"
)

type principalKey struct{}

func withPrincipal(ctx context.Context, p iam.Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

func principalFrom(ctx context.Context) iam.Principal {
	p, _ := ctx.Value(principalKey{}).(iam.Principal)
	return p
}

// apiKey reads the key from "Authorization: Bearer KEY" or "X-API-Key".
func apiKey(h http.Header) string {
	if v := h.Get("X-API-Key"); v != "" {
		return v
	}
	if v, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer "); ok {
		return strings.TrimSpace(v)
	}
	return ""
}

// authenticate checks the request's API key.
func (s *Server) authenticate(h http.Header) (iam.Principal, error) {
	return s.iam.Authenticate(apiKey(h))
}

// authInterceptor authenticates every RPC and puts the principal in the
// context.
type authInterceptor struct{ s *Server }

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		p, err := a.s.authenticate(req.Header())
		if err != nil {
			return nil, errdefs.ToConnect(err)
		}
		return next(withPrincipal(ctx, p), req)
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		p, err := a.s.authenticate(conn.RequestHeader())
		if err != nil {
			return errdefs.ToConnect(err)
		}
		return next(withPrincipal(ctx, p), conn)
	}
}

// actingProject resolves the project a request acts on: the one asked for, or the
// key's own. It must be the key's project or below it.
func actingProject(p iam.Principal, asked string) (string, error) {
	if asked == "" {
		return p.Project, nil
	}
	if !p.CanAccess(asked) {
		return "", errdefs.PermissionDenied("project %q: your API key belongs to %q and reaches only it and its sub-projects", asked, p.Project)
	}
	return asked, nil
}

package apiserver

import (
	"context"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam"
	"github.com/opendsec/opendsec/internal/rpcproxy"
)

type principalKey struct{}

func withPrincipal(ctx context.Context, p iam.Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

func principalFrom(ctx context.Context) iam.Principal {
	p, _ := ctx.Value(principalKey{}).(iam.Principal)
	return p
}

// apiKey reads the key from "Authorization: Bearer KEY" or "X-API-Key". A
// request that carries two different keys is refused: serving it with
// either would be a guess at which caller it is.
func apiKey(h http.Header) (string, error) {
	header := strings.TrimSpace(h.Get("X-API-Key"))
	bearer := ""
	if v, ok := strings.CutPrefix(h.Get("Authorization"), "Bearer "); ok {
		bearer = strings.TrimSpace(v)
	}
	if header != "" && bearer != "" && header != bearer {
		return "", errdefs.InvalidArgument("API key: the request carries two different keys (Authorization and X-API-Key); send one")
	}
	if header != "" {
		return header, nil
	}
	return bearer, nil
}

// authenticate checks the request's API key.
func (s *Server) authenticate(h http.Header) (iam.Principal, error) {
	key, err := apiKey(h)
	if err != nil {
		return iam.Principal{}, err
	}
	return s.iam.Authenticate(key)
}

// Request bodies the API reads, by route. A route's bound applies before
// anything decodes the body, so no request costs more memory than its
// route allows, and none that is not authenticated costs any.
const (
	// maxControlBytes bounds a call of the sandbox, IAM and image services:
	// specs, names and policies, never file contents.
	maxControlBytes = 4 << 20
	// maxRequestBytes bounds a unary agent call (a 16 MiB file chunk fits).
	maxRequestBytes = 24 << 20
)

// authFirst authenticates a request from its headers before anything reads
// its body, then bounds the body at limit bytes. A body that cannot be read
// (a broken chunked encoding, a client that stops halfway) is the client's
// fault and answers invalid-argument, not an internal error.
func (s *Server) authFirst(next http.Handler, limit int64) http.Handler {
	ew := connect.NewErrorWriter()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := s.authenticate(r.Header)
		if err != nil {
			ew.Write(w, r, errdefs.ToConnect(err)) //nolint:errcheck // the client went away
			return
		}
		if r.ContentLength > limit {
			ew.Write(w, r, errdefs.ToConnect(errdefs.ResourceExhausted("request body: %d bytes, over the %d this route allows", r.ContentLength, limit))) //nolint:errcheck // the client went away
			return
		}
		rpcproxy.BoundBody(w, r, limit)
		next.ServeHTTP(w, r.WithContext(withPrincipal(r.Context(), p)))
	})
}

// authInterceptor puts the principal authFirst found in the context; a
// call that reached a handler without it (a route wired without authFirst)
// is authenticated here.
type authInterceptor struct{ s *Server }

func (a authInterceptor) principal(ctx context.Context, h http.Header) (context.Context, error) {
	if _, ok := ctx.Value(principalKey{}).(iam.Principal); ok {
		return ctx, nil
	}
	p, err := a.s.authenticate(h)
	if err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return withPrincipal(ctx, p), nil
}

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		ctx, err := a.principal(ctx, req.Header())
		if err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, err := a.principal(ctx, conn.RequestHeader())
		if err != nil {
			return err
		}
		return next(ctx, conn)
	}
}

// actingProject resolves the project a request acts on: the one asked for, or the
// key's own. It must be the key's project or below it.
func actingProject(p iam.Principal, asked string) (string, error) {
	if asked == "" {
		return p.Project, nil
	}
	if !p.CanAccess(asked) {
		return "", errdefs.PermissionDenied("project %q: your API key belongs to %q and reaches only it and its sub-projects", errdefs.Clip(asked, 128), p.Project)
	}
	return asked, nil
}

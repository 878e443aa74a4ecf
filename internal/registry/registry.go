// Package registry copies images between OCI registries (the Distribution
// API, as Docker Hub, GHCR, Harbor and Debian's docker-registry serve it)
// and the shared image store [ours: the paper's images come from its own
// builds]. It uses go-containerregistry for references, logins (the token
// dance) and uploads, and fetches layers itself, so that a broken download
// continues where it stopped (an HTTP range request into the store's
// partial blob) and a layer the store holds is never fetched again.
//
// Plain HTTP goes only to loopback registries, as Docker allows, and to
// registries the operator lists as insecure; every other registry is
// reached over TLS.
package registry

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// Options are what a pull or push needs besides the references.
type Options struct {
	// Insecure lists registries ("host" or "host:port") reached over plain
	// HTTP, besides loopback ones.
	Insecure []string
	// Allowed, if set, lists the only registries ("host" or "host:port";
	// "docker.io" is Docker Hub) a pull or push may name: an apiserver
	// fetches what its users ask, and an operator may keep that to known
	// registries.
	Allowed []string
	// Credentials log in; when empty, Config's logins for the registry are
	// used, else none.
	Credentials Credentials
	Config      *DockerConfig
	// Transport carries the requests (http.DefaultTransport if nil).
	Transport http.RoundTripper
	Progress  image.Progress
	// Room, if set, is asked before a pull stores what it needs (the
	// layers not in the store yet); its error ends the pull (a quota).
	Room      func(total int64) error
	UserAgent string
}

const refHelp = `want a registry reference such as "registry.example.com/team/app:1.0", "127.0.0.1:5000/py:3.12", "python:3.12" (Docker Hub) or one ending in "@sha256:<64 hex>"`

// ParseReference parses a registry reference (docker's rules: no registry
// means Docker Hub, no tag means "latest").
func ParseReference(s string) (name.Reference, error) {
	if s == "" {
		return nil, errdefs.InvalidArgument("registry reference: empty; %s", refHelp)
	}
	if len(s) > 1024 {
		return nil, errdefs.InvalidArgument("registry reference: longer than 1024 characters")
	}
	if strings.Contains(s, "://") {
		return nil, errdefs.InvalidArgument("registry reference %q: no scheme is given (plain HTTP is for loopback and listed insecure registries); %s", s, refHelp)
	}
	r, err := name.ParseReference(s)
	if err != nil {
		return nil, errdefs.InvalidArgument("registry reference %q: %v; %s", s, strings.TrimPrefix(err.Error(), "could not parse reference: "), refHelp)
	}
	return r, nil
}

// DefaultName is the store name a pulled image gets when none is given:
// the repository's last part and the tag (or "sha256-" and 12 hex digits of
// a digest) in project proj.
func DefaultName(r name.Reference, proj string) (image.Ref, error) {
	repo := r.Context().RepositoryStr()
	base := repo[strings.LastIndexByte(repo, '/')+1:]
	tag := r.Identifier()
	if d, ok := r.(name.Digest); ok {
		hex := strings.TrimPrefix(d.DigestStr(), "sha256:")
		tag = "sha256-" + hex[:min(12, len(hex))]
	}
	return image.ParseRef(proj + "/" + base + ":" + tag)
}

// plainHTTPAllowed reports whether host (as in a URL: "host:port") may be
// reached without TLS.
func plainHTTPAllowed(host string, insecure []string) bool {
	if hostListed(host, insecure) {
		return true
	}
	hn := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		hn = h
	}
	if strings.EqualFold(hn, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(hn, "[]"))
	return ip != nil && ip.IsLoopback()
}

// tlsGuard refuses plain HTTP to registries that are neither loopback nor
// listed as insecure. go-containerregistry itself tries plain HTTP for
// private addresses (RFC 1918, .local); this keeps them on TLS.
type tlsGuard struct {
	next     http.RoundTripper
	insecure []string
}

func (g tlsGuard) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Scheme == "http" && !plainHTTPAllowed(r.URL.Host, g.insecure) {
		return nil, errdefs.PermissionDenied("registry %s: plain HTTP refused (only loopback registries and those the operator lists with --insecure-registry are reached without TLS)", r.URL.Host)
	}
	return g.next.RoundTrip(r)
}

func (o *Options) transport() http.RoundTripper {
	next := o.Transport
	if next == nil {
		next = guardedTransport
	}
	return tlsGuard{next: next, insecure: o.Insecure}
}

// checkAllowed refuses a registry the operator's allow-list lacks.
func (o *Options) checkAllowed(reg string) error {
	if len(o.Allowed) == 0 || hostListed(reg, o.Allowed) || reg == name.DefaultRegistry && hostListed("docker.io", o.Allowed) {
		return nil
	}
	return errdefs.PermissionDenied("registry %s: not one this cluster reaches (its operator allows %s)", reg, strings.Join(o.Allowed, ", "))
}

// hostListed reports whether host ("host" or "host:port") is in list, by
// either form.
func hostListed(host string, list []string) bool {
	for _, h := range list {
		if strings.EqualFold(h, host) {
			return true
		}
		if hn, _, err := net.SplitHostPort(host); err == nil && strings.EqualFold(h, hn) {
			return true
		}
	}
	return false
}

// guardedTransport is http.DefaultTransport that never connects to a
// link-local address (169.254.0.0/16, fe80::/10: cloud metadata services
// live there), whatever a registry or its redirects name.
var guardedTransport = func() http.RoundTripper {
	t := http.DefaultTransport.(*http.Transport).Clone()
	d := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, Control: refuseLinkLocal}
	t.DialContext = d.DialContext
	return t
}()

// refuseLinkLocal is a dialer's Control: it refuses link-local addresses.
func refuseLinkLocal(_, address string, _ syscall.RawConn) error {
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return err
	}
	if ip := net.ParseIP(host); ip != nil && (ip.IsLinkLocalUnicast() || ip.IsLinkLocalMulticast()) {
		return errdefs.PermissionDenied("registry connection to %s refused: a link-local address (where cloud metadata services answer)", host)
	}
	return nil
}

func (o *Options) authenticator(ctx context.Context, reg name.Registry) (authn.Authenticator, error) {
	cr := o.Credentials
	if cr.Empty() && o.Config != nil {
		var err error
		if cr, err = o.Config.For(ctx, reg.RegistryStr()); err != nil {
			return nil, errdefs.Unauthenticated("%v", err)
		}
	}
	if cr.Empty() {
		return authn.Anonymous, nil
	}
	return authn.FromConfig(authn.AuthConfig{Username: cr.Username, Password: cr.Password, IdentityToken: cr.IdentityToken}), nil
}

// remoteOptions are go-containerregistry's options for one call, logged
// in with auth (o.authenticator's, found once per pull or push: it may run
// a credential helper).
func (o *Options) remoteOptions(ctx context.Context, auth authn.Authenticator) []remote.Option {
	ua := o.UserAgent
	if ua == "" {
		ua = "opendsec"
	}
	return []remote.Option{remote.WithContext(ctx), remote.WithAuth(auth), remote.WithTransport(o.transport()), remote.WithUserAgent(ua)}
}

// classify turns a registry's or the network's error into the project's
// error classes, naming the registry.
func classify(reg string, what string, err error) error {
	if err == nil {
		return nil
	}
	var terr *transport.Error
	if errors.As(err, &terr) {
		msg := errdefs.Clip(terr.Error(), 300)
		switch {
		case terr.StatusCode == http.StatusUnauthorized || hasCode(terr, transport.UnauthorizedErrorCode):
			return errdefs.Unauthenticated("registry %s: %s: the credentials were refused or are needed (log in with docker login, or pass --username and --password-stdin): %s", reg, what, msg)
		case terr.StatusCode == http.StatusForbidden || hasCode(terr, transport.DeniedErrorCode):
			return errdefs.PermissionDenied("registry %s: %s: access denied: %s", reg, what, msg)
		case terr.StatusCode == http.StatusNotFound || hasCode(terr, transport.ManifestUnknownErrorCode) || hasCode(terr, transport.NameUnknownErrorCode):
			return errdefs.NotFound("registry %s: %s: not found: %s", reg, what, msg)
		case terr.StatusCode == http.StatusTooManyRequests:
			return errdefs.ResourceExhausted("registry %s: %s: rate limited: %s", reg, what, msg)
		case terr.StatusCode >= 500:
			return errdefs.Unavailable("registry %s: %s: %s", reg, what, msg)
		}
		return errdefs.InvalidArgument("registry %s: %s: %s", reg, what, msg)
	}
	if errdefs.Code(err) != connect.CodeInternal { // already classified, or a cancel
		return err
	}
	var dnsErr *net.DNSError
	var opErr *net.OpError
	if errors.As(err, &dnsErr) || errors.As(err, &opErr) || unreachable(err.Error()) {
		return errdefs.Unavailable("registry %s: %s: unreachable: %v", reg, what, err)
	}
	return fmt.Errorf("registry %s: %s: %w", reg, what, err)
}

func hasCode(e *transport.Error, c transport.ErrorCode) bool {
	for _, d := range e.Errors {
		if d.Code == c {
			return true
		}
	}
	return false
}

// unreachable tells network failures that reach here as text only (the
// registry ping joins its attempts' errors into one message).
func unreachable(msg string) bool {
	for _, s := range []string{"connection refused", "no such host", "i/o timeout", "network is unreachable", "no route to host", "connection reset"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// Package inbound serves what reaches a node's sandboxes from outside:
// agent calls, forwarded over each sandbox's agent link, and requests for a
// port inside a sandbox, forwarded to its address on the node's sandbox
// network. Both find the sandbox through a lookup the edge hands in, and
// resume it first if it is paused.
package inbound

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/rpcproxy"
)

// Inbound traffic [ours]. HTTP and WebSocket requests for a port inside a
// sandbox reach the edge from the apiserver (which authenticated them, or
// marked them public) and go to the sandbox's address on the node's
// sandbox network: the node's own connections to a sandbox are the only
// inbound ones its table lets through. A paused sandbox is resumed first,
// as for agent calls. TunnelProtocol upgrades a request to a raw TCP
// connection to the port (dsec port-forward).

// TunnelProtocol is the Upgrade token of a raw TCP tunnel to a port.
const TunnelProtocol = "dsec-tcp"

type portKey struct{}

// portCall is a port request's sandbox address and port.
type portCall struct {
	sandbox string
	port    string
	target  string          // addr:port
	ended   context.Context // done once the sandbox failed or was removed
}

// Ports serves requests the apiserver marked with headers.SandboxPort.
// lookup finds a sandbox by id in the caller's scope; lookupAny by id alone
// (a public request, or a dial once the call was checked).
func Ports(lookup func(id, scope string) (*sandbox.Sandbox, error), lookupAny func(id string) (*sandbox.Sandbox, error), log *slog.Logger) http.Handler {
	return (&portProxy{lookup: lookup, lookupAny: lookupAny, log: log}).handler()
}

// portProxy serves requests the apiserver marked with headers.SandboxPort.
type portProxy struct {
	// lookup finds a sandbox by id in the caller's scope; lookupAny by id
	// alone (a public request, or a dial once the call was checked).
	lookup    func(id, scope string) (*sandbox.Sandbox, error)
	lookupAny func(id string) (*sandbox.Sandbox, error)
	log       *slog.Logger
}

// dial dials "SANDBOXID:PORT" at the sandbox's current address.
func (p *portProxy) dial(ctx context.Context, network, hostport string) (net.Conn, error) {
	id, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, err
	}
	sb, err := p.lookupAny(id)
	if err != nil {
		return nil, err
	}
	addr := sb.View().NetworkAddress
	if addr == "" {
		return nil, errdefs.FailedPrecondition("sandbox %s has no network address", id)
	}
	return (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, network, net.JoinHostPort(addr, port))
}

// handler is the proxy's HTTP handler.
func (p *portProxy) handler() http.Handler {
	proxy := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			call := pr.In.Context().Value(portKey{}).(portCall)
			// The pool's key is the sandbox id, not its address: an
			// address is given to a new sandbox once its owner is gone,
			// and a kept connection to the old one would be reset.
			pr.SetURL(&url.URL{Scheme: "http", Host: net.JoinHostPort(call.sandbox, call.port)})
			pr.Out.Host = pr.In.Host // the sandbox's server sees the name it was called by
			for _, h := range append(headers.Internal, headers.SandboxID) {
				pr.Out.Header.Del(h)
			}
		},
		Transport: &http.Transport{
			DialContext:           p.dial,
			MaxIdleConnsPerHost:   16,
			IdleConnTimeout:       30 * time.Second,
			ResponseHeaderTimeout: 0, // a long poll is the sandbox's business
		},
		FlushInterval: -1,
		ErrorLog:      slog.NewLogLogger(p.log.Handler(), slog.LevelDebug),
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			call := r.Context().Value(portKey{}).(portCall)
			errdefs.WriteHTTP(w, portError(call, err))
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		call, done, err := p.call(r)
		if err != nil {
			errdefs.WriteHTTP(w, err)
			return
		}
		defer done()
		// A request outlives its sandbox by nothing: a stream still open
		// when the sandbox ends is cut, so its client learns at once.
		ctx, cancel := context.WithCancel(context.WithValue(r.Context(), portKey{}, call))
		defer cancel()
		defer context.AfterFunc(call.ended, cancel)()
		r = r.WithContext(ctx)
		if r.Header.Get("Upgrade") == TunnelProtocol {
			p.tunnel(w, r, call)
			return
		}
		rpcproxy.FullDuplex(w)
		proxy.ServeHTTP(w, r)
	})
}

// call checks a port request: the sandbox, the caller's right to it, its
// network, and resumes it if paused. done ends the call.
func (p *portProxy) call(r *http.Request) (portCall, func(), error) {
	id := r.Header.Get(headers.SandboxID)
	port, err := strconv.Atoi(r.Header.Get(headers.SandboxPort))
	if err != nil || port < 1 || port > 65535 {
		return portCall{}, nil, errdefs.InvalidArgument("port %q: want 1 to 65535", r.Header.Get(headers.SandboxPort))
	}
	public := r.Header.Get(headers.Public) == "1"
	scope := r.Header.Get(headers.Scope)
	var sb *sandbox.Sandbox
	if public {
		sb, err = p.lookupAny(id)
	} else {
		sb, err = p.lookup(id, scope)
	}
	if err != nil {
		return portCall{}, nil, err
	}
	view := sb.View()
	netp := view.GetSpec().GetNetwork()
	if netp == nil || view.NetworkAddress == "" {
		return portCall{}, nil, errdefs.FailedPrecondition("sandbox %s has no network, so its ports cannot be reached; create it with a network policy (an empty one denies all egress)", id)
	}
	if public && !netp.GetAllowPublicTraffic() {
		return portCall{}, nil, errdefs.Unauthenticated("sandbox %s: its ports need an API key (it was not created with allow_public_traffic)", id)
	}
	if _, err := sb.EnsureRunning(r.Context(), true); err != nil {
		return portCall{}, nil, err
	}
	// A port request says nothing of the agent: it does not excuse a heartbeat.
	return portCall{sandbox: id, port: strconv.Itoa(port), target: net.JoinHostPort(view.NetworkAddress, strconv.Itoa(port)), ended: sb.Ended()}, func() { sb.CallEnded(false) }, nil
}

// portError says why a port could not be reached.
func portError(call portCall, err error) error {
	if errors.Is(err, syscall.ECONNREFUSED) {
		return errdefs.Unavailable("sandbox %s: nothing listens on %s (connection refused); a server must listen on 0.0.0.0 or the sandbox's address, not 127.0.0.1", call.sandbox, call.target)
	}
	return errdefs.Unavailable("sandbox %s: port %s: %v", call.sandbox, call.target, err)
}

// tunnel answers an Upgrade to TunnelProtocol with a TCP connection to the
// port, copied both ways until either side closes.
func (p *portProxy) tunnel(w http.ResponseWriter, r *http.Request, call portCall) {
	conn, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(r.Context(), "tcp", call.target)
	if err != nil {
		errdefs.WriteHTTP(w, portError(call, err))
		return
	}
	defer conn.Close()
	client, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		p.log.Warn("port tunnel: cannot take over the connection", logging.SandboxID, call.sandbox, logging.Error, err)
		errdefs.WriteHTTP(w, errdefs.Unsupported("port tunnel: this connection cannot be upgraded (HTTP/1.1 only): %v", err))
		return
	}
	defer client.Close()
	// The splice below ends when either side closes; the request's context
	// ending (the sandbox did) closes both.
	defer context.AfterFunc(r.Context(), func() { conn.Close(); client.Close() })()
	if _, err := buf.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: " + TunnelProtocol + "\r\n\r\n"); err != nil {
		return
	}
	if err := buf.Flush(); err != nil {
		return
	}
	if buf.Reader.Buffered() > 0 {
		if _, err := io.CopyN(conn, buf, int64(buf.Reader.Buffered())); err != nil {
			return
		}
	}
	rpcproxy.Splice(client, conn)
}

package agentlink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/headers"
	"github.com/opendsec/opendsec/internal/logging"
)

// Link is the edge's side for one sandbox. It implements http.RoundTripper:
// requests go to the agent over the current connection, waiting for one if
// the agent is (re)connecting.
type Link struct {
	path string
	auth *Auth // nil: agents connect without a handshake (auth.go)
	log  *slog.Logger

	mu      sync.Mutex
	ln      net.Listener  // guarded by mu; nil while detached
	cur     *agentConn    // guarded by mu; nil until the agent connects
	changed chan struct{} // guarded by mu; closed and replaced when cur changes
	closed  bool          // guarded by mu
	failed  error         // guarded by mu; set by Fail: calls end with it at once
	lost    time.Time     // guarded by mu; when the last connection ended (zero while one is up)

	detaches atomic.Uint64 // how many times Detach cut the connection
	refused  *Refusals     // nil: not counted
}

// Refusals counts the connections links refused, for the edge's metrics:
// a failed handshake (a process that is not the sandbox's agent, or one
// with a wrong key) or a failed HTTP/2 setup.
type Refusals struct{ n atomic.Uint64 }

// Count is how many connections were refused.
func (r *Refusals) Count() uint64 { return r.n.Load() }

func (r *Refusals) add() {
	if r != nil {
		r.n.Add(1)
	}
}

type agentConn struct {
	raw    *watchedConn
	cc     *http.ClientConn
	tr     *http.Transport
	gotEOF chan struct{}
}

// Listen creates the socket at path (replacing a stale one) and starts
// accepting the agent's connections.
func Listen(path string, log *slog.Logger) (*Link, error) {
	return ListenAuthenticated(path, nil, log)
}

// ListenAuthenticated is Listen for a link that serves only the agent that
// presents auth's key (auth.go); nil auth is Listen.
func ListenAuthenticated(path string, auth *Auth, log *slog.Logger) (*Link, error) {
	return ListenCounted(path, auth, nil, log)
}

// ListenCounted is ListenAuthenticated counting the connections it
// refuses in refused (nil: not counted).
func ListenCounted(path string, auth *Auth, refused *Refusals, log *slog.Logger) (*Link, error) {
	l := &Link{path: path, auth: auth, log: logging.OrDiscard(log), changed: make(chan struct{}), refused: refused}
	if err := l.listen(); err != nil {
		return nil, err
	}
	return l, nil
}

// Path returns the socket path.
func (l *Link) Path() string { return l.path }

func (l *Link) listen() error {
	if err := os.Remove(l.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("agentlink: remove stale socket: %w", err)
	}
	ln, err := net.Listen("unix", l.path)
	if err != nil {
		return fmt.Errorf("agentlink: listen %s: %w", l.path, err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(true)
	l.mu.Lock()
	l.ln = ln
	l.mu.Unlock()
	go l.acceptLoop(ln)
	return nil
}

func (l *Link) acceptLoop(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		if l.auth == nil {
			l.take(c)
			continue
		}
		// The handshake of one connection must not hold up the next: an
		// impostor that connects and says nothing would block the agent.
		go func() {
			if err := l.auth.accept(c); err != nil {
				l.log.Warn("agent connection refused", "path", l.path, logging.Error, err)
				l.refused.add()
				c.Close()
				return
			}
			l.take(c)
		}()
	}
}

// take makes c, a connection from the agent, the current one. A VM's
// (a link without authentication) starts at the agent's first SETTINGS
// frame (stale.go).
func (l *Link) take(c net.Conn) {
	if l.auth == nil {
		c = &staleSkippingConn{Conn: c}
	}
	ac, err := newAgentConn(c)
	if err != nil {
		l.log.Warn("agent connection setup failed", logging.Error, err)
		l.refused.add()
		c.Close()
		return
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		ac.close()
		return
	}
	old := l.cur
	if old != nil && old.alive() {
		l.log.Warn("agent connected again while its connection was alive; replacing it", "path", l.path)
	}
	l.cur = ac
	l.lost = time.Time{}
	close(l.changed)
	l.changed = make(chan struct{})
	l.mu.Unlock()
	if old != nil {
		old.close()
	}
	go l.forgetOnEOF(ac)
}

// forgetOnEOF drops ac once the agent closes it and wakes waiters.
func (l *Link) forgetOnEOF(ac *agentConn) {
	<-ac.gotEOF
	l.mu.Lock()
	if l.cur == ac {
		l.cur = nil
		l.lost = time.Now()
		close(l.changed)
		l.changed = make(chan struct{})
	}
	l.mu.Unlock()
}

// Down reports whether no agent is connected, and since when one was lost
// (zero if the agent never connected or the link is detached on purpose).
func (l *Link) Down() (down bool, since time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cur != nil && l.cur.alive() {
		return false, time.Time{}
	}
	if l.cur != nil && l.lost.IsZero() {
		l.lost = time.Now() // ended by a GOAWAY, which has no event
	}
	return true, l.lost
}

// Fail ends every call waiting for the agent, and every later one, with
// err: the sandbox is known to be dead, and no agent will connect again.
func (l *Link) Fail(err error) {
	l.mu.Lock()
	l.failed = err
	cur := l.cur
	l.cur = nil
	close(l.changed)
	l.changed = make(chan struct{})
	l.mu.Unlock()
	if cur != nil {
		cur.close()
	}
}

func newAgentConn(c net.Conn) (*agentConn, error) {
	wc := &watchedConn{Conn: c, eof: make(chan struct{})}
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols: &protos,
		DialContext: func(context.Context, string, string) (net.Conn, error) {
			return wc, nil
		},
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 4096},
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	cc, err := tr.NewClientConn(ctx, "http", "agent:80")
	if err != nil {
		return nil, err
	}
	return &agentConn{raw: wc, cc: cc, tr: tr, gotEOF: wc.eof}, nil
}

func (a *agentConn) close() {
	a.cc.Close()
	a.raw.Close()
}

func (a *agentConn) alive() bool {
	select {
	case <-a.gotEOF:
		return false
	default:
		return a.cc.Err() == nil
	}
}

// watchedConn closes eof once a read fails, i.e. once the agent has closed
// its end.
type watchedConn struct {
	net.Conn
	once sync.Once
	eof  chan struct{}
}

func (w *watchedConn) Read(p []byte) (int, error) {
	n, err := w.Conn.Read(p)
	if err != nil {
		w.once.Do(func() { close(w.eof) })
	}
	return n, err
}

// current returns a live connection, waiting until ctx ends for one.
func (l *Link) current(ctx context.Context) (*agentConn, error) {
	for {
		l.mu.Lock()
		cur, changed, closed, failed := l.cur, l.changed, l.closed, l.failed
		l.mu.Unlock()
		if failed != nil {
			return nil, failed
		}
		if closed {
			return nil, errdefs.Unavailable("agent link closed")
		}
		if cur != nil && cur.alive() {
			return cur, nil
		}
		if cur != nil {
			// Its HTTP/2 session failed while the connection stands (a VM's
			// agent still in the session of a host before a snapshot answers
			// a new host's preface with GOAWAY): close it, so the peer
			// connects afresh (QEMU dials again).
			l.drop(cur)
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, errdefs.Wrap(errdefs.ErrUnavailable, ctx.Err(), "agent not connected")
		case <-time.After(100 * time.Millisecond):
			// Re-check cur: a connection ended by a GOAWAY has no event.
		}
	}
}

// drop closes ac and forgets it if it is the current connection.
func (l *Link) drop(ac *agentConn) {
	l.mu.Lock()
	if l.cur == ac {
		l.cur = nil
	}
	l.mu.Unlock()
	ac.close()
}

// WaitReady returns once the agent is connected.
func (l *Link) WaitReady(ctx context.Context) error {
	_, err := l.current(ctx)
	return err
}

// firstServingTry bounds WaitServing's first request: longer than a
// guest's boot (about 1.5 s under TCG), so a new VM is answered as soon as
// its agent runs instead of after a dropped connection and the
// hypervisor's reconnect (a second each).
const firstServingTry = 5 * time.Second

// WaitServing returns once the agent has answered a request: for a link
// whose connection is made before the agent runs (a VM's serial port,
// which its hypervisor connects at start), where WaitReady says nothing.
//
// The first request waits up to firstServingTry: what the link sends before
// the guest's agent opens its port waits in the hypervisor's socket, and a
// booting guest answers it once its agent runs. Later requests wait a
// second each (see below).
func (l *Link) WaitServing(ctx context.Context) error {
	return l.WaitServingWith(ctx, func(try context.Context) (bool, error) {
		req, _ := http.NewRequestWithContext(try, http.MethodGet, "http://agent/dsec-serving", nil)
		resp, err := l.RoundTrip(req)
		if err != nil {
			return false, err
		}
		resp.Body.Close()
		return true, nil
	})
}

// WaitServingWith is WaitServing with the caller's first request: call
// sends it and says whether the agent answered (an answer that is an error
// ends the wait with that error). A restored copy's first request is its
// new identity, which spares a round trip to a guest that runs slowly.
func (l *Link) WaitServingWith(ctx context.Context, call func(try context.Context) (answered bool, err error)) error {
	wait := firstServingTry
	for {
		ac, err := l.current(ctx)
		if err != nil {
			return err
		}
		try, cancel := context.WithTimeout(ctx, wait)
		wait = time.Second
		answered, err := call(try)
		cancel()
		if answered {
			return err
		}
		if ctx.Err() != nil {
			return errdefs.Wrap(errdefs.ErrUnavailable, ctx.Err(), "agent not serving")
		}
		if try.Err() != nil {
			// No answer on a standing connection: the agent may be stuck in
			// a session from before a snapshot, waiting for the rest of a
			// frame. Drop the connection, so the peer connects afresh and
			// the agent sees its host go and come back.
			l.drop(ac)
		}
		select {
		case <-ctx.Done():
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// RoundTrip sends req to the agent.
func (l *Link) RoundTrip(req *http.Request) (*http.Response, error) {
	ac, err := l.current(req.Context())
	if err != nil {
		return nil, err
	}
	// The node's clock rides on every request (headers.HostTime); it
	// replaces whatever a caller put there.
	req = req.Clone(req.Context())
	req.Header.Set(headers.HostTime, strconv.FormatInt(time.Now().UnixNano(), 10))
	return ac.cc.RoundTrip(req)
}

// Detach stops accepting, removes the socket and closes the agent's
// connection, returning once the agent has closed its end, so the sandbox
// holds no host socket (needed before a gVisor checkpoint).
func (l *Link) Detach(ctx context.Context) error {
	l.detaches.Add(1)
	l.mu.Lock()
	ln, cur := l.ln, l.cur
	l.ln, l.cur, l.lost = nil, nil, time.Time{}
	l.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	if cur == nil {
		return nil
	}
	if hc, ok := cur.raw.Conn.(interface{ CloseWrite() error }); ok {
		hc.CloseWrite()
	}
	// The HTTP/2 client reads continuously, so EOF is seen as soon as the
	// agent closes.
	select {
	case <-cur.gotEOF:
		cur.close()
		return nil
	case <-ctx.Done():
		cur.close()
		return errdefs.Wrap(errdefs.ErrUnavailable, ctx.Err(), "agent did not close its connection")
	}
}

// Detaches counts the calls to Detach: a call that fails while the count
// moved was cut by a snapshot, not by a broken agent.
func (l *Link) Detaches() uint64 { return l.detaches.Load() }

// Reattach listens again after Detach.
func (l *Link) Reattach() error {
	l.mu.Lock()
	has := l.ln != nil
	l.mu.Unlock()
	if has {
		return nil
	}
	return l.listen()
}

// Close stops listening and drops the connection.
func (l *Link) Close() error {
	l.mu.Lock()
	ln, cur := l.ln, l.cur
	l.ln, l.cur, l.closed = nil, nil, true
	close(l.changed)
	l.changed = make(chan struct{})
	l.mu.Unlock()
	if ln != nil {
		ln.Close()
	}
	if cur != nil {
		cur.close()
	}
	return nil
}

var _ http.RoundTripper = (*Link)(nil)

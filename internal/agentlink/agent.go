package agentlink

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/opendsec/opendsec/internal/logging"
)

// Dialer is the agent's side: it keeps one connection to the edge socket open
// and serves handler on it.
type Dialer struct {
	Path    string
	Handler http.Handler
	Log     *slog.Logger
	// Authenticate makes the agent present its key at every connection to
	// a Unix socket (auth.go); the first connection is given it.
	Authenticate bool
	// OnConnect, if set, runs after each connection is made.
	OnConnect func()

	keyMu sync.Mutex
	key   string // guarded by keyMu; the key the edge gave

	connects atomic.Uint64
}

// Key is the agent's key: the one SetKey gave, or the edge at the first
// handshake ("" before either).
func (d *Dialer) Key() string {
	d.keyMu.Lock()
	defer d.keyMu.Unlock()
	return d.key
}

// SetKey gives the agent its key before Run: an agent that comes back
// from a snapshot has its source's (an in-process agent's simulation of a
// restored memory; a real one has it in its memory).
func (d *Dialer) SetKey(k string) {
	d.keyMu.Lock()
	defer d.keyMu.Unlock()
	d.key = k
}

// Connects returns how many times a connection has been made.
func (d *Dialer) Connects() uint64 { return d.connects.Load() }

// Backoff between failed dials: fast at first, so a restored copy or a
// restarted edge is reached within milliseconds, slower after a while so an
// absent edge costs little.
const (
	fastRetry    = 2 * time.Millisecond
	fastRetryFor = 20 * time.Second
	slowRetry    = 200 * time.Millisecond
	maxFastRetry = 10 * time.Millisecond
)

// Run dials and serves until ctx ends.
func (d *Dialer) Run(ctx context.Context) {
	log := logging.OrDiscard(d.Log)
	delay := fastRetry
	downSince := time.Now()
	for ctx.Err() == nil {
		conn, err := dial(ctx, d.Path)
		if err == nil && d.Authenticate {
			if _, unix := conn.(*net.UnixConn); unix {
				var key string
				if key, err = hello(conn, d.Key()); err != nil {
					log.Debug("edge handshake failed", logging.Error, err)
					conn.Close()
				} else {
					d.SetKey(key)
				}
			}
		}
		if err != nil {
			if time.Since(downSince) > fastRetryFor {
				delay = slowRetry
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(delay):
			}
			if delay < maxFastRetry {
				delay *= 2
			}
			continue
		}
		d.connects.Add(1)
		log.Debug("connected to edge", "path", d.Path)
		if d.OnConnect != nil {
			d.OnConnect()
		}
		began := time.Now()
		serveConn(ctx, conn, d.Handler)
		log.Debug("edge connection closed", "path", d.Path)
		delay, downSince = fastRetry, time.Now()
		// A virtio-serial port opens whether or not the host is connected,
		// and then reads as ended at once: wait before opening it again.
		if _, port := conn.(*portConn); port && time.Since(began) < 50*time.Millisecond {
			select {
			case <-ctx.Done():
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
}

// serveConn serves HTTP/2 on conn until either side closes it.
func serveConn(ctx context.Context, conn net.Conn, h http.Handler) {
	done := make(chan struct{})
	var once sync.Once
	var protos http.Protocols
	protos.SetUnencryptedHTTP2(true)
	srv := &http.Server{
		Handler:   h,
		Protocols: &protos,
		ConnState: func(_ net.Conn, st http.ConnState) {
			if st == http.StateClosed || st == http.StateHijacked {
				once.Do(func() { close(done) })
			}
		},
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 4096},
	}
	go srv.Serve(&oneConnListener{conn: conn, closed: make(chan struct{})}) //nolint:errcheck // ends with the listener
	select {
	case <-done:
	case <-ctx.Done():
	}
	srv.Close()
	// Close conn too: when ctx ends before srv.Serve has taken the
	// connection, srv.Close does not know it, and the edge would go on
	// seeing a live agent.
	conn.Close()
}

// oneConnListener hands out one connection, then blocks until closed.
type oneConnListener struct {
	mu     sync.Mutex
	conn   net.Conn // guarded by mu; nil once handed out
	closed chan struct{}
	once   sync.Once
}

func (l *oneConnListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	c := l.conn
	l.conn = nil
	l.mu.Unlock()
	if c != nil {
		return c, nil
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *oneConnListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *oneConnListener) Addr() net.Addr { return &net.UnixAddr{Name: "edge", Net: "unix"} }

var _ net.Listener = (*oneConnListener)(nil)

// ImageUserEnv carries the image's USER from the edge to the agent in the
// agent's environment, which the agent takes it out of: every backend
// passes the environment through, so none has to know about it.
const ImageUserEnv = "DSEC_IMAGE_USER"

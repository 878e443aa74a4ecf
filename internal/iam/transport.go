package iam

import (
	"bufio"
	"crypto/tls"
	"errors"
	"net"
	"sync"
	"time"

	"github.com/hashicorp/raft"
)

// One port per replica [ours]. The Raft port, over mutual TLS, carries
// Raft's own connections and the replicas' requests to each other
// (forwarded writes, joins, status): a Raft connection's first byte is an
// RPC type (0-4), a request's is requestMagic. tlsLayer reads that byte
// and hands Raft only its own connections.

// requestMagic opens a replica-to-replica request connection.
const requestMagic byte = 0xd5

// tlsLayer is Raft's stream layer over mutual TLS, sharing the port with
// replica requests.
type tlsLayer struct {
	ln        net.Listener
	client    *tls.Config
	advertise net.Addr                      // if set, what Addr reports
	serve     func(net.Conn, *bufio.Reader) // a request connection
	raftIn    chan net.Conn
	closed    chan struct{}
	closeMu   sync.Once

	mu       sync.Mutex
	live     map[*peekedConn]struct{} // Raft's accepted connections not yet closed
	draining bool                     // drain began: Accept hands Raft no more
	// sorting counts accepted connections not yet handed to Raft or, for
	// a request, not yet answered: drain waits for them, so a replica
	// that stops answers (if only "not the leader") every request whose
	// TLS handshake it made, instead of ending its process under it.
	sorting int
	// accepting is closed when run returns: every connection it took is
	// counted in sorting by then.
	accepting chan struct{}
}

var _ raft.StreamLayer = (*tlsLayer)(nil)

func newTLSLayer(ln net.Listener, server, client *tls.Config) *tlsLayer {
	return &tlsLayer{ln: tls.NewListener(ln, server), client: client, raftIn: make(chan net.Conn), closed: make(chan struct{}), live: map[*peekedConn]struct{}{}, accepting: make(chan struct{})}
}

// run accepts connections until the listener closes; serve must be set.
// Other errors (out of file descriptors) are waited out, as Raft's own
// accept loop does.
func (l *tlsLayer) run() {
	if l.accepting != nil {
		defer close(l.accepting)
	}
	backoff := 5 * time.Millisecond
	for {
		c, err := l.ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			l.Close()
			return
		}
		if err != nil {
			select {
			case <-l.closed:
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, time.Second)
			continue
		}
		backoff = 5 * time.Millisecond
		l.mu.Lock()
		l.sorting++
		l.mu.Unlock()
		go func() {
			defer func() {
				l.mu.Lock()
				l.sorting--
				l.mu.Unlock()
			}()
			l.sort(c)
		}()
	}
}

// sort reads a connection's first byte (the TLS handshake with it, both
// within 10 s) and routes it.
func (l *tlsLayer) sort(c net.Conn) {
	c.SetReadDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck // a failed read below says it
	br := bufio.NewReader(c)
	first, err := br.Peek(1)
	if err != nil {
		c.Close()
		return
	}
	c.SetReadDeadline(time.Time{}) //nolint:errcheck // as above
	if first[0] == requestMagic {
		br.Discard(1) //nolint:errcheck // peeked
		l.serve(c, br)
		return
	}
	select {
	case l.raftIn <- &peekedConn{Conn: c, r: br, layer: l}:
	case <-l.closed:
		c.Close()
	}
}

func (l *tlsLayer) Accept() (net.Conn, error) {
	select {
	case c := <-l.raftIn:
		pc := c.(*peekedConn)
		l.mu.Lock()
		if l.draining {
			l.mu.Unlock()
			// Taken after drain began: not Raft's to handle.
			pc.Conn.Close()
			return nil, net.ErrClosed
		}
		l.live[pc] = struct{}{}
		l.mu.Unlock()
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

// drain ends Raft's accepted connections and waits, up to timeout, for
// the transport to let go of each: Raft's transport answers a heartbeat on
// the connection's own goroutine, which writes the term to the log store,
// and its Close does not wait for those goroutines. Closing the store
// under one panicked a replica ("database not open"). It also waits for
// the connections still being sorted or answered (sorting): called after
// Close, when no new ones come. It returns how many connections were
// still held at the timeout.
func (l *tlsLayer) drain(timeout time.Duration) int {
	l.mu.Lock()
	l.draining = true
	live := make([]*peekedConn, 0, len(l.live))
	for c := range l.live {
		live = append(live, c)
	}
	l.mu.Unlock()
	for _, c := range live {
		// The socket, not the wrapper: a handler blocked in a read fails,
		// returns, and closes the wrapper, which is what is waited for.
		// (Outside the lock: a TLS close may wait on its write.)
		c.Conn.Close()
	}
	deadline := time.Now().Add(timeout)
	if l.accepting != nil { // a connection Accept just gave is counted
		select {
		case <-l.accepting:
		case <-time.After(time.Until(deadline)):
		}
	}
	for {
		l.mu.Lock()
		n := len(l.live) + l.sorting
		l.mu.Unlock()
		if n == 0 || time.Now().After(deadline) {
			return n
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (l *tlsLayer) Close() error {
	l.closeMu.Do(func() { close(l.closed) })
	return l.ln.Close()
}

func (l *tlsLayer) Addr() net.Addr {
	if l.advertise != nil {
		return l.advertise
	}
	return l.ln.Addr()
}

func (l *tlsLayer) Dial(addr raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	return dialTLS(string(addr), l.client, timeout)
}

// dialTLS dials a replica's port over mutual TLS.
func dialTLS(addr string, client *tls.Config, timeout time.Duration) (net.Conn, error) {
	d := &net.Dialer{Timeout: timeout}
	cfg := client.Clone()
	if host, _, err := net.SplitHostPort(addr); err == nil && cfg.ServerName == "" {
		cfg.ServerName = host
	}
	return tls.DialWithDialer(d, "tcp", addr, cfg)
}

// peekedConn is a Raft connection whose first bytes were read into r.
type peekedConn struct {
	net.Conn
	r     *bufio.Reader
	layer *tlsLayer
}

func (c *peekedConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func (c *peekedConn) Close() error {
	c.layer.mu.Lock()
	delete(c.layer.live, c)
	c.layer.mu.Unlock()
	return c.Conn.Close()
}

package iam

import (
	"bufio"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// acceptedConn hands l a connection as Raft's transport gets one.
func acceptedConn(t *testing.T, l *tlsLayer) net.Conn {
	t.Helper()
	a, b := net.Pipe()
	t.Cleanup(func() { b.Close() })
	go func() { l.raftIn <- &peekedConn{Conn: a, r: bufio.NewReader(a), layer: l} }()
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// drain returns only once each connection's handler let go of it: a
// handler still writing a heartbeat's term to the store when the store
// closed panicked a replica.
func TestDrainWaitsForRaftsConnectionHandlers(t *testing.T) {
	l := &tlsLayer{raftIn: make(chan net.Conn), closed: make(chan struct{}), live: map[*peekedConn]struct{}{}}
	c := acceptedConn(t, l)
	var done atomic.Bool
	go func() {
		time.Sleep(100 * time.Millisecond) // the heartbeat's store write
		buf := make([]byte, 1)
		c.Read(buf) //nolint:errcheck // fails: drain closed the socket
		done.Store(true)
		c.Close()
	}()
	if n := l.drain(10 * time.Second); n != 0 {
		t.Fatalf("%d connections held after drain", n)
	}
	if !done.Load() {
		t.Fatal("drain returned while the handler still held its connection")
	}
}

func TestDrainGivesUpAtItsTimeout(t *testing.T) {
	l := &tlsLayer{raftIn: make(chan net.Conn), closed: make(chan struct{}), live: map[*peekedConn]struct{}{}}
	acceptedConn(t, l) // a handler that never lets go
	if n := l.drain(20 * time.Millisecond); n != 1 {
		t.Fatalf("drain reported %d held connections, want 1", n)
	}
}

// A connection Accept takes after drain began is closed, not handed to
// Raft: drain would otherwise wait its whole timeout for it.
func TestAcceptAfterDrainHandsRaftNothing(t *testing.T) {
	l := &tlsLayer{raftIn: make(chan net.Conn), closed: make(chan struct{}), live: map[*peekedConn]struct{}{}}
	if n := l.drain(time.Second); n != 0 {
		t.Fatalf("drain of nothing: %d", n)
	}
	a, b := net.Pipe()
	defer b.Close()
	go func() { l.raftIn <- &peekedConn{Conn: a, r: bufio.NewReader(a), layer: l} }()
	if c, err := l.Accept(); err == nil {
		t.Fatalf("Accept after drain handed Raft %v", c)
	}
	if len(l.live) != 0 {
		t.Fatalf("%d connections tracked after drain", len(l.live))
	}
}

// A stopping replica answers a request whose connection it accepted
// before its listener closed: drain waits for it. A create was lost so
// when the IAM leader was upgraded ("its answer was lost ... connection
// reset by peer"): the process ended between the TLS handshake and the
// answer.
func TestDrainWaitsForARequestAcceptedBeforeClose(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	entered, answered := make(chan struct{}), make(chan struct{})
	l := &tlsLayer{ln: ln, raftIn: make(chan net.Conn), closed: make(chan struct{}), live: map[*peekedConn]struct{}{}, accepting: make(chan struct{})}
	l.serve = func(c net.Conn, br *bufio.Reader) {
		defer c.Close()
		op, _, err := readFrame(br)
		if err != nil {
			t.Errorf("read the request: %v", err)
			return
		}
		close(entered)
		time.Sleep(200 * time.Millisecond)        // the request's work
		writeFrame(c, byte(op), []byte("answer")) //nolint:errcheck // read below
		close(answered)
	}
	go l.run()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte{requestMagic}); err != nil {
		t.Fatal(err)
	}
	if err := writeFrame(c, codeOK, []byte("q")); err != nil {
		t.Fatal(err)
	}
	<-entered
	l.Close()
	if n := l.drain(5 * time.Second); n != 0 {
		t.Fatalf("drain left %d connections", n)
	}
	select {
	case <-answered:
	default:
		t.Fatal("drain returned before the request it accepted was answered")
	}
	_, out, err := readFrame(bufio.NewReader(c))
	if err != nil || string(out) != "answer" {
		t.Fatalf("the request's answer: %q %v", out, err)
	}
}

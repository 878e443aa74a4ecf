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

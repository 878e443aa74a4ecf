package agentlink

import (
	"bytes"
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// Agent authentication [ours]. The edge's socket is in the sandbox (the
// agent dials it from there), so root in the sandbox can dial it too, and
// an impostor that answered the edge's calls could forge what a grader
// reads. The edge therefore talks only to the agent it started:
//
//   - each sandbox has a key the edge made (Auth.Key, kept in its record
//     on the node, never in the sandbox's files or environment);
//   - the first connection of the sandbox's life is given the key, on that
//     connection: nothing but the agent runs in a sandbox until its agent
//     has connected (every other process is started by the agent, at the
//     edge's request), so that connection is the agent's. From then on
//     (Auth.Issued) every connection must present the key;
//   - the agent keeps the key in its memory, which no process of the
//     sandbox can read (Protect: not dumpable, no CAP_SYS_PTRACE), and
//     presents it at every reconnect (an edge restart, a snapshot's
//     detach); a restored copy's agent has its source's key, and its record
//     gets it from the snapshot.
//
// The handshake comes before HTTP/2 on the agent's connection:
//
//	agent → edge: "DSEC-AGENT/1 " + 64 hex digits of the key, or 64 "-" when it has none, "\n"
//	edge → agent: "OK " + 64 hex digits of the key "\n"; or the edge closes the connection
//
// A VM's link is its hypervisor's serial port, not a socket in the guest:
// its links have no Auth and its agent sends no hello.

// KeyLen is the length of a key in hex digits.
const KeyLen = 64

const (
	helloPrefix = "DSEC-AGENT/1 "
	helloLen    = len(helloPrefix) + KeyLen + 1
	replyPrefix = "OK "
	replyLen    = len(replyPrefix) + KeyLen + 1
	// handshakeTimeout bounds the hello: a connection that says nothing
	// holds a goroutine no longer.
	handshakeTimeout = 5 * time.Second
)

var noKey = bytes.Repeat([]byte{'-'}, KeyLen)

// NewKey returns a fresh random key.
func NewKey() string {
	var b [KeyLen / 2]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return hex.EncodeToString(b[:])
}

// ValidKey reports whether k has a key's form.
func ValidKey(k string) bool {
	if len(k) != KeyLen {
		return false
	}
	_, err := hex.DecodeString(k)
	return err == nil
}

// Auth is how an edge's link knows its agent.
type Auth struct {
	// Key is the sandbox's agent key (NewKey).
	Key string
	// Issued reports that the agent has the key: then every connection
	// must present it. Until then the first connection is given it.
	Issued bool

	mu sync.Mutex // guards Issued once the link runs
}

// ErrImpostor is a connection the link refused: it did not present the
// sandbox's agent key.
var ErrImpostor = errors.New("agent connection refused: it did not present the sandbox's agent key")

// accept runs the edge's side of the handshake on c.
func (a *Auth) accept(c net.Conn) error {
	c.SetDeadline(time.Now().Add(handshakeTimeout)) //nolint:errcheck // a Unix socket has deadlines
	defer c.SetDeadline(time.Time{})                //nolint:errcheck // as above
	hello := make([]byte, helloLen)
	if _, err := io.ReadFull(c, hello); err != nil {
		return fmt.Errorf("agent hello: %w", err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.check(hello); err != nil {
		return err
	}
	if _, err := io.WriteString(c, replyPrefix+a.Key+"\n"); err != nil {
		return fmt.Errorf("agent handshake: %w", err)
	}
	a.Issued = true
	return nil
}

// check decides on a hello: the key presented, or none while the key has
// not been issued. Callers hold a.mu.
func (a *Auth) check(hello []byte) error {
	if len(hello) != helloLen || !bytes.HasPrefix(hello, []byte(helloPrefix)) || hello[helloLen-1] != '\n' {
		return fmt.Errorf("%w (no hello)", ErrImpostor)
	}
	presented := hello[len(helloPrefix) : helloLen-1]
	switch {
	case subtle.ConstantTimeCompare(presented, []byte(a.Key)) == 1:
		return nil // the agent, reconnecting
	case a.Issued:
		return ErrImpostor
	case !bytes.Equal(presented, noKey):
		return fmt.Errorf("%w (a wrong key before any was issued)", ErrImpostor)
	}
	return nil
}

// hello runs the agent's side of the handshake on c: it presents key (""
// for none) and returns the key the edge answers with.
func hello(c net.Conn, key string) (string, error) {
	c.SetDeadline(time.Now().Add(handshakeTimeout)) //nolint:errcheck // a Unix socket has deadlines
	defer c.SetDeadline(time.Time{})                //nolint:errcheck // as above
	k := noKey
	if key != "" {
		k = []byte(key)
	}
	if _, err := c.Write(append(append([]byte(helloPrefix), k...), '\n')); err != nil {
		return "", err
	}
	reply := make([]byte, replyLen)
	if _, err := io.ReadFull(c, reply); err != nil {
		return "", fmt.Errorf("the edge refused this agent or closed: %w", err)
	}
	got := string(reply[len(replyPrefix) : replyLen-1])
	if !bytes.HasPrefix(reply, []byte(replyPrefix)) || reply[replyLen-1] != '\n' || !ValidKey(got) {
		return "", errors.New("the edge's answer to the hello is malformed")
	}
	if key != "" && got != key {
		return "", errors.New("the edge answered with another key")
	}
	return got, nil
}

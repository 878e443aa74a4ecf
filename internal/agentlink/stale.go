package agentlink

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
)

// A VM's agent port is a byte stream its hypervisor hands from one host
// connection to the next. What the agent wrote after its host had gone (a
// closing session's GOAWAY, a WINDOW_UPDATE) can wait in the port, and in
// a snapshot's device state, and reach the next connection before the new
// session's first frame: Go's HTTP/2 client then ends the connection
// ("protocol error: received GOAWAY before a SETTINGS frame"), the guest
// reconnects a second later, and under load (64 copies of one snapshot)
// the same can happen again. skipToSettings drops whole frames until the
// server's first SETTINGS; the session starts there.

const (
	frameHeaderLen = 9
	frameSettings  = 0x4
	flagAck        = 0x1
	// maxStaleBytes bounds what is skipped: more is not a stale session's
	// tail, and the connection fails as it would have.
	maxStaleBytes = 1 << 20
)

// staleSkippingConn is a connection from a VM's agent whose reads start at
// the server's first SETTINGS frame.
type staleSkippingConn struct {
	net.Conn
	started bool   // the first SETTINGS was found; reads pass through
	pending []byte // its header, returned before the rest
	// Skipped counts the bytes dropped before it.
	skipped int
}

func (c *staleSkippingConn) Read(p []byte) (int, error) {
	if !c.started {
		if err := c.skip(); err != nil {
			return 0, err
		}
	}
	if len(c.pending) > 0 {
		n := copy(p, c.pending)
		c.pending = c.pending[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// CloseWrite half-closes the connection underneath (Link.Detach).
func (c *staleSkippingConn) CloseWrite() error {
	if hc, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return hc.CloseWrite()
	}
	return nil
}

// skip reads frame headers, dropping each frame, until a SETTINGS frame
// that is not an acknowledgement.
func (c *staleSkippingConn) skip() error {
	for {
		h := make([]byte, frameHeaderLen)
		if _, err := io.ReadFull(c.Conn, h); err != nil {
			return err
		}
		length := int(binary.BigEndian.Uint32(append([]byte{0}, h[:3]...)))
		if h[3] == frameSettings && h[4]&flagAck == 0 && binary.BigEndian.Uint32(h[5:9])&0x7fffffff == 0 {
			c.started, c.pending = true, h
			return nil
		}
		c.skipped += frameHeaderLen + length
		if c.skipped > maxStaleBytes {
			return fmt.Errorf("agent link: %d bytes before the agent's first SETTINGS frame", c.skipped)
		}
		if _, err := io.CopyN(io.Discard, c.Conn, int64(length)); err != nil {
			return err
		}
	}
}

package agentlink

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"
)

// VirtioPrefix names a virtio-serial port instead of a Unix socket in
// Dialer.Path ("virtio-port:dsec.agent"): inside a microvm the host's
// QEMU connects the port to the edge's socket, and the agent serves the
// same HTTP/2 on the port. A host that goes away reads as end of file; the
// agent opens the port again, as it would dial again.
const VirtioPrefix = "virtio-port:"

// VsockPrefix names a vsock address ("vsock:2:1024", CID and port)
// instead of a Unix socket: a Firecracker guest's connections to the
// host's CID 2 reach the Unix socket Firecracker was given for that port,
// which leads to the edge's socket.
const VsockPrefix = "vsock:"

// dial opens the edge connection that path names.
func dial(ctx context.Context, path string) (net.Conn, error) {
	if addr, ok := strings.CutPrefix(path, VsockPrefix); ok {
		cid, port, err := parseVsock(addr)
		if err != nil {
			return nil, err
		}
		return dialVsock(cid, port)
	}
	name, ok := strings.CutPrefix(path, VirtioPrefix)
	if !ok {
		return (&net.Dialer{}).DialContext(ctx, "unix", path)
	}
	dev, err := findVirtioPort(name)
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	return &portConn{File: f, name: name}, nil
}

// findVirtioPort is the device of the port called name.
func findVirtioPort(name string) (string, error) {
	ports, _ := filepath.Glob("/sys/class/virtio-ports/*/name")
	for _, p := range ports {
		if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) == name {
			return "/dev/" + filepath.Base(filepath.Dir(p)), nil
		}
	}
	return "", fmt.Errorf("no virtio-serial port named %q", name)
}

// portConn is a virtio-serial port as a net.Conn. Once a read found the
// host gone, writes are dropped: the port buffers what the guest writes
// while no host is connected and would hand it to the next one, whose
// HTTP/2 session it would break (a closing session's GOAWAY, first).
type portConn struct {
	*os.File
	name string
	gone atomic.Bool
}

func (c *portConn) Read(p []byte) (int, error) {
	n, err := c.File.Read(p)
	if err != nil {
		c.gone.Store(true)
	}
	return n, err
}

func (c *portConn) Write(p []byte) (int, error) {
	if c.gone.Load() {
		return 0, net.ErrClosed
	}
	return c.File.Write(p)
}

func (c *portConn) LocalAddr() net.Addr  { return portAddr(c.name) }
func (c *portConn) RemoteAddr() net.Addr { return portAddr("host") }

// SetDeadline and its kin work when the runtime polls the device; the
// HTTP/2 server sets none of its own.
func (c *portConn) SetDeadline(t time.Time) error {
	c.File.SetDeadline(t) //nolint:errcheck // a device the poller cannot watch has none
	return nil
}

func (c *portConn) SetReadDeadline(t time.Time) error {
	c.File.SetReadDeadline(t) //nolint:errcheck // as above
	return nil
}

func (c *portConn) SetWriteDeadline(t time.Time) error {
	c.File.SetWriteDeadline(t) //nolint:errcheck // as above
	return nil
}

type portAddr string

func (a portAddr) Network() string { return "virtio-serial" }
func (a portAddr) String() string  { return string(a) }

package agentlink

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// parseVsock reads "CID:PORT".
func parseVsock(addr string) (cid, port uint32, err error) {
	c, p, ok := strings.Cut(addr, ":")
	if ok {
		var c64, p64 uint64
		if c64, err = strconv.ParseUint(c, 10, 32); err == nil {
			if p64, err = strconv.ParseUint(p, 10, 32); err == nil {
				return uint32(c64), uint32(p64), nil
			}
		}
	}
	return 0, 0, fmt.Errorf("vsock address %q: want %sCID:PORT, two numbers", addr, VsockPrefix)
}

// dialVsock connects to cid:port; the socket is non-blocking, so the
// runtime's poller serves it like any other connection.
func dialVsock(cid, port uint32) (net.Conn, error) {
	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("vsock socket: %w", err)
	}
	if err := unix.Connect(fd, &unix.SockaddrVM{CID: cid, Port: port}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("vsock connect %d:%d: %w", cid, port, err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), fmt.Sprintf("vsock:%d:%d", cid, port))
	defer f.Close() // FileConn holds its own copy
	return net.FileConn(f)
}

package rpcproxy

import (
	"io"
	"net"
)

// Splice copies a to b and b to a until both directions end; the end of
// one direction half-closes the other side (or closes it when it cannot
// half-close), so a request-then-response protocol sees its EOF.
func Splice(a, b net.Conn) {
	done := make(chan struct{}, 2)
	cp := func(dst, src net.Conn) {
		io.Copy(dst, src) //nolint:errcheck // ends with either side
		if cw, ok := dst.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite() //nolint:errcheck // the other direction may go on
		} else {
			dst.Close()
		}
		done <- struct{}{}
	}
	go cp(a, b)
	go cp(b, a)
	<-done
	<-done
}

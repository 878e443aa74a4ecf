package aether

import (
	"errors"
	"os"
	"syscall"
	"time"
)

// drainMax bounds what a pump takes from a stream's buffer once its read
// deadline has passed (a pipe holds 64 KiB, a terminal 4 KiB; a writer that
// keeps filling it is cut here).
const drainMax = 1 << 20

// pumpOutput reads f until it ends and hands each chunk to publish. When a
// read deadline ends the reading, what f already holds is still taken.
func pumpOutput(f *os.File, publish func([]byte)) {
	buf := make([]byte, 32*1024)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			publish(append([]byte(nil), buf[:n]...))
		}
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			drainBuffered(f, buf, publish)
		}
		return
	}
}

// drainBuffered takes what f holds now, without waiting for more: one
// non-blocking read at a time until the buffer is empty, the stream ends, or
// drainMax bytes were taken.
func drainBuffered(f *os.File, buf []byte, publish func([]byte)) {
	if f.SetReadDeadline(time.Time{}) != nil {
		return
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	for taken := 0; taken < drainMax; {
		var n int
		var rerr error
		if err := rc.Read(func(fd uintptr) bool {
			n, rerr = syscall.Read(int(fd), buf)
			return true // one attempt: never wait for more
		}); err != nil {
			return
		}
		if n <= 0 || rerr != nil {
			return // empty (EAGAIN), ended (0, EIO) or failed
		}
		publish(append([]byte(nil), buf[:n]...))
		taken += n
	}
}

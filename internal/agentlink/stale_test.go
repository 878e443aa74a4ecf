package agentlink

import (
	"bytes"
	"io"
	"net"
	"testing"
)

// frame is an HTTP/2 frame of typ with flags on stream, carrying payload.
func frame(typ, flags byte, stream uint32, payload []byte) []byte {
	n := len(payload)
	h := []byte{byte(n >> 16), byte(n >> 8), byte(n), typ, flags, byte(stream >> 24), byte(stream >> 16), byte(stream >> 8), byte(stream)}
	return append(h, payload...)
}

// A stale session's frames before the agent's SETTINGS are dropped whole;
// everything from the SETTINGS on passes as it came.
func TestStaleFramesBeforeSettingsAreSkipped(t *testing.T) {
	settings := frame(0x4, 0, 0, []byte{0, 3, 0, 0, 0x10, 0})
	rest := frame(0x8, 0, 0, []byte{0, 0, 0, 1}) // a WINDOW_UPDATE of the new session
	stale := bytes.Join([][]byte{
		frame(0x7, 0, 0, make([]byte, 8)),    // GOAWAY
		frame(0x4, 0x1, 0, nil),              // a SETTINGS acknowledgement
		frame(0x6, 0, 0, make([]byte, 8)),    // PING
		frame(0x8, 0, 3, []byte{0, 0, 1, 0}), // WINDOW_UPDATE on a stream
	}, nil)
	a, b := net.Pipe()
	go func() {
		b.Write(append(append(stale, settings...), rest...)) //nolint:errcheck // read below
		b.Close()
	}()
	c := &staleSkippingConn{Conn: a}
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatal(err)
	}
	if want := append(append([]byte{}, settings...), rest...); !bytes.Equal(got, want) {
		t.Fatalf("read %x, want %x", got, want)
	}
	if c.skipped != len(stale) {
		t.Fatalf("skipped %d bytes, want %d", c.skipped, len(stale))
	}
}

// A stream that never brings a SETTINGS frame fails once past the bound,
// or at its end.
func TestNoSettingsFails(t *testing.T) {
	a, b := net.Pipe()
	go func() {
		for range 20 {
			if _, err := b.Write(frame(0x0, 0, 1, make([]byte, 64<<10))); err != nil {
				return
			}
		}
		b.Close()
	}()
	if _, err := io.ReadAll(&staleSkippingConn{Conn: a}); err == nil {
		t.Fatal("1.3 MB of DATA frames before any SETTINGS read without an error")
	}
	a.Close()
}

func FuzzStaleSkippingConn(f *testing.F) {
	f.Add(frame(0x4, 0, 0, nil))
	f.Add(append(frame(0x7, 0, 0, make([]byte, 8)), frame(0x4, 0, 0, nil)...))
	f.Fuzz(func(t *testing.T, data []byte) {
		a, b := net.Pipe()
		go func() { b.Write(data); b.Close() }() //nolint:errcheck // read below
		io.ReadAll(&staleSkippingConn{Conn: a})  //nolint:errcheck // must not panic or hang
		a.Close()
	})
}

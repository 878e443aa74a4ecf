package aether

import (
	"bytes"
	"os"
	"testing"
	"time"
)

// A deadline that passed before the pump read (a starved agent sees the
// timer before the poller sees the data) still leaves the written output
// delivered, and the pump returns without waiting for the writer to close.
func TestPumpOutputTakesBufferedOutputAfterDeadline(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	// The writer stays open, as a background child holding stdout does.
	defer w.Close()
	// More than one read's worth.
	want := bytes.Repeat([]byte("last line\n"), 10000)
	go w.Write(want) //nolint:errcheck // checked through what the pump got
	time.Sleep(50 * time.Millisecond)
	if err := r.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	var got []byte
	done := make(chan struct{})
	go func() {
		defer close(done)
		pumpOutput(r, func(b []byte) { got = append(got, b...) })
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the pump waited for a writer that keeps its end open")
	}
	// The writer goroutine may still hold some once the pipe's buffer filled;
	// everything the pipe held when the deadline passed must be there.
	if len(got) == 0 || !bytes.Equal(got, want[:len(got)]) {
		t.Fatalf("pumped %d bytes, not a prefix of the %d written", len(got), len(want))
	}
}

// Without a deadline the pump reads until the stream ends.
func TestPumpOutputReadsToTheEnd(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	go func() {
		w.Write([]byte("a\n")) //nolint:errcheck
		time.Sleep(20 * time.Millisecond)
		w.Write([]byte("b\n")) //nolint:errcheck
		w.Close()
	}()
	var got []byte
	pumpOutput(r, func(b []byte) { got = append(got, b...) })
	if string(got) != "a\nb\n" {
		t.Fatalf("pumped %q", got)
	}
}

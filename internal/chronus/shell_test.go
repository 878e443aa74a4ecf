package chronus

import (
	"bytes"
	"testing"
)

func TestMarkerScannerAcrossChunks(t *testing.T) {
	nonce := "dsecabc"
	stream := []byte("line one\nno newline\n\x1edsecabc 3 /tmp/x y\nafter")
	for split := 0; split <= len(stream); split++ {
		m := newMarkerScanner(nonce)
		var out bytes.Buffer
		out.Write(m.feed(stream[:split]))
		out.Write(m.feed(stream[split:]))
		if !m.done() {
			t.Fatalf("split %d: marker not found", split)
		}
		if out.String() != "line one\nno newline" {
			t.Fatalf("split %d: output %q", split, out.String())
		}
		if code, pwd := m.status(); code != 3 || pwd != "/tmp/x y" {
			t.Fatalf("split %d: status %d %q", split, code, pwd)
		}
	}
}

func TestRingLogKeepsNewest(t *testing.T) {
	r := newRingLog(10)
	if off := r.write([]byte("abcdef")); off != 0 {
		t.Fatalf("first offset %d", off)
	}
	if off := r.write([]byte("ghijkl")); off != 6 {
		t.Fatalf("second offset %d", off)
	}
	data, next, first := r.read(0, 100)
	if first == 0 || next != 12 || string(data) != "abcdefghijkl"[first:] {
		t.Fatalf("read = %q next %d first %d", data, next, first)
	}
	r.write(bytes.Repeat([]byte("z"), 25))
	data, next, first = r.read(0, 100)
	if len(data) != 10 || next != 37 || first != 27 {
		t.Fatalf("after big write: %q next %d first %d", data, next, first)
	}
}

func FuzzMarkerScanner(f *testing.F) {
	f.Add([]byte("out\n\x1edsecn 0 /\n"), 3)
	f.Add([]byte("\x1e\x1e\n\n\x1edsec"), 1)
	f.Fuzz(func(t *testing.T, data []byte, split int) {
		m := newMarkerScanner("dsecn")
		if split < 0 || split > len(data) {
			split = len(data) / 2
		}
		var out bytes.Buffer
		out.Write(m.feed(data[:split]))
		out.Write(m.feed(data[split:]))
		out.Write(m.flush())
		if !m.found && !bytes.Equal(out.Bytes(), data) {
			t.Fatalf("without a marker the output must be the input: %q vs %q", out.Bytes(), data)
		}
		if m.found && !bytes.HasPrefix(data, out.Bytes()) {
			t.Fatalf("output %q is not a prefix of %q", out.Bytes(), data)
		}
		m.status()
	})
}

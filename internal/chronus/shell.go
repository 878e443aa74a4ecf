// Package chronus keeps persistent shell sessions inside a sandbox [paper]:
// one long-lived shell per session, so the working directory, exported
// variables, functions and background jobs survive between commands. Each
// command line is handed to the shell's eval (a syntax error cannot swallow
// what follows), with stdin from /dev/null (it cannot read the next command),
// and is followed by a marker carrying a per-command nonce, the exit status
// and the working directory. Output is capped per command and recorded in a
// capped log per session [ours].
package chronus

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"strings"
)

// markerByte starts every marker line; it is unusual in normal output and the
// nonce makes a clash practically impossible.
const markerByte = '\x1e'

// wrap returns the text written to the shell for one command line.
func wrap(command, nonce string) string {
	var b strings.Builder
	b.WriteString("eval '")
	b.WriteString(strings.ReplaceAll(command, "'", `'\''`))
	b.WriteString("' </dev/null\n")
	// $? is read before printf runs, so it is eval's status.
	b.WriteString(`printf '\n\036%s %d %s\n' '` + nonce + `' "$?" "$PWD"` + "\n")
	b.WriteString(`printf '\n\036%s\n' '` + nonce + `' >&2` + "\n")
	return b.String()
}

func newNonce() string {
	b := make([]byte, 12)
	if _, err := rand.Read(b); err != nil {
		panic("chronus: crypto/rand failed: " + err.Error())
	}
	return "dsec" + hex.EncodeToString(b)
}

// markerScanner finds the end marker in one output stream. Bytes before the
// marker are the command's output; the newline the wrapper adds in front of
// the marker is removed.
type markerScanner struct {
	prefix  []byte // "\n\x1e" + nonce
	pending []byte // bytes held back because they may start the marker
	found   bool
	tail    []byte // bytes after the prefix, up to the end of the marker line
	line    []byte // the marker line's fields once complete
}

func newMarkerScanner(nonce string) *markerScanner {
	return &markerScanner{prefix: append([]byte{'\n', markerByte}, nonce...)}
}

// feed consumes p and returns the part of it that is command output. After
// the marker line is complete, done reports true.
func (m *markerScanner) feed(p []byte) (out []byte) {
	if m.found {
		m.consumeTail(p)
		return nil
	}
	data := append(m.pending, p...)
	m.pending = nil
	if i := bytes.Index(data, m.prefix); i >= 0 {
		m.found = true
		m.consumeTail(data[i+len(m.prefix):])
		return data[:i]
	}
	// Hold back the longest suffix that is a prefix of the marker.
	keep := 0
	for k := min(len(m.prefix)-1, len(data)); k > 0; k-- {
		if bytes.HasPrefix(m.prefix, data[len(data)-k:]) {
			keep = k
			break
		}
	}
	m.pending = append([]byte(nil), data[len(data)-keep:]...)
	return data[:len(data)-keep]
}

func (m *markerScanner) consumeTail(p []byte) {
	if m.line != nil {
		return
	}
	m.tail = append(m.tail, p...)
	if i := bytes.IndexByte(m.tail, '\n'); i >= 0 {
		m.line = m.tail[:i]
	}
}

// flush returns output held back when no marker will come (the shell exited).
func (m *markerScanner) flush() []byte {
	if m.found {
		return nil
	}
	p := m.pending
	m.pending = nil
	return p
}

func (m *markerScanner) done() bool { return m.line != nil }

// status parses " <code> <pwd>" from the stdout marker line.
func (m *markerScanner) status() (code int, pwd string) {
	fields := strings.SplitN(strings.TrimPrefix(string(m.line), " "), " ", 2)
	code, err := strconv.Atoi(fields[0])
	if err != nil {
		code = -1
	}
	if len(fields) == 2 {
		pwd = fields[1]
	}
	return code, pwd
}

package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"
)

// qmpConn is a session on a QEMU's monitor socket (QMP: JSON lines; a
// greeting, qmp_capabilities, then commands). A snapshot or restore runs
// its commands and polls the migration on one session.
type qmpConn struct {
	c   net.Conn
	r   *bufio.Reader
	enc *json.Encoder
}

// dialQMP opens a session on sock; ctx's deadline bounds all of it.
func dialQMP(ctx context.Context, sock string) (*qmpConn, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", sock, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl) //nolint:errcheck // a failed read says it
	} else {
		c.SetDeadline(time.Now().Add(30 * time.Second)) //nolint:errcheck // as above
	}
	q := &qmpConn{c: c, r: bufio.NewReader(c), enc: json.NewEncoder(c)}
	if _, err := q.read(); err != nil { // the greeting
		c.Close()
		return nil, fmt.Errorf("qmp greeting: %w", err)
	}
	if _, err := q.call("qmp_capabilities", nil); err != nil {
		c.Close()
		return nil, err
	}
	return q, nil
}

func (q *qmpConn) Close() error { return q.c.Close() }

// read skips events until a reply (or the greeting) comes.
func (q *qmpConn) read() (map[string]json.RawMessage, error) {
	for {
		line, err := q.r.ReadBytes('\n')
		if err != nil {
			return nil, err
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(line, &m); err != nil {
			return nil, fmt.Errorf("qmp: %q: %w", line, err)
		}
		if _, event := m["event"]; !event {
			return m, nil
		}
	}
}

// call runs one command and returns its "return".
func (q *qmpConn) call(cmd string, args any) (json.RawMessage, error) {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	if err := q.enc.Encode(req); err != nil {
		return nil, err
	}
	m, err := q.read()
	if err != nil {
		return nil, err
	}
	if e, ok := m["error"]; ok {
		return nil, fmt.Errorf("qmp %s: %s", cmd, e)
	}
	return m["return"], nil
}

// qmp runs one command on a session of its own.
func qmp(ctx context.Context, sock, command string, args any) (json.RawMessage, error) {
	q, err := dialQMP(ctx, sock)
	if err != nil {
		return nil, err
	}
	defer q.Close()
	return q.call(command, args)
}

// ignoreShared has migration leave out RAM that is a shared file (the
// guest's RAM, which a snapshot keeps as the file itself).
var ignoreShared = ignoringShared(true)

// ignoringShared sets QEMU's x-ignore-shared migration capability: on,
// RAM mapped shared stays out of the stream (it is in its file); off, the
// stream carries all of it.
func ignoringShared(on bool) map[string]any {
	return map[string]any{"capabilities": []map[string]any{{"capability": "x-ignore-shared", "state": on}}}
}

// qemuChardev is one entry of QMP query-chardev.
type qemuChardev struct {
	Label    string `json:"label"`
	Filename string `json:"filename"`
	// FrontendOpen is the guest's side: whether it has the port open.
	FrontendOpen bool `json:"frontend-open"`
}

// agentChannel is the agent's chardev as QMP query-chardev reports it;
// found is false when QEMU lists none (or a reply it cannot parse, which
// a poller asks again for).
func agentChannel(q *qmpConn) (ch qemuChardev, found bool, err error) {
	out, err := q.call("query-chardev", nil)
	if err != nil {
		return qemuChardev{}, false, err
	}
	var devs []qemuChardev
	json.Unmarshal(out, &devs) //nolint:errcheck // not found: asked again
	for _, d := range devs {
		if d.Label == "agent" {
			return d, true, nil
		}
	}
	return qemuChardev{}, false, nil
}

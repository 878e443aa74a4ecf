package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"
)

// qmp runs one command on a QEMU's monitor socket (QMP: JSON lines; a
// greeting, qmp_capabilities, then commands) and returns its "return".
func qmp(ctx context.Context, sock, command string, args any) (json.RawMessage, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, fmt.Errorf("qmp %s: %w", sock, err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl) //nolint:errcheck // a failed read says it
	} else {
		c.SetDeadline(time.Now().Add(30 * time.Second)) //nolint:errcheck // as above
	}
	r := bufio.NewReader(c)
	enc := json.NewEncoder(c)
	// read skips events until a reply (or the greeting) comes.
	read := func() (map[string]json.RawMessage, error) {
		for {
			line, err := r.ReadBytes('\n')
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
	call := func(cmd string, a any) (json.RawMessage, error) {
		req := map[string]any{"execute": cmd}
		if a != nil {
			req["arguments"] = a
		}
		if err := enc.Encode(req); err != nil {
			return nil, err
		}
		m, err := read()
		if err != nil {
			return nil, err
		}
		if e, ok := m["error"]; ok {
			return nil, fmt.Errorf("qmp %s: %s", cmd, e)
		}
		return m["return"], nil
	}
	if _, err := read(); err != nil { // the greeting
		return nil, fmt.Errorf("qmp greeting: %w", err)
	}
	if _, err := call("qmp_capabilities", nil); err != nil {
		return nil, err
	}
	return call(command, args)
}

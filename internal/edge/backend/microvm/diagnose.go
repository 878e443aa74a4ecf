package microvm

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

var _ backend.GuestReporter = (*Backend)(nil)

// GuestReport implements backend.GuestReporter: what the VMM reports of
// a guest whose agent went silent (QEMU: the run state, whether its end of
// the agent's channel is connected to the edge, whether the guest has its
// port open) and the console's last line. A silent agent in a running
// guest whose channel is connected points at the guest; a channel QEMU
// has not reconnected points at the host.
func (b *Backend) GuestReport(ctx context.Context, id sandboxid.ID) string {
	bx, err := b.get(id)
	if err != nil {
		return ""
	}
	v, err := b.vmmOf(bx)
	if err != nil {
		return ""
	}
	d := v.diagnose(ctx, bx)
	if d == "" {
		return ""
	}
	parts := []string{d}
	if line := lastLine(b.ConsoleTail(ctx, id)); line != "" {
		parts = append(parts, "the console's last line: "+line)
	}
	return strings.Join(parts, "; ")
}

// lastLine is the last non-blank line of text.
func lastLine(text string) string {
	text = strings.TrimSpace(text)
	if i := strings.LastIndexByte(text, '\n'); i >= 0 {
		text = text[i+1:]
	}
	return strings.TrimSpace(text)
}

func (q *QEMU) diagnose(ctx context.Context, bx *box) string {
	m, err := dialQMP(ctx, bx.qmpSock())
	if err != nil {
		return ""
	}
	defer m.Close()
	var parts []string
	var st struct {
		Status string `json:"status"`
	}
	if out, err := m.call("query-status", nil); err == nil && json.Unmarshal(out, &st) == nil {
		parts = append(parts, "QEMU reports the guest "+st.Status)
	}
	if ch, found, err := agentChannel(m); err == nil && found {
		parts = append(parts, describeAgentChannel(ch))
	}
	return strings.Join(parts, "; ")
}

// describeAgentChannel says whether QEMU's end of the agent's channel is
// connected to the edge's socket (a client chardev, which QEMU reports
// "disconnected:" until it has reconnected; it tries every second) and
// whether the guest has its port open.
func describeAgentChannel(d qemuChardev) string {
	host := "connected to the edge"
	if strings.HasPrefix(d.Filename, "disconnected:") {
		host = "not connected to the edge"
	}
	guest := "open"
	if !d.FrontendOpen {
		guest = "closed"
	}
	return fmt.Sprintf("the agent's channel is %s, the guest's port %s", host, guest)
}

func (f *Firecracker) diagnose(ctx context.Context, bx *box) string {
	i, err := f.api(bx).info(ctx)
	if err != nil {
		return ""
	}
	return "Firecracker reports the guest " + i.State
}

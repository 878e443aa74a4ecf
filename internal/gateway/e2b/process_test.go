package e2b

import (
	"context"
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"

	envdprocess "github.com/opendsec/opendsec/api/gen/e2b/process"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
)

// brokenStream is an upstream event stream that sends n events and then
// breaks with err once ctx is done.
type brokenStream struct {
	ctx  context.Context
	n    int
	err  error
	sent int
}

func (s *brokenStream) Receive() bool {
	if s.sent < s.n {
		s.sent++
		return true
	}
	<-s.ctx.Done()
	return false
}
func (s *brokenStream) Msg() *agentv1.ProcessEvent { return &agentv1.ProcessEvent{} }
func (s *brokenStream) Err() error                 { return s.err }
func (s *brokenStream) Close() error               { return nil }

// A stream cut on the way (a proxy's reset, "internal") after the call's
// deadline ends as envd's would, deadline_exceeded; before the deadline, or
// without one, the error is passed on as it is.
func TestRelayReportsACutAfterTheDeadlineAsATimeout(t *testing.T) {
	t.Parallel()
	cut := connect.NewError(connect.CodeInternal, errors.New("stream error: stream ID 19; INTERNAL_ERROR; received from peer"))
	get := func(m *agentv1.ProcessEvent) *agentv1.ProcessEvent { return m }
	sent := 0
	send := func(*envdprocess.ProcessEvent) error { sent++; return nil }

	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := relay(ctx, &brokenStream{ctx: ctx, n: 3, err: cut}, get, send)
	if connect.CodeOf(err) != connect.CodeDeadlineExceeded || sent != 3 {
		t.Fatalf("cut after the deadline: %v (code %v), %d events relayed", err, connect.CodeOf(err), sent)
	}

	ctx2, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if err := relay(ctx2, &brokenStream{ctx: ctx2, err: cut}, get, send); connect.CodeOf(err) != connect.CodeInternal {
		t.Fatalf("cut with no deadline passed: %v", err)
	}
}

package aether

import (
	"context"
	"errors"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/spawn"
)

const (
	defaultRunTimeout = 60 * time.Second
	defaultOutputCap  = 1 << 20
	maxOutputCap      = 64 << 20
	keepaliveEvery    = 20 * time.Second
)

type processService struct {
	table *processTable
}

var _ agentv1connect.ProcessServiceHandler = (*processService)(nil)

func (s *processService) Start(ctx context.Context, req *connect.Request[agentv1.StartRequest], stream *connect.ServerStream[agentv1.StartResponse]) error {
	send := func(ev *agentv1.ProcessEvent) error { return stream.Send(&agentv1.StartResponse{Event: ev}) }
	sub := newSubscriber(ctx)
	_, err := s.table.start(req.Msg.GetProcess(), sub)
	var nf *spawn.ErrNotFound
	if errors.As(err, &nf) {
		for _, ev := range notFoundEvents(nf) {
			if err := send(ev); err != nil {
				return err
			}
		}
		return nil
	}
	if err != nil {
		return err
	}
	return forward(ctx, sub, send)
}

// forward sends sub's events until the Exited event or the client leaves.
func forward(ctx context.Context, sub *subscriber, send func(*agentv1.ProcessEvent) error) error {
	tick := time.NewTicker(keepaliveEvery)
	defer tick.Stop()
	for {
		select {
		case ev := <-sub.ch:
			if err := send(ev); err != nil {
				return err
			}
			if ev.GetExited() != nil {
				return nil
			}
		case <-tick.C:
			ka := &agentv1.ProcessEvent{Event: &agentv1.ProcessEvent_Keepalive_{Keepalive: &agentv1.ProcessEvent_Keepalive{}}}
			if err := send(ka); err != nil {
				return err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (s *processService) Connect(ctx context.Context, req *connect.Request[agentv1.ConnectRequest], stream *connect.ServerStream[agentv1.ConnectResponse]) error {
	p, err := s.table.find(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	send := func(ev *agentv1.ProcessEvent) error { return stream.Send(&agentv1.ConnectResponse{Event: ev}) }
	sub := newSubscriber(ctx)
	if exited := p.subscribe(sub); exited != nil {
		return send(exited)
	}
	defer p.unsubscribe(sub)
	if err := send(startedEvent(p.pid, p.tag)); err != nil {
		return err
	}
	return forward(ctx, sub, send)
}

func (s *processService) Run(ctx context.Context, req *connect.Request[agentv1.RunRequest]) (*connect.Response[agentv1.RunResponse], error) {
	cfg := req.Msg.GetProcess()
	if cfg == nil {
		return nil, errdefs.InvalidArgument("process: missing")
	}
	if cfg.Pty != nil || cfg.KeepStdinOpen {
		return nil, errdefs.InvalidArgument("process: pty and keep_stdin_open need Start, not Run")
	}
	capBytes := req.Msg.MaxOutputBytes
	if capBytes == 0 {
		capBytes = defaultOutputCap
	}
	if capBytes > maxOutputCap {
		return nil, errdefs.InvalidArgument("max_output_bytes %d: at most %d", capBytes, maxOutputCap)
	}
	if cfg.TimeoutMs == 0 {
		cfg.TimeoutMs = uint32(defaultRunTimeout / time.Millisecond)
	}
	began := time.Now()
	sub := newSubscriber(ctx)
	p, err := s.table.start(cfg, sub)
	var nf *spawn.ErrNotFound
	if errors.As(err, &nf) {
		return connect.NewResponse(&agentv1.RunResponse{Stderr: []byte(nf.Error() + "\n"), ExitCode: 127}), nil
	}
	if err != nil {
		return nil, err
	}
	out := &agentv1.RunResponse{Pid: uint32(p.pid)}
	stdout, stderr := cappedBuffer{max: capBytes}, cappedBuffer{max: capBytes}
	for {
		select {
		case ev := <-sub.ch:
			switch e := ev.Event.(type) {
			case *agentv1.ProcessEvent_Output_:
				if e.Output.Stream == agentv1.Stream_STREAM_STDERR {
					stderr.write(e.Output.Data)
				} else {
					stdout.write(e.Output.Data)
				}
			case *agentv1.ProcessEvent_Exited_:
				out.Stdout, out.StdoutDropped = stdout.buf, stdout.dropped
				out.Stderr, out.StderrDropped = stderr.buf, stderr.dropped
				out.ExitCode, out.Signal, out.TimedOut = e.Exited.ExitCode, e.Exited.Signal, e.Exited.TimedOut
				out.DurationUs = time.Since(began).Microseconds()
				return connect.NewResponse(out), nil
			}
		case <-ctx.Done():
			// The caller gave up: do not leave the process behind.
			p.signal(syscall.SIGKILL) //nolint:errcheck // it may be gone
			return nil, ctx.Err()
		}
	}
}

// cappedBuffer keeps the first max bytes and counts the rest.
type cappedBuffer struct {
	buf     []byte
	max     uint64
	dropped uint64
}

func (c *cappedBuffer) write(p []byte) {
	room := c.max - uint64(len(c.buf))
	if uint64(len(p)) <= room {
		c.buf = append(c.buf, p...)
		return
	}
	c.buf = append(c.buf, p[:room]...)
	c.dropped += uint64(len(p)) - room
}

func (s *processService) List(ctx context.Context, req *connect.Request[agentv1.ListRequest]) (*connect.Response[agentv1.ListResponse], error) {
	out := &agentv1.ListResponse{}
	self := os.Getpid()
	pageSize := int64(os.Getpagesize())
	for _, pid := range spawn.Pids() {
		if pid == self {
			continue
		}
		st, ok := spawn.ReadStat(pid)
		if !ok {
			continue
		}
		info := &agentv1.ProcessInfo{Pid: uint32(pid), Ppid: uint32(st.PPID), State: st.State, RssBytes: st.RSS * pageSize}
		if raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); err == nil {
			info.Cmdline = strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		}
		info.Uid = uidOf(pid)
		if tag, ok := s.table.tagOf(pid); ok {
			info.Managed, info.Tag = true, tag
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

func uidOf(pid int) uint32 {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				n, _ := strconv.ParseUint(f[0], 10, 32)
				return uint32(n)
			}
		}
	}
	return 0
}

func (s *processService) SendInput(ctx context.Context, req *connect.Request[agentv1.SendInputRequest]) (*connect.Response[agentv1.SendInputResponse], error) {
	p, err := s.table.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if isDone(p) {
		return nil, errdefs.FailedPrecondition("process %d: already exited", p.pid)
	}
	if err := p.writeInput(req.Msg.Data); err != nil {
		return nil, err
	}
	return connect.NewResponse(&agentv1.SendInputResponse{}), nil
}

func (s *processService) CloseStdin(ctx context.Context, req *connect.Request[agentv1.CloseStdinRequest]) (*connect.Response[agentv1.CloseStdinResponse], error) {
	p, err := s.table.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.pty != nil {
		return nil, errdefs.FailedPrecondition("process %d: has a terminal; send Ctrl-D (0x04) instead", p.pid)
	}
	p.closeStdin()
	return connect.NewResponse(&agentv1.CloseStdinResponse{}), nil
}

func (s *processService) SendSignal(ctx context.Context, req *connect.Request[agentv1.SendSignalRequest]) (*connect.Response[agentv1.SendSignalResponse], error) {
	sig := req.Msg.Signal
	if sig <= 0 || sig > 64 {
		return nil, errdefs.InvalidArgument("signal %d: want 1 to 64 (e.g. 15 for SIGTERM, 9 for SIGKILL)", sig)
	}
	p, err := s.table.find(req.Msg.GetProcess())
	if err == nil {
		if err := p.signal(syscall.Signal(sig)); err != nil {
			return nil, errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "signal process %d", p.pid)
		}
		return connect.NewResponse(&agentv1.SendSignalResponse{}), nil
	}
	// Any other process in the sandbox can be signalled by pid.
	pid, ok := req.Msg.GetProcess().GetSelector().(*agentv1.ProcessSelector_Pid)
	if !ok || pid.Pid <= 1 || int(pid.Pid) == os.Getpid() {
		return nil, err
	}
	if kerr := syscall.Kill(int(pid.Pid), syscall.Signal(sig)); kerr != nil {
		if errors.Is(kerr, syscall.ESRCH) {
			return nil, errdefs.NotFound("process %d: no such process", pid.Pid)
		}
		return nil, errdefs.Wrap(errdefs.ErrFailedPrecondition, kerr, "signal process %d", pid.Pid)
	}
	return connect.NewResponse(&agentv1.SendSignalResponse{}), nil
}

func (s *processService) ResizePty(ctx context.Context, req *connect.Request[agentv1.ResizePtyRequest]) (*connect.Response[agentv1.ResizePtyResponse], error) {
	p, err := s.table.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.pty == nil {
		return nil, errdefs.FailedPrecondition("process %d: has no terminal", p.pid)
	}
	if req.Msg.Size == nil || req.Msg.Size.Cols == 0 || req.Msg.Size.Rows == 0 {
		return nil, errdefs.InvalidArgument("size: cols and rows must be at least 1")
	}
	if err := pty.Setsize(p.pty, winsize(req.Msg.Size)); err != nil {
		return nil, errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "resize terminal")
	}
	return connect.NewResponse(&agentv1.ResizePtyResponse{}), nil
}

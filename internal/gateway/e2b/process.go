package e2b

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"syscall"
	"time"

	"connectrpc.com/connect"

	envdprocess "github.com/opendsec/opendsec/api/gen/e2b/process"
	"github.com/opendsec/opendsec/api/gen/e2b/process/envdprocessconnect"
	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// processService is envd's process.Process on top of our ProcessService.
type processService struct{ g *Gateway }

var _ envdprocessconnect.ProcessHandler = (*processService)(nil)

func selector(s *envdprocess.ProcessSelector) *agentv1.ProcessSelector {
	switch v := s.GetSelector().(type) {
	case *envdprocess.ProcessSelector_Pid:
		return &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Pid{Pid: v.Pid}}
	case *envdprocess.ProcessSelector_Tag:
		return &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Tag{Tag: v.Tag}}
	}
	return nil
}

// event turns one of our process events into envd's.
func event(ev *agentv1.ProcessEvent) *envdprocess.ProcessEvent {
	switch e := ev.Event.(type) {
	case *agentv1.ProcessEvent_Started_:
		return &envdprocess.ProcessEvent{Event: &envdprocess.ProcessEvent_Start{Start: &envdprocess.ProcessEvent_StartEvent{Pid: e.Started.Pid}}}
	case *agentv1.ProcessEvent_Output_:
		data := &envdprocess.ProcessEvent_DataEvent{}
		switch e.Output.Stream {
		case agentv1.Stream_STREAM_STDERR:
			data.Output = &envdprocess.ProcessEvent_DataEvent_Stderr{Stderr: e.Output.Data}
		case agentv1.Stream_STREAM_PTY:
			data.Output = &envdprocess.ProcessEvent_DataEvent_Pty{Pty: e.Output.Data}
		default:
			data.Output = &envdprocess.ProcessEvent_DataEvent_Stdout{Stdout: e.Output.Data}
		}
		return &envdprocess.ProcessEvent{Event: &envdprocess.ProcessEvent_Data{Data: data}}
	case *agentv1.ProcessEvent_Exited_:
		x := e.Exited
		end := &envdprocess.ProcessEvent_EndEvent{ExitCode: x.ExitCode, Exited: x.Signal == 0, Status: fmt.Sprintf("exit status %d", x.ExitCode)}
		if x.Signal != 0 {
			end.Status = "signal: " + syscall.Signal(x.Signal).String()
			end.ExitCode = -1
		}
		if x.Error != "" {
			end.Error = &x.Error
		}
		return &envdprocess.ProcessEvent{Event: &envdprocess.ProcessEvent_End{End: end}}
	}
	return &envdprocess.ProcessEvent{Event: &envdprocess.ProcessEvent_Keepalive{Keepalive: &envdprocess.ProcessEvent_KeepAlive{}}}
}

// relay copies our event stream to envd's until it ends. A stream that
// breaks once the call's deadline has passed ends as envd's does, with
// deadline_exceeded (the SDKs' TimeoutException): the agent kills the
// command at that same deadline, and on a loaded node a hop on the way may
// cut the stream first (a proxy's reset, seen as "internal").
func relay[T any](ctx context.Context, in interface {
	Receive() bool
	Msg() T
	Err() error
	Close() error
}, get func(T) *agentv1.ProcessEvent, send func(*envdprocess.ProcessEvent) error) error {
	defer in.Close()
	for in.Receive() {
		ev := event(get(in.Msg()))
		if err := send(ev); err != nil {
			return err
		}
		if ev.GetEnd() != nil {
			return nil // the process ended; a break after it changes nothing
		}
	}
	if err := in.Err(); err != nil && !errors.Is(err, io.EOF) {
		if errors.Is(ctx.Err(), context.DeadlineExceeded) && connect.CodeOf(err) != connect.CodeDeadlineExceeded {
			return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("the call's timeout ran out (the stream then ended with: %v)", err))
		}
		return err
	}
	return nil
}

func (s *processService) Start(ctx context.Context, req *connect.Request[envdprocess.StartRequest], stream *connect.ServerStream[envdprocess.StartResponse]) error {
	call := callOf(ctx)
	p := req.Msg.GetProcess()
	if p.GetCmd() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd: required"))
	}
	cfg := &agentv1.ProcessConfig{
		Args: append([]string{p.GetCmd()}, p.GetArgs()...), Env: p.GetEnvs(), User: call.user,
		Tag: req.Msg.GetTag(), KeepStdinOpen: req.Msg.GetStdin(),
	}
	if p.Cwd != nil {
		cfg.Cwd = resolve(call.user, p.GetCwd())
	}
	if req.Msg.Pty != nil {
		size := req.Msg.GetPty().GetSize()
		cfg.Pty = &agentv1.PtySize{Cols: size.GetCols(), Rows: size.GetRows()}
	}
	// envd kills a command when the call's timeout (Connect-Timeout-Ms, the
	// SDKs' `timeout`, 60 s unless set; 0 is none) runs out, even if it runs
	// in the background; the agent does the same with TimeoutMs.
	if deadline, ok := ctx.Deadline(); ok {
		cfg.TimeoutMs = uint32(min(max(time.Until(deadline).Milliseconds(), 1), math.MaxUint32))
	}
	in, err := s.g.process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: cfg}))
	if err != nil {
		return err
	}
	return relay(ctx, in, func(m *agentv1.StartResponse) *agentv1.ProcessEvent { return m.Event },
		func(ev *envdprocess.ProcessEvent) error { return stream.Send(&envdprocess.StartResponse{Event: ev}) })
}

func (s *processService) Connect(ctx context.Context, req *connect.Request[envdprocess.ConnectRequest], stream *connect.ServerStream[envdprocess.ConnectResponse]) error {
	in, err := s.g.process.Connect(ctx, connect.NewRequest(&agentv1.ConnectRequest{Process: selector(req.Msg.GetProcess())}))
	if err != nil {
		return err
	}
	return relay(ctx, in, func(m *agentv1.ConnectResponse) *agentv1.ProcessEvent { return m.Event },
		func(ev *envdprocess.ProcessEvent) error { return stream.Send(&envdprocess.ConnectResponse{Event: ev}) })
}

func (s *processService) List(ctx context.Context, req *connect.Request[envdprocess.ListRequest]) (*connect.Response[envdprocess.ListResponse], error) {
	resp, err := s.g.process.List(ctx, connect.NewRequest(&agentv1.ListRequest{}))
	if err != nil {
		return nil, err
	}
	out := &envdprocess.ListResponse{}
	for _, p := range resp.Msg.Processes {
		if !p.Managed || len(p.Cmdline) == 0 {
			continue
		}
		info := &envdprocess.ProcessInfo{Pid: p.Pid, Config: &envdprocess.ProcessConfig{Cmd: p.Cmdline[0], Args: p.Cmdline[1:]}}
		if p.Tag != "" {
			tag := p.Tag
			info.Tag = &tag
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

func (s *processService) Update(ctx context.Context, req *connect.Request[envdprocess.UpdateRequest]) (*connect.Response[envdprocess.UpdateResponse], error) {
	if req.Msg.Pty == nil {
		return connect.NewResponse(&envdprocess.UpdateResponse{}), nil
	}
	size := req.Msg.GetPty().GetSize()
	_, err := s.g.process.ResizePty(ctx, connect.NewRequest(&agentv1.ResizePtyRequest{
		Process: selector(req.Msg.GetProcess()), Size: &agentv1.PtySize{Cols: size.GetCols(), Rows: size.GetRows()},
	}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&envdprocess.UpdateResponse{}), nil
}

func inputBytes(in *envdprocess.ProcessInput) []byte {
	if d := in.GetStdin(); d != nil {
		return d
	}
	return in.GetPty()
}

func (s *processService) SendInput(ctx context.Context, req *connect.Request[envdprocess.SendInputRequest]) (*connect.Response[envdprocess.SendInputResponse], error) {
	_, err := s.g.process.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: selector(req.Msg.GetProcess()), Data: inputBytes(req.Msg.GetInput())}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&envdprocess.SendInputResponse{}), nil
}

// StreamInput takes a start message naming the process, then input in order.
func (s *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[envdprocess.StreamInputRequest]) (*connect.Response[envdprocess.StreamInputResponse], error) {
	var sel *agentv1.ProcessSelector
	for stream.Receive() {
		switch e := stream.Msg().Event.(type) {
		case *envdprocess.StreamInputRequest_Start:
			sel = selector(e.Start.GetProcess())
		case *envdprocess.StreamInputRequest_Data:
			if sel == nil {
				return nil, errdefs.ToConnect(errdefs.InvalidArgument("input before the start message naming the process"))
			}
			if _, err := s.g.process.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: sel, Data: inputBytes(e.Data.GetInput())})); err != nil {
				return nil, err
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&envdprocess.StreamInputResponse{}), nil
}

func (s *processService) SendSignal(ctx context.Context, req *connect.Request[envdprocess.SendSignalRequest]) (*connect.Response[envdprocess.SendSignalResponse], error) {
	sig := int32(req.Msg.Signal)
	if sig == 0 {
		sig = int32(envdprocess.Signal_SIGNAL_SIGKILL)
	}
	if _, err := s.g.process.SendSignal(ctx, connect.NewRequest(&agentv1.SendSignalRequest{Process: selector(req.Msg.GetProcess()), Signal: sig})); err != nil {
		return nil, err
	}
	return connect.NewResponse(&envdprocess.SendSignalResponse{}), nil
}

func (s *processService) CloseStdin(ctx context.Context, req *connect.Request[envdprocess.CloseStdinRequest]) (*connect.Response[envdprocess.CloseStdinResponse], error) {
	if _, err := s.g.process.CloseStdin(ctx, connect.NewRequest(&agentv1.CloseStdinRequest{Process: selector(req.Msg.GetProcess())})); err != nil {
		return nil, err
	}
	return connect.NewResponse(&envdprocess.CloseStdinResponse{}), nil
}

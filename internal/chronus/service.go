package chronus

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"sort"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/spawn"
)

// Limits of the service.
const (
	MaxSessions      = 64
	LogCap           = 4 << 20
	defaultTimeout   = 60 * time.Second
	defaultOutputCap = 1 << 20
	maxOutputCap     = 64 << 20
	maxReadChunk     = 1 << 20
)

// Service implements SessionService.
type Service struct {
	sp *spawn.Spawner

	mu       sync.Mutex
	sessions map[string]*session // guarded by mu
}

var _ agentv1connect.SessionServiceHandler = (*Service)(nil)

// New returns a service starting shells with sp.
func New(sp *spawn.Spawner) *Service {
	return &Service{sp: sp, sessions: map[string]*session{}}
}

func shellPath() string {
	for _, p := range []string{"/bin/bash", "/usr/bin/bash", "/bin/sh"} {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
			return p
		}
	}
	return "/bin/sh"
}

func (s *Service) CreateSession(ctx context.Context, req *connect.Request[agentv1.CreateSessionRequest]) (*connect.Response[agentv1.CreateSessionResponse], error) {
	s.mu.Lock()
	n := len(s.sessions)
	s.mu.Unlock()
	if n >= MaxSessions {
		return nil, errdefs.ResourceExhausted("sessions: at most %d open in one sandbox; close one first", MaxSessions)
	}
	shell := shellPath()
	args := []string{shell}
	if shell != "/bin/sh" {
		args = append(args, "--noprofile", "--norc")
	}
	r := spawn.Request{Args: args, Env: req.Msg.Env, Cwd: req.Msg.Cwd, User: req.Msg.User}
	res, err := s.sp.Resolve(r)
	if err != nil {
		return nil, err
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	r.Files = []*os.File{inR, outW, errW}
	proc, err := s.sp.Start(res, r)
	inR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		errR.Close()
		return nil, err
	}
	idb := make([]byte, 6)
	rand.Read(idb) //nolint:errcheck // crypto/rand does not fail on Linux
	sess := &session{
		id: "s" + hex.EncodeToString(idb), user: res.User.Name, pid: proc.Pid, created: time.Now(),
		stdin: inW, log: newRingLog(LogCap), cwd: res.Dir,
		outCh: make(chan []byte, 64), errCh: make(chan []byte, 64),
		startCh: make(chan *command), exited: make(chan struct{}),
	}
	go pump(outR, sess.outCh)
	go pump(errR, sess.errCh)
	go func() {
		st, err := proc.Wait()
		s.sp.Forget(proc.Pid)
		if err == nil {
			sess.exitStatus = st.ExitCode()
			if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				sess.exitStatus = 128 + int(ws.Signal())
			}
		}
		close(sess.exited)
	}()
	go sess.loop()
	s.mu.Lock()
	s.sessions[sess.id] = sess
	s.mu.Unlock()
	return connect.NewResponse(&agentv1.CreateSessionResponse{Session: sess.proto()}), nil
}

func (sess *session) proto() *agentv1.Session {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	return &agentv1.Session{
		Id: sess.id, Pid: uint32(sess.pid), User: sess.user,
		CreatedAt: timestamppb.New(sess.created), CommandsRun: sess.commands, Cwd: sess.cwd,
	}
}

func (s *Service) get(id string) (*session, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sess, ok := s.sessions[id]
	if !ok {
		return nil, errdefs.NotFound("session %q: no such session", id)
	}
	return sess, nil
}

func (s *Service) RunInSession(ctx context.Context, req *connect.Request[agentv1.RunInSessionRequest]) (*connect.Response[agentv1.RunInSessionResponse], error) {
	m := req.Msg
	sess, err := s.get(m.SessionId)
	if err != nil {
		return nil, err
	}
	if m.Command == "" {
		return nil, errdefs.InvalidArgument("command: empty")
	}
	for _, c := range m.Command {
		if c == 0 {
			return nil, errdefs.InvalidArgument("command: contains a NUL byte")
		}
	}
	timeout := time.Duration(m.TimeoutMs) * time.Millisecond
	if timeout == 0 {
		timeout = defaultTimeout
	}
	capBytes := m.MaxOutputBytes
	if capBytes == 0 {
		capBytes = defaultOutputCap
	}
	if capBytes > maxOutputCap {
		return nil, errdefs.InvalidArgument("max_output_bytes %d: at most %d", capBytes, maxOutputCap)
	}
	sess.run.Lock()
	defer sess.run.Unlock()
	res, err := sess.exec(m.Command, timeout, capBytes)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&agentv1.RunInSessionResponse{
		Stdout: res.Stdout, Stderr: res.Stderr, ExitCode: int32(res.ExitCode), TimedOut: res.TimedOut,
		StdoutDropped: res.StdoutDropped, StderrDropped: res.StderrDropped, Cwd: res.Cwd, LogOffset: res.LogOffset,
	}), nil
}

func (s *Service) GetSessionOutput(ctx context.Context, req *connect.Request[agentv1.GetSessionOutputRequest]) (*connect.Response[agentv1.GetSessionOutputResponse], error) {
	sess, err := s.get(req.Msg.SessionId)
	if err != nil {
		return nil, err
	}
	if req.Msg.Offset < 0 {
		return nil, errdefs.InvalidArgument("offset must not be negative")
	}
	limit := int(req.Msg.Limit)
	if limit == 0 || limit > maxReadChunk {
		limit = maxReadChunk
	}
	data, next, first := sess.log.read(req.Msg.Offset, limit)
	return connect.NewResponse(&agentv1.GetSessionOutputResponse{Data: data, NextOffset: next, FirstOffset: first}), nil
}

func (s *Service) ListSessions(ctx context.Context, req *connect.Request[agentv1.ListSessionsRequest]) (*connect.Response[agentv1.ListSessionsResponse], error) {
	s.mu.Lock()
	all := make([]*session, 0, len(s.sessions))
	for _, sess := range s.sessions {
		all = append(all, sess)
	}
	s.mu.Unlock()
	sort.Slice(all, func(i, j int) bool { return all[i].created.Before(all[j].created) })
	out := &agentv1.ListSessionsResponse{}
	for _, sess := range all {
		out.Sessions = append(out.Sessions, sess.proto())
	}
	return connect.NewResponse(out), nil
}

func (s *Service) CloseSession(ctx context.Context, req *connect.Request[agentv1.CloseSessionRequest]) (*connect.Response[agentv1.CloseSessionResponse], error) {
	s.mu.Lock()
	sess, ok := s.sessions[req.Msg.SessionId]
	delete(s.sessions, req.Msg.SessionId)
	s.mu.Unlock()
	if !ok {
		return nil, errdefs.NotFound("session %q: no such session", req.Msg.SessionId)
	}
	sess.close()
	return connect.NewResponse(&agentv1.CloseSessionResponse{}), nil
}

// Close ends every session.
func (s *Service) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, sess := range s.sessions {
		sess.close()
		delete(s.sessions, id)
	}
}

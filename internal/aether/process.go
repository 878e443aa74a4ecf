package aether

import (
	"context"
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/creack/pty"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/spawn"
)

// exitedRetention is how long an exited process stays findable by Connect.
const exitedRetention = time.Minute

const (
	// drainGrace is how long output is still read after the process exits,
	// for streams a background child keeps open.
	drainGrace = 250 * time.Millisecond
	// drainCap bounds the whole drain after an exit, for a background child
	// that keeps writing.
	drainCap = 5 * time.Second
)

// process is one process started through ProcessService.
type process struct {
	pid  int
	pgid int
	tag  string
	args []string
	pty  *os.File // terminal master; nil without a pty

	stdinMu sync.Mutex
	stdin   *os.File // guarded by stdinMu; nil once closed

	mu   sync.Mutex
	subs map[*subscriber]struct{} // guarded by mu
	exit *agentv1.ProcessEvent    // guarded by mu; the Exited event once known

	done     chan struct{} // closed once exit is set and published
	timedOut atomic.Bool
}

// subscriber receives a process's events; done ends the subscription.
type subscriber struct {
	ch   chan *agentv1.ProcessEvent
	done <-chan struct{}
}

func newSubscriber(ctx context.Context) *subscriber {
	return &subscriber{ch: make(chan *agentv1.ProcessEvent, 16), done: ctx.Done()}
}

// publish hands ev to every subscriber, waiting for slow ones: the process
// then blocks on its pipe instead of the agent buffering without bound.
func (p *process) publish(ev *agentv1.ProcessEvent) {
	p.mu.Lock()
	subs := make([]*subscriber, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
		case <-s.done:
			p.unsubscribe(s)
		}
	}
}

func (p *process) subscribe(s *subscriber) (exited *agentv1.ProcessEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exit != nil {
		return p.exit
	}
	p.subs[s] = struct{}{}
	return nil
}

func (p *process) unsubscribe(s *subscriber) {
	p.mu.Lock()
	delete(p.subs, s)
	p.mu.Unlock()
}

func (p *process) writeInput(data []byte) error {
	if p.pty != nil {
		_, err := p.pty.Write(data)
		return err
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return errdefs.FailedPrecondition("process %d: stdin is closed (start it with keep_stdin_open)", p.pid)
	}
	_, err := p.stdin.Write(data)
	return err
}

func (p *process) closeStdin() {
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
}

func (p *process) signal(sig syscall.Signal) error {
	if sig == syscall.SIGKILL {
		go p.killAll()
		return nil
	}
	// The process leads its own group (or session); signal all of it.
	if err := syscall.Kill(-p.pgid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return err
	}
	return nil
}

// killAll ends the process group for good. One kill(-pgid) can miss
// members born while it is delivered, and a fork bomb makes them faster than
// that (a container once kept 900 of them after its command timed out,
// and could run nothing more), so it signals until none is left. A process
// that left the group (setsid, setpgid) is not reached; the sandbox's pids
// limit still bounds it, and stopping the sandbox ends it.
func (p *process) killAll() {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		if err := syscall.Kill(-p.pgid, syscall.SIGKILL); err != nil {
			return // ESRCH: the group is empty
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func outputEvent(stream agentv1.Stream, data []byte) *agentv1.ProcessEvent {
	return &agentv1.ProcessEvent{Event: &agentv1.ProcessEvent_Output_{
		Output: &agentv1.ProcessEvent_Output{Stream: stream, Data: data}}}
}

func startedEvent(pid int, tag string) *agentv1.ProcessEvent {
	return &agentv1.ProcessEvent{Event: &agentv1.ProcessEvent_Started_{
		Started: &agentv1.ProcessEvent_Started{Pid: uint32(pid), Tag: tag}}}
}

func exitedEvent(code, sig int32, timedOut bool, msg string) *agentv1.ProcessEvent {
	return &agentv1.ProcessEvent{Event: &agentv1.ProcessEvent_Exited_{
		Exited: &agentv1.ProcessEvent_Exited{ExitCode: code, Signal: sig, TimedOut: timedOut, Error: msg}}}
}

// processTable holds the processes started through ProcessService.
type processTable struct {
	spawner *spawn.Spawner
	watches *watchSet // nil: none to wait for

	mu    sync.Mutex
	byPID map[int]*process    // guarded by mu
	byTag map[string]*process // guarded by mu
}

func newProcessTable(sp *spawn.Spawner) *processTable {
	return &processTable{spawner: sp, byPID: map[int]*process{}, byTag: map[string]*process{}}
}

// notFoundEvents are what a shell would print for a missing program.
func notFoundEvents(err *spawn.ErrNotFound) []*agentv1.ProcessEvent {
	return []*agentv1.ProcessEvent{
		startedEvent(0, ""),
		outputEvent(agentv1.Stream_STREAM_STDERR, []byte(err.Error()+"\n")),
		exitedEvent(127, 0, false, err.Error()),
	}
}

// start starts cfg with first as its first subscriber, so no output is lost.
func (t *processTable) start(cfg *agentv1.ProcessConfig, first *subscriber) (*process, error) {
	if cfg == nil {
		return nil, errdefs.InvalidArgument("process: missing")
	}
	if cfg.Tag != "" {
		t.mu.Lock()
		old, taken := t.byTag[cfg.Tag]
		t.mu.Unlock()
		if taken && !isDone(old) {
			return nil, errdefs.AlreadyExists("tag %q: a running process already has it", cfg.Tag)
		}
	}
	req := spawn.Request{Args: cfg.Args, Env: cfg.Env, Cwd: cfg.Cwd, User: cfg.User}
	res, err := t.spawner.Resolve(req)
	if err != nil {
		return nil, err
	}
	if cfg.Pty != nil {
		res.Env = append(res.Env, "TERM=xterm-256color")
	}
	p := &process{tag: cfg.Tag, args: cfg.Args, subs: map[*subscriber]struct{}{first: {}}, done: make(chan struct{})}
	var readers []readerStream
	var childFiles []*os.File
	if cfg.Pty != nil {
		master, tty, err := openPty()
		if err != nil {
			return nil, errdefs.Wrap(errdefs.ErrUnavailable, err, "open pty")
		}
		if err := pty.Setsize(master, winsize(cfg.Pty)); err != nil {
			master.Close()
			tty.Close()
			return nil, errdefs.Wrap(errdefs.ErrInvalidArgument, err, "pty size")
		}
		p.pty = master
		req.Setsid = true
		req.Files = []*os.File{tty, tty, tty}
		childFiles = []*os.File{tty}
		readers = []readerStream{{master, agentv1.Stream_STREAM_PTY}}
	} else {
		stdinR, stdinW, err := stdinFor(cfg)
		if err != nil {
			return nil, limitErr("start", err)
		}
		outR, outW, err := os.Pipe()
		if err != nil {
			closeAll(stdinR, stdinW)
			return nil, limitErr("start", err)
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			closeAll(stdinR, stdinW, outR, outW)
			return nil, limitErr("start", err)
		}
		p.stdin = stdinW
		req.Files = []*os.File{stdinR, outW, errW}
		childFiles = []*os.File{stdinR, outW, errW}
		readers = []readerStream{{outR, agentv1.Stream_STREAM_STDOUT}, {errR, agentv1.Stream_STREAM_STDERR}}
	}
	proc, err := t.spawner.Start(res, req)
	for _, f := range childFiles {
		f.Close()
	}
	if err != nil {
		for _, r := range readers {
			r.f.Close()
		}
		p.closeStdin()
		return nil, limitErr("start", err)
	}
	p.pid, p.pgid = proc.Pid, proc.Pid
	t.mu.Lock()
	t.byPID[p.pid] = p
	if p.tag != "" {
		t.byTag[p.tag] = p
	}
	t.mu.Unlock()
	first.ch <- startedEvent(p.pid, p.tag)

	if len(cfg.Stdin) > 0 {
		data := cfg.Stdin
		keep := cfg.KeepStdinOpen
		go func() {
			p.writeInput(data) //nolint:errcheck // a process may exit without reading its input
			if !keep && p.pty == nil {
				p.closeStdin()
			}
		}()
	} else if !cfg.KeepStdinOpen {
		p.closeStdin()
	}
	var timer *time.Timer
	if cfg.TimeoutMs > 0 {
		timer = time.AfterFunc(time.Duration(cfg.TimeoutMs)*time.Millisecond, func() {
			p.timedOut.Store(true)
			p.signal(syscall.SIGKILL) //nolint:errcheck // it may have exited already
		})
	}
	go t.supervise(p, proc, readers, timer)
	return p, nil
}

// openPty opens a terminal whose master is in the runtime's poller, so
// closing it wakes a blocked reader. gVisor's terminals do not answer a
// master read with EIO when the last slave closes, so the close after the
// drain grace is what ends the read there.
func openPty() (master, tty *os.File, err error) {
	m, tty, err := pty.Open()
	if err != nil {
		return nil, nil, err
	}
	defer m.Close()
	fd, err := syscall.Dup(int(m.Fd()))
	if err != nil {
		tty.Close()
		return nil, nil, err
	}
	if err := syscall.SetNonblock(fd, true); err != nil {
		syscall.Close(fd)
		tty.Close()
		return nil, nil, err
	}
	syscall.CloseOnExec(fd)
	return os.NewFile(uintptr(fd), m.Name()), tty, nil
}

type readerStream struct {
	f      *os.File
	stream agentv1.Stream
}

func stdinFor(cfg *agentv1.ProcessConfig) (r, w *os.File, err error) {
	if len(cfg.Stdin) == 0 && !cfg.KeepStdinOpen {
		r, err = os.Open(os.DevNull)
		return r, nil, err
	}
	return os.Pipe()
}

func winsize(s *agentv1.PtySize) *pty.Winsize {
	cols, rows := s.Cols, s.Rows
	if cols == 0 {
		cols = 80
	}
	if rows == 0 {
		rows = 24
	}
	return &pty.Winsize{Cols: uint16(min(cols, 65535)), Rows: uint16(min(rows, 65535))}
}

// supervise pumps output, waits for the process and publishes its exit.
//
// After the exit, each pump reads on for drainGrace: a read deadline ends a
// read that a background child keeps open, and the pump then takes what is
// already buffered without waiting.
// A starved agent (a busy host, a throttled cgroup) may see the deadline's
// timer before the poller sees the data, so the deadline never drops output
// that the process wrote before it exited (a terminal's last line once went
// missing so). Streams that cannot take a deadline are closed after the
// grace, as a last resort after drainCap for all of them.
func (t *processTable) supervise(p *process, proc *os.Process, readers []readerStream, timer *time.Timer) {
	var pumps sync.WaitGroup
	for _, r := range readers {
		pumps.Add(1)
		go func() {
			defer pumps.Done()
			pumpOutput(r.f, func(data []byte) { p.publish(outputEvent(r.stream, data)) })
		}()
	}
	state, werr := proc.Wait()
	t.spawner.Forget(p.pid)
	if timer != nil {
		timer.Stop()
	}
	pumped := make(chan struct{})
	go func() { pumps.Wait(); close(pumped) }()
	var undated []*os.File
	for _, r := range readers {
		if r.f.SetReadDeadline(time.Now().Add(drainGrace)) != nil {
			undated = append(undated, r.f)
		}
	}
	capAt := time.After(drainCap)
	if len(undated) > 0 {
		select {
		case <-pumped:
		case <-time.After(drainGrace):
			closeAll(undated...)
		}
	}
	select {
	case <-pumped:
	case <-capAt:
	}
	for _, r := range readers {
		r.f.Close()
	}
	<-pumped
	p.closeStdin()
	if t.watches != nil {
		t.watches.sync() // what it wrote is seen by watchers before its exit is
	}
	code, sig, msg := exitStatus(state, werr)
	ev := exitedEvent(code, sig, p.timedOut.Load(), msg)
	p.mu.Lock()
	p.exit = ev
	subs := p.subs
	p.subs = nil
	p.mu.Unlock()
	for s := range subs {
		select {
		case s.ch <- ev:
		case <-s.done:
		}
	}
	close(p.done)
	time.AfterFunc(exitedRetention, func() { t.remove(p) })
}

func exitStatus(state *os.ProcessState, err error) (code, sig int32, msg string) {
	if err != nil {
		return -1, 0, err.Error()
	}
	ws, ok := state.Sys().(syscall.WaitStatus)
	if ok && ws.Signaled() {
		return 128 + int32(ws.Signal()), int32(ws.Signal()), ""
	}
	return int32(state.ExitCode()), 0, ""
}

func (t *processTable) remove(p *process) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.byPID[p.pid] == p {
		delete(t.byPID, p.pid)
	}
	if p.tag != "" && t.byTag[p.tag] == p {
		delete(t.byTag, p.tag)
	}
}

func isDone(p *process) bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// find resolves a selector to a process started through the service.
func (t *processTable) find(sel *agentv1.ProcessSelector) (*process, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	switch s := sel.GetSelector().(type) {
	case *agentv1.ProcessSelector_Pid:
		if p, ok := t.byPID[int(s.Pid)]; ok {
			return p, nil
		}
		return nil, errdefs.NotFound("process %d: not started through the agent, or gone", s.Pid)
	case *agentv1.ProcessSelector_Tag:
		if p, ok := t.byTag[s.Tag]; ok {
			return p, nil
		}
		return nil, errdefs.NotFound("process with tag %q: none", s.Tag)
	default:
		return nil, errdefs.InvalidArgument("process: give a pid or a tag")
	}
}

func (t *processTable) tagOf(pid int) (string, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	p, ok := t.byPID[pid]
	if !ok {
		return "", false
	}
	return p.tag, true
}

// closeAll is used at shutdown.
func (t *processTable) closeAll() {
	t.mu.Lock()
	ps := make([]*process, 0, len(t.byPID))
	for _, p := range t.byPID {
		ps = append(ps, p)
	}
	t.mu.Unlock()
	for _, p := range ps {
		p.signal(syscall.SIGKILL) //nolint:errcheck // best effort at shutdown
	}
}

// limitErr names the sandbox limit a failed start ran into: its processes
// hold all the open files (EMFILE) or processes (EAGAIN) it may have. The
// call is refused with resource-exhausted; the sandbox goes on.
func limitErr(what string, err error) error {
	switch {
	case errors.Is(err, syscall.EMFILE), errors.Is(err, syscall.ENFILE):
		return errdefs.ResourceExhausted("%s: the sandbox is at its limit of open files (resources.open_files): its processes hold them all; retry when fewer are open", what)
	case errors.Is(err, syscall.EAGAIN):
		return errdefs.ResourceExhausted("%s: the sandbox is at its limit of processes and threads (resources.pids); retry when fewer run", what)
	}
	return err
}

func closeAll(fs ...*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}

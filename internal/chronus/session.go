package chronus

import (
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/spawn"
)

// Result is the outcome of one command in a session.
type Result struct {
	Stdout, Stderr               []byte
	StdoutDropped, StderrDropped uint64
	ExitCode                     int
	TimedOut                     bool
	Cwd                          string
	LogOffset                    int64
}

// session is one persistent shell.
type session struct {
	id      string
	user    string
	pid     int
	created time.Time
	stdin   *os.File
	log     *ringLog

	run sync.Mutex // held while a command runs: one at a time

	outCh, errCh chan []byte
	startCh      chan *command
	exited       chan struct{} // closed when the shell is gone
	exitStatus   int           // valid after exited

	mu       sync.Mutex
	commands int64  // guarded by mu
	cwd      string // guarded by mu
	dead     string // guarded by mu; why the session ended, "" while alive
}

type command struct {
	text           string
	outScan        *markerScanner
	errScan        *markerScanner
	stdout, stderr capped
	done           chan struct{}
	shellExited    bool
}

// capped keeps the first max bytes and counts the rest.
type capped struct {
	buf     []byte
	max     uint64
	dropped uint64
}

func (c *capped) write(p []byte) {
	room := c.max - uint64(len(c.buf))
	if uint64(len(p)) <= room {
		c.buf = append(c.buf, p...)
		return
	}
	c.buf = append(c.buf, p[:room]...)
	c.dropped += uint64(len(p)) - room
}

// pump copies a pipe into ch until it closes.
func pump(f *os.File, ch chan<- []byte) {
	defer close(ch)
	buf := make([]byte, 32*1024)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			ch <- append([]byte(nil), buf[:n]...)
		}
		if err != nil {
			f.Close()
			return
		}
	}
}

// loop routes shell output to the running command or, between commands, to
// the log only (a background job's output). It ends when the shell is gone.
func (s *session) loop() {
	var cur *command
	outCh, errCh, exited := s.outCh, s.errCh, s.exited
	feed := func(scan *markerScanner, dst *capped, data []byte) {
		if cur == nil {
			s.log.write(data)
			return
		}
		out := scan.feed(data)
		dst.write(out)
		s.log.write(out)
		if cur.outScan.done() && cur.errScan.done() {
			close(cur.done)
			cur = nil
		}
	}
	var grace <-chan time.Time
	shellGone := false
	for {
		if shellGone && (grace == nil || (outCh == nil && errCh == nil)) {
			if cur != nil {
				cur.stdout.write(cur.outScan.flush())
				cur.stderr.write(cur.errScan.flush())
				cur.shellExited = true
				close(cur.done)
			}
			return
		}
		select {
		case c := <-s.startCh:
			cur = c
		case data, ok := <-outCh:
			if !ok {
				outCh = nil
				continue
			}
			var dst *capped
			var scan *markerScanner
			if cur != nil {
				dst, scan = &cur.stdout, cur.outScan
			}
			feed(scan, dst, data)
		case data, ok := <-errCh:
			if !ok {
				errCh = nil
				continue
			}
			var dst *capped
			var scan *markerScanner
			if cur != nil {
				dst, scan = &cur.stderr, cur.errScan
			}
			feed(scan, dst, data)
		case <-exited:
			// Read what the shell wrote before exiting, for a moment at most
			// (a background job may hold the pipes open).
			exited, shellGone = nil, true
			grace = time.After(100 * time.Millisecond)
		case <-grace:
			grace = nil
		}
	}
}

func (s *session) state() (dead string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dead
}

func (s *session) markDead(why string) {
	s.mu.Lock()
	if s.dead == "" {
		s.dead = why
	}
	s.mu.Unlock()
}

// exec runs one command line. Callers hold s.run.
func (s *session) exec(text string, timeout time.Duration, capBytes uint64) (Result, error) {
	if why := s.state(); why != "" {
		return Result{}, errdefs.FailedPrecondition("session %s ended: %s", s.id, why)
	}
	nonce := newNonce()
	cmd := &command{
		text:    text,
		outScan: newMarkerScanner(nonce),
		errScan: newMarkerScanner(nonce),
		stdout:  capped{max: capBytes},
		stderr:  capped{max: capBytes},
		done:    make(chan struct{}),
	}
	before := map[int]bool{}
	for _, pid := range spawn.Descendants(s.pid) {
		before[pid] = true
	}
	offset := s.log.write([]byte("$ " + text + "\n"))
	select {
	case s.startCh <- cmd:
	case <-s.exited:
		return Result{}, errdefs.FailedPrecondition("session %s ended: %s", s.id, s.state())
	}
	if _, err := s.stdin.WriteString(wrap(text, nonce)); err != nil {
		<-cmd.done
		return Result{}, errdefs.FailedPrecondition("session %s ended: shell input closed", s.id)
	}
	timedOut := false
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-cmd.done:
	case <-timer.C:
		timedOut = true
		s.killNewDescendants(before)
		select {
		case <-cmd.done:
		case <-time.After(2 * time.Second):
			// A builtin loop in the shell itself: only killing the shell ends it.
			s.markDead(fmt.Sprintf("killed after a %s timeout: the command kept the shell itself busy", timeout))
			syscall.Kill(-s.pid, syscall.SIGKILL) //nolint:errcheck // it may be gone
			<-cmd.done
		}
	}
	res := Result{
		Stdout: cmd.stdout.buf, Stderr: cmd.stderr.buf,
		StdoutDropped: cmd.stdout.dropped, StderrDropped: cmd.stderr.dropped,
		TimedOut: timedOut, LogOffset: offset,
	}
	if cmd.shellExited {
		res.ExitCode = s.exitStatus
		s.markDead(fmt.Sprintf("the shell exited with status %d", s.exitStatus))
	} else {
		res.ExitCode, res.Cwd = cmd.outScan.status()
	}
	s.mu.Lock()
	s.commands++
	if res.Cwd != "" {
		s.cwd = res.Cwd
	}
	res.Cwd = s.cwd
	s.mu.Unlock()
	s.log.write([]byte(fmt.Sprintf("[exit %d]\n", res.ExitCode)))
	return res, nil
}

func (s *session) killNewDescendants(before map[int]bool) {
	for _, pid := range spawn.Descendants(s.pid) {
		if !before[pid] {
			syscall.Kill(pid, syscall.SIGKILL) //nolint:errcheck // it may be gone
		}
	}
}

func (s *session) close() {
	s.markDead("closed")
	syscall.Kill(-s.pid, syscall.SIGKILL) //nolint:errcheck // it may be gone
	s.stdin.Close()
}

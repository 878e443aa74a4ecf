package sudo

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/spawn"
)

// Broker runs commands for sudo clients. It uses the agent's spawner, so
// its children are reaped like the agent's own.
type Broker struct {
	spawner *spawn.Spawner
	log     *slog.Logger
	dir     string
	// identify tells who is calling; tests replace it.
	identify func(c net.Conn, in *bufio.Reader) (uint32, error)
}

// NewBroker returns a broker for the directory dir (see Listen), starting
// processes with sp; accounts and sudoers are read below sp.Users.Root.
func NewBroker(dir string, sp *spawn.Spawner, log *slog.Logger) *Broker {
	b := &Broker{spawner: sp, log: logging.OrDiscard(log).With(logging.Component, "sudo"), dir: dir}
	b.identify = b.challenge
	return b
}

// Listen prepares dir: the socket, which every local user may connect to
// (the broker decides by the caller's proven uid), and the proof
// directory, where anyone may create a file but no one may list or remove
// another's.
func Listen(dir string) (*net.UnixListener, error) {
	if err := os.MkdirAll(proofsIn(dir), 0o755); err != nil {
		return nil, err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return nil, err
	}
	if err := os.Chmod(proofsIn(dir), 0o733|os.ModeSticky); err != nil {
		return nil, err
	}
	path := socketIn(dir)
	os.Remove(path)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o666); err != nil {
		ln.Close()
		return nil, err
	}
	return ln, nil
}

// challenge has the client create a file named by a fresh random nonce in
// the proof directory: the kernel makes the client its owner, which no one
// else can forge. A hard link of someone else's file or a symbolic link is
// refused.
func (b *Broker) challenge(c net.Conn, in *bufio.Reader) (uint32, error) {
	var raw [16]byte
	rand.Read(raw[:]) //nolint:errcheck // crypto/rand does not fail
	nonce := hex.EncodeToString(raw[:])
	send(c, Message{Challenge: nonce})
	c.SetReadDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck // a unix conn takes deadlines
	defer c.SetReadDeadline(time.Time{})                //nolint:errcheck // as above
	line, err := in.ReadBytes('\n')
	if err != nil {
		return 0, fmt.Errorf("no answer to the identity challenge: %v", err)
	}
	var m Message
	if json.Unmarshal(line, &m) != nil || !m.Proved {
		return 0, errors.New("the identity challenge was not answered")
	}
	p := filepath.Join(proofsIn(b.dir), nonce)
	defer os.Remove(p)
	fi, err := os.Lstat(p)
	if err != nil {
		return 0, fmt.Errorf("identity proof: %v", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || !fi.Mode().IsRegular() || st.Nlink != 1 {
		return 0, errors.New("identity proof: not a new plain file")
	}
	return st.Uid, nil
}

// Serve answers clients until ctx ends.
func (b *Broker) Serve(ctx context.Context, ln *net.UnixListener) {
	go func() {
		<-ctx.Done()
		ln.Close()
	}()
	for {
		c, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() == nil {
				b.log.Warn("sudo broker stopped accepting", logging.Error, err)
			}
			return
		}
		go b.handle(c)
	}
}

// send writes one message line; the client may be gone.
func send(c net.Conn, m Message) {
	data, _ := json.Marshal(m)
	c.Write(append(data, '\n')) //nolint:errcheck // the client went away
}

func fail(c net.Conn, format string, args ...any) {
	send(c, Message{Error: fmt.Sprintf(format, args...)})
}

// readRequest reads the length-prefixed request and the three descriptors
// sent with its first bytes.
func readRequest(c *net.UnixConn) (Request, []*os.File, error) {
	c.SetReadDeadline(time.Now().Add(10 * time.Second)) //nolint:errcheck // a unix conn takes deadlines
	defer c.SetReadDeadline(time.Time{})                //nolint:errcheck // as above
	head := make([]byte, 4)
	oob := make([]byte, syscall.CmsgSpace(3*4))
	n, oobn, _, _, err := c.ReadMsgUnix(head, oob)
	if err != nil {
		return Request{}, nil, err
	}
	var files []*os.File
	if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for _, m := range msgs {
			fds, err := syscall.ParseUnixRights(&m)
			if err != nil {
				continue
			}
			for _, fd := range fds {
				files = append(files, os.NewFile(uintptr(fd), "sudo-stdio"))
			}
		}
	}
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	if _, err := io.ReadFull(c, head[n:]); err != nil {
		closeAll()
		return Request{}, nil, err
	}
	size := binary.BigEndian.Uint32(head)
	if size > maxRequest {
		closeAll()
		return Request{}, nil, fmt.Errorf("request of %d bytes: at most %d", size, maxRequest)
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(c, body); err != nil {
		closeAll()
		return Request{}, nil, err
	}
	if len(files) != 3 {
		closeAll()
		return Request{}, nil, fmt.Errorf("request: want stdin, stdout and stderr, got %d descriptors", len(files))
	}
	r, err := decodeRequest(body)
	if err != nil {
		closeAll()
		return Request{}, nil, err
	}
	return r, files, nil
}

func (b *Broker) handle(c *net.UnixConn) {
	defer c.Close()
	req, files, err := readRequest(c)
	if err != nil {
		fail(c, "sudo: %v", err)
		return
	}
	in := bufio.NewReader(c)
	uid, err := b.identify(c, in)
	if err != nil {
		for _, f := range files {
			f.Close()
		}
		fail(c, "sudo: cannot tell who is calling: %v", err)
		return
	}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	db := b.spawner.Users
	caller, err := db.Lookup(strconv.FormatUint(uint64(uid), 10))
	if err != nil {
		fail(c, "sudo: you do not exist in the passwd database")
		return
	}
	if !LoadPolicy(db.Root).Allows(db, caller) {
		b.log.Info("sudo refused", "user", caller.Name)
		fail(c, "sudo: %s may not run commands as root: no NOPASSWD rule for the user or its groups in /etc/sudoers or /etc/sudoers.d (there are no passwords here)", caller.Name)
		return
	}
	if req.Validate {
		code := 0
		send(c, Message{Exit: &code})
		return
	}
	target, err := db.Lookup(req.User)
	if err != nil {
		fail(c, "sudo: unknown user %s", req.User)
		return
	}
	args, cwd := req.Args, req.Cwd
	shell := target.Shell
	if shell == "" {
		shell = "/bin/sh"
	}
	switch {
	case req.Login:
		args, cwd = shellArgs(shell, []string{"-l"}, req.Args), target.Home
	case req.Shell:
		if s := envLookup(req.Env, "SHELL"); s != "" {
			shell = s
		}
		args = shellArgs(shell, nil, req.Args)
	}
	if cwd == "" {
		// The caller could not name its directory (one it may not read):
		// start in the target's home, or at the root without one.
		cwd = "/"
		if fi, err := os.Stat(target.Home); err == nil && fi.IsDir() {
			cwd = target.Home
		}
	}
	env := commandEnv(req, caller.Name, caller.UID, caller.GID, target.Shell, args)
	sr := spawn.Request{Args: args, Env: env, Cwd: cwd, User: target.Name, Files: files}
	res, err := b.spawner.Resolve(sr)
	if err != nil {
		var nf *spawn.ErrNotFound
		if errors.As(err, &nf) {
			fail(c, "sudo: %s: command not found", nf.Program)
			return
		}
		fail(c, "sudo: %v", err)
		return
	}
	proc, err := b.spawner.Start(res, sr)
	if err != nil {
		fail(c, "sudo: %v", err)
		return
	}
	b.log.Debug("sudo", "user", caller.Name, "as", target.Name, "args", args, "pid", proc.Pid)
	for _, f := range files {
		f.Close()
	}
	files = nil
	b.relay(c, in, proc)
}

// relay forwards the client's signals to the command's process group until
// it exits, kills the group if the client goes away first, then reports
// how the command ended.
func (b *Broker) relay(c *net.UnixConn, in *bufio.Reader, proc *os.Process) {
	var mu sync.Mutex
	exited := false // guarded by mu; once set, the pid may be reused
	signal := func(sig syscall.Signal) {
		mu.Lock()
		defer mu.Unlock()
		if !exited {
			syscall.Kill(-proc.Pid, sig) //nolint:errcheck // it may be exiting
		}
	}
	go func() {
		sc := bufio.NewScanner(in)
		for sc.Scan() {
			var m Message
			if json.Unmarshal(sc.Bytes(), &m) == nil && m.Signal > 0 && m.Signal < 65 {
				signal(syscall.Signal(m.Signal))
			}
		}
		// The client is gone (killed, or its caller was): the command must
		// not outlive it unseen.
		signal(syscall.SIGKILL)
	}()
	// Wait without reaping first, so no signal can reach a reused pid.
	var info unix.Siginfo
	for {
		err := unix.Waitid(unix.P_PID, proc.Pid, &info, unix.WEXITED|unix.WNOWAIT, nil)
		if err != syscall.EINTR {
			break
		}
	}
	mu.Lock()
	exited = true
	mu.Unlock()
	state, err := proc.Wait()
	b.spawner.Forget(proc.Pid)
	if err != nil {
		fail(c, "sudo: %v", err)
		return
	}
	if ws, ok := state.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		send(c, Message{Signal: int(ws.Signal())})
		return
	}
	code := state.ExitCode()
	send(c, Message{Exit: &code})
}

// keptEnv are the caller's variables sudo keeps with env_reset.
var keptEnv = map[string]bool{"TERM": true, "COLORTERM": true, "DISPLAY": true, "LANG": true, "LANGUAGE": true, "TZ": true, "XAUTHORITY": true, "LS_COLORS": true}

// securePath is Debian's sudoers secure_path.
const securePath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// commandEnv follows sudo's rules: env_reset keeps only a few of the
// caller's variables (-E keeps all), PATH is secure_path, and SUDO_* name
// the caller. HOME, USER and LOGNAME are the target's (HOME stays with -E).
func commandEnv(req Request, callerName string, uid, gid uint32, targetShell string, args []string) map[string]string {
	env := map[string]string{}
	for _, kv := range req.Env {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			continue
		}
		if req.PreserveEnv || keptEnv[k] || strings.HasPrefix(k, "LC_") {
			env[k] = v
		}
	}
	if !req.PreserveEnv {
		delete(env, "HOME")
	}
	delete(env, "USER")
	delete(env, "LOGNAME")
	env["PATH"] = securePath
	if targetShell != "" {
		env["SHELL"] = targetShell
	}
	env["SUDO_USER"] = callerName
	env["SUDO_UID"] = strconv.FormatUint(uint64(uid), 10)
	env["SUDO_GID"] = strconv.FormatUint(uint64(gid), 10)
	env["SUDO_COMMAND"] = strings.Join(args, " ")
	return env
}

func envLookup(env []string, key string) string {
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, key+"="); ok {
			return v
		}
	}
	return ""
}

// shellArgs runs cmd through shell -c, each word quoted, as sudo -i and -s
// do; without a command, the shell itself.
func shellArgs(shell string, flags, cmd []string) []string {
	args := append([]string{shell}, flags...)
	if len(cmd) == 0 {
		return args
	}
	quoted := make([]string, len(cmd))
	for i, w := range cmd {
		quoted[i] = shellQuote(w)
	}
	return append(args, "-c", strings.Join(quoted, " "))
}

func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// Package spawn starts processes inside a sandbox on behalf of the agent and
// of chronus sessions: it resolves the user, environment, working directory
// and program, and tracks every child so the agent, running as PID 1, can
// reap orphans without stealing the exit status of a child it waits for.
package spawn

import (
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sysuser"
)

// Request describes a process to start.
type Request struct {
	Args []string
	Env  map[string]string
	Cwd  string
	User string
	// Setsid puts the process in a new session (for a terminal); otherwise it
	// gets its own process group.
	Setsid bool
	// Files are stdin, stdout and stderr.
	Files []*os.File
}

// Spawner starts processes. BaseEnv is the sandbox's environment, below the
// per-user and per-request variables.
type Spawner struct {
	Users   sysuser.DB
	BaseEnv map[string]string
	// WorkDir, if set, is where processes that name no directory start
	// (the image's WORKDIR, as docker does) instead of the user's home.
	WorkDir string
	// DefaultUser, if set, is who processes that name no user run as (the
	// image's USER, as docker does) instead of root.
	DefaultUser string
	// Cgroup, if set, is an open cgroup v2 directory every process starts
	// in (clone3's CLONE_INTO_CGROUP): the sandbox's limits bind its
	// processes while the agent, outside, keeps running (a microVM's
	// guest, dsec-vminit).
	Cgroup *os.File
	// Ready, if set, is closed once processes may start: Start waits for
	// it (the agent makes its spare threads meanwhile, while it connects).
	Ready <-chan struct{}

	mu      sync.Mutex
	tracked map[int]struct{} // guarded by mu: pids of children someone waits for
}

// SetDefaults replaces BaseEnv, WorkDir and DefaultUser while processes
// may be starting: a sandbox restored from a template snapshot gets its
// own in its first request.
func (s *Spawner) SetDefaults(env map[string]string, workDir, user string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.BaseEnv, s.WorkDir, s.DefaultUser = env, workDir, user
}

func (s *Spawner) defaults() (map[string]string, string, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.BaseEnv, s.WorkDir, s.DefaultUser
}

// ErrNotFound marks a program that does not exist: the caller reports exit
// code 127, as a shell would.
type ErrNotFound struct{ Program string }

func (e *ErrNotFound) Error() string { return e.Program + ": command not found" }

// Resolved is a request with user, environment and program worked out.
type Resolved struct {
	Path string
	Args []string
	Env  []string
	Dir  string
	User sysuser.User
}

// Resolve works out everything Start needs without starting anything.
func (s *Spawner) Resolve(r Request) (*Resolved, error) {
	if len(r.Args) == 0 || r.Args[0] == "" {
		return nil, errdefs.InvalidArgument("args: need at least the program name")
	}
	baseEnv, workDir, defaultUser := s.defaults()
	name := r.User
	if name == "" {
		name = defaultUser
	}
	u, err := s.Users.Lookup(name)
	if err != nil {
		return nil, err
	}
	env := map[string]string{"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	for k, v := range baseEnv {
		env[k] = v
	}
	env["HOME"], env["USER"], env["LOGNAME"] = u.Home, u.Name, u.Name
	for k, v := range r.Env {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.Contains(v, "\x00") {
			return nil, errdefs.InvalidArgument("env %q: names must be non-empty without '=' or NUL, values without NUL", k)
		}
		env[k] = v
	}
	for _, a := range r.Args {
		if strings.Contains(a, "\x00") {
			return nil, errdefs.InvalidArgument("args: an argument contains a NUL byte")
		}
	}
	dir := r.Cwd
	if dir == "" {
		dir = u.Home
		if workDir != "" {
			dir = workDir
		}
	}
	if !filepath.IsAbs(dir) {
		dir = filepath.Join(u.Home, dir)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return nil, errdefs.InvalidArgument("cwd %q: no such directory in the sandbox", r.Cwd)
	}
	path, err := lookPath(r.Args[0], env["PATH"], dir)
	if err != nil {
		return nil, err
	}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	envList := make([]string, 0, len(keys))
	for _, k := range keys {
		envList = append(envList, k+"="+env[k])
	}
	return &Resolved{Path: path, Args: r.Args, Env: envList, Dir: dir, User: u}, nil
}

func lookPath(prog, pathEnv, dir string) (string, error) {
	if strings.Contains(prog, "/") {
		p := prog
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if isExecutable(p) {
			return p, nil
		}
		return "", &ErrNotFound{Program: prog}
	}
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, prog)
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if isExecutable(p) {
			return p, nil
		}
	}
	return "", &ErrNotFound{Program: prog}
}

func isExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0
}

// Start starts a resolved process and tracks it until Forget.
func (s *Spawner) Start(res *Resolved, r Request) (*os.Process, error) {
	if s.Ready != nil {
		<-s.Ready
	}
	sys := &syscall.SysProcAttr{}
	if r.Setsid {
		sys.Setsid, sys.Setctty, sys.Ctty = true, true, 0
	} else {
		sys.Setpgid = true
	}
	if s.Cgroup != nil {
		sys.UseCgroupFD, sys.CgroupFD = true, int(s.Cgroup.Fd())
	}
	if res.User.UID != 0 || res.User.GID != 0 {
		sys.Credential = &syscall.Credential{Uid: res.User.UID, Gid: res.User.GID, Groups: res.User.Groups}
	}
	attr := &os.ProcAttr{Dir: res.Dir, Env: res.Env, Files: r.Files, Sys: sys}
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := os.StartProcess(res.Path, res.Args, attr)
	if err != nil {
		return nil, errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "start %s", res.Args[0])
	}
	if s.tracked == nil {
		s.tracked = make(map[int]struct{})
	}
	s.tracked[p.Pid] = struct{}{}
	resetOOMScore(p.Pid)
	return p, nil
}

// resetOOMScore gives a child the default OOM score. The agent protects
// itself from the OOM killer (the edge starts it with a low score), and a
// child would inherit that; a sandbox that runs out of memory must lose one
// of its workloads, not its agent.
func resetOOMScore(pid int) {
	if !ownOOMScoreAdjusted() {
		return
	}
	os.WriteFile("/proc/"+strconv.Itoa(pid)+"/oom_score_adj", []byte("0"), 0) //nolint:errcheck // best effort
}

// ownOOMScoreAdjusted reports, once, whether this process runs with an OOM
// score other than the default; it is set at start and never changed.
var ownOOMScoreAdjusted = sync.OnceValue(func() bool {
	own, err := os.ReadFile("/proc/self/oom_score_adj")
	return err == nil && strings.TrimSpace(string(own)) != "0"
})

// Forget stops tracking pid once its status has been collected.
func (s *Spawner) Forget(pid int) {
	s.mu.Lock()
	delete(s.tracked, pid)
	s.mu.Unlock()
}

// ReapOrphans collects the status of every zombie child that nobody waits
// for. It holds the lock, so a child being started is never taken for one.
func (s *Spawner) ReapOrphans() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, pid := range zombieChildren(os.Getpid()) {
		if _, ok := s.tracked[pid]; ok {
			continue
		}
		var ws syscall.WaitStatus
		if got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil); err == nil && got == pid {
			n++
		}
	}
	return n
}

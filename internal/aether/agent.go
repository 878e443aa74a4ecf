// Package aether is the agent inside every sandbox [paper: role; ours:
// design]: it serves ProcessService, FilesystemService, SessionService
// (chronus) and AgentService over the connection it dials to the edge. It is
// built static without cgo and runs as the sandbox's PID 1, reaping orphans.
package aether

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/chronus"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/guestnet"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/rpcopts"
	"github.com/opendsec/opendsec/internal/spawn"
	"github.com/opendsec/opendsec/internal/sudo"
	"github.com/opendsec/opendsec/internal/sysuser"
	"github.com/opendsec/opendsec/internal/version"
)

// Config configures an agent.
type Config struct {
	// EdgeSocket is the Unix socket the agent dials.
	EdgeSocket string
	// Env is the sandbox's environment, given to every process.
	Env map[string]string
	// Root is where the sandbox's /etc/passwd is found; "/" in a sandbox.
	Root string
	// WorkDir is where processes that name no directory start (the
	// image's WORKDIR); empty: the user's home.
	WorkDir string
	// DefaultUser is who processes that name no user run as (the image's
	// USER); empty: root.
	DefaultUser string
	// ApplyIdentity lets SetIdentity change the hostname, /etc/machine-id
	// and the entropy pool. Only true inside a real sandbox: an in-process
	// agent (the fake backend) must never touch its host.
	ApplyIdentity bool
	// MachineID, if set with ApplyIdentity, is written to /etc/machine-id
	// (and the hostname to /etc/hostname) before the agent dials the edge.
	MachineID string
	// DetachConsole, once the edge is reached, points the agent's stdout
	// and stderr at /dev/null (see DetachConsole).
	DetachConsole bool
	// SudoDir, if set, is where the agent serves the sudo broker
	// (internal/sudo), for runtimes that ignore setuid.
	SudoDir string
	// SyncClock steps the sandbox's clock to the node's that each request
	// carries (clock.go): for a VM, whose clock stops while it is paused.
	SyncClock bool
	// AuthenticateLink makes the agent present its key to the edge at
	// every connection (agentlink/auth.go); LinkKey, if set, is the key it
	// starts with (an in-process agent's restored memory).
	AuthenticateLink bool
	// SpawnCgroup, if set, is the cgroup every process of the sandbox
	// starts in (spawn.Spawner.Cgroup).
	SpawnCgroup *os.File
	LinkKey     string
	// Limits, if set, counts what the sandbox's limits ended or refused;
	// every answer carries its counts (limits.go).
	Limits *LimitEvents
}

// Agent serves one sandbox.
type Agent struct {
	cfg      Config
	log      *slog.Logger
	spawner  *spawn.Spawner
	procs    *processTable
	watches  *watchSet // the file watchers, shared by the file and process services
	sessions *chronus.Service
	dialer   *agentlink.Dialer
	started  time.Time

	// Wrap, if set before Run, wraps the handler (the fake backend uses it
	// to hold requests while "paused").
	Wrap func(http.Handler) http.Handler
}

// New returns an agent; Run starts it.
func New(cfg Config, log *slog.Logger) *Agent {
	log = logging.OrDiscard(log)
	users := sysuser.NewDB(cfg.Root)
	sp := &spawn.Spawner{Users: users, BaseEnv: cfg.Env, WorkDir: cfg.WorkDir, DefaultUser: cfg.DefaultUser, Cgroup: cfg.SpawnCgroup}
	a := &Agent{cfg: cfg, log: log, spawner: sp, procs: newProcessTable(sp), sessions: chronus.New(sp), started: time.Now(), watches: &watchSet{}}
	a.procs.watches = a.watches
	a.dialer = &agentlink.Dialer{Path: cfg.EdgeSocket, Log: log, Authenticate: cfg.AuthenticateLink}
	a.dialer.SetKey(cfg.LinkKey)
	return a
}

// LinkKey is the key the agent presents to the edge ("" until it has one).
func (a *Agent) LinkKey() string { return a.dialer.Key() }

// Handler serves the agent's services.
func (a *Agent) Handler() http.Handler {
	opts := rpcopts.Handler(
		connect.WithInterceptors(errdefs.Interceptor()),
		connect.WithReadMaxBytes(agentMaxMessage),
	)
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewProcessServiceHandler(&processService{table: a.procs}, opts...))
	mux.Handle(agentv1connect.NewFilesystemServiceHandler(&fileService{users: a.spawner.Users, watches: a.watches}, opts...))
	mux.Handle(agentv1connect.NewSessionServiceHandler(a.sessions, opts...))
	mux.Handle(agentv1connect.NewAgentServiceHandler(&agentService{a: a}, opts...))
	return mux
}

// agentMaxMessage bounds a request: a 16 MiB file chunk plus framing.
const agentMaxMessage = 20 << 20

// Run dials the edge and serves until ctx ends. As PID 1 it also reaps
// orphaned processes.
func (a *Agent) Run(ctx context.Context) error {
	if a.cfg.EdgeSocket == "" {
		return errors.New("aether: no edge socket configured")
	}
	if os.Getpid() == 1 {
		go a.reapOrphans(ctx)
	}
	if a.cfg.ApplyIdentity { // inside a sandbox, not the fake's in-process agent
		// While the agent connects, not before: making them holds 8
		// threads in a 20 ms sleep, which every create waited for. No
		// process starts until they exist (a fork bomb must not find the
		// agent unable to make a thread).
		warmed := make(chan struct{})
		a.spawner.Ready = warmed
		go func() { warmThreads(spareThreads); close(warmed) }()
	}
	// A new sandbox's identity comes with its command line: no call is
	// needed before it is ready (a restored copy gets SetIdentity).
	if a.cfg.ApplyIdentity && a.cfg.MachineID != "" {
		host, _ := os.Hostname()
		if err := applyIdentity(host, a.cfg.MachineID, nil); err != nil {
			a.log.Warn("identity not applied", logging.Error, err)
		}
	}
	if a.cfg.SudoDir != "" {
		if ln, err := sudo.Listen(a.cfg.SudoDir); err != nil {
			a.log.Warn("sudo broker not started: sudo will not work in this sandbox", logging.Error, err)
		} else {
			go sudo.NewBroker(a.cfg.SudoDir, a.spawner, a.log).Serve(ctx, ln)
		}
	}
	if a.cfg.DetachConsole {
		var once sync.Once
		a.dialer.OnConnect = func() {
			once.Do(func() {
				if err := DetachConsole(); err != nil {
					a.log.Warn("console left attached", logging.Error, err)
				}
			})
		}
	}
	a.dialer.Handler = reportLimits(a.Handler(), a.cfg.Limits)
	if a.cfg.SyncClock {
		a.dialer.Handler = syncClock(a.dialer.Handler, a.log)
	}
	if a.Wrap != nil {
		a.dialer.Handler = a.Wrap(a.dialer.Handler)
	}
	a.dialer.Run(ctx)
	a.sessions.Close()
	a.procs.closeAll()
	return nil
}

func (a *Agent) reapOrphans(ctx context.Context) {
	ch := make(chan os.Signal, 16)
	signal.Notify(ch, syscall.SIGCHLD)
	defer signal.Stop(ch)
	tick := time.NewTicker(10 * time.Second) // in case a SIGCHLD was coalesced
	defer tick.Stop()
	for {
		select {
		case <-ch:
		case <-tick.C:
		case <-ctx.Done():
			return
		}
		a.spawner.ReapOrphans()
	}
}

type agentService struct{ a *Agent }

var _ agentv1connect.AgentServiceHandler = (*agentService)(nil)

func (s *agentService) Health(ctx context.Context, req *connect.Request[agentv1.HealthRequest]) (*connect.Response[agentv1.HealthResponse], error) {
	host, _ := os.Hostname()
	return connect.NewResponse(&agentv1.HealthResponse{
		Version: version.Version, Hostname: host,
		UptimeMs: time.Since(s.a.started).Milliseconds(), Connects: s.a.dialer.Connects(),
	}), nil
}

func (s *agentService) SetIdentity(ctx context.Context, req *connect.Request[agentv1.SetIdentityRequest]) (*connect.Response[agentv1.SetIdentityResponse], error) {
	m := req.Msg
	if m.Hostname != "" && (len(m.Hostname) > 64 || strings.ContainsAny(m.Hostname, " /\x00\n")) {
		return nil, errdefs.InvalidArgument("hostname %q: 1 to 64 characters without spaces or slashes", m.Hostname)
	}
	if m.MachineId != "" && (len(m.MachineId) != 32 || strings.Trim(m.MachineId, "0123456789abcdef") != "") {
		return nil, errdefs.InvalidArgument("machine_id: want 32 lowercase hex characters")
	}
	var nic *guestnet.Config
	if n := m.Network; n != nil {
		nic = &guestnet.Config{Address: n.Address, Gateway: n.Gateway, MAC: n.Mac}
		if err := nic.Check(); err != nil {
			return nil, errdefs.InvalidArgument("network: %v", err)
		}
	}
	var env map[string]string
	if m.Settings != nil {
		var err error
		if env, err = checkSettings(m.Settings); err != nil {
			return nil, err
		}
	}
	if s.a.cfg.ApplyIdentity {
		if err := applyIdentity(m.Hostname, m.MachineId, m.Entropy); err != nil {
			return nil, err
		}
		if m.Settings != nil {
			if err := applySettings(m.Settings, env); err != nil {
				return nil, err
			}
		}
		if nic != nil {
			if err := nic.Readdress(); err != nil {
				return nil, errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "take the copy's network")
			}
		}
	}
	if m.Settings != nil {
		user := env[agentlink.ImageUserEnv]
		delete(env, agentlink.ImageUserEnv)
		s.a.spawner.SetDefaults(env, m.Settings.WorkDir, user)
	}
	return connect.NewResponse(&agentv1.SetIdentityResponse{}), nil
}

// applyIdentity sets the hostname (only if it differs: a new sandbox has
// its own from the runtime, and a container's agent has no CAP_SYS_ADMIN to
// set one; a restored copy carries its source's), writes /etc/hostname
// (images ship their build host's name there) and /etc/machine-id, and
// mixes entropy into the kernel's pool. Empty values are left alone.
func applyIdentity(hostname, machineID string, entropy []byte) error {
	if cur, _ := os.Hostname(); hostname != "" && cur != hostname {
		if err := syscall.Sethostname([]byte(hostname)); err != nil {
			return errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "set hostname")
		}
	}
	if hostname != "" {
		os.WriteFile("/etc/hostname", []byte(hostname+"\n"), 0o644) //nolint:errcheck // optional
	}
	if machineID != "" {
		if err := os.WriteFile("/etc/machine-id", []byte(machineID+"\n"), 0o444); err != nil {
			return errdefs.Wrap(errdefs.ErrFailedPrecondition, err, "write /etc/machine-id")
		}
	}
	if len(entropy) > 0 {
		// Writing mixes the bytes into the pool (no entropy credit needed:
		// the kernel reseeds its CRNG from the mixed pool).
		if f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0); err == nil {
			f.Write(entropy) //nolint:errcheck // best effort; gVisor draws from the host anyway
			// A write only mixes the pool; the CRNG that copies of one
			// snapshot share would go on the same for up to a minute
			// (boot_id, every key drawn). Reseed it now (needs
			// CAP_SYS_ADMIN: a VM's agent has it).
			unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0) //nolint:errcheck // best effort, as above
			f.Close()
		}
	}
	return nil
}

// Command aether is the agent inside every sandbox. The edge starts it as the
// sandbox's first process; it dials the edge's socket and serves the agent API.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/aether"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sudo"
	"github.com/opendsec/opendsec/internal/version"
)

func main() {
	// Mounted over /usr/bin/sudo where the runtime ignores setuid (gVisor),
	// this binary is sudo's client.
	if filepath.Base(os.Args[0]) == "sudo" {
		os.Exit(sudo.Main(os.Args[1:]))
	}
	socket := flag.String("edge-socket", "/.dsec/run/edge.sock", "Unix socket of the edge to dial")
	sudoDir := flag.String("sudo-dir", "", "serve the sudo broker in this directory (runtimes that ignore setuid)")
	verbose := flag.Bool("v", false, "log debug messages")
	machineID := flag.String("machine-id", "", "write this machine id to /etc/machine-id (and the hostname to /etc/hostname) before dialing the edge")
	pidsMax := flag.Int("pids-max", 0, "limit the sandbox's processes and threads in this kernel's pids cgroup (gVisor); 0 for none")
	printVersion := flag.Bool("version", false, "print the version and exit")
	syncClock := flag.Bool("sync-clock", false, "step the clock to the node's that every request from the edge carries (in a VM)")
	linkAuth := flag.Bool("link-auth", false, "present the key the edge gives at the first connection at every later one (the edge then serves no other agent)")
	memoryMax := flag.Int64("memory-max", 0, "keep the sandbox's memory under this many bytes by killing the process that holds the most (gVisor, whose sentry enforces no limit); 0 for none")
	spawnCgroup := flag.String("spawn-cgroup", "", "start every process of the sandbox in this cgroup v2 directory, the agent staying outside it (a microVM's guest)")
	flag.Parse()
	if *printVersion {
		fmt.Println(version.Version)
		return
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	if err := aether.Protect(); err != nil {
		fmt.Fprintln(os.Stderr, "aether:", err)
		os.Exit(1)
	}
	if *pidsMax > 0 {
		if err := aether.LimitTasks(*pidsMax); err != nil {
			fmt.Fprintln(os.Stderr, "aether: limit tasks:", err)
			os.Exit(1)
		}
	}
	var cgroup *os.File
	if *spawnCgroup != "" {
		var err error
		if cgroup, err = os.OpenFile(*spawnCgroup, os.O_RDONLY|syscall.O_DIRECTORY, 0); err != nil {
			fmt.Fprintln(os.Stderr, "aether: the sandbox's cgroup:", err)
			os.Exit(1)
		}
	}
	ctx := context.Background()
	if os.Getpid() != 1 {
		// Run by hand: a signal ends it. As a sandbox's PID 1 it ignores
		// them (Protect) and the runtime's SIGKILL ends it.
		var stop context.CancelFunc
		ctx, stop = signal.NotifyContext(ctx, syscall.SIGTERM, syscall.SIGINT)
		defer stop()
	}
	log := logging.New("text", level)
	limits := aether.NewLimitEvents(cgroup)
	if *memoryMax > 0 {
		go aether.WatchMemory(ctx, *memoryMax, 50*time.Millisecond, limits, log)
	}
	if err := run(ctx, *socket, *sudoDir, *machineID, *syncClock, *linkAuth, cgroup, limits, log); err != nil {
		fmt.Fprintln(os.Stderr, "aether:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, socket, sudoDir, machineID string, syncClock, linkAuth bool, cgroup *os.File, limits *aether.LimitEvents, log *slog.Logger) error {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	imageUser := env[agentlink.ImageUserEnv]
	delete(env, agentlink.ImageUserEnv)
	// The runtime starts the agent in the image's WORKDIR ("/" without one).
	workDir, _ := os.Getwd()
	if workDir == "/" {
		workDir = ""
	}
	return aether.New(aether.Config{WorkDir: workDir, DefaultUser: imageUser, EdgeSocket: socket, Env: env, Root: "/", ApplyIdentity: true, SudoDir: sudoDir, DetachConsole: true, MachineID: machineID, SyncClock: syncClock, AuthenticateLink: linkAuth, SpawnCgroup: cgroup, Limits: limits}, log).Run(ctx)
}

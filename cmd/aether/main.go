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
	"runtime/pprof"
	"strings"
	"syscall"

	"github.com/opendsec/opendsec/internal/aether"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sudo"
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
	version := flag.Bool("version", false, "print the version and exit")
	flag.Parse()
	if *version {
		fmt.Println(aether.Version)
		return
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	// Debug knob (unstable): SIGUSR2 writes every goroutine's stack to
	// stderr (the container backend's console.log) without stopping.
	usr2 := make(chan os.Signal, 1)
	signal.Notify(usr2, syscall.SIGUSR2)
	go func() {
		for range usr2 {
			pprof.Lookup("goroutine").WriteTo(os.Stderr, 2) //nolint:errcheck // diagnostics only
		}
	}()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, *socket, *sudoDir, logging.New("text", level)); err != nil {
		fmt.Fprintln(os.Stderr, "aether:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, socket, sudoDir string, log *slog.Logger) error {
	env := map[string]string{}
	for _, kv := range os.Environ() {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	return aether.New(aether.Config{EdgeSocket: socket, Env: env, Root: "/", ApplyIdentity: true, SudoDir: sudoDir}, log).Run(ctx)
}

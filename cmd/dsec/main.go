// Command dsec is OpenDsec's one binary: `dsec up` runs every component in
// one process; the other verbs are the command line client.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"connectrpc.com/connect"
	"github.com/opendsec/opendsec/internal/version"
)

const usage = `usage: dsec <command> [flags]

Cluster:
  up        run every component in one process (apiserver, watcher, IAM, edge,
            and the E2B-compatible gateway)
  gateway   run the E2B-compatible gateway alone, in front of an apiserver
  iam       run an IAM replica; iam status | join | remove
  edge      run an edge (one node) alone
  apiserver run an apiserver alone (with its own IAM read replica and view of the edges)
  watcher   run a watcher alone: polls the edges, serves their state to apiservers
  ca        init | issue: the cluster's certificate authority
  rollout   roll a new build out over a cluster in waves, with health gates
            and an automatic rollback (--plan, --binary; --rollback)

Sandboxes (DSEC_API_URL and DSEC_API_KEY from client.env):
  run       create a sandbox, optionally run a command in it
  exec      run a command in a sandbox
  ls        list sandboxes
  stop      stop and remove sandboxes (--all for every one)
  pause     pause sandboxes, or a whole task (--task): frozen, or --offload
            (memory written to disk and given back)
  resume    resume sandboxes, or a whole task (--task)
  fork      fork a sandbox into copies that keep its memory (gvisor backend)
  snapshot  snapshot a sandbox; snapshot ls | rm | restore
  port-forward  forward a local port to a port inside a sandbox
  network   show or change a sandbox's network policy (--add, --remove, --replace, --internet)
  image     ls | import | rm | build | export
  pool      set | ls: warm pools, sandboxes of an image kept started on
            every node for creates to claim (root admin)
  whoami    show the API key's project and role
  key       create | ls | revoke API keys (--format e2b for E2B's SDKs)
  project   create | ls | quota | rm projects; ls shows usage against quota
  nodes     the edges: health, version, allocation against capacity, backends (root admin)
  version   print this binary's version

Run "dsec <command> -h" for the flags of a command.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cmd, args := os.Args[1], os.Args[2:]
	var err error
	code := 0
	switch cmd {
	case "up":
		err = cmdUp(ctx, args)
	case "run":
		code, err = cmdRun(ctx, args)
	case "exec":
		code, err = cmdExec(ctx, args)
	case "ls":
		err = cmdLs(ctx, args)
	case "stop":
		err = cmdStop(ctx, args)
	case "pause", "resume":
		err = cmdPause(ctx, cmd, args)
	case "fork":
		err = cmdFork(ctx, args)
	case "snapshot":
		err = cmdSnapshot(ctx, args)
	case "network":
		err = cmdNetwork(ctx, args)
	case "port-forward":
		err = cmdPortForward(ctx, args)
	case "image":
		err = cmdImage(ctx, args)
	case "pool":
		err = cmdPool(ctx, args)
	case "whoami":
		err = cmdWhoami(ctx, args)
	case "key":
		err = cmdKey(ctx, args)
	case "project":
		err = cmdProject(ctx, args)
	case "nodes":
		err = cmdNodes(ctx, args)
	case "gateway":
		err = cmdGateway(ctx, args)
	case "iam":
		err = cmdIAM(ctx, args)
	case "edge":
		err = cmdEdge(ctx, args)
	case "apiserver":
		err = cmdAPIServer(ctx, args)
	case "watcher":
		err = cmdWatcher(ctx, args)
	case "ca":
		err = cmdCA(args)
	case "rollout":
		err = cmdRollout(ctx, args)
	case "version", "--version":
		fmt.Println(version.Version)
		return
	case "help", "-h", "--help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "dsec: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	if ctx.Err() != nil && daemons[cmd] {
		// A daemon's log says why it stopped: a signal, and which one.
		fmt.Fprintf(os.Stderr, "dsec %s: stopping: %v\n", cmd, context.Cause(ctx))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsec:", describe(err))
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// daemons are the commands that run until they are stopped.
var daemons = map[string]bool{"up": true, "iam": true, "edge": true, "apiserver": true, "watcher": true, "gateway": true}

// describe prints an RPC error as "code: message".
func describe(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return fmt.Sprintf("%s: %s", ce.Code(), ce.Message())
	}
	return err.Error()
}

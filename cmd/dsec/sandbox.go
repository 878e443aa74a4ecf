package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/term"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	iamv1 "github.com/opendsec/opendsec/api/gen/opendsec/iam/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
)

// multiFlag collects repeated -env K=V flags.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func envMap(kvs []string) (map[string]string, error) {
	out := map[string]string{}
	for _, kv := range kvs {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("env %q: want KEY=VALUE", kv)
		}
		out[k] = v
	}
	return out, nil
}

func cmdRun(ctx context.Context, args []string) (int, error) {
	fs := flag.NewFlagSet("run", flag.ExitOnError)
	backend := fs.String("backend", "container", "isolation backend: container, gvisor or microvm")
	img := fs.String("image", "root/busybox:latest", "image name project/name:tag")
	cpu := fs.Float64("cpu", 0, "cpu cores (0: server default)")
	mem := fs.Int64("memory", 0, "memory limit in MiB (0: server default)")
	disk := fs.Int64("disk", 0, "writable layer size in MiB (0: server default)")
	pids := fs.Int64("pids", 0, "processes and threads (0: server default)")
	timeout := fs.Int64("timeout", 0, "time to live in seconds (0: server default)")
	task := fs.String("task", "", "task label (dsec pause --task pauses every sandbox of a task)")
	onTimeout := fs.String("on-timeout", "kill", "when the time to live runs out: kill (remove it) or pause (offloaded where the backend can, else frozen)")
	explicitResume := fs.Bool("explicit-resume", false, "while paused, calls do not resume it: only dsec resume does")
	rm := fs.Bool("rm", false, "stop the sandbox after the command")
	var env, allow multiFlag
	fs.Var(&env, "env", "KEY=VALUE for every process (repeatable)")
	network := fs.Bool("network", false, "give the sandbox a network interface (egress only where --allow or --internet say)")
	internet := fs.Bool("internet", false, "allow every public address (implies --network)")
	fs.Var(&allow, "allow", `allowed destination, e.g. "pypi.example.org", "tcp 10.1.0.0/16:443" (repeatable; implies --network)`)
	public := fs.Bool("public", false, "let requests without an API key reach the sandbox's ports (implies --network)")
	wait := fs.Duration("wait", 0, "how long to keep sending the create again while the fleet has no room (0: a minute)")
	fs.Parse(args)
	c, err := client.FromEnv()
	if err != nil {
		return 1, err
	}
	c.CreateWait = *wait
	c.OnCreateRetry = func(err error, pause time.Duration) {
		fmt.Fprintf(os.Stderr, "dsec run: %v; trying again in %.1fs\n", err, pause.Seconds())
	}
	e, err := envMap(env)
	if err != nil {
		return 2, err
	}
	ot, ok := map[string]sandboxv1.OnTimeout{"kill": sandboxv1.OnTimeout_ON_TIMEOUT_KILL, "pause": sandboxv1.OnTimeout_ON_TIMEOUT_PAUSE}[*onTimeout]
	if !ok {
		return 2, fmt.Errorf("run: --on-timeout %q: want kill or pause", *onTimeout)
	}
	spec := &sandboxv1.SandboxSpec{
		Backend: *backend, Image: *img, TimeoutSeconds: *timeout, Env: e, Task: *task, OnTimeout: ot, ExplicitResume: *explicitResume,
		Resources: &sandboxv1.Resources{CpuCores: *cpu, MemoryMb: *mem, DiskMb: *disk, Pids: *pids},
	}
	if *network || *internet || *public || len(allow) > 0 {
		spec.Network = &sandboxv1.NetworkPolicy{Internet: *internet, Rules: networkRules(allow), AllowPublicTraffic: *public}
	}
	sb, err := c.Create(ctx, spec)
	if err != nil {
		return 1, err
	}
	if fs.NArg() == 0 {
		fmt.Println(sb.ID)
		return 0, nil
	}
	fmt.Fprintln(os.Stderr, sb.ID)
	code, err := execStream(ctx, sb, &agentv1.ProcessConfig{Args: fs.Args()}, false, false)
	if *rm {
		if serr := sb.Stop(context.WithoutCancel(ctx)); serr != nil && err == nil {
			err = serr
		}
	}
	return code, err
}

func cmdExec(ctx context.Context, args []string) (int, error) {
	fs := flag.NewFlagSet("exec", flag.ExitOnError)
	tty := fs.Bool("t", false, "run in a terminal")
	interactive := fs.Bool("i", false, "send this terminal's input")
	cwd := fs.String("cwd", "", "working directory")
	user := fs.String("user", "", "user name or uid")
	timeout := fs.Duration("timeout", 0, "kill the command after this long")
	var env multiFlag
	fs.Var(&env, "env", "KEY=VALUE (repeatable)")
	fs.Parse(args)
	if fs.NArg() < 2 {
		return 2, fmt.Errorf("exec: usage: dsec exec [flags] SANDBOX_ID -- COMMAND [ARGS...]")
	}
	c, err := client.FromEnv()
	if err != nil {
		return 1, err
	}
	e, err := envMap(env)
	if err != nil {
		return 2, err
	}
	argv := fs.Args()[1:]
	if argv[0] == "--" {
		argv = argv[1:]
	}
	if len(argv) == 0 {
		return 2, fmt.Errorf("exec: no command after the sandbox id")
	}
	cfg := &agentv1.ProcessConfig{Args: argv, Env: e, Cwd: *cwd, User: *user, TimeoutMs: uint32(timeout.Milliseconds())}
	return execStream(ctx, c.Sandbox(fs.Arg(0)), cfg, *tty, *interactive)
}

// execStream runs cfg, copying its output here, and returns its exit code.
func execStream(ctx context.Context, sb *client.Sandbox, cfg *agentv1.ProcessConfig, tty, interactive bool) (int, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if tty {
		cols, rows, err := term.GetSize(int(os.Stdin.Fd()))
		if err != nil {
			cols, rows = 80, 24
		}
		cfg.Pty = &agentv1.PtySize{Cols: uint32(cols), Rows: uint32(rows)}
		if term.IsTerminal(int(os.Stdin.Fd())) {
			old, err := term.MakeRaw(int(os.Stdin.Fd()))
			if err == nil {
				defer term.Restore(int(os.Stdin.Fd()), old)
			}
		}
	}
	cfg.KeepStdinOpen = interactive && !tty
	stream, err := sb.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: cfg}))
	if err != nil {
		return 1, err
	}
	for stream.Receive() {
		ev := stream.Msg().Event
		switch {
		case ev.GetStarted() != nil:
			if pid := ev.GetStarted().Pid; pid != 0 && (interactive || tty) {
				sel := &agentv1.ProcessSelector{Selector: &agentv1.ProcessSelector_Pid{Pid: pid}}
				go forwardInput(ctx, sb, sel, tty)
				if tty {
					go forwardResize(ctx, sb, sel)
				}
			}
		case ev.GetOutput() != nil:
			o := ev.GetOutput()
			if o.Stream == agentv1.Stream_STREAM_STDERR {
				os.Stderr.Write(o.Data)
			} else {
				os.Stdout.Write(o.Data)
			}
		case ev.GetExited() != nil:
			x := ev.GetExited()
			if x.TimedOut {
				fmt.Fprintln(os.Stderr, "dsec: command timed out")
			}
			return int(x.ExitCode), nil
		}
	}
	if err := stream.Err(); err != nil {
		return 1, err
	}
	return 1, fmt.Errorf("exec: stream ended without an exit status")
}

func forwardInput(ctx context.Context, sb *client.Sandbox, sel *agentv1.ProcessSelector, tty bool) {
	buf := make([]byte, 32*1024)
	for {
		n, err := os.Stdin.Read(buf)
		if n > 0 {
			if _, serr := sb.Process.SendInput(ctx, connect.NewRequest(&agentv1.SendInputRequest{Process: sel, Data: append([]byte(nil), buf[:n]...)})); serr != nil {
				return
			}
		}
		if err == io.EOF && !tty {
			sb.Process.CloseStdin(ctx, connect.NewRequest(&agentv1.CloseStdinRequest{Process: sel})) //nolint:errcheck // it may have exited
			return
		}
		if err != nil {
			return
		}
	}
}

func forwardResize(ctx context.Context, sb *client.Sandbox, sel *agentv1.ProcessSelector) {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGWINCH)
	defer signal.Stop(ch)
	for {
		select {
		case <-ctx.Done():
			return
		case <-ch:
			if cols, rows, err := term.GetSize(int(os.Stdin.Fd())); err == nil {
				sb.Process.ResizePty(ctx, connect.NewRequest(&agentv1.ResizePtyRequest{Process: sel, Size: &agentv1.PtySize{Cols: uint32(cols), Rows: uint32(rows)}})) //nolint:errcheck // best effort
			}
		}
	}
}

func cmdLs(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("ls", flag.ExitOnError)
	task := fs.String("task", "", "only this task")
	project := fs.String("project", "", "project subtree (default: the key's)")
	quiet := fs.Bool("q", false, "print ids only")
	fs.Parse(args)
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	all, err := listAll(ctx, c, *project, *task)
	if err != nil {
		return err
	}
	if *quiet {
		for _, sb := range all {
			fmt.Println(sb.Id)
		}
		return nil
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tPROJECT\tBACKEND\tIMAGE\tSTATE\tCPU\tMEM\tAGE\tEXPIRES IN\tAGENT\tLIMITS HIT")
	for _, sb := range all {
		s := sb.Spec
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%g\t%dM\t%s\t%s\t%s\t%s\n", sb.Id, sb.Project, s.Backend, s.Image,
			strings.ToLower(strings.TrimPrefix(sb.State.String(), "SANDBOX_STATE_")), s.Resources.GetCpuCores(), s.Resources.GetMemoryMb(),
			time.Since(sb.CreatedAt.AsTime()).Round(time.Second), time.Until(sb.ExpiresAt.AsTime()).Round(time.Second), agentColumn(sb), limitsHit(sb.LimitEvents))
	}
	return tw.Flush()
}

// agentColumn is the sandbox's agent's version, marked when it is older
// than its edge's (the sandbox was made before an upgrade).
func agentColumn(sb *sandboxv1.Sandbox) string {
	v := orDash(sb.AgentVersion)
	if sb.AgentOutdated {
		v += " (outdated)"
	}
	return v
}

// limitsHit says what a sandbox's limits did inside it: "-" for nothing,
// else e.g. "2 OOM kills, 40 forks refused".
func limitsHit(le *sandboxv1.LimitEvents) string {
	var parts []string
	if n := le.GetOomKills(); n > 0 {
		parts = append(parts, fmt.Sprintf("%d OOM kill%s", n, plural(n)))
	}
	if n := le.GetForksRefused(); n > 0 {
		parts = append(parts, fmt.Sprintf("%d fork%s refused", n, plural(n)))
	}
	if len(parts) == 0 {
		return "-"
	}
	return strings.Join(parts, ", ")
}

func plural(n int64) string {
	if n == 1 {
		return ""
	}
	return "s"
}

func listAll(ctx context.Context, c *client.Client, project, task string) ([]*sandboxv1.Sandbox, error) {
	var all []*sandboxv1.Sandbox
	token := ""
	for {
		resp, err := c.Sandboxes.ListSandboxes(ctx, connect.NewRequest(&sandboxv1.ListSandboxesRequest{Project: project, Task: task, PageSize: 1000, PageToken: token}))
		if err != nil {
			return nil, err
		}
		all = append(all, resp.Msg.Sandboxes...)
		if token = resp.Msg.NextPageToken; token == "" {
			return all, nil
		}
	}
}

func cmdStop(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("stop", flag.ExitOnError)
	all := fs.Bool("all", false, "stop every sandbox of the key's project subtree")
	fs.Parse(args)
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	ids := fs.Args()
	if *all {
		list, err := listAll(ctx, c, "", "")
		if err != nil {
			return err
		}
		for _, sb := range list {
			ids = append(ids, sb.Id)
		}
	}
	if len(ids) == 0 {
		if *all {
			return nil // nothing running: nothing to stop
		}
		return fmt.Errorf("stop: name sandbox ids, or --all")
	}
	failed := 0
	for _, id := range ids {
		if _, err := c.Sandboxes.StopSandbox(ctx, connect.NewRequest(&sandboxv1.StopSandboxRequest{SandboxId: id})); err != nil {
			fmt.Fprintf(os.Stderr, "dsec: stop %s: %s\n", id, describe(err))
			failed++
			continue
		}
		fmt.Println(id)
	}
	if failed > 0 {
		return fmt.Errorf("stop: %d of %d failed", failed, len(ids))
	}
	return nil
}

func cmdWhoami(ctx context.Context, args []string) error {
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	resp, err := c.IAM.WhoAmI(ctx, connect.NewRequest(&iamv1.WhoAmIRequest{}))
	if err != nil {
		return err
	}
	k := resp.Msg.Key
	fmt.Printf("key %s (%s) of project %s, role %s\n", k.Id, k.Name, k.Project, strings.TrimPrefix(k.Role.String(), "ROLE_"))
	return nil
}

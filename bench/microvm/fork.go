package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
)

// prep is the state a source builds before it forks (and each cold
// sandbox builds again): 32 MiB of random data written to a file, which
// fills the guest's page cache (its memory) and its writable layer.
const prep = "dd if=/dev/urandom of=/tmp/state bs=1M count=32 2>/dev/null"

// forkRow is one fork count's figures.
type forkRow struct {
	count               int
	ours, oursPause     time.Duration
	bare, barePause     time.Duration
	gvisor, gvisorPause time.Duration
	cold                time.Duration
}

// answered waits until every sandbox answers a command.
func answered(ctx context.Context, cl *client.Client, ids []string) error {
	errs := make(chan error, len(ids))
	for _, id := range ids {
		go func() {
			r, err := cl.Sandbox(id).Shell(ctx, "true")
			if err == nil && r.ExitCode != 0 {
				err = fmt.Errorf("exit %d", r.ExitCode)
			}
			errs <- err
		}()
	}
	for range ids {
		if err := <-errs; err != nil {
			return err
		}
	}
	return nil
}

// forkOnce forks a prepared source into count copies through the API and
// waits until each answers; it returns the total, the source's pause and
// the copies (the caller stops them).
func forkOnce(ctx context.Context, cl *client.Client, spec *sandboxv1.SandboxSpec, count int) (time.Duration, time.Duration, []string, error) {
	src, err := cl.Create(ctx, spec)
	if err != nil {
		return 0, 0, nil, err
	}
	defer src.Stop(ctx) //nolint:errcheck // measured
	if r, err := src.Shell(ctx, prep); err != nil || r.ExitCode != 0 {
		return 0, 0, nil, fmt.Errorf("prepare the source: %v %v", r, err)
	}
	t0 := time.Now()
	resp, err := cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: int32(count)}))
	if err != nil {
		return 0, 0, nil, err
	}
	var ids []string
	for _, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			return 0, 0, ids, fmt.Errorf("copy: %s %s", r.ErrorCode, r.ErrorMessage)
		}
		ids = append(ids, r.Sandbox.Id)
	}
	if err := answered(ctx, cl, ids); err != nil {
		return 0, 0, ids, err
	}
	return time.Since(t0), time.Duration(resp.Msg.SourcePauseUs) * time.Microsecond, ids, nil
}

// coldOnce creates count sandboxes at once, each running the preparation,
// until every one has; it returns the time and the sandboxes.
func coldOnce(ctx context.Context, cl *client.Client, spec *sandboxv1.SandboxSpec, count int) (time.Duration, []string, error) {
	t0 := time.Now()
	var mu sync.Mutex
	var ids []string
	var first error
	var wg sync.WaitGroup
	for range count {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := cl.Create(ctx, spec)
			if err == nil {
				mu.Lock()
				ids = append(ids, sb.ID)
				mu.Unlock()
				var r *sandboxRun
				r, err = shell(ctx, cl, sb.ID, prep)
				if err == nil && r.exit != 0 {
					err = fmt.Errorf("prep exit %d", r.exit)
				}
			}
			if err != nil {
				mu.Lock()
				first = err
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return time.Since(t0), ids, first
}

type sandboxRun struct{ exit int32 }

func shell(ctx context.Context, cl *client.Client, id, cmd string) (*sandboxRun, error) {
	r, err := cl.Sandbox(id).Shell(ctx, cmd)
	if err != nil {
		return nil, err
	}
	return &sandboxRun{exit: r.ExitCode}, nil
}

// bareFork is the raw QEMU steps of a fork: a guest of the same kernel,
// init, agent and memory size, its RAM a shared file; stop + migrate of
// its device state (x-ignore-shared), then count QEMUs started at once,
// each mapping the RAM file privately and taking the state in, until all
// run. It returns the total and the source's stop.
func bareFork(ctx context.Context, q *microvm.QEMU, agent string, memMB, count int) (time.Duration, time.Duration, error) {
	dir, err := os.MkdirTemp("", "dsec-bench-bare-fork-")
	if err != nil {
		return 0, 0, err
	}
	defer os.RemoveAll(dir)
	data, err := os.ReadFile(agent)
	if err != nil {
		return 0, 0, err
	}
	initrd := filepath.Join(dir, "initrd.cpio")
	if err := q.WriteInitramfs(initrd, []microvm.InitFile{{Path: "/aether", Mode: 0o755, Data: data}}); err != nil {
		return 0, 0, err
	}
	mem := filepath.Join("/dev/shm", filepath.Base(dir)+".mem")
	defer os.Remove(mem)
	g := microvm.Guest{MemoryMB: memMB, Initrd: initrd, Console: filepath.Join(dir, "console.log"), AgentChardev: "null,id=agent", MemFile: mem, MemShared: true, ModulesDisk: q.ModulesDisk}
	srcDir := filepath.Join(dir, "src")
	os.MkdirAll(srcDir, 0o700)
	src, err := q.StartBare(ctx, srcDir, g)
	if err != nil {
		return 0, 0, err
	}
	defer src.Kill()
	// Until the guest's init has handed over to the agent.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		if out, _ := os.ReadFile(g.Console); strings.Contains(string(out), "starting the agent") {
			break
		}
		if time.Now().After(deadline) {
			return 0, 0, fmt.Errorf("bare guest did not start its agent")
		}
	}
	time.Sleep(300 * time.Millisecond) // the agent opens its port
	state := filepath.Join(dir, "state")
	t0 := time.Now()
	pause, err := src.SnapshotShared(ctx, state)
	if err != nil {
		return 0, 0, err
	}
	errs := make(chan error, count)
	var copies []*microvm.BareGuest
	var mu sync.Mutex
	for i := range count {
		go func() {
			cdir := filepath.Join(dir, fmt.Sprint("copy", i))
			os.MkdirAll(cdir, 0o700)
			cg := g
			cg.MemShared, cg.Incoming, cg.Console = false, true, filepath.Join(cdir, "console.log")
			c, err := q.StartBare(ctx, cdir, cg)
			if err == nil {
				mu.Lock()
				copies = append(copies, c)
				mu.Unlock()
				err = c.Incoming(ctx, state)
			}
			errs <- err
		}()
	}
	var first error
	for range count {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	took := time.Since(t0)
	for _, c := range copies {
		c.Kill()
	}
	return took, pause, first
}

func medianRow(rows []forkRow) forkRow {
	sort.Slice(rows, func(i, j int) bool { return rows[i].ours < rows[j].ours })
	return rows[len(rows)/2]
}

func printForkTable(rows []forkRow) {
	fmt.Printf("\nfork until every copy answers (the bare row: until every copy runs), ms; median run of each count by ours\n")
	fmt.Printf("%5s %9s %7s | %9s %7s | %9s %7s | %9s | %7s %7s %7s\n", "count", target.name, "paused", "bare QEMU", "stopped", "gvisor", "paused", "cold+prep", "/bare", "/gvisor", "/cold")
	for _, r := range rows {
		fmt.Printf("%5d %9s %7s | %9s %7s | %9s %7s | %9s | %6.2fx %6.2fx %6.2fx\n", r.count,
			benchstat.Ms(r.ours, 0), benchstat.Ms(r.oursPause, 0), benchstat.Ms(r.bare, 0), benchstat.Ms(r.barePause, 0),
			benchstat.Ms(r.gvisor, 0), benchstat.Ms(r.gvisorPause, 0), benchstat.Ms(r.cold, 0),
			float64(r.ours)/float64(r.bare), float64(r.ours)/float64(r.gvisor), float64(r.ours)/float64(r.cold))
	}
}

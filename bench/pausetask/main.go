// Command pausetask measures pausing a whole task, in one run: for N gvisor
// sandboxes of one task (N = 10, 50, 200 by default), each holding 16 MiB
// it wrote in memory, pause_task with offload and resume_task (wall time,
// p50 and max per sandbox as each node measured it), the memory given back
// per sandbox, and the first call to an offloaded sandbox (which restores
// it); against runsc's own checkpoint and restore of as many bare runsc
// containers of the same image and state, four at a time as the edge does.
// Needs root, runsc and root/busybox:latest (make images).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	rspec "github.com/opencontainers/runtime-spec/specs-go"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
)

// prep is each sandbox's state: 16 MiB written to its memory-backed /tmp
// and a process that stays.
const prep = "dd if=/dev/urandom of=/tmp/state bs=1M count=16 2>/dev/null; (sleep 100000 &) ; echo ok"

func main() {
	store := flag.String("store", ".cache/images", "image store with root/busybox:latest")
	agent := flag.String("agent", "bin/aether", "aether binary")
	sizes := flag.String("sizes", "10,50,200", "task sizes")
	flag.Parse()
	var ns []int
	for _, f := range strings.Split(*sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "bench: -sizes %q: want positive numbers\n", *sizes)
			os.Exit(2)
		}
		ns = append(ns, n)
	}
	if err := run(context.Background(), *store, *agent, ns); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type row struct {
	n                     int
	pause, resume         time.Duration
	pauseEach, resumeEach []time.Duration
	releasedPer           int64
	firstCall             time.Duration
	raw, rawRestore       time.Duration
	rawEach, rawRestEach  []time.Duration
}

func run(ctx context.Context, store, agent string, sizes []int) error {
	// 200 sandboxes of 0.1 core on 2 cores: the node admits them.
	c, err := benchcluster.Start(ctx, store, agent, benchcluster.Backend{Name: gvisor.Name, Factory: gvisor.New}, func(cfg *embed.Config) { cfg.CPUOvercommit = 20 })
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	var rows []row
	for _, n := range sizes {
		r := row{n: n}
		if err := ours(ctx, cl, n, &r); err != nil {
			return fmt.Errorf("pause_task of %d: %w", n, err)
		}
		if err := raw(ctx, c.Work, store, n, &r); err != nil {
			return fmt.Errorf("bare runsc of %d: %w", n, err)
		}
		rows = append(rows, r)
	}
	host, _ := os.Hostname()
	fmt.Printf("pause a task (gvisor, busybox, 16 MiB written each; machine %s); per sandbox: p50/max as its node measured\n", host)
	fmt.Printf("%5s | %-24s %-24s %9s %10s | %-24s %-24s | %7s %7s\n", "n", "pause_task(offload)", "resume_task", "freed/sb", "1st call", "runsc checkpoint", "runsc restore", "pause/", "resume/")
	for _, r := range rows {
		fmt.Printf("%5d | %-24s %-24s %7.1fMiB %10s | %-24s %-24s | %6.2fx %6.2fx\n", r.n,
			cell(r.pause, r.pauseEach), cell(r.resume, r.resumeEach), float64(r.releasedPer)/(1<<20), benchstat.Ms(r.firstCall, 0),
			cell(r.raw, r.rawEach), cell(r.rawRestore, r.rawRestEach),
			float64(r.pause)/float64(r.raw), float64(r.resume)/float64(r.rawRestore))
	}
	return nil
}

func cell(wall time.Duration, each []time.Duration) string {
	return fmt.Sprintf("%s (%s/%s)", benchstat.Ms(wall, 0), benchstat.Ms(benchstat.Pct(each, 50), 0), benchstat.Ms(benchstat.Pct(each, 100), 0))
}

// parallel runs f for 0..n-1, k at a time, and returns the first error.
func parallel(n, k int, f func(i int) error) error {
	sem := make(chan struct{}, k)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			errs <- f(i)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

func ours(ctx context.Context, cl *client.Client, n int, r *row) error {
	task := fmt.Sprintf("bench-%d", n)
	ids := make([]string, n)
	err := parallel(n, 4, func(i int) error {
		sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/busybox:latest", Task: task,
			Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 128}})
		if err != nil {
			return err
		}
		ids[i] = sb.ID
		if out, err := sb.Shell(ctx, prep); err != nil || strings.TrimSpace(string(out.Stdout)) != "ok" {
			return fmt.Errorf("prepare %s: %v %v", sb.ID, out, err)
		}
		return nil
	})
	defer parallel(n, 4, func(i int) error { //nolint:errcheck // measured
		if ids[i] != "" {
			cl.Sandbox(ids[i]).Stop(context.Background()) //nolint:errcheck // measured
		}
		return nil
	})
	if err != nil {
		return err
	}
	t0 := time.Now()
	p, err := cl.PauseTask(ctx, task, sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD)
	if err != nil {
		return err
	}
	r.pause = time.Since(t0)
	for _, x := range p.Results {
		if x.ErrorCode != "" || x.Sandbox.GetPauseDepth() != sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
			return fmt.Errorf("%s: %s %s (depth %v)", x.SandboxId, x.ErrorCode, x.ErrorMessage, x.Sandbox.GetPauseDepth())
		}
		r.pauseEach = append(r.pauseEach, time.Duration(x.TookUs)*time.Microsecond)
	}
	r.releasedPer = p.MemoryReleasedBytes / int64(len(p.Results))
	t0 = time.Now()
	if out, err := cl.Sandbox(ids[0]).Shell(ctx, "true"); err != nil || out.ExitCode != 0 {
		return fmt.Errorf("first call: %v %v", out, err)
	}
	r.firstCall = time.Since(t0)
	t0 = time.Now()
	res, err := cl.ResumeTask(ctx, task)
	if err != nil {
		return err
	}
	r.resume = time.Since(t0)
	for _, x := range res.Results {
		if x.ErrorCode != "" {
			return fmt.Errorf("%s: %s %s", x.SandboxId, x.ErrorCode, x.ErrorMessage)
		}
		r.resumeEach = append(r.resumeEach, time.Duration(x.TookUs)*time.Microsecond)
	}
	return nil
}

// quiet runs cmd with its stdio on /dev/null (runsc's detached sandbox
// keeps what it is given).
func quiet(cmd *exec.Cmd) error {
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer null.Close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, null, null
	return cmd.Run()
}

// raw runs n bare runsc containers of the same image and state, then
// checkpoints them and restores them in place, four at a time.
func raw(ctx context.Context, work, storeDir string, n int, r *row) error {
	st, err := image.OpenStore(storeDir)
	if err != nil {
		return err
	}
	ref, _ := image.ParseRef("root/busybox:latest")
	im, err := st.Resolve(ref)
	if err != nil {
		return err
	}
	cache, err := image.NewCache(filepath.Join(work, "rawcache"), st)
	if err != nil {
		return err
	}
	layers, err := cache.Layers(ctx, im, nil)
	if err != nil {
		return err
	}
	root := filepath.Join(work, "runsc-root")
	runsc := func(args ...string) *exec.Cmd {
		cmd := exec.CommandContext(ctx, "runsc", append([]string{"--root", root, "--network=none", "--overlay2=root:memory"}, args...)...)
		return cmd
	}
	ids := make([]string, n)
	dirs := make([]string, n)
	defer func() {
		for i, id := range ids {
			if id == "" {
				continue
			}
			runsc("kill", id, "KILL").Run()      //nolint:errcheck // cleanup
			runsc("delete", "--force", id).Run() //nolint:errcheck // cleanup
			rootfs.Unmount(filepath.Join(dirs[i], "rootfs"))
		}
	}()
	err = parallel(n, 4, func(i int) error {
		id := fmt.Sprintf("bench-pt-%d-%03d", n, i) // runsc takes an id as a prefix: equal lengths
		dir := filepath.Join(work, id)
		if err := rootfs.Mount(layers, rootfs.LayoutIn(dir)); err != nil {
			return err
		}
		mem := int64(128 << 20)
		ready := filepath.Join(dir, "ready")
		if err := os.MkdirAll(ready, 0o777); err != nil {
			return err
		}
		s := rspec.Spec{
			Version: "1.0.2",
			Process: &rspec.Process{Args: []string{"sh", "-c", prep + "; touch /ready/done; exec sleep 100000"}, Env: []string{"PATH=/bin:/usr/bin"}, Cwd: "/"},
			Root:    &rspec.Root{Path: filepath.Join(dir, "rootfs")},
			Mounts: []rspec.Mount{{Destination: "/proc", Type: "proc", Source: "proc"}, {Destination: "/tmp", Type: "tmpfs", Source: "tmpfs"},
				{Destination: "/ready", Type: "bind", Source: ready, Options: []string{"rbind", "rw"}}},
			Linux: &rspec.Linux{CgroupsPath: "/opendsec-bench/" + id, Resources: &rspec.LinuxResources{Memory: &rspec.LinuxMemory{Limit: &mem}},
				Namespaces: []rspec.LinuxNamespace{{Type: rspec.PIDNamespace}, {Type: rspec.IPCNamespace}, {Type: rspec.UTSNamespace}, {Type: rspec.MountNamespace}, {Type: rspec.NetworkNamespace}}},
		}
		data, _ := json.Marshal(s)
		if err := os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600); err != nil {
			return err
		}
		ids[i], dirs[i] = id, dir
		// The sandbox keeps the stdio it is started with: a pipe here would
		// never end.
		if err := quiet(runsc("run", "--detach", "--bundle", dir, id)); err != nil {
			return fmt.Errorf("runsc run %s: %w", id, err)
		}
		// Until the preparation is done (it leaves a file on the host).
		for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
			if _, err := os.Stat(filepath.Join(ready, "done")); err == nil {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: not prepared in 2 minutes", id)
			}
		}
	})
	if err != nil {
		return err
	}
	var mu sync.Mutex
	timed := func(each *[]time.Duration, f func(i int) error) (time.Duration, error) {
		t0 := time.Now()
		err := parallel(n, 4, func(i int) error {
			t := time.Now()
			err := f(i)
			mu.Lock()
			*each = append(*each, time.Since(t))
			mu.Unlock()
			return err
		})
		return time.Since(t0), err
	}
	if r.raw, err = timed(&r.rawEach, func(i int) error {
		if out, err := runsc("checkpoint", "--image-path", filepath.Join(dirs[i], "img"), ids[i]).CombinedOutput(); err != nil {
			return fmt.Errorf("runsc checkpoint: %v %s", err, out)
		}
		return nil
	}); err != nil {
		return err
	}
	r.rawRestore, err = timed(&r.rawRestEach, func(i int) error {
		runsc("delete", "--force", ids[i]).Run() //nolint:errcheck // the checkpoint stopped it
		if err := quiet(runsc("restore", "--detach", "--bundle", dirs[i], "--image-path", filepath.Join(dirs[i], "img"), ids[i])); err != nil {
			return fmt.Errorf("runsc restore %s: %w", ids[i], err)
		}
		return runsc("exec", ids[i], "true").Run()
	})
	return err
}

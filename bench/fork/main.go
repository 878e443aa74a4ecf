// Command fork benchmarks fork with memory on the gvisor backend, in one
// run, against (a) bare runsc: `runsc checkpoint` + N parallel
// `runsc restore` of the same prepared state, and (b) what a user has
// without fork: N cold creates, each re-running the preparation (a Python
// process importing modules and listening on a port). For count = 1, 4, 8
// it prints the total time, the source's interruption and per-copy time to
// first exec, with ratios. Needs root, runsc and root/py:3.11 (make images).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	rspec "github.com/opencontainers/runtime-spec/specs-go"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/bench/internal/pyprep"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/image"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with root/py:3.11")
	agent := flag.String("agent", "bin/aether", "aether binary")
	counts := flag.String("counts", "1,4,8", "fork counts")
	reps := flag.Int("reps", 3, "repetitions per count; the row shows the run with the median total")
	flag.Parse()
	if err := run(context.Background(), *store, *agent, *counts, *reps); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type row struct {
	count                int
	ours, oursPause      time.Duration
	oursFirst            []time.Duration
	bare, bareCheckpoint time.Duration
	bareFirst            []time.Duration
	cold                 time.Duration
}

func run(ctx context.Context, storeDir, agent, countList string, reps int) error {
	c, err := benchcluster.Start(ctx, storeDir, agent, benchcluster.Backend{Name: gvisor.Name, Factory: gvisor.New}, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	spec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/py:3.11", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 1024}}
	prepared := func() (*client.Sandbox, time.Duration, error) {
		t0 := time.Now()
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			return nil, 0, err
		}
		if err := pyprep.Run(ctx, sb); err != nil {
			return nil, 0, err
		}
		return sb, time.Since(t0), nil
	}
	// Warm-up (unpacks the layers once).
	if sb, _, err := prepared(); err != nil {
		return err
	} else {
		sb.Stop(ctx)
	}
	var rows []row
	for _, f := range strings.Split(countList, ",") {
		var n int
		fmt.Sscan(f, &n)
		var runs []row
		for rep := 0; rep < reps; rep++ {
			r := row{count: n}

			// Ours.
			src, _, err := prepared()
			if err != nil {
				return err
			}
			t0 := time.Now()
			resp, err := cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: int32(n)}))
			if err != nil {
				return err
			}
			r.oursPause = time.Duration(resp.Msg.SourcePauseUs) * time.Microsecond
			var mu sync.Mutex
			var wg sync.WaitGroup
			var copies []*client.Sandbox
			for _, res := range resp.Msg.Results {
				if res.Sandbox == nil {
					return fmt.Errorf("copy failed: %s %s", res.ErrorCode, res.ErrorMessage)
				}
				sb := cl.Sandbox(res.Sandbox.Id)
				copies = append(copies, sb)
				wg.Add(1)
				go func() {
					defer wg.Done()
					if r2, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"true"}}); err == nil && r2.ExitCode == 0 {
						mu.Lock()
						r.oursFirst = append(r.oursFirst, time.Since(t0))
						mu.Unlock()
					}
				}()
			}
			wg.Wait()
			r.ours = time.Since(t0)
			for _, sb := range append(copies, src) {
				sb.Stop(ctx)
			}

			// Cold: N creates, each re-running the preparation, in parallel.
			t0 = time.Now()
			var cold []*client.Sandbox
			var coldErr error
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					sb, _, err := prepared()
					mu.Lock()
					defer mu.Unlock()
					if err != nil {
						coldErr = err
						return
					}
					cold = append(cold, sb)
				}()
			}
			wg.Wait()
			r.cold = time.Since(t0)
			for _, sb := range cold {
				sb.Stop(ctx)
			}
			if coldErr != nil {
				return coldErr
			}

			// Bare runsc on the same image and bundle template.
			if err := bareFork(ctx, c.Work, storeDir, n, rep, &r); err != nil {
				return err
			}
			runs = append(runs, r)
		}
		sort.Slice(runs, func(i, j int) bool { return runs[i].ours < runs[j].ours })
		rows = append(rows, runs[len(runs)/2])
	}
	fmt.Printf("fork with memory, gvisor backend vs bare runsc vs cold creates (root/py:3.11, Python with modules imported; median of %d runs, %s)\n\n", reps, time.Now().Format(time.RFC3339))
	fmt.Printf("%-6s %-9s %-10s %-16s | %-9s %-11s %-16s | %-10s | %s\n", "count", "ours", "src pause", "first exec p50/max", "runsc", "checkpoint", "first exec p50/max", "cold", "ratios")
	for _, r := range rows {
		fmt.Printf("%-6d %-9s %-10s %-16s | %-9s %-11s %-16s | %-10s | ours/runsc %.2fx, cold/ours %.1fx\n",
			r.count, msf(r.ours), msf(r.oursPause), msf(benchstat.Pct(r.oursFirst, 50))+"/"+msf(benchstat.Pct(r.oursFirst, 100)),
			msf(r.bare), msf(r.bareCheckpoint), msf(benchstat.Pct(r.bareFirst, 50))+"/"+msf(benchstat.Pct(r.bareFirst, 100)),
			msf(r.cold), float64(r.ours)/float64(r.bare), float64(r.cold)/float64(r.ours))
	}
	fmt.Println("\nours: ForkSandbox call until every copy ran `true`; src pause: time the source did not run (from the server);")
	fmt.Println("runsc: checkpoint + N parallel restores + `runsc exec true` in each; cold: N parallel creates + the preparation.")
	return nil
}

// bareFork prepares the same state in a runsc sandbox started directly (the
// preparation as its first process, no agent), then checkpoints it and
// restores N copies in parallel.
func bareFork(ctx context.Context, work, storeDir string, n, rep int, r *row) error {
	st, err := image.OpenStore(storeDir)
	if err != nil {
		return err
	}
	ref, _ := image.ParseRef("root/py:3.11")
	im, err := st.Resolve(ref)
	if err != nil {
		return err
	}
	cache, err := image.NewCache(filepath.Join(work, "state", "edge", "cache"), st)
	if err != nil {
		return err
	}
	layers, err := cache.Layers(ctx, im, nil)
	if err != nil {
		return err
	}
	root := filepath.Join(work, "runsc-root")
	runsc := func(args ...string) *exec.Cmd {
		return exec.CommandContext(ctx, "runsc", append([]string{"--root", root, "--network=none", "--overlay2=root:memory"}, args...)...)
	}
	optDir := filepath.Join(work, "opt")
	os.MkdirAll(optDir, 0o755)
	os.WriteFile(filepath.Join(optDir, "prep.py"), []byte(pyprep.Script), 0o644)
	bundle := func(id string, args []string) (string, error) {
		dir := filepath.Join(work, id)
		if err := rootfs.Mount(layers, rootfs.LayoutIn(dir)); err != nil {
			return "", err
		}
		mem := int64(1 << 30)
		s := rspec.Spec{
			Version:  "1.0.2",
			Process:  &rspec.Process{Args: args, Env: []string{"PATH=/usr/local/bin:/usr/bin:/bin"}, Cwd: "/"},
			Root:     &rspec.Root{Path: filepath.Join(dir, "rootfs")},
			Hostname: id,
			Mounts: []rspec.Mount{
				{Destination: "/proc", Type: "proc", Source: "proc"},
				{Destination: "/opt/bench", Type: "bind", Source: optDir, Options: []string{"rbind", "ro"}},
			},
			Linux: &rspec.Linux{
				CgroupsPath: "/opendsec-bench/" + id,
				Resources:   &rspec.LinuxResources{Memory: &rspec.LinuxMemory{Limit: &mem}},
				Namespaces: []rspec.LinuxNamespace{{Type: rspec.PIDNamespace}, {Type: rspec.IPCNamespace}, {Type: rspec.UTSNamespace},
					{Type: rspec.MountNamespace}, {Type: rspec.NetworkNamespace}},
			},
		}
		data, _ := json.Marshal(s)
		return dir, os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600)
	}
	start := func(cmd *exec.Cmd) error {
		null, _ := os.OpenFile(os.DevNull, os.O_RDWR, 0)
		defer null.Close()
		cmd.Stdin, cmd.Stdout, cmd.Stderr = null, null, null
		return cmd.Run()
	}
	srcID := fmt.Sprintf("bench-src-%02d-%02d00", n, rep)
	dir, err := bundle(srcID, []string{"python3", "/opt/bench/prep.py"})
	if err != nil {
		return err
	}
	if err := start(runsc("run", "--detach", "--bundle", dir, srcID)); err != nil {
		return fmt.Errorf("runsc run: %w", err)
	}
	if out, err := runsc("exec", srcID, "sh", "-c", pyprep.WaitReady).CombinedOutput(); err != nil {
		return fmt.Errorf("bare preparation: %v %s", err, out)
	}
	img := filepath.Join(work, fmt.Sprintf("img-%d-%d", n, rep))
	t0 := time.Now()
	if out, err := runsc("checkpoint", "--image-path", img, srcID).CombinedOutput(); err != nil {
		return fmt.Errorf("runsc checkpoint: %v %s", err, out)
	}
	r.bareCheckpoint = time.Since(t0)
	var wg sync.WaitGroup
	var mu sync.Mutex
	ids := []string{}
	var firstErr error
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("bench-cp%02d-%02d-%02d", n, i, rep)
		d, err := bundle(id, []string{"python3", "/opt/bench/prep.py"})
		if err != nil {
			return err
		}
		ids = append(ids, id)
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := start(runsc("restore", "--detach", "--bundle", d, "--image-path", img, id))
			if err == nil {
				err = runsc("exec", id, "true").Run()
			}
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				firstErr = err
				return
			}
			r.bareFirst = append(r.bareFirst, time.Since(t0))
		}()
	}
	wg.Wait()
	r.bare = time.Since(t0)
	for _, id := range append(ids, srcID) {
		runsc("kill", id, "KILL").Run()
		runsc("delete", "--force", id).Run()
		rootfs.Unmount(filepath.Join(work, id, "rootfs"))
	}
	return firstErr
}

func msf(d time.Duration) string { return benchstat.Ms(d, 0) }

// Command density bursts many small container sandboxes (0.1 core, 64 MiB
// each) onto one edge of this machine (or -edges of them, as `dsec up
// --edges` runs them), with the CPU overcommit a dense
// node needs, and reports failures, creates per second and host memory per
// sandbox (MemAvailable before and after, over the count), side by side
// with the same burst of bare `crun run` containers (busybox sleeping, no
// agent) for the raw runtime's rate and memory. With -raw-spec it also
// bursts bare crun with the platform's own OCI spec, then over a root made
// as a sandbox's, then with the agent in it (ourspec.go): what each part
// of a create costs against the bare runtime. Needs root, crun and
// `make images`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchplot"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/sandboxnet"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with the image")
	img := flag.String("image", "root/busybox:latest", "image to run")
	n := flag.Int("n", 1000, "sandboxes in the burst")
	raw := flag.Int("raw", 200, "bare crun containers in the raw burst (0: skip)")
	par := flag.Int("parallel", 16, "creates in flight at once")
	over := flag.Float64("cpu-overcommit", 64, "the edge's CPU overcommit")
	memOver := flag.Float64("memory-overcommit", 3, "the edge's memory overcommit")
	agent := flag.String("agent", "bin/aether", "aether binary")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the burst (the edge, apiserver and client, in this process) to this file")
	mutexProfile := flag.String("mutexprofile", "", "write a profile of lock contention during the burst to this file")
	network := flag.Bool("network", false, "give every sandbox a network interface (default deny), as the issue's second goal measures")
	pool := flag.Int("pool", 0, "keep a warm pool of this many sandboxes of the burst's image and shape on the edge, full before the burst (0: none)")
	disk := flag.Int64("disk", 64, "each sandbox's disk_mb, 16 or more (the node admits against its disk: 64 MiB each fits some 850 on this machine's 55 GiB free)")
	edgeCount := flag.Int("edges", 1, "edges of the cluster, on this machine (the seed's burst went to two)")
	hold := flag.Duration("hold", 0, "keep the burst's sandboxes this long after it before removing them (to look at them)")
	flag.BoolVar(&rawSpec, "raw-spec", false, "also burst bare crun with the platform's OCI spec (limits, seccomp, binds; sleep for the agent), then over a root made as a sandbox's (writable layer and overlay), then with those mounts in a mount namespace of each container's own, then with the agent: what each part of a create costs (ourspec.go)")
	plot := flag.String("plot", "density.png", "write a plot of creates over time, ours and bare crun's, to this PNG (\"\": none)")
	flag.Parse()
	withNetwork, plotPath, poolSize, edges, diskMB, holdFor = *network, *plot, *pool, max(*edgeCount, 1), *disk, *hold
	profile, lockProfile = *cpuProfile, *mutexProfile
	// Interrupted, the burst stops and what it made is still removed:
	// a killed run leaves its sandboxes' agents, mounts and cgroups.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *store, *img, *n, *raw, *par, *over, *memOver, *agent); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, storeDir, imgName string, n, raw, par int, over, memOver float64, agent string) error {
	be := benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}
	c, err := benchcluster.Start(ctx, storeDir, agent, be, func(cfg *embed.Config) {
		cfg.Capacity = capacity.Host(over, memOver)
		cfg.Capacity.MaxSandboxes = int64(n+poolSize) + 16
		cfg.Edges = edges
		if poolSize > 0 {
			cfg.Pools = []edge.Pool{{Spec: &sandboxv1.SandboxSpec{Backend: "container", Image: imgName, Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: diskMB}}, Project: "root", Size: poolSize}}
		}
		if withNetwork {
			cfg.Network = &sandboxnet.NodeConfig{Upstream: []string{"127.0.0.1:53"}}
		}
	})
	if err != nil {
		return err
	}
	defer c.Close()
	for _, e := range c.Edges {
		defer e.DrainPools(ctx)
	}
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	spec := func() *sandboxv1.SandboxSpec {
		s := &sandboxv1.SandboxSpec{Backend: "container", Image: imgName, Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: diskMB}}
		if withNetwork {
			s.Network = &sandboxv1.NetworkPolicy{}
		}
		return s
	}
	warm, err := cl.Create(ctx, spec()) // unpack the image's layers once
	if err != nil {
		return err
	}
	warm.Stop(ctx) //nolint:errcheck // a warm-up
	for _, e := range c.Edges {
		for deadline := time.Now().Add(10 * time.Minute); e.PoolReady() < poolSize; time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				return fmt.Errorf("the warm pool did not fill (%d of %d)", e.PoolReady(), poolSize)
			}
		}
	}
	before := memAvailableMB()
	countersBefore := meminfo()
	var failed atomic.Int64
	var mu sync.Mutex
	var made []*client.Sandbox
	var oursAt []time.Duration // when each create was answered, from the start
	var firstErr error
	stopProfile, err := startProfile()
	if err != nil {
		return err
	}
	start := time.Now()
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			sb, err := cl.Create(ctx, spec())
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failed.Add(1)
				if firstErr == nil {
					firstErr = fmt.Errorf("create %d: %w", i, err)
				}
				return
			}
			made = append(made, sb)
			oursAt = append(oursAt, time.Since(start))
			if len(made)%100 == 0 {
				fmt.Fprintf(os.Stderr, "\r%d/%d sandboxes", len(made), n)
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	stopProfile()
	time.Sleep(2 * time.Second) // let the agents settle
	after := memAvailableMB()
	countersAfter := meminfo()
	agentPSS, agents := processPSS("aether")
	fmt.Fprintln(os.Stderr)
	if holdFor > 0 {
		fmt.Fprintf(os.Stderr, "holding the %d sandboxes for %v\n", len(made), holdFor)
		time.Sleep(holdFor)
	}
	ours := len(made)
	var stopWG sync.WaitGroup
	for _, sb := range made {
		stopWG.Add(1)
		sem <- struct{}{}
		go func() { defer stopWG.Done(); defer func() { <-sem }(); sb.Stop(context.WithoutCancel(ctx)) }() //nolint:errcheck // cleanup
	}
	stopWG.Wait()

	var rawRate, rawMem float64
	var rawAt []time.Duration
	var rawCrunCPU time.Duration
	if raw > 0 {
		settle(3 * time.Minute)
		b, err := bareBurst(ctx, c.Work, raw, par, rawDefaultSpec, agent)
		if err != nil {
			return err
		}
		rawRate, rawMem, rawAt, rawCrunCPU = b.rate, b.memMB, b.at, b.crunCPU
	}
	type specRow struct {
		label string
		burst
	}
	var specRows []specRow
	if raw > 0 && rawSpec {
		for _, r := range []struct {
			kind  rawKind
			label string
		}{
			{rawOurSpec, "bare crun run of our OCI spec (sleep)"},
			{rawOurRoot, "the same, each on a layer and overlay"},
			{rawOurRootOwnNS, "those mounts in a namespace of its own"},
			{rawOurAgent, "our spec and root, and the agent dialling"},
		} {
			settle(3 * time.Minute)
			b, err := bareBurst(ctx, c.Work, raw, par, r.kind, agent)
			if err != nil {
				return err
			}
			specRows = append(specRows, specRow{r.label, b})
		}
	}
	host, _ := os.Hostname()
	fmt.Printf("density: %d container sandboxes (0.1 core, 64 MiB, %d MiB disk) onto %d edge(s), %d at a time, overcommit cpu %g, memory %g (machine %s)\n", n, diskMB, edges, par, over, memOver, host)
	fmt.Printf("%-40s %10s %12s %16s\n", "", "made", "creates/s", "host MiB/sandbox")
	label := "ours (crun + agent, full path)"
	switch {
	case withNetwork:
		label = "ours, each with a network"
	case poolSize > 0:
		label = fmt.Sprintf("ours, a warm pool of %d first", poolSize)
	}
	fmt.Printf("%-40s %10d %12.1f %16.1f\n", label, ours, float64(ours)/took.Seconds(), float64(before-after)/float64(max(ours, 1)))
	printMemoryBreakdown(countersBefore, countersAfter, ours, agentPSS, agents)
	if raw > 0 {
		mem := fmt.Sprintf("%16.1f", rawMem)
		if rawMem < 0.5 {
			mem = fmt.Sprintf("%16s", "<0.5 (noise)")
		}
		fmt.Printf("%-40s %10d %12.1f %s\n", "bare crun run (busybox sleep)", raw, rawRate, mem)
		for _, r := range specRows {
			fmt.Printf("%-40s %10d %12.1f %16.1f\n", r.label, raw, r.rate, r.memMB)
		}
		if len(specRows) > 0 {
			fmt.Printf("crun's CPU per container, ms: default spec %.1f", ms(rawCrunCPU))
			for _, r := range specRows {
				fmt.Printf("; %s %.1f", r.label, ms(r.crunCPU))
				if r.agentCPU > 0 {
					fmt.Printf(" (the agent's own %.1f)", ms(r.agentCPU))
				}
			}
			fmt.Println()
		}
		fmt.Printf("ratio ours/bare: creates/s %.2fx\n", float64(ours)/took.Seconds()/rawRate)
		for _, r := range specRows {
			fmt.Printf("ratio %q/bare: creates/s %.2fx\n", r.label, r.rate/rawRate)
		}
	}
	if edges > 1 {
		perEdge := map[string]int{}
		for _, sb := range made {
			node, _, _ := strings.Cut(sb.ID, "-")
			perEdge[node]++
		}
		fmt.Printf("per edge: %v; the burst took %s\n", perEdge, took.Round(100*time.Millisecond))
	}
	fmt.Printf("failures: %d", failed.Load())
	if firstErr != nil {
		fmt.Printf(" (first: %v)", firstErr)
	}
	fmt.Println()
	if plotPath != "" {
		chart := benchplot.Chart{Title: fmt.Sprintf("creates over time, %d at a time (machine %s)", par, host), XLabel: "seconds from the burst's start", YLabel: "sandboxes made",
			Series: []benchplot.Series{{Name: label, Color: benchplot.Ours, Points: cumulative(oursAt)}}}
		if raw > 0 {
			chart.Series = append(chart.Series, benchplot.Series{Name: "bare crun run", Color: benchplot.Raw, Points: cumulative(rawAt)})
		}
		if err := chart.WritePNG(plotPath); err != nil {
			return err
		}
		fmt.Printf("plot: %s\n", plotPath)
	}
	return nil
}

// cumulative is how many of the creates answered at times were done by
// each of them.
func cumulative(times []time.Duration) []benchplot.Point {
	sorted := slices.Sorted(slices.Values(times))
	out := []benchplot.Point{{X: 0, Y: 0}}
	for i, t := range sorted {
		out = append(out, benchplot.Point{X: t.Seconds(), Y: float64(i + 1)})
	}
	return out
}

// rawKind is what a bare burst runs.
type rawKind int

const (
	rawDefaultSpec  rawKind = iota // crun's default spec over one busybox tree
	rawOurSpec                     // the platform's spec over that tree (ourspec.go)
	rawOurRoot                     // the platform's spec over a root made as a sandbox's
	rawOurRootOwnNS                // that root in a mount namespace of its own, which crun joins
	rawOurAgent                    // the platform's root and spec with the agent instead of sleep, until it has dialled too
)

// burst is what a bare burst measured.
type burst struct {
	rate  float64         // containers per second
	memMB float64         // host MiB per container
	at    []time.Duration // when each run returned (or agent dialled), from the start
	// crunCPU is the CPU time crun took per container (its processes,
	// which the bench waits for); agentCPU the agents' own by the end
	// (rawOurAgent).
	crunCPU, agentCPU time.Duration
}

// bareBurst runs n busybox containers with crun, par at a time.
func bareBurst(ctx context.Context, work string, n, par int, kind rawKind, agent string) (burst, error) {
	root := filepath.Join(work, "raw")
	bundle := filepath.Join(root, "bundle")
	if err := os.MkdirAll(filepath.Join(bundle, "rootfs", "bin"), 0o755); err != nil {
		return burst{}, err
	}
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return burst{}, err
	}
	if out, err := exec.Command("cp", bb, filepath.Join(bundle, "rootfs", "bin", "busybox")).CombinedOutput(); err != nil {
		return burst{}, fmt.Errorf("%v: %s", err, out)
	}
	os.Symlink("busybox", filepath.Join(bundle, "rootfs", "bin", "sleep")) //nolint:errcheck // exists on a rerun
	// The containers that run on this tree itself would each make their
	// mount points in it, racing ("cannot mkdir `proc`: File exists").
	if err := makeMountPoints(filepath.Join(bundle, "rootfs")); err != nil {
		return burst{}, err
	}
	os.Remove(filepath.Join(bundle, "config.json")) //nolint:errcheck // a rerun's
	if out, err := exec.Command("crun", "spec", "-b", bundle).CombinedOutput(); err != nil {
		return burst{}, fmt.Errorf("crun spec: %v: %s", err, out)
	}
	cfgPath := filepath.Join(bundle, "config.json")
	data, _ := os.ReadFile(cfgPath)
	conf := strings.Replace(string(data), `"sh"`, `"sleep", "3600"`, 1)
	conf = strings.Replace(conf, `"terminal": true`, `"terminal": false`, 1)
	conf = strings.Replace(conf, `"readonly": true`, `"readonly": false`, 1)
	if err := os.WriteFile(cfgPath, []byte(conf), 0o644); err != nil {
		return burst{}, err
	}
	bundleOf := func(int) string { return bundle }
	var roots *ourRoot
	if kind != rawDefaultSpec {
		ours := filepath.Join(root, "ours")
		os.RemoveAll(ours) //nolint:errcheck // a rerun's
		bound := filepath.Join(bundle, "rootfs", "bin", "busybox")
		if kind == rawOurAgent {
			if bound, err = filepath.Abs(agent); err != nil {
				return burst{}, err
			}
		}
		if err := writeOurSpecBundles(ours, filepath.Join(bundle, "rootfs"), bound, n, kind); err != nil {
			return burst{}, err
		}
		defer os.RemoveAll(ours)
		bundleOf = func(i int) string { return filepath.Join(ours, strconv.Itoa(i)) }
	}
	var dialled *agentDials
	if kind == rawOurAgent {
		if dialled, err = listenForAgents(filepath.Join(root, "ours", "run", "edge.sock")); err != nil {
			return burst{}, err
		}
		defer dialled.Close()
	}
	layerOf, nsOf := make([]string, n), make([]*os.File, n)
	if kind >= rawOurRoot {
		if roots, err = openOurRoot(ctx, filepath.Join(root, "layers"), filepath.Join(bundle, "rootfs"), diskMB); err != nil {
			return burst{}, err
		}
		defer func() {
			for i, layer := range layerOf {
				if nsOf[i] != nil {
					nsOf[i].Close()            // the namespace, its mounts and loop device go
					roots.layers.Remove(layer) //nolint:errcheck // scratch, removed with the work directory
				} else if layer != "" {
					roots.remove(bundleOf(i), layer) //nolint:errcheck // as above
				}
			}
		}()
	}
	state := filepath.Join(root, "state")
	before := memAvailableMB()
	cpu0 := childrenCPU()
	start := time.Now()
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	var errOnce sync.Once
	var atMu sync.Mutex
	var at []time.Duration
	var runErr error
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			id := "dsec-density-" + strconv.Itoa(i)
			// No pipes: the detached container would hold them open. Its
			// errors go to a file of its own, kept for the report.
			errFile := filepath.Join(root, id+".err")
			stderr, err := os.Create(errFile)
			switch {
			case err != nil:
			case kind == rawOurRootOwnNS:
				var nsPath string
				if nsPath, nsOf[i], layerOf[i], err = roots.mountInOwnNS(ctx, bundleOf(i)); err == nil {
					err = os.Symlink(nsPath, filepath.Join(bundleOf(i), "mntns"))
				}
			case roots != nil:
				layerOf[i], err = roots.mount(ctx, bundleOf(i))
			}
			if err == nil {
				cmd := exec.CommandContext(ctx, "crun", "--root", state, "run", "-d", "-b", bundleOf(i), id)
				cmd.Stderr = stderr
				err = cmd.Run()
				stderr.Close()
			}
			if err == nil && dialled == nil {
				atMu.Lock()
				at = append(at, time.Since(start))
				atMu.Unlock()
			}
			if err != nil {
				msg, _ := os.ReadFile(errFile)
				errOnce.Do(func() { runErr = fmt.Errorf("crun run %s: %v: %s", id, err, strings.TrimSpace(string(msg))) })
			}
			os.Remove(errFile) //nolint:errcheck // scratch
		}()
	}
	wg.Wait()
	took := time.Since(start)
	if dialled != nil && runErr == nil {
		// Done once every run returned and every agent dialled (an agent
		// can dial before its crun has returned).
		if at, err = dialled.wait(n, start, time.Minute); err != nil {
			runErr = err
		} else {
			took = max(took, at[len(at)-1])
		}
	}
	b := burst{rate: float64(n) / took.Seconds(), at: at, crunCPU: (childrenCPU() - cpu0) / time.Duration(n)}
	if dialled != nil {
		b.agentCPU = processCPU("aether") / time.Duration(n)
	}
	time.Sleep(2 * time.Second)
	after := memAvailableMB()
	b.memMB = float64(before-after) / float64(n)
	for i := range n {
		exec.Command("crun", "--root", state, "delete", "-f", "dsec-density-"+strconv.Itoa(i)).Run() //nolint:errcheck // cleanup
	}
	if runErr != nil {
		return burst{}, runErr
	}
	return b, nil
}

// memAvailableMB is the host's MemAvailable, with clean caches dropped
// first so that the page cache does not blur the difference.
func memAvailableMB() int64 {
	exec.Command("sync").Run()                                     //nolint:errcheck // best effort
	os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o644) //nolint:errcheck // best effort
	return meminfo()["MemAvailable"] >> 10
}

// withNetwork gives every sandbox of the burst a network interface.
var withNetwork bool

// plotPath is where the -plot flag puts the plot ("": none).
var plotPath string

// poolSize is the -pool flag: a warm pool of the burst's spec (0: none).
var poolSize int

// edges is the -edges flag: the cluster's edges, all on this machine.
var edges int

// diskMB is the -disk flag: each sandbox's disk_mb.
var diskMB int64

// holdFor is the -hold flag: how long the burst's sandboxes are kept.
var holdFor time.Duration

// rawSpec is the -raw-spec flag (ourspec.go).
var rawSpec bool

// profile and lockProfile are where -cpuprofile and -mutexprofile
// write; "" for none.
var profile, lockProfile string

// startProfile starts the profiles of the burst that were asked for.
func startProfile() (stop func(), err error) {
	stopLocks := func() {}
	if lockProfile != "" {
		runtime.SetMutexProfileFraction(1)
		stopLocks = func() {
			runtime.SetMutexProfileFraction(0)
			if f, err := os.Create(lockProfile); err == nil {
				pprof.Lookup("mutex").WriteTo(f, 0) //nolint:errcheck // a bench's extra
				f.Close()
			}
		}
	}
	if profile == "" {
		return stopLocks, nil
	}
	f, err := os.Create(profile)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close(); stopLocks() }, nil
}

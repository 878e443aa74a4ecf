// Command create benchmarks the container backend against the raw runtime
// it wraps, in one run: create-to-first-exec of our full path (client →
// apiserver → edge → crun → agent) against a bare `crun run` + `crun exec`
// of the same bundle (the config.json our backend wrote, on the same image
// layers, with `sleep` as its first process instead of the agent), and an
// exec round trip (`true`) against `crun exec`. It prints p50/p99 side by
// side with the ratios. It also runs bare crun on the same bundle without
// the container backend's hardening (no seccomp filter, no no_new_privs,
// Docker's capabilities), which is what the hardening costs the runtime, and
// our create once more with no writable layers made ahead of time, which is
// what the warm set saves. Needs root, crun and the store `make images`
// fills.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	rspec "github.com/opencontainers/runtime-spec/specs-go"
	dto "github.com/prometheus/client_model/go"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/backend/oci"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/image"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with the image")
	img := flag.String("image", "root/busybox:latest", "image to run")
	n := flag.Int("n", 30, "iterations per measurement")
	agent := flag.String("agent", "bin/aether", "aether binary")
	flag.Parse()
	if err := run(context.Background(), *store, *img, *n, *agent); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, storeDir, imgName string, n int, agent string) error {
	be := benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}
	// Our create with every writable layer formatted on demand.
	cold, err := benchcluster.Start(ctx, storeDir, agent, be, func(cfg *embed.Config) { cfg.WarmLayers = -1 })
	if err != nil {
		return err
	}
	coldCreate, err := createTimes(ctx, cold, imgName, n)
	cold.Close()
	if err != nil {
		return err
	}
	// Our create claiming a started sandbox from a warm pool (issue 28),
	// the pool full again before each.
	poolCreate, poolParts, err := poolTimes(ctx, storeDir, agent, be, imgName, n)
	if err != nil {
		return err
	}
	c, err := benchcluster.Start(ctx, storeDir, agent, be, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	work := c.Work
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	spec := func() *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "container", Image: imgName, Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 512}}
	}
	// Warm-up: unpack the layers into the node cache once.
	if sb, err := cl.Create(ctx, spec()); err != nil {
		return err
	} else {
		sb.Stop(ctx)
	}
	trueCmd := &agentv1.ProcessConfig{Args: []string{"true"}}

	// Ours: create -> first exec.
	var oursCreate []time.Duration
	for i := 0; i < n; i++ {
		t0 := time.Now()
		sb, err := cl.Create(ctx, spec())
		if err != nil {
			return err
		}
		if r, err := sb.Run(ctx, trueCmd); err != nil || r.ExitCode != 0 {
			return fmt.Errorf("first exec: %v %v", r, err)
		}
		oursCreate = append(oursCreate, time.Since(t0))
		sb.Stop(ctx)
	}
	// Ours: exec round trip.
	sb, err := cl.Create(ctx, spec())
	if err != nil {
		return err
	}
	template, err := os.ReadFile(filepath.Join(work, "state", "edge", "sandboxes", sb.ID, "config.json"))
	if err != nil {
		return err
	}
	var oursExec, agentSide, listRPC []time.Duration
	for i := 0; i < n*3; i++ {
		t0 := time.Now()
		r, err := sb.Run(ctx, trueCmd)
		if err != nil || r.ExitCode != 0 {
			return fmt.Errorf("exec: %v %v", r, err)
		}
		oursExec = append(oursExec, time.Since(t0))
		agentSide = append(agentSide, time.Duration(r.DurationUs)*time.Microsecond)
		t0 = time.Now()
		if _, err := sb.Process.List(ctx, connect.NewRequest(&agentv1.ListRequest{})); err != nil {
			return fmt.Errorf("list processes: %v", err)
		}
		listRPC = append(listRPC, time.Since(t0))
	}
	// The same exec while a neighbour spins two processes under its one-core
	// limit: CPU limits keep it from moving this sandbox's latency.
	hog, err := cl.Create(ctx, spec())
	if err != nil {
		return err
	}
	go hog.Run(ctx, &agentv1.ProcessConfig{Args: []string{"sh", "-c", "for i in 1 2; do timeout 60 sh -c 'while :; do :; done' & done; wait"}}) //nolint:errcheck // stopped below
	time.Sleep(time.Second)
	var underHog []time.Duration
	for i := 0; i < n*3; i++ {
		t0 := time.Now()
		if r, err := sb.Run(ctx, trueCmd); err != nil || r.ExitCode != 0 {
			return fmt.Errorf("exec next to the hog: %v %v", r, err)
		}
		underHog = append(underHog, time.Since(t0))
	}
	hog.Stop(ctx)
	sb.Stop(ctx)

	// Bare crun on the same layers.
	st, err := image.OpenStore(storeDir)
	if err != nil {
		return err
	}
	ref, _ := image.ParseRef(imgName)
	im, err := st.Resolve(ref)
	if err != nil {
		return err
	}
	layers, err := layersOf(filepath.Join(work, "state", "edge", "cache"), st, im)
	if err != nil {
		return err
	}
	root := filepath.Join(work, "crun-root")
	plainTemplate, err := withoutHardening(template)
	if err != nil {
		return err
	}
	var bareCreate, bareExec, plainCreate, plainExec []time.Duration
	for i := 0; i < n; i++ {
		execs := 0
		if i == 0 {
			execs = n * 3 // exec round trips on the first container
		}
		// Hardened and plain alternate, so drift on the machine hits both.
		created, times, err := bareRun(filepath.Join(work, fmt.Sprintf("bench-%06d", i)), root, layers, template, execs)
		if err != nil {
			return err
		}
		bareCreate = append(bareCreate, created)
		bareExec = append(bareExec, times...)
		created, times, err = bareRun(filepath.Join(work, fmt.Sprintf("plain-%06d", i)), root, layers, plainTemplate, execs)
		if err != nil {
			return err
		}
		plainCreate = append(plainCreate, created)
		plainExec = append(plainExec, times...)
	}

	fmt.Printf("container backend vs bare crun (%s, %d iterations, %s)\n\n", imgName, n, time.Now().Format(time.RFC3339))
	fmt.Printf("%-26s %10s %10s %10s %10s   %s\n", "measurement", "ours p50", "ours p99", "crun p50", "crun p99", "ratio (p50)")
	row := func(name string, ours, bare []time.Duration, ratio string) {
		fmt.Printf("%-26s %10s %10s %10s %10s   %s\n", name, msf(benchstat.Pct(ours, 50)), msf(benchstat.Pct(ours, 99)), msf(benchstat.Pct(bare, 50)), msf(benchstat.Pct(bare, 99)), ratio)
	}
	row("create -> first exec", oursCreate, bareCreate, fmt.Sprintf("ours/crun = %.2fx (target <= 1.3x)", float64(benchstat.Pct(oursCreate, 50))/float64(benchstat.Pct(bareCreate, 50))))
	row("exec round trip (true)", oursExec, bareExec, fmt.Sprintf("crun/ours = %.1fx faster (target >= 5x)", float64(benchstat.Pct(bareExec, 50))/float64(benchstat.Pct(oursExec, 50))))
	fmt.Printf("\nwhere an exec round trip goes (ours, p50): agent spawn to exit %s; an RPC that spawns nothing (process list) through the same hops %s\n",
		msf(benchstat.Pct(agentSide, 50)), msf(benchstat.Pct(listRPC, 50)))

	fmt.Printf("\nwhat the hardening costs (bare crun, same bundle: seccomp filter, no_new_privs, fewer capabilities vs none of them)\n\n")
	fmt.Printf("%-26s %10s %10s %10s %10s   %s\n", "measurement", "hard p50", "hard p99", "plain p50", "plain p99", "ratio (p50)")
	row("create -> first exec", bareCreate, plainCreate, fmt.Sprintf("hardened/plain = %.2fx", float64(benchstat.Pct(bareCreate, 50))/float64(benchstat.Pct(plainCreate, 50))))
	row("exec round trip (true)", bareExec, plainExec, fmt.Sprintf("hardened/plain = %.2fx", float64(benchstat.Pct(bareExec, 50))/float64(benchstat.Pct(plainExec, 50))))

	fmt.Printf("\na neighbour spinning two processes under its one-core limit (ours, exec round trip)\n\n")
	fmt.Printf("%-26s %10s %10s %10s %10s   %s\n", "measurement", "hog p50", "hog p99", "idle p50", "idle p99", "ratio (p50)")
	row("exec round trip (true)", underHog, oursExec, fmt.Sprintf("with hog/idle = %.2fx", float64(benchstat.Pct(underHog, 50))/float64(benchstat.Pct(oursExec, 50))))

	fmt.Printf("\nfrom a warm pool (ours: a create that claims a started sandbox, against bare crun's create)\n\n")
	fmt.Printf("%-26s %10s %10s %10s %10s   %s\n", "measurement", "pool p50", "pool p99", "crun p50", "crun p99", "ratio (p50)")
	row("create -> first exec", poolCreate, bareCreate, fmt.Sprintf("pool/crun = %.2fx (goal: under 10 ms)", float64(benchstat.Pct(poolCreate, 50))/float64(benchstat.Pct(bareCreate, 50))))
	fmt.Printf("\nwhere a claim's time goes (means per create, from the components' metrics):\n%s", poolParts)

	fmt.Printf("\nwhat the warm writable layers save (ours, create -> first exec)\n\n")
	fmt.Printf("%-26s %10s %10s %10s %10s   %s\n", "measurement", "warm p50", "warm p99", "cold p50", "cold p99", "ratio (p50)")
	row("create -> first exec", oursCreate, coldCreate, fmt.Sprintf("warm/cold = %.2fx", float64(benchstat.Pct(oursCreate, 50))/float64(benchstat.Pct(coldCreate, 50))))
	return nil
}

// poolTimes times create -> first exec on a cluster whose edge keeps a
// warm pool of two sandboxes of the image and shape, waiting before each
// create until the pool is full again.
func poolTimes(ctx context.Context, storeDir, agent string, be benchcluster.Backend, imgName string, n int) ([]time.Duration, string, error) {
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: imgName, Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 512}}
	c, err := benchcluster.Start(ctx, storeDir, agent, be, func(cfg *embed.Config) {
		cfg.Pools = []edge.Pool{{Spec: spec, Project: "root", Size: 2}}
	})
	if err != nil {
		return nil, "", err
	}
	defer c.Close()
	defer c.Edge.DrainPools(ctx)
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return nil, "", err
	}
	var out, created []time.Duration
	before, err := c.Metrics.Gather()
	if err != nil {
		return nil, "", err
	}
	for range n {
		for deadline := time.Now().Add(time.Minute); c.Edge.PoolReady() < 2; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				return nil, "", fmt.Errorf("the warm pool did not fill in a minute (%d ready)", c.Edge.PoolReady())
			}
		}
		t0 := time.Now()
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			return nil, "", err
		}
		created = append(created, time.Since(t0))
		if r, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"true"}}); err != nil || r.ExitCode != 0 {
			return nil, "", fmt.Errorf("first exec: %v %v", r, err)
		}
		out = append(out, time.Since(t0))
		sb.Stop(ctx)
	}
	after, err := c.Metrics.Gather()
	if err != nil {
		return nil, "", err
	}
	var parts strings.Builder
	fmt.Fprintf(&parts, "  %-44s %6.2f ms  (p50, the client's)\n", "Create answered", float64(benchstat.Pct(created, 50))/1e6)
	fmt.Fprintf(&parts, "  %-44s %6.2f ms  (p50, the client's)\n", "then the first exec answered", float64(benchstat.Pct(out, 50)-benchstat.Pct(created, 50))/1e6)
	for _, p := range []struct{ what, name, method string }{
		{"apiserver CreateSandbox, whole", "opendsec_apiserver_request_duration_seconds", "CreateSandbox"},
		{"  edge CreateSandbox (the claim)", "opendsec_edge_request_duration_seconds", "CreateSandbox"},
		{"  IAM Raft applies (reserve, bind; each)", "opendsec_iam_raft_apply_duration_seconds", ""},
		{"first exec (apiserver's proxy to the agent)", "opendsec_apiserver_request_duration_seconds", "Run"},
	} {
		sum, count := histDelta(before, after, p.name, p.method)
		if count == 0 {
			continue
		}
		fmt.Fprintf(&parts, "  %-44s %6.2f ms  (%d calls)\n", p.what, sum/float64(count)*1000, count)
	}
	return out, parts.String(), nil
}

// createTimes times create -> first exec on a cluster.
func createTimes(ctx context.Context, c *benchcluster.Cluster, imgName string, n int) ([]time.Duration, error) {
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return nil, err
	}
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: imgName, Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 512}}
	var out []time.Duration
	for i := -1; i < n; i++ { // the first one warms the layer cache
		t0 := time.Now()
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			return nil, err
		}
		if r, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"true"}}); err != nil || r.ExitCode != 0 {
			return nil, fmt.Errorf("first exec: %v %v", r, err)
		}
		if i >= 0 {
			out = append(out, time.Since(t0))
		}
		sb.Stop(ctx)
	}
	return out, nil
}

// withoutHardening is the backend's bundle template less its hardening:
// no seccomp filter, no no_new_privs, Docker's default capabilities.
func withoutHardening(template []byte) ([]byte, error) {
	var s rspec.Spec
	if err := json.Unmarshal(template, &s); err != nil {
		return nil, err
	}
	s.Linux.Seccomp = nil
	delete(s.Annotations, "run.oci.seccomp_bpf_data")
	s.Process.NoNewPrivileges = false
	docker := append(append([]string(nil), oci.DefaultCaps...), "CAP_NET_RAW", "CAP_MKNOD")
	s.Process.Capabilities = &rspec.LinuxCapabilities{Bounding: docker, Effective: docker, Permitted: docker}
	return json.Marshal(s)
}

// bareRun starts one container with bare crun on the bundle in dir, times
// create -> first exec and then execs more `crun exec true`, and always
// deletes the container and unmounts its rootfs, also on an error.
func bareRun(dir, root string, layers []string, template []byte, execs int) (created time.Duration, times []time.Duration, err error) {
	id := filepath.Base(dir)
	t0 := time.Now()
	if err := bareBundle(dir, layers, template); err != nil {
		return 0, nil, err
	}
	defer func() {
		exec.Command("crun", "--root", root, "delete", "--force", id).Run() //nolint:errcheck // it may not exist
		rootfs.Unmount(filepath.Join(dir, "rootfs"))                        //nolint:errcheck // best effort
	}()
	// The container keeps the stdio it is given: a file, not a pipe.
	logf, err := os.Create(filepath.Join(dir, "console.log"))
	if err != nil {
		return 0, nil, err
	}
	runCmd := exec.Command("crun", "--root", root, "run", "--detach", "--bundle", dir, id)
	runCmd.Stdout, runCmd.Stderr = logf, logf
	err = runCmd.Run()
	logf.Close()
	if err != nil {
		out, _ := os.ReadFile(filepath.Join(dir, "console.log"))
		return 0, nil, fmt.Errorf("crun run: %v: %s", err, out)
	}
	if out, err := exec.Command("crun", "--root", root, "exec", id, "true").CombinedOutput(); err != nil {
		return 0, nil, fmt.Errorf("crun exec: %v: %s", err, out)
	}
	created = time.Since(t0)
	for j := 0; j < execs; j++ {
		t1 := time.Now()
		if out, err := exec.Command("crun", "--root", root, "exec", id, "true").CombinedOutput(); err != nil {
			return 0, nil, fmt.Errorf("crun exec: %v: %s", err, out)
		}
		times = append(times, time.Since(t1))
	}
	return created, times, nil
}

// layersOf unpacks (or finds) the image's layers in a scratch cache.
func layersOf(cacheDir string, st *image.Store, im *image.Image) ([]string, error) {
	cache, err := image.NewCache(cacheDir, st)
	if err != nil {
		return nil, err
	}
	return cache.Layers(context.Background(), im, nil)
}

// bareBundle mounts the rootfs and writes our backend's config with its
// own root, hostname and cgroup, and `sleep` instead of the agent.
func bareBundle(dir string, layers []string, template []byte) error {
	// The writable layer goes in the bundle's own directory here: the cost
	// measured is the runtime's, not the node's layer file systems.
	if err := rootfs.Mount(layers, rootfs.LayoutIn(dir)); err != nil {
		return err
	}
	var s rspec.Spec
	if err := json.Unmarshal(template, &s); err != nil {
		return err
	}
	id := filepath.Base(dir)
	s.Root.Path = filepath.Join(dir, "rootfs")
	s.Hostname = id
	s.Linux.CgroupsPath = "/opendsec-bench/" + id
	s.Process.Args = []string{"/bin/sleep", "3600"}
	s.Process.OOMScoreAdj = nil
	runDir := filepath.Join(dir, "run")
	if err := os.MkdirAll(runDir, 0o700); err != nil {
		return err
	}
	hosts := filepath.Join(dir, "hosts")
	if err := os.WriteFile(hosts, []byte("127.0.0.1 localhost "+id+"\n"), 0o644); err != nil {
		return err
	}
	for i, m := range s.Mounts {
		switch m.Destination {
		case "/.dsec/run":
			s.Mounts[i].Source = runDir
		case "/etc/hosts", "/etc/resolv.conf":
			s.Mounts[i].Source = hosts
		}
	}
	data, _ := json.Marshal(s)
	return os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600)
}

func msf(d time.Duration) string { return benchstat.Ms(d, 1) }

// histDelta is how much a histogram's sum and count grew between two
// gatherings, over its series whose method label is method ("": all).
func histDelta(before, after []*dto.MetricFamily, name, method string) (float64, uint64) {
	total := func(fams []*dto.MetricFamily) (float64, uint64) {
		var sum float64
		var count uint64
		for _, f := range fams {
			if f.GetName() != name {
				continue
			}
			for _, m := range f.Metric {
				ok := method == ""
				for _, l := range m.Label {
					if l.GetName() == "method" && l.GetValue() == method {
						ok = true
					}
				}
				if ok {
					sum += m.GetHistogram().GetSampleSum()
					count += m.GetHistogram().GetSampleCount()
				}
			}
		}
		return sum, count
	}
	s0, c0 := total(before)
	s1, c1 := total(after)
	return s1 - s0, c1 - c0
}

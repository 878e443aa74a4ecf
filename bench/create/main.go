// Command create benchmarks the container backend against the raw runtime
// it wraps, in one run: create-to-first-exec of our full path (client →
// apiserver → edge → crun → agent) against a bare `crun run` + `crun exec`
// of the same bundle (the config.json our backend wrote, on the same image
// layers, with `sleep` as its first process instead of the agent), and an
// exec round trip (`true`) against `crun exec`. It prints p50/p99 side by
// side with the ratios. Needs root, crun and the store `make images` fills.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"connectrpc.com/connect"
	rspec "github.com/opencontainers/runtime-spec/specs-go"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
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
	c, err := benchcluster.Start(ctx, storeDir, agent, benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}, nil)
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
	var bareCreate, bareExec []time.Duration
	for i := 0; i < n; i++ {
		execs := 0
		if i == 0 {
			execs = n * 3 // exec round trips on the first container
		}
		created, times, err := bareRun(filepath.Join(work, fmt.Sprintf("bench-%06d", i)), root, layers, template, execs)
		if err != nil {
			return err
		}
		bareCreate = append(bareCreate, created)
		bareExec = append(bareExec, times...)
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
	return nil
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
		case "/etc/hosts":
			s.Mounts[i].Source = hosts
		}
	}
	data, _ := json.Marshal(s)
	return os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600)
}

func msf(d time.Duration) string { return benchstat.Ms(d, 1) }

// Command apiservers measures creates per second on the container backend
// through one apiserver and through two (the second reading IAM from its
// own non-voting replica, its quota reservations going to the leader over
// the Raft port), in one process with one edge (dsec up), and through two
// apiservers of a cluster of separate processes (3 IAM replicas, a
// watcher, one edge: bin/dsec daemons), in one run; the raw runtime's rate
// for the same burst is bench/density's bare `crun run` line. The
// sandboxes are stopped after each burst. Needs root, crun, `make build`
// and `make images`.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sync"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/embed"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with the image")
	img := flag.String("image", "root/busybox:latest", "image to run")
	n := flag.Int("n", 200, "creates per burst")
	par := flag.Int("parallel", 16, "creates in flight at once")
	agent := flag.String("agent", "bin/aether", "aether binary")
	dsec := flag.String("dsec", "bin/dsec", "dsec binary, for the cluster of processes")
	flag.Parse()
	if err := run(context.Background(), *store, *img, *n, *par, *agent, *dsec); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, storeDir, imgName string, n, par int, agent, dsec string) error {
	host, _ := os.Hostname()
	fmt.Printf("creates per second, %d container sandboxes (0.1 core, 64 MiB), %d in flight (machine %s)\n", n, par, host)
	var rates []float64
	for _, apis := range []int{1, 2} {
		rate, p50, err := burst(ctx, storeDir, imgName, agent, n, par, apis)
		if err != nil {
			return err
		}
		rates = append(rates, rate)
		fmt.Printf("%-46s %8.1f creates/s   p50 %s\n", fmt.Sprintf("through %d apiserver(s)", apis), rate, benchstat.Ms(p50, 1))
	}
	// The same through separate processes: 3 IAM replicas, a watcher, one
	// edge and 2 apiservers, each a dsec daemon.
	d, err := startDaemons(ctx, dsec, agent, storeDir, 2)
	if err != nil {
		return err
	}
	rate, p50, err := measure(ctx, d.urls, d.key, imgName, n, par)
	d.stop()
	if err != nil {
		return err
	}
	fmt.Printf("%-46s %8.1f creates/s   p50 %s\n", "through 2 apiserver daemons (cluster processes)", rate, benchstat.Ms(p50, 1))
	fmt.Printf("ratio 2 apiservers / 1: %.2fx; daemons / one process (dsec up): %.2fx (one edge on 2 cores bounds all)\n", rates[1]/rates[0], rate/rates[0])
	return nil
}

func burst(ctx context.Context, storeDir, imgName, agent string, n, par, apis int) (float64, time.Duration, error) {
	be := benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}
	c, err := benchcluster.Start(ctx, storeDir, agent, be, func(cfg *embed.Config) {
		cfg.APIServers = apis
		cfg.Capacity = capacity.Host(64, 3)
		cfg.Capacity.MaxSandboxes = int64(n) + 16
	})
	if err != nil {
		return 0, 0, err
	}
	defer c.Close()
	return measure(ctx, c.APIURLs, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"), imgName, n, par)
}

// measure runs n creates, par at once, spread over the apiservers at urls,
// and stops the sandboxes.
func measure(ctx context.Context, urls []string, key, imgName string, n, par int) (float64, time.Duration, error) {
	var clients []*client.Client
	for _, u := range urls {
		cl, err := client.New(u, key)
		if err != nil {
			return 0, 0, err
		}
		clients = append(clients, cl)
	}
	spec := func() *sandboxv1.SandboxSpec {
		return &sandboxv1.SandboxSpec{Backend: "container", Image: imgName, Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: 64}}
	}
	if sb, err := clients[0].Create(ctx, spec()); err == nil { // unpack the layers once
		sb.Stop(ctx) //nolint:errcheck // a warm-up
	} else {
		return 0, 0, err
	}
	var mu sync.Mutex
	var made []*client.Sandbox
	var times []time.Duration
	var firstErr error
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			t0 := time.Now()
			sb, err := clients[i%len(clients)].Create(ctx, spec())
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if firstErr == nil {
					firstErr = err
				}
				return
			}
			made = append(made, sb)
			times = append(times, time.Since(t0))
		}()
	}
	wg.Wait()
	took := time.Since(start)
	for _, sb := range made {
		wg.Add(1)
		sem <- struct{}{}
		go func() { defer wg.Done(); defer func() { <-sem }(); sb.Stop(ctx) }() //nolint:errcheck // cleanup
	}
	wg.Wait()
	if firstErr != nil {
		return 0, 0, fmt.Errorf("%d apiserver(s): %w", len(urls), firstErr)
	}
	return float64(len(made)) / took.Seconds(), benchstat.Pct(times, 50), nil
}

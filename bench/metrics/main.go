// Command metrics measures what the Prometheus metrics cost a create and
// an exec: the same container sandbox cycle (create, one exec, stop) on a
// cluster that keeps no metrics, one that keeps them, and one whose
// metrics endpoint four clients scrape as fast as it answers. It prints
// the medians and 90th percentiles and each ratio to the cluster without
// metrics, one run on one machine. Needs root and crun.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/embed"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with root/busybox:latest")
	n := flag.Int("n", 60, "sandbox cycles per cluster")
	agent := flag.String("agent", "bin/aether", "aether binary")
	flag.Parse()
	if err := run(context.Background(), *store, *agent, *n); err != nil {
		fmt.Fprintln(os.Stderr, "metrics:", err)
		os.Exit(1)
	}
}

type result struct {
	name    string
	cycles  []time.Duration
	scrapes int64
}

func run(ctx context.Context, store, agent string, n int) error {
	// Two rounds of the three, the first a warm-up (page cache, the
	// image's layer forms), the second reported.
	var results []result
	for round := 0; round < 2; round++ {
		results = results[:0]
		for _, c := range []struct {
			name            string
			metrics, scrape bool
		}{{"no metrics", false, false}, {"metrics", true, false}, {"metrics, 40 scrapes/s", true, true}} {
			r, err := measure(ctx, store, agent, n, c.metrics, c.scrape)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			r.name = c.name
			results = append(results, r)
		}
	}
	base := benchstat.Pct(results[0].cycles, 50)
	for _, r := range results {
		p50, p90 := benchstat.Pct(r.cycles, 50), benchstat.Pct(r.cycles, 90)
		extra := ""
		if r.scrapes > 0 {
			extra = fmt.Sprintf("  (%d scrapes meanwhile)", r.scrapes)
		}
		fmt.Printf("%-22s create+exec+stop p50 %s  p90 %s  ratio %.2f%s\n", r.name, benchstat.Ms(p50, 1), benchstat.Ms(p90, 1), p50.Seconds()/base.Seconds(), extra)
	}
	return nil
}

func measure(ctx context.Context, store, agent string, n int, withMetrics, scrape bool) (result, error) {
	be := benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}
	c, err := benchcluster.Start(ctx, store, agent, be, func(cfg *embed.Config) {
		cfg.NoMetrics = !withMetrics
		if withMetrics {
			cfg.MetricsListen = "127.0.0.1:0"
		}
	})
	if err != nil {
		return result{}, err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return result{}, err
	}
	var scrapes atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	if scrape {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				tick := time.NewTicker(100 * time.Millisecond)
				defer tick.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
					}
					if resp, err := http.Get(c.MetricsURL); err == nil {
						io.Copy(io.Discard, resp.Body) //nolint:errcheck // a load
						resp.Body.Close()
						scrapes.Add(1)
					}
				}
			}()
		}
	}
	spec := &sandboxv1.SandboxSpec{Backend: container.Name, Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.5, MemoryMb: 128}}
	var cycles []time.Duration
	for i := 0; i < n+5; i++ {
		t0 := time.Now()
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			close(stop)
			wg.Wait()
			return result{}, err
		}
		if r, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"true"}}); err != nil || r.ExitCode != 0 {
			close(stop)
			wg.Wait()
			return result{}, fmt.Errorf("exec: %v", err)
		}
		if err := sb.Stop(ctx); err != nil {
			close(stop)
			wg.Wait()
			return result{}, err
		}
		if i >= 5 { // the first few warm the node up
			cycles = append(cycles, time.Since(t0))
		}
	}
	close(stop)
	wg.Wait()
	return result{cycles: cycles, scrapes: scrapes.Load()}, nil
}

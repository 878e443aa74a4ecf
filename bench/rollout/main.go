// Command rollout measures `dsec rollout` over a cluster of
// scripts/cluster.sh (3 IAM replicas, a watcher, 2 apiservers, 3 edges,
// each a process) under a load of creates and commands: each wave's time
// (its component's restart and readiness, then the soak), beside the bare
// restart of the same component by `scripts/cluster.sh restart` (what the
// rollout wraps), and the calls the load made and lost. The build rolled
// out is the one running (bin/dsec again, with its gates): what is timed
// is the rollout, not a new build's start. Needs root, crun, iproute2,
// `make build` and `make images`.
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/rollout"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with the image")
	soak := flag.Duration("soak", 3*time.Second, "the rollout's soak after each wave")
	flag.Parse()
	if err := run(context.Background(), *store, *soak); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, store string, soak time.Duration) error {
	store, err := filepath.Abs(store)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "dsec-bench-rollout-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	state := filepath.Join(dir, "cluster")
	script := filepath.Join("scripts", "cluster.sh")
	if out, err := exec.CommandContext(ctx, script, "up", state, "--image-store", store).CombinedOutput(); err != nil {
		return fmt.Errorf("cluster.sh up: %v\n%s", err, out)
	}
	defer exec.Command(script, "down", state).Run() //nolint:errcheck // best effort at the end
	url := benchstat.EnvValue(filepath.Join(state, "client.env"), "DSEC_API_URL")
	key := benchstat.EnvValue(filepath.Join(state, "client.env"), "DSEC_API_KEY")
	cl, err := client.New(url, key)
	if err != nil {
		return err
	}

	// The bare restarts: one component of each kind, by cluster.sh, until
	// its metrics answer again (what the rollout waits for too).
	plan, err := rollout.LoadPlan(filepath.Join(state, "rollout.json"))
	if err != nil {
		return err
	}
	bare := map[string]time.Duration{}
	for _, c := range plan.Components {
		if _, done := bare[c.Kind]; done {
			continue
		}
		began := time.Now()
		if out, err := exec.CommandContext(ctx, script, "restart", state, c.Name).CombinedOutput(); err != nil {
			return fmt.Errorf("cluster.sh restart %s: %v\n%s", c.Name, err, out)
		}
		if err := waitAnswer(ctx, c.Metrics); err != nil {
			return fmt.Errorf("%s after its restart: %w", c.Name, err)
		}
		bare[c.Kind] = time.Since(began)
	}
	kinds := map[string]string{}
	for _, c := range plan.Components {
		kinds[c.Name] = c.Kind
	}

	l := startLoad(ctx, cl)
	time.Sleep(2 * time.Second) // the load under way
	began := time.Now()
	cmd := exec.CommandContext(ctx, filepath.Join(state, "bin", "dsec"), "rollout", "--plan", filepath.Join(state, "rollout.json"),
		"--binary", "bin/dsec", "--agent", "bin/aether", "--soak", soak.String(), "--ready-timeout", "90s")
	out, err := cmd.CombinedOutput()
	total := time.Since(began)
	res := l.stop()
	if err != nil {
		return fmt.Errorf("dsec rollout: %v\n%s", err, out)
	}
	waves := parseWaves(string(out))
	host, _ := os.Hostname()
	fmt.Printf("dsec rollout of a scripts/cluster.sh cluster (3 IAM, watcher, 2 apiservers, 3 edges), soak %v, under load (machine %s)\n", soak, host)
	fmt.Printf("%-10s %12s %12s %14s %8s\n", "component", "wave", "restart", "bare restart", "ratio")
	for _, w := range waves {
		b := bare[kinds[w.component]]
		ratio := "-"
		if b > 0 {
			ratio = fmt.Sprintf("%.2fx", w.back.Seconds()/b.Seconds())
		}
		fmt.Printf("%-10s %12s %12s %14s %8s\n", w.component, benchstat.Ms(w.wave, 0), benchstat.Ms(w.back, 0), benchstat.Ms(b, 0), ratio)
	}
	fmt.Printf("rollout of %d components in %s; load: %d creates, %d commands, %d failed\n", len(waves), total.Round(100*time.Millisecond), res.creates, res.execs, len(res.errs))
	for i, e := range res.errs {
		if i == 5 {
			fmt.Printf("  ... %d more\n", len(res.errs)-5)
			break
		}
		fmt.Printf("  failed: %v\n", e)
	}
	if len(res.errs) > 0 {
		return errors.New("calls failed during the rollout")
	}
	return nil
}

// waitAnswer waits until url answers 200.
func waitAnswer(ctx context.Context, url string) error {
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer in 90 s: %v", url, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

type wave struct {
	component  string
	back, wave time.Duration // the component's restart and readiness; the whole wave, soak included
}

var backLine = regexp.MustCompile(`time=(\S+) .*msg="component back" .*component=(\S+) .*took=(\S+)`)

// parseWaves reads each component's restart from the rollout's log; a
// wave runs from the end of the one before (or began) to the end of its
// soak, the next wave's start.
func parseWaves(log string) []wave {
	var out []wave
	var ends []time.Time
	sc := bufio.NewScanner(strings.NewReader(log))
	for sc.Scan() {
		m := backLine.FindStringSubmatch(sc.Text())
		if m == nil || strings.Contains(sc.Text(), "rolling back") {
			continue
		}
		at, err1 := time.Parse(time.RFC3339Nano, m[1])
		took, err2 := time.ParseDuration(m[3])
		if err1 != nil || err2 != nil {
			continue
		}
		out = append(out, wave{component: m[2], back: took})
		ends = append(ends, at.Add(-took))
	}
	// A wave lasts from its restart's start to the next one's.
	for i := range out {
		start := ends[i]
		end := time.Now()
		if i+1 < len(ends) {
			end = ends[i+1]
		}
		out[i].wave = end.Sub(start)
	}
	return out
}

type loadResult struct {
	creates, execs int
	errs           []error
}

type load struct {
	stopping atomic.Bool
	wg       sync.WaitGroup
	mu       sync.Mutex
	res      loadResult
}

// startLoad runs 3 workers: a create every other round (8 each at most,
// stopped at the end), commands in between.
func startLoad(ctx context.Context, cl *client.Client) *load {
	l := &load{}
	spec := &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 0.1, MemoryMb: 64, DiskMb: 64}}
	for range 3 {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			var mine []*client.Sandbox
			defer func() {
				for _, sb := range mine {
					sb.Stop(context.WithoutCancel(ctx)) //nolint:errcheck // the cluster goes down next
				}
			}()
			for i := 0; !l.stopping.Load(); i++ {
				if i%2 == 0 && len(mine) < 8 {
					cctx, cancel := context.WithTimeout(ctx, time.Minute)
					sb, err := cl.Create(cctx, spec)
					cancel()
					l.add(func(r *loadResult) {
						if err != nil {
							r.errs = append(r.errs, fmt.Errorf("create: %w", err))
						} else {
							r.creates++
						}
					})
					if err == nil {
						mine = append(mine, sb)
					}
				}
				if len(mine) == 0 {
					time.Sleep(100 * time.Millisecond)
					continue
				}
				target := mine[i%len(mine)]
				cctx, cancel := context.WithTimeout(ctx, time.Minute)
				r, err := target.Shell(cctx, "echo alive")
				cancel()
				l.add(func(res *loadResult) {
					if err != nil || strings.TrimSpace(string(r.GetStdout())) != "alive" {
						res.errs = append(res.errs, fmt.Errorf("exec in %s: %v, %v", target.ID, r, err))
					} else {
						res.execs++
					}
				})
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	return l
}

func (l *load) add(f func(*loadResult)) {
	l.mu.Lock()
	f(&l.res)
	l.mu.Unlock()
}

func (l *load) stop() loadResult {
	l.stopping.Store(true)
	l.wg.Wait()
	return l.res
}

// Command crossfork measures a fork of 8 copies (gvisor, a Python process
// prepared as bench/fork prepares it) whose copies run on the source's own
// node against one whose copies run on two other nodes, which first pull
// the snapshot from the source's edge over mutual TLS, in one run on one 3-edge cluster: edge 1
// has room for one sandbox (the cross-node source), edge 2 for many (the
// same-node source). It prints the total, the source's interruption and
// per-copy time to first exec; bench/fork has bare runsc's checkpoint and
// restore for the same preparation. Needs root, runsc and root/py:3.11.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"sync"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/bench/internal/pyprep"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with root/py:3.11")
	agent := flag.String("agent", "bin/aether", "aether binary")
	n := flag.Int("n", 8, "copies per fork")
	reps := flag.Int("reps", 3, "forks of each kind; the row shows the one with the median total")
	flag.Parse()
	if err := run(context.Background(), *store, *agent, *n, *reps); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

type result struct {
	total, pause time.Duration
	first        []time.Duration
	nodes        map[sandboxid.NodeID]int
}

func run(ctx context.Context, storeDir, agent string, n, reps int) error {
	c, err := benchcluster.Start(ctx, storeDir, agent, benchcluster.Backend{Name: gvisor.Name, Factory: gvisor.New}, func(cfg *embed.Config) {
		cfg.Edges = 3
		cfg.EdgeCapacity = func(i int) capacity.Node {
			node := capacity.Node{CPUCores: 64, MemoryMB: 65536, MaxSandboxes: 64, HostCPUCores: 2, HostMemoryMB: 8192}
			if i == 1 {
				node.MaxSandboxes = 1
			}
			return node
		}
	})
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	spec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: "root/py:3.11", Resources: &sandboxv1.Resources{CpuCores: 0.25, MemoryMb: 512}}
	fork := func(e *edge.Edge) (result, error) {
		made, err := e.Create(ctx, spec, "root")
		if err != nil {
			return result{}, err
		}
		src := cl.Sandbox(made.Id)
		defer src.Stop(ctx) //nolint:errcheck // cleanup
		if err := pyprep.Run(ctx, src); err != nil {
			return result{}, err
		}
		t0 := time.Now()
		resp, err := cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: int32(n)}))
		if err != nil {
			return result{}, err
		}
		r := result{pause: time.Duration(resp.Msg.SourcePauseUs) * time.Microsecond, nodes: map[sandboxid.NodeID]int{}}
		var mu sync.Mutex
		var wg sync.WaitGroup
		var copies []*client.Sandbox
		var failed error
		for _, res := range resp.Msg.Results {
			if res.Sandbox == nil {
				failed = fmt.Errorf("copy failed: %s %s", res.ErrorCode, res.ErrorMessage)
				continue
			}
			_, node, _ := sandboxid.Parse(res.Sandbox.Id)
			r.nodes[node]++
			sb := cl.Sandbox(res.Sandbox.Id)
			copies = append(copies, sb)
			wg.Add(1)
			go func() {
				defer wg.Done()
				if out, err := sb.Shell(ctx, "curl -s http://127.0.0.1:8000/"); err == nil && len(out.Stdout) > 0 {
					mu.Lock()
					r.first = append(r.first, time.Since(t0))
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		r.total = time.Since(t0)
		for _, sb := range copies {
			sb.Stop(ctx) //nolint:errcheck // cleanup
		}
		if failed == nil && len(r.first) != n {
			failed = fmt.Errorf("%d of %d copies answered with the source's server", len(r.first), n)
		}
		return r, failed
	}
	// Warm-up: unpacks the image's layers on every edge.
	for _, e := range c.Edges[1:] {
		if _, err := fork(e); err != nil {
			return err
		}
	}
	host, _ := os.Hostname()
	fmt.Printf("fork of %d gvisor copies of a prepared Python process, median of %d (machine %s)\n", n, reps, host)
	var same, cross result
	for i, kind := range []struct {
		name string
		on   *edge.Edge
		out  *result
	}{{"same node (copies share the snapshot)", c.Edges[1], &same}, {"other nodes (each pulls the snapshot)", c.Edges[0], &cross}} {
		var runs []result
		for range reps {
			r, err := fork(kind.on)
			if err != nil {
				return fmt.Errorf("%s: %w", kind.name, err)
			}
			runs = append(runs, r)
		}
		sort.Slice(runs, func(a, b int) bool { return runs[a].total < runs[b].total })
		*kind.out = runs[len(runs)/2]
		r := *kind.out
		fmt.Printf("%-40s total %8s  source paused %7s  first exec p50 %8s max %8s  copies per node %v\n",
			kind.name, benchstat.Ms(r.total, 0), benchstat.Ms(r.pause, 0), benchstat.Ms(benchstat.Pct(r.first, 50), 0), benchstat.Ms(benchstat.Pct(r.first, 100), 0), counts(r.nodes))
		if i == 1 && r.nodes[c.Edges[0].Node()] != 0 {
			return fmt.Errorf("cross-node fork left copies on the source's full node: %v", r.nodes)
		}
	}
	fmt.Printf("ratio other nodes / same node: total %.2fx, first exec p50 %.2fx\n",
		float64(cross.total)/float64(same.total), float64(benchstat.Pct(cross.first, 50))/float64(benchstat.Pct(same.first, 50)))
	return nil
}

func counts(m map[sandboxid.NodeID]int) []int {
	var out []int
	for _, v := range m {
		out = append(out, v)
	}
	sort.Sort(sort.Reverse(sort.IntSlice(out)))
	return out
}

// Command placement measures placement quality, pure computation on
// internal/placement: a burst of sandboxes of mixed sizes onto a set of
// equal nodes, placed by power-of-k (k=2, 3), by a uniformly random node,
// and by the globally least-loaded node, each as one apiserver and as two
// apiservers sharing a view refreshed only every R placements (as the
// watcher's 1 s poll does under a burst) and each knowing only its own
// in-flight placements. It prints the load imbalance after the burst: the
// most loaded node's load over the mean (1.00 is perfect), and the spread
// of sandbox counts.
package main

import (
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"

	"github.com/opendsec/opendsec/internal/placement"
)

func main() {
	nodes := flag.Int("nodes", 10, "edges")
	n := flag.Int("n", 300, "sandboxes in the burst")
	refresh := flag.Int("refresh", 50, "placements between view refreshes (stale view)")
	seeds := flag.Int("seeds", 20, "runs per strategy, averaged")
	flag.Parse()
	host, _ := os.Hostname()
	fmt.Printf("placement quality: %d sandboxes (0.25-2 cores, 256-2048 MiB) onto %d nodes of 16 cores / 64 GiB, mean of %d runs (machine %s)\n",
		*n, *nodes, *seeds, host)
	fmt.Printf("%-30s %18s %18s %18s %18s\n", "", "max/mean, fresh", "count sd, fresh", "max/mean, 2 api", "count sd, 2 api")
	for _, s := range []struct {
		name string
		k    int
	}{{"random (k=1)", 1}, {"power-of-2", 2}, {"power-of-3", 3}, {"least-loaded (k=all)", *nodes}} {
		var fresh, freshSD, stale, staleSD float64
		for seed := range *seeds {
			a, b := run(*nodes, *n, s.k, 1, 1, uint64(seed))
			c, d := run(*nodes, *n, s.k, 2, *refresh, uint64(seed))
			fresh, freshSD, stale, staleSD = fresh+a, freshSD+b, stale+c, staleSD+d
		}
		f := float64(*seeds)
		fmt.Printf("%-30s %18.3f %18.2f %18.3f %18.2f\n", s.name, fresh/f, freshSD/f, stale/f, staleSD/f)
	}
}

// run places n sandboxes by k with apis apiservers whose shared view is
// refreshed every refresh placements, and returns max/mean load and the
// standard deviation of sandbox counts.
func run(nodeCount, n, k, apis, refresh int, seed uint64) (float64, float64) {
	rng := rand.New(rand.NewPCG(seed, 7))
	truth := make([]placement.Node, nodeCount)
	for i := range truth {
		truth[i] = placement.Node{
			ID: fmt.Sprintf("n%d", i), Healthy: true, Backends: map[string]string{"container": ""},
			Capacity: placement.Resources{Sandboxes: 1000, CPUCores: 16 * 8, MemoryMB: 64 << 10},
			Host:     placement.Resources{CPUCores: 16, MemoryMB: 64 << 10},
		}
	}
	view := append([]placement.Node(nil), truth...)
	inflight := make([]map[string]placement.Resources, apis)
	for i := range inflight {
		inflight[i] = map[string]placement.Resources{}
	}
	sizes := []struct {
		cpu float64
		mem int64
	}{{0.25, 256}, {0.5, 512}, {1, 1024}, {2, 2048}}
	for i := range n {
		if i%refresh == 0 {
			view = append(view[:0], truth...)
			for a := range inflight {
				inflight[a] = map[string]placement.Resources{}
			}
		}
		sz := sizes[rng.IntN(len(sizes))]
		a := i % apis
		ranked, err := placement.Place(view, inflight[a], placement.Request{Backend: "container", CPUCores: sz.cpu, MemoryMB: sz.mem, Count: 1}, k, rng)
		if err != nil {
			panic(err)
		}
		for j := range truth {
			if truth[j].ID == ranked[0] {
				truth[j].Allocated.Sandboxes++
				truth[j].Allocated.CPUCores += sz.cpu
				truth[j].Allocated.MemoryMB += sz.mem
			}
		}
		r := inflight[a][ranked[0]]
		r.Sandboxes, r.CPUCores, r.MemoryMB = r.Sandboxes+1, r.CPUCores+sz.cpu, r.MemoryMB+sz.mem
		inflight[a][ranked[0]] = r
	}
	var maxLoad, sum, sumC, sumC2 float64
	for _, nd := range truth {
		l := math.Max(nd.Allocated.CPUCores/nd.Capacity.CPUCores, float64(nd.Allocated.MemoryMB)/float64(nd.Capacity.MemoryMB))
		maxLoad, sum = math.Max(maxLoad, l), sum+l
		c := float64(nd.Allocated.Sandboxes)
		sumC, sumC2 = sumC+c, sumC2+c*c
	}
	mean := sum / float64(len(truth))
	meanC := sumC / float64(len(truth))
	return maxLoad / mean, math.Sqrt(sumC2/float64(len(truth)) - meanC*meanC)
}

package placement

import (
	"math/rand/v2"
	"sort"
)

// Share is how many of a fork's copies one node runs.
type Share struct {
	Node  string
	Count int64
}

// SplitFork places count copies of a sandbox of r's size whose source runs
// on source [ours]. Without spread, copies go on the source's node while
// it has room (they share its snapshot there, no transfer) and the rest,
// one at a time, on the best of k sampled nodes, each pulling the snapshot
// once. With spread, every copy is placed that way, the source's node
// included, to spread their CPU. Copies no node has room for go to the
// source's node, whose edge refuses them (it has the final say). The
// source's share comes first, then the others by node id.
func SplitFork(nodes []Node, inflight map[string]Resources, source string, r Request, count int64, spread bool, k int, rng *rand.Rand) ([]Share, error) {
	one := r
	one.Count = 1
	extra := make(map[string]Resources, len(inflight))
	for n, res := range inflight {
		extra[n] = res
	}
	byID := make(map[string]*Node, len(nodes))
	for i := range nodes {
		byID[nodes[i].ID] = &nodes[i]
	}
	fits := func(id string) bool {
		n := byID[id]
		if n == nil || !n.Healthy {
			return false
		}
		if why, ok := n.Backends[r.Backend]; !ok || why != "" {
			return false
		}
		f := n.free(extra[id])
		return f.Sandboxes >= 1 && f.CPUCores+1e-9 >= r.CPUCores && f.MemoryMB >= r.MemoryMB
	}
	counts := map[string]int64{}
	for range count {
		node := source
		if spread || !fits(source) {
			ranked, err := Place(nodes, extra, one, k, rng)
			if err != nil {
				return nil, err
			}
			if fits(ranked[0]) {
				node = ranked[0]
			}
		}
		counts[node]++
		e := extra[node]
		e.Sandboxes++
		e.CPUCores += r.CPUCores
		e.MemoryMB += r.MemoryMB
		extra[node] = e
	}
	out := make([]Share, 0, len(counts))
	for n, c := range counts {
		out = append(out, Share{Node: n, Count: c})
	}
	sort.Slice(out, func(i, j int) bool {
		if (out[i].Node == source) != (out[j].Node == source) {
			return out[i].Node == source
		}
		return out[i].Node < out[j].Node
	})
	return out, nil
}

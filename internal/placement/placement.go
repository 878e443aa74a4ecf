// Package placement picks nodes for new sandboxes [paper]: filter the nodes
// that are healthy, run the backend and could ever hold the sandbox, then
// power-of-k: sample k of those with room, overlay this apiserver's own
// in-flight placements, and rank the sample by load, least loaded first.
// The rest follow as fallbacks for when an edge rejects, and after them the
// nodes that look full: the view may be stale, and the edge has the final
// say on admission [paper]. Place is pure: no I/O, no clock; randomness
// comes in.
package placement

import (
	"math/rand/v2"
	"sort"
	"strings"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Resources is an amount of CPU, memory and sandboxes.
type Resources struct {
	Sandboxes int64
	CPUCores  float64
	MemoryMB  int64
}

// Node is what placement knows of one node.
type Node struct {
	ID      string
	Healthy bool
	// Backends maps a backend name to "" (usable) or why it is not.
	Backends  map[string]string
	Capacity  Resources // admission totals
	Allocated Resources
	Host      Resources // bounds one sandbox
}

// Request is a sandbox to place.
type Request struct {
	Backend  string
	CPUCores float64
	MemoryMB int64
	Count    int64 // sandboxes of this size (1 for a create)
}

// DefaultK is how many nodes are sampled.
const DefaultK = 2

func (n *Node) free(extra Resources) Resources {
	return Resources{
		Sandboxes: n.Capacity.Sandboxes - n.Allocated.Sandboxes - extra.Sandboxes,
		CPUCores:  n.Capacity.CPUCores - n.Allocated.CPUCores - extra.CPUCores,
		MemoryMB:  n.Capacity.MemoryMB - n.Allocated.MemoryMB - extra.MemoryMB,
	}
}

// load is the larger of the CPU and memory fractions in use after placing r.
func (n *Node) load(extra Resources, r Request) float64 {
	cpu := (n.Allocated.CPUCores + extra.CPUCores + r.CPUCores*float64(r.Count)) / max(n.Capacity.CPUCores, 1e-9)
	mem := float64(n.Allocated.MemoryMB+extra.MemoryMB+r.MemoryMB*r.Count) / max(float64(n.Capacity.MemoryMB), 1e-9)
	return max(cpu, mem)
}

// Place ranks nodes for r; inflight is what this apiserver placed that the
// nodes' reports do not show yet.
func Place(nodes []Node, inflight map[string]Resources, r Request, k int, rng *rand.Rand) ([]string, error) {
	if r.Count < 1 {
		r.Count = 1
	}
	if k < 1 {
		k = DefaultK
	}
	var healthy, withBackend, sized, roomy, full []*Node
	var reasons []string
	for i := range nodes {
		n := &nodes[i]
		if !n.Healthy {
			continue
		}
		healthy = append(healthy, n)
		why, known := n.Backends[r.Backend]
		if !known || why != "" {
			if known {
				reasons = append(reasons, n.ID+": "+why)
			}
			continue
		}
		withBackend = append(withBackend, n)
		if r.CPUCores > n.Host.CPUCores || r.MemoryMB > n.Host.MemoryMB {
			continue
		}
		sized = append(sized, n)
		f := n.free(inflight[n.ID])
		if f.Sandboxes >= r.Count && f.CPUCores+1e-9 >= r.CPUCores*float64(r.Count) && f.MemoryMB >= r.MemoryMB*r.Count {
			roomy = append(roomy, n)
		} else {
			full = append(full, n)
		}
	}
	switch {
	case len(healthy) == 0:
		return nil, errdefs.Unavailable("no healthy edge node")
	case len(withBackend) == 0 && len(reasons) > 0:
		return nil, errdefs.FailedPrecondition("backend %q cannot run on any node: %s", r.Backend, strings.Join(reasons, "; "))
	case len(withBackend) == 0:
		return nil, errdefs.InvalidArgument("backend %q: no node offers it", r.Backend)
	case len(sized) == 0:
		var maxCPU float64
		var maxMem int64
		for _, n := range withBackend {
			maxCPU, maxMem = max(maxCPU, n.Host.CPUCores), max(maxMem, n.Host.MemoryMB)
		}
		if r.CPUCores > maxCPU {
			return nil, errdefs.InvalidArgument("resources.cpu_cores %g: over the node capacity (%g cores at most)", r.CPUCores, maxCPU)
		}
		return nil, errdefs.InvalidArgument("resources.memory_mb %d: over the node capacity (%d MiB at most)", r.MemoryMB, maxMem)
	}
	// Sample k without replacement, rank the sample, then the rest.
	rng.Shuffle(len(roomy), func(i, j int) { roomy[i], roomy[j] = roomy[j], roomy[i] })
	k = min(k, len(roomy))
	byLoad := func(s []*Node) {
		sort.SliceStable(s, func(i, j int) bool { return s[i].load(inflight[s[i].ID], r) < s[j].load(inflight[s[j].ID], r) })
	}
	sample, rest := roomy[:k], roomy[k:]
	byLoad(sample)
	byLoad(rest)
	byLoad(full)
	out := make([]string, 0, len(sized))
	for _, n := range append(append(sample, rest...), full...) {
		out = append(out, n.ID)
	}
	return out, nil
}

package apiserver

import (
	"sync"
	"time"

	"github.com/opendsec/opendsec/internal/placement"
)

// inflight remembers this apiserver's placements until the watcher's view
// includes them, so a burst of creates does not pile onto one node [paper].
type inflight struct {
	mu      sync.Mutex
	next    uint64
	entries map[uint64]*inflightEntry // guarded by mu
}

type inflightEntry struct {
	node    string
	project string
	res     placement.Resources
	sentAt  time.Time // just before the create went to the edge
	doneAt  time.Time // when the edge answered (zero while in flight)
	done    bool
}

func newInflight() *inflight { return &inflight{entries: map[uint64]*inflightEntry{}} }

// add records a placement about to be tried and returns its handle.
func (f *inflight) add(node, project string, res placement.Resources) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	f.entries[f.next] = &inflightEntry{node: node, project: project, res: res, sentAt: time.Now()}
	return f.next
}

// released records a removal this apiserver made, subtracted from usage
// until a poll shows it.
func (f *inflight) released(node, project string, res placement.Resources) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	neg := placement.Resources{Sandboxes: -res.Sandboxes, CPUCores: -res.CPUCores, MemoryMB: -res.MemoryMB}
	now := time.Now()
	f.entries[f.next] = &inflightEntry{node: node, project: project, res: neg, sentAt: now, doneAt: now, done: true}
}

// move re-points a placement at the node it is being tried on now.
func (f *inflight) move(id uint64, node string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if e := f.entries[id]; e != nil && e.node != node {
		e.node, e.sentAt = node, time.Now()
	}
}

// finish marks a placement done; a failed one is dropped at once.
func (f *inflight) finish(id uint64, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !ok {
		delete(f.entries, id)
		return
	}
	if e := f.entries[id]; e != nil {
		e.done, e.doneAt = true, time.Now()
	}
}

// overlay returns what is not yet in a view whose last poll of each node
// started at polledAt[node]. The edge counts a sandbox from the moment it
// admits it, which is before it answers, so a poll that started after the
// answer shows it; until then this apiserver counts it itself. (A poll
// that started after the create was sent is not enough: on a loaded node
// the edge can answer that poll before it admits the create, and the
// sandbox would be counted by neither; a quota test saw 4 of 3 admitted.)
func (f *inflight) overlay(polledAt map[string]time.Time) (byNode map[string]placement.Resources, pending []inflightEntry) {
	f.mu.Lock()
	defer f.mu.Unlock()
	byNode = map[string]placement.Resources{}
	for id, e := range f.entries {
		if e.done && (polledAt[e.node].After(e.doneAt) || time.Since(e.doneAt) > time.Minute) {
			delete(f.entries, id)
			continue
		}
		r := byNode[e.node]
		r.Sandboxes += e.res.Sandboxes
		r.CPUCores += e.res.CPUCores
		r.MemoryMB += e.res.MemoryMB
		byNode[e.node] = r
		pending = append(pending, *e)
	}
	return byNode, pending
}

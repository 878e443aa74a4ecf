package apiserver

import (
	"sync"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/placement"
	"github.com/opendsec/opendsec/internal/watcher"
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
	stamp   *edgev1.UsageStamp // the edge's change that counted it, if it said
}

// nodeMark is what the watcher's view last heard from a node: when that
// poll started and the usage change its status reflects.
type nodeMark struct {
	polledAt time.Time
	usage    *edgev1.UsageStamp
}

func marksOf(view *watcher.View) map[string]nodeMark {
	marks := map[string]nodeMark{}
	for _, n := range view.Nodes {
		marks[n.ID] = nodeMark{polledAt: n.PolledAt, usage: n.Status.GetUsage()}
	}
	return marks
}

// covers reports whether a status stamped have includes the change want.
func covers(have, want *edgev1.UsageStamp) bool {
	return have != nil && want != nil && want.Epoch != "" && have.Epoch == want.Epoch && have.Seq >= want.Seq
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

// finish marks a placement done, with the edge's stamp of the change that
// counted it (nil if it gave none); a failed one is dropped at once.
func (f *inflight) finish(id uint64, ok bool, stamp *edgev1.UsageStamp) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !ok {
		delete(f.entries, id)
		return
	}
	if e := f.entries[id]; e != nil {
		e.done, e.doneAt, e.stamp = true, time.Now(), stamp
	}
}

// overlay returns what is not yet in the view whose nodes say marks. A
// placement is in it once the node's status is stamped at or after the
// change that counted it. Without a stamp (an edge that gives none), a
// poll that started after the edge answered shows it: the edge counts a
// sandbox from the moment it admits it, which is before it answers. (A
// poll that started after the create was sent is not enough: on a loaded
// node the edge can answer that poll before it admits the create, and the
// sandbox would be counted by neither; a quota test saw 4 of 3 admitted.
// Nor is waiting for a later poll exact: one that started between the
// admission and the answer counts the sandbox too, and a create right after
// was refused its quota for up to a second, which the stamp ends.)
func (f *inflight) overlay(marks map[string]nodeMark) map[string]placement.Resources {
	f.mu.Lock()
	defer f.mu.Unlock()
	byNode := map[string]placement.Resources{}
	for id, e := range f.entries {
		m := marks[e.node]
		if e.done && (covers(m.usage, e.stamp) || m.polledAt.After(e.doneAt) || time.Since(e.doneAt) > time.Minute) {
			delete(f.entries, id)
			continue
		}
		r := byNode[e.node]
		r.Sandboxes += e.res.Sandboxes
		r.CPUCores += e.res.CPUCores
		r.MemoryMB += e.res.MemoryMB
		byNode[e.node] = r
	}
	return byNode
}

// Package watcher aggregates scheduling state [paper]: it polls every edge
// for health, capacity and what runs there (per backend, project and task),
// and serves the latest view to placement and quota checks. It keeps nothing
// on disk; after a restart the first round of polls rebuilds the view.
package watcher

import (
	"context"
	"errors"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/edgeclient"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/placement"
)

// Config configures a watcher.
type Config struct {
	// Edges are the edge addresses ("host:port") to poll.
	Edges    []string
	Interval time.Duration
	Timeout  time.Duration
}

// NodeView is the last known state of one edge.
type NodeView struct {
	ID       string
	Addr     string
	Healthy  bool
	Err      string
	PolledAt time.Time // when the poll that produced Status started
	// UnhealthySince is, for an unhealthy node, when its polls began to
	// fail.
	UnhealthySince time.Time
	Status         *edgev1.NodeStatus
	// slowPolls counts the polls in a row that the edge did not answer in
	// time (a local watcher's own count).
	slowPolls int
}

// slowPollsTolerated is how many polls in a row a healthy edge may leave
// unanswered within the timeout before it is taken for unreachable. A busy
// node answers late, not never: beside a CPU hog, with 30 gVisor sandboxes
// restoring, one status poll took more than its 3 s, and every call routed
// to that node was refused as "unreachable" until the next poll. An edge
// that refuses (or a port nobody listens on) is unhealthy at once; a host
// that is gone stops answering, and after this many polls it is too.
const slowPollsTolerated = 3

// View is an immutable snapshot of every edge.
type View struct {
	Nodes []*NodeView
	byID  map[string]*NodeView
}

// Node finds an edge by node id.
func (v *View) Node(id string) (*NodeView, bool) {
	n, ok := v.byID[id]
	return n, ok
}

// Placement converts the view for placement.
func (v *View) Placement() []placement.Node {
	out := make([]placement.Node, 0, len(v.Nodes))
	for _, n := range v.Nodes {
		if n.Status == nil {
			continue
		}
		s := n.Status
		pn := placement.Node{ID: n.ID, Healthy: n.Healthy, Backends: map[string]string{}}
		for _, b := range s.Backends {
			pn.Backends[b.Name] = b.UnavailableReason
		}
		pn.Capacity = res(s.Capacity)
		pn.Allocated = res(s.Allocated)
		pn.Host = res(s.Host)
		out = append(out, pn)
	}
	return out
}

func res(u *edgev1.Usage) placement.Resources {
	if u == nil {
		return placement.Resources{}
	}
	return placement.Resources{Sandboxes: u.Sandboxes, CPUCores: u.CpuCores, MemoryMB: u.MemoryMb}
}

// Healthy lists healthy nodes.
func (v *View) Healthy() []*NodeView {
	var out []*NodeView
	for _, n := range v.Nodes {
		if n.Healthy {
			out = append(out, n)
		}
	}
	return out
}

// Watcher polls edges.
type Watcher struct {
	cfg  Config
	pool *edgeclient.Pool
	log  *slog.Logger

	mu    sync.Mutex
	edges []string // guarded by mu
	view  atomic.Pointer[View]
}

// New returns a watcher; Run polls.
func New(cfg Config, pool *edgeclient.Pool, log *slog.Logger) *Watcher {
	if cfg.Interval == 0 {
		cfg.Interval = time.Second
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 3 * time.Second
	}
	w := &Watcher{cfg: cfg, pool: pool, log: logging.OrDiscard(log).With(logging.Component, "watcher"), edges: append([]string(nil), cfg.Edges...)}
	w.view.Store(&View{byID: map[string]*NodeView{}})
	return w
}

// AddEdge starts polling another edge.
func (w *Watcher) AddEdge(addr string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, e := range w.edges {
		if e == addr {
			return
		}
	}
	w.edges = append(w.edges, addr)
}

// View returns the latest snapshot.
func (w *Watcher) View() *View { return w.view.Load() }

// Run polls until ctx ends.
func (w *Watcher) Run(ctx context.Context) {
	tick := time.NewTicker(w.cfg.Interval)
	defer tick.Stop()
	for {
		w.Poll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// Poll runs one round over every edge in parallel and publishes the view.
func (w *Watcher) Poll(ctx context.Context) {
	w.mu.Lock()
	edges := append([]string(nil), w.edges...)
	w.mu.Unlock()
	prev := w.View()
	prevByAddr := map[string]*NodeView{}
	for _, n := range prev.Nodes {
		prevByAddr[n.Addr] = n
	}
	results := make([]*NodeView, len(edges))
	var wg sync.WaitGroup
	for i, addr := range edges {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = w.pollOne(ctx, addr, prevByAddr[addr])
		}()
	}
	wg.Wait()
	w.view.Store(NewView(results))
}

// NewView is the view of nodes, sorted by id; nodes without an id (never
// reached) are left out.
func NewView(nodes []*NodeView) *View {
	v := &View{byID: map[string]*NodeView{}}
	for _, n := range nodes {
		if n.ID == "" {
			continue
		}
		v.Nodes = append(v.Nodes, n)
		v.byID[n.ID] = n
	}
	sort.Slice(v.Nodes, func(i, j int) bool { return v.Nodes[i].ID < v.Nodes[j].ID })
	return v
}

func (w *Watcher) pollOne(ctx context.Context, addr string, prev *NodeView) *NodeView {
	started := time.Now()
	ctx, cancel := context.WithTimeout(ctx, w.cfg.Timeout)
	defer cancel()
	resp, err := w.pool.Get(addr).Edge.GetNodeStatus(ctx, connect.NewRequest(&edgev1.GetNodeStatusRequest{}))
	if err != nil {
		nv := &NodeView{Addr: addr, Err: err.Error(), PolledAt: started}
		if prev != nil {
			nv.ID, nv.Status = prev.ID, prev.Status
			if slow := connect.CodeOf(err) == connect.CodeDeadlineExceeded || errors.Is(err, context.DeadlineExceeded); slow && prev.Healthy {
				nv.slowPolls = prev.slowPolls + 1
				nv.Healthy = nv.slowPolls < slowPollsTolerated
			}
			if prev.Healthy && !nv.Healthy {
				w.log.Warn("edge unreachable", "addr", addr, logging.NodeID, prev.ID, logging.Error, err)
			}
			nv.UnhealthySince = prev.UnhealthySince
		}
		if !nv.Healthy && nv.UnhealthySince.IsZero() {
			nv.UnhealthySince = started
		}
		return nv
	}
	st := resp.Msg.Status
	return &NodeView{ID: st.NodeId, Addr: addr, Healthy: true, PolledAt: started, Status: st}
}

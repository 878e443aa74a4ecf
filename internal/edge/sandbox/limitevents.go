package sandbox

import (
	"net/http"
	"sync/atomic"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/headers"
)

// limitCounts are what a sandbox's limits ended or refused inside it while
// it lived on [ours] (Sandbox.limit_events): as its agent reports them on
// every answer (headers.LimitEvents: gVisor's memory watch, a microVM
// guest's cgroup) and as the node's cgroups count them (a container's,
// through backend.Usage at each metrics sample). Each source's counts are
// its own totals; the sandbox's are their sum.
type limitCounts struct {
	agentOOM, agentForks atomic.Int64
	nodeOOM, nodeForks   atomic.Int64
}

// reset starts the counts afresh.
func (c *limitCounts) reset() {
	for _, n := range []*atomic.Int64{&c.agentOOM, &c.agentForks, &c.nodeOOM, &c.nodeForks} {
		n.Store(0)
	}
}

// fromAgent takes the counts an agent's answer carries, if it does.
func (c *limitCounts) fromAgent(h http.Header) {
	if oom, forks, ok := headers.ParseLimitEvents(h.Get(headers.LimitEvents)); ok {
		c.agentOOM.Store(oom)
		c.agentForks.Store(forks)
	}
}

// fromNode takes the counts of the node's cgroups.
func (c *limitCounts) fromNode(u backend.Usage) {
	c.nodeOOM.Store(u.OOMKills)
	c.nodeForks.Store(u.ForksRefused)
}

// proto is the counts for the API; nil while nothing happened.
func (c *limitCounts) proto() *sandboxv1.LimitEvents {
	oom := c.agentOOM.Load() + c.nodeOOM.Load()
	forks := c.agentForks.Load() + c.nodeForks.Load()
	if oom == 0 && forks == 0 {
		return nil
	}
	return &sandboxv1.LimitEvents{OomKills: oom, ForksRefused: forks}
}

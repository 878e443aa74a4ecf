package sandbox

import (
	"net/http"
	"testing"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/headers"
)

// TestLimitCounts: an agent's counts and the node's add up, each source's
// later totals replace its earlier ones, and an answer without counts (or
// with a malformed value) changes nothing.
func TestLimitCounts(t *testing.T) {
	var c limitCounts
	if c.proto() != nil {
		t.Fatal("counts before anything happened")
	}
	h := http.Header{}
	h.Set(headers.LimitEvents, headers.FormatLimitEvents(2, 0))
	c.fromAgent(h)
	c.fromNode(backend.Usage{OOMKills: 1, ForksRefused: 5})
	if le := c.proto(); le.GetOomKills() != 3 || le.GetForksRefused() != 5 {
		t.Fatalf("%v, want 3 OOM kills and 5 forks refused", le)
	}
	h.Set(headers.LimitEvents, headers.FormatLimitEvents(4, 1))
	c.fromAgent(h)
	c.fromAgent(http.Header{})
	bad := http.Header{}
	bad.Set(headers.LimitEvents, "oom_kills=-7 forks_refused=0")
	c.fromAgent(bad)
	if le := c.proto(); le.GetOomKills() != 5 || le.GetForksRefused() != 6 {
		t.Fatalf("%v, want 5 and 6", le)
	}
}

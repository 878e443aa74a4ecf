package apiserver

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/opendsec/opendsec/internal/edgeclient/edgefake"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam/fsm"
)

// Placements are counted by outcome, each move past a declining edge by
// its answer, and a quota's refusal as one.
func TestPlacementsAndQuotaRefusalsAreCounted(t *testing.T) {
	t.Parallel()
	// a is the less loaded: placement asks it first.
	a, b := edgefake.New("10.0.0.1:7000", usage(32)), edgefake.New("10.0.0.2:7000", usage(16))
	f := newFixture(t, a, b)
	ctx := ctxFor(t)
	st := f.s.placeStats
	count := func(outcome string) float64 { return valueOf(t, st.placements.WithLabelValues(outcome)) }

	if _, err := f.create(ctx, ""); err != nil {
		t.Fatal(err)
	}
	a.Decline(errdefs.ResourceExhausted("node full"))
	if _, err := f.create(ctx, ""); err != nil {
		t.Fatal(err)
	}
	b.Decline(errdefs.Unavailable("node draining"))
	if _, err := f.create(ctx, ""); err == nil {
		t.Fatal("a create every node declined succeeded")
	}
	a.Decline(errdefs.InvalidArgument("image: a layer is missing on this node"))
	b.Decline(errdefs.InvalidArgument("image: a layer is missing on this node"))
	if _, err := f.create(ctx, ""); err == nil {
		t.Fatal("a create the edge found bad succeeded")
	}
	// The second create lands on b, first or after a declined: the
	// order of equally fitting nodes is the placement's draw.
	after := count(placedAfter)
	if count(placedFirst)+after != 2 || count(placedNone) != 1 || count(placedErrorOut) != 1 || count(placedNoNode) != 0 {
		t.Errorf("placements: placed %v, placed_after_refusal %v, declined %v, error %v, no_node %v; want 2 placed in all, 1 declined, 1 error",
			count(placedFirst), after, count(placedNone), count(placedErrorOut), count(placedNoNode))
	}
	if got := valueOf(t, st.moves.WithLabelValues("resource_exhausted")); got != after+1 {
		t.Errorf("moves past a full node = %v, want %v (one per placement after a refusal, one when every node declined)", got, after+1)
	}
	if got := valueOf(t, st.moves.WithLabelValues("unavailable")); got != 1 {
		t.Errorf("moves past an unavailable node = %v, want 1", got)
	}

	a.Decline(nil)
	b.Decline(nil)
	if _, err := f.iam.SetQuota(ctx, "root", fsm.Quota{MaxSandboxes: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.create(ctx, ""); err == nil {
		t.Fatal("a create over the project's quota succeeded")
	}
	if got := valueOf(t, st.quota); got != 1 {
		t.Errorf("quota refusals = %v, want 1", got)
	}
}

// valueOf reads a counter.
func valueOf(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

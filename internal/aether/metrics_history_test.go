package aether

import (
	"testing"
	"time"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
)

func TestMetricsHistoryKeepsAnHourAndAnswersRanges(t *testing.T) {
	var h metricsHistory
	base := time.Unix(1_700_000_000, 0)
	for i := 0; i < historyLen+10; i++ {
		h.add(&agentv1.MetricsSample{TimestampUnix: base.Unix() + int64(i)*5})
	}
	all, _ := h.between(0, 0, base)
	if len(all) != historyLen || all[0].TimestampUnix != base.Unix()+50 {
		t.Fatalf("kept %d samples from %d", len(all), all[0].TimestampUnix)
	}
	got, _ := h.between(base.Unix()+100, base.Unix()+120, base)
	if len(got) != 5 || got[0].TimestampUnix != base.Unix()+100 || got[4].TimestampUnix != base.Unix()+120 {
		t.Fatalf("range 100-120 s: %v", got)
	}
	if got, _ := h.between(0, base.Unix()-1, base); len(got) != 0 {
		t.Fatalf("a range before the first sample: %v", got)
	}
	last := base.Unix() + int64(historyLen+9)*5
	if _, stale := h.between(0, 0, time.Unix(last+2, 0)); stale {
		t.Fatal("a 2 s old newest sample called stale")
	}
	if _, stale := h.between(0, 0, time.Unix(last+6, 0)); !stale {
		t.Fatal("a 6 s old newest sample not called stale")
	}
}

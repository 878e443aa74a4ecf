package aether

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
)

// BenchmarkRunTrue times one Run of `true` through a real agent link, and
// reports the part the agent itself spends (spawn to exit) as agent-ns/op.
func BenchmarkRunTrue(b *testing.B) {
	c := startAgent(b)
	ctx := context.Background()
	req := &agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"true"}}}
	var agent time.Duration
	b.ResetTimer()
	for b.Loop() {
		resp, err := c.proc.Run(ctx, connect.NewRequest(req))
		if err != nil || resp.Msg.ExitCode != 0 {
			b.Fatal(resp, err)
		}
		agent += time.Duration(resp.Msg.DurationUs) * time.Microsecond
	}
	b.ReportMetric(float64(agent.Nanoseconds())/float64(b.N), "agent-ns/op")
}

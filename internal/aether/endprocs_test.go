package aether

import (
	"os"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
)

// An agent outside a sandbox (in-process, as the fake backend runs it)
// shares its host's processes: EndProcesses refuses there and ends
// nothing. (Inside a sandbox it is tested end to end by test/e2b's
// filesystem-only pause.)
func TestEndProcessesRefusesOutsideASandbox(t *testing.T) {
	c := startAgent(t)
	_, err := c.agent.EndProcesses(ctxT(t), connect.NewRequest(&agentv1.EndProcessesRequest{}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("EndProcesses outside a sandbox: %v, want failed precondition", err)
	}
}

// userProcesses skips what it must keep and kernel threads.
func TestUserProcessesKeepsWhatItIsTold(t *testing.T) {
	self := os.Getpid()
	for _, pid := range userProcesses(map[int]bool{self: true, 1: true}) {
		if pid == self || pid == 1 {
			t.Fatalf("pid %d listed though kept", pid)
		}
	}
	found := false
	for _, pid := range userProcesses(map[int]bool{}) {
		found = found || pid == self
	}
	if !found {
		t.Fatal("this test's own process is not listed when nothing is kept")
	}
}

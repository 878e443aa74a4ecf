package aether

import (
	"context"
	"os"
	"strconv"
	"syscall"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// endProcessesWithin is how long EndProcesses waits for what it killed to
// be gone.
const endProcessesWithin = 10 * time.Second

// EndProcesses ends every process of the sandbox but the agent and what
// it runs under (PID 1 and the agent's parent, a VM's init), with SIGKILL
// as a power-off would, and answers once they are gone. Only an agent
// inside a sandbox does it: the fake backend's in-process agent shares
// its host's processes.
func (s *agentService) EndProcesses(ctx context.Context, req *connect.Request[agentv1.EndProcessesRequest]) (*connect.Response[agentv1.EndProcessesResponse], error) {
	if !s.a.cfg.ApplyIdentity {
		return nil, errdefs.FailedPrecondition("this agent does not run inside a sandbox: it ends no processes")
	}
	keep := map[int]bool{1: true, os.Getpid(): true, os.Getppid(): true}
	ended := map[int]bool{}
	deadline := time.Now().Add(endProcessesWithin)
	for {
		left := 0
		for _, pid := range userProcesses(keep) {
			left++
			if syscall.Kill(pid, syscall.SIGKILL) == nil {
				ended[pid] = true
			}
		}
		s.a.spawner.ReapOrphans()
		if left == 0 {
			return connect.NewResponse(&agentv1.EndProcessesResponse{Ended: uint32(len(ended))}), nil
		}
		if time.Now().After(deadline) {
			return nil, errdefs.Unavailable("%d processes still there %v after SIGKILL", left, endProcessesWithin)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// userProcesses is every process in /proc but those in keep and kernel
// threads (which have no command line), zombies included until reaped.
func userProcesses(keep map[int]bool) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || keep[pid] {
			continue
		}
		if cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline"); err != nil || len(cmd) == 0 {
			continue // gone, or a kernel thread (a VM's)
		}
		out = append(out, pid)
	}
	return out
}

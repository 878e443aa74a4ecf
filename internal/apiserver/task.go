package apiserver

import (
	"context"
	"sort"
	"sync"

	"connectrpc.com/connect"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/edge/v1/edgev1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxspec"
)

// Task-wide pause and resume [paper: a preempted job's sandboxes pause
// together]: every edge is asked at once for its sandboxes of the task in
// the caller's scope, and each edge pauses or resumes them in parallel.
// The answer lists every sandbox acted on; a node that could not be
// reached is a result of its own, named with the error, so nothing is
// silently left out.

func (h *sandboxService) PauseTask(ctx context.Context, req *connect.Request[sandboxv1.PauseTaskRequest]) (*connect.Response[sandboxv1.PauseTaskResponse], error) {
	m := req.Msg
	scope, err := h.taskScope(ctx, m.Task, m.Project)
	if err != nil {
		return nil, err
	}
	if _, ok := sandboxv1.PauseDepth_name[int32(m.Depth)]; !ok {
		return nil, errdefs.InvalidArgument("depth %d: want FREEZE, OFFLOAD or FILESYSTEM", m.Depth)
	}
	results := h.s.eachEdge(ctx, func(ctx context.Context, e edgev1connect.EdgeServiceClient) ([]*sandboxv1.TaskSandboxResult, error) {
		resp, err := e.PauseTask(ctx, connect.NewRequest(&edgev1.PauseTaskRequest{Task: m.Task, Scope: scope, Depth: m.Depth}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.Results, nil
	})
	out := &sandboxv1.PauseTaskResponse{Results: results}
	for _, r := range results {
		out.MemoryReleasedBytes += r.MemoryReleasedBytes
	}
	return connect.NewResponse(out), nil
}

func (h *sandboxService) ResumeTask(ctx context.Context, req *connect.Request[sandboxv1.ResumeTaskRequest]) (*connect.Response[sandboxv1.ResumeTaskResponse], error) {
	m := req.Msg
	scope, err := h.taskScope(ctx, m.Task, m.Project)
	if err != nil {
		return nil, err
	}
	results := h.s.eachEdge(ctx, func(ctx context.Context, e edgev1connect.EdgeServiceClient) ([]*sandboxv1.TaskSandboxResult, error) {
		resp, err := e.ResumeTask(ctx, connect.NewRequest(&edgev1.ResumeTaskRequest{Task: m.Task, Scope: scope}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.Results, nil
	})
	return connect.NewResponse(&sandboxv1.ResumeTaskResponse{Results: results}), nil
}

// taskScope checks a task-wide request and returns the project subtree
// it acts on.
func (h *sandboxService) taskScope(ctx context.Context, task, project string) (string, error) {
	if task == "" {
		return "", errdefs.InvalidArgument("task: required (the task label the sandboxes were created with)")
	}
	if err := sandboxspec.CheckTask(task); err != nil {
		return "", err
	}
	return actingProject(principalFrom(ctx), project)
}

// eachEdge runs call on every edge the watcher knows at once, healthy or
// not (one that does not answer is named, not skipped), and gathers their
// results, sorted by node and sandbox id; an edge that failed is one
// result carrying its error.
func (s *Server) eachEdge(ctx context.Context, call func(context.Context, edgev1connect.EdgeServiceClient) ([]*sandboxv1.TaskSandboxResult, error)) []*sandboxv1.TaskSandboxResult {
	var (
		mu  sync.Mutex
		out []*sandboxv1.TaskSandboxResult
	)
	s.onEveryEdge(func(node string, edge edgev1connect.EdgeServiceClient) {
		rs, err := call(ctx, edge)
		mu.Lock()
		defer mu.Unlock()
		if err != nil {
			code, msg := errdefs.ItemError(errdefs.OnNode(node, err))
			out = append(out, &sandboxv1.TaskSandboxResult{NodeId: node, ErrorCode: code, ErrorMessage: msg})
			return
		}
		out = append(out, rs...)
	})
	sort.Slice(out, func(i, j int) bool { return out[i].NodeId+"/"+out[i].SandboxId < out[j].NodeId+"/"+out[j].SandboxId })
	return out
}

// onEveryEdge calls call for every edge the watcher knows, healthy or
// not, all at once, and returns when each call has. node names the edge:
// its node id, or its address while it has not said its id.
func (s *Server) onEveryEdge(call func(node string, edge edgev1connect.EdgeServiceClient)) {
	var wg sync.WaitGroup
	for _, n := range s.watcher.View().Nodes {
		node := n.ID
		if node == "" {
			node = n.Addr
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			call(node, s.edges.Get(n.Addr).Edge)
		}()
	}
	wg.Wait()
}

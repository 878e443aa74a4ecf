package edge

import (
	"context"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// PauseOutcome is what a pause did.
type PauseOutcome struct {
	Sandbox *sandboxv1.Sandbox
	// Released is the memory given back to the node, as the sandbox's
	// cgroup counted it before.
	Released int64
	// Note says why the pause is shallower than asked.
	Note string
}

// PauseAt pauses a sandbox at depth.
func (e *Edge) PauseAt(ctx context.Context, id, scope string, depth sandboxv1.PauseDepth) (*PauseOutcome, error) {
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	began := time.Now()
	view, released, note, err := sb.PauseAt(ctx, depth)
	op := "pause"
	if depth == sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
		op = "offload"
	}
	e.prom.took(op, sb.Backend().Name(), began, err)
	if err != nil {
		return nil, err
	}
	return &PauseOutcome{Sandbox: view, Released: released, Note: note}, nil
}

// TaskResult is what a task-wide call did to one sandbox.
type TaskResult struct {
	ID       string
	Sandbox  *sandboxv1.Sandbox
	Err      error
	Released int64
	Note     string
	Took     time.Duration
}

// taskParallel bounds how many of a task's sandboxes this node pauses or
// resumes at once: a checkpoint or restore is CPU-bound.
func taskParallel(depth sandboxv1.PauseDepth) int {
	if depth == sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD {
		return 4
	}
	return 16
}

// PauseTask pauses every running (or, for offload, frozen) sandbox of
// task in scope, in parallel.
func (e *Edge) PauseTask(ctx context.Context, task, scope string, depth sandboxv1.PauseDepth) ([]TaskResult, error) {
	if task == "" {
		return nil, errdefs.InvalidArgument("task: required (the task label sandboxes were created with)")
	}
	return eachOfTask(e.reg.ofTask(task, scope), taskParallel(depth), func(sb *sandbox.Sandbox) (int64, string, error, bool) {
		return sb.PauseForTask(ctx, depth)
	}), nil
}

// ResumeTask resumes every paused sandbox of task in scope, in parallel.
func (e *Edge) ResumeTask(ctx context.Context, task, scope string) ([]TaskResult, error) {
	if task == "" {
		return nil, errdefs.InvalidArgument("task: required (the task label sandboxes were created with)")
	}
	return eachOfTask(e.reg.ofTask(task, scope), taskParallel(sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD), func(sb *sandbox.Sandbox) (int64, string, error, bool) {
		err, acted := sb.ResumeForTask(ctx)
		return 0, "", err, acted
	}), nil
}

// eachOfTask runs do on each of a task's sandboxes, parallel at most n
// at once; do says whether it acted. Sandboxes it left
// alone are not in the results.
func eachOfTask(sbs []*sandbox.Sandbox, n int, do func(*sandbox.Sandbox) (int64, string, error, bool)) []TaskResult {
	results := make([]TaskResult, len(sbs))
	acted := make([]bool, len(sbs))
	sem := make(chan struct{}, n)
	done := make(chan struct{})
	for i, sb := range sbs {
		go func() {
			defer func() { done <- struct{}{} }()
			sem <- struct{}{}
			defer func() { <-sem }()
			began := time.Now()
			released, note, err, did := do(sb)
			acted[i] = did
			results[i] = TaskResult{ID: string(sb.ID()), Sandbox: sb.View(), Err: err, Released: released, Note: note, Took: time.Since(began)}
		}()
	}
	for range sbs {
		<-done
	}
	var out []TaskResult
	for i, r := range results {
		if acted[i] {
			out = append(out, r)
		}
	}
	return out
}

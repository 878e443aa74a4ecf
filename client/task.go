package client

import (
	"context"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
)

// PauseTask pauses every running sandbox of task in the key's project
// subtree, on every node, at depth (FREEZE or OFFLOAD), and returns what
// happened to each; a sandbox that could not be paused carries its error
// and the others are paused anyway.
func (c *Client) PauseTask(ctx context.Context, task string, depth sandboxv1.PauseDepth) (*sandboxv1.PauseTaskResponse, error) {
	resp, err := c.Sandboxes.PauseTask(ctx, connect.NewRequest(&sandboxv1.PauseTaskRequest{Task: task, Depth: depth}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// ResumeTask resumes every paused sandbox of task. Resuming is optional:
// any call to a paused sandbox resumes it first.
func (c *Client) ResumeTask(ctx context.Context, task string) (*sandboxv1.ResumeTaskResponse, error) {
	resp, err := c.Sandboxes.ResumeTask(ctx, connect.NewRequest(&sandboxv1.ResumeTaskRequest{Task: task}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// Pause pauses the sandbox at depth.
func (s *Sandbox) Pause(ctx context.Context, depth sandboxv1.PauseDepth) (*sandboxv1.PauseSandboxResponse, error) {
	resp, err := s.c.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: s.ID, Depth: depth}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

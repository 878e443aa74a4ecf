package main

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
)

// pauseRow is one pause and resume, ours through the API against QMP's
// stop and cont on a bare restore of the same template: the pause until it
// answers, the resume until the guest's agent answers a command again.
type pauseRow struct{ pause, resume, barePause, bareResume time.Duration }

func pauseResume(ctx context.Context, cl *client.Client, q *microvm.QEMU, spec *sandboxv1.SandboxSpec, tpl string, n int) error {
	var rows []pauseRow
	sb, err := cl.Create(ctx, spec)
	if err != nil {
		return err
	}
	defer sb.Stop(ctx) //nolint:errcheck // measured
	bare, _, _, err := startBareCopy(ctx, q, tpl)
	if err != nil {
		return err
	}
	defer bare.end()
	agent := agentv1connect.NewProcessServiceClient(&http.Client{Transport: bare.link}, "http://agent")
	for range n {
		var r pauseRow
		t0 := time.Now()
		if _, err := cl.Sandboxes.PauseSandbox(ctx, connect.NewRequest(&sandboxv1.PauseSandboxRequest{SandboxId: sb.ID})); err != nil {
			return err
		}
		r.pause = time.Since(t0)
		t0 = time.Now()
		if _, err := cl.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: sb.ID})); err != nil {
			return err
		}
		if res, err := sb.Shell(ctx, "true"); err != nil || res.ExitCode != 0 {
			return fmt.Errorf("after a resume: %v %v", res, err)
		}
		r.resume = time.Since(t0)
		if r.barePause, err = bare.guest.Monitor(ctx, "stop"); err != nil {
			return err
		}
		t0 = time.Now()
		if _, err := bare.guest.Monitor(ctx, "cont"); err != nil {
			return err
		}
		if _, err := agent.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"/bin/sh", "-c", "true"}}})); err != nil {
			return fmt.Errorf("bare: after cont: %w", err)
		}
		r.bareResume = time.Since(t0)
		rows = append(rows, r)
	}
	pick := func(f func(pauseRow) time.Duration) time.Duration {
		d := make([]time.Duration, len(rows))
		for i, r := range rows {
			d[i] = f(r)
		}
		return median(d)
	}
	p, rs := pick(func(r pauseRow) time.Duration { return r.pause }), pick(func(r pauseRow) time.Duration { return r.resume })
	bp, br := pick(func(r pauseRow) time.Duration { return r.barePause }), pick(func(r pauseRow) time.Duration { return r.bareResume })
	fmt.Printf("\npause and resume, median of %d: %s pause %s against QMP stop %s (%.2fx); resume to a command's answer %s against QMP cont to the agent's %s (%.2fx)\n",
		n, target.name, benchstat.Ms(p, 1), benchstat.Ms(bp, 1), float64(p)/float64(bp), benchstat.Ms(rs, 1), benchstat.Ms(br, 1), float64(rs)/float64(br))
	return nil
}

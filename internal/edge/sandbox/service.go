package sandbox

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// The image's service [ours]: an image whose config names a start command
// (image.LabelStart) has it started in each new sandbox, and the create is
// answered once its ready command (image.LabelReady) exits 0, as E2B's
// templates do. Copies made by fork or restore carry the running service
// in their memory and skip this.

const (
	defaultReadyLimit = 60 * time.Second
	readyEvery        = 100 * time.Millisecond
	serviceTag        = "image-service"
)

// HasService says whether an image of these labels starts a service in
// each new sandbox.
func HasService(labels map[string]string) bool { return serviceLabels(labels) != nil }

// serviceLabels is the labels of the image's service, nil if it has none.
func serviceLabels(labels map[string]string) map[string]string {
	if labels[image.LabelStart] == "" {
		return nil
	}
	out := map[string]string{}
	for _, k := range []string{image.LabelStart, image.LabelStartUser, image.LabelReady, image.LabelReadyLimit} {
		if v, ok := labels[k]; ok {
			out[k] = v
		}
	}
	return out
}

// startService runs the image's start command and waits for its ready
// command. Callers hold sb.mu.
func (sb *Sandbox) startService(ctx context.Context, labels map[string]string) error {
	start := labels[image.LabelStart]
	if start == "" {
		return nil
	}
	limit := defaultReadyLimit
	if s := labels[image.LabelReadyLimit]; s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			return errdefs.InvalidArgument("image label %s=%q: a positive Go duration such as 60s is expected", image.LabelReadyLimit, s)
		}
		limit = d
	}
	user := labels[image.LabelStartUser]
	pc := agentv1connect.NewProcessServiceClient(&http.Client{Transport: sb.link}, "http://agent")
	// The start call only has to see the process start: the process stays
	// in the agent's table when the call ends.
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	stream, err := pc.Start(sctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{
		Args: []string{"/bin/sh", "-c", start}, User: user, Tag: serviceTag,
	}}))
	if err != nil {
		return fmt.Errorf("sandbox %s: start the image's service: %w", sb.id, errdefs.FromConnect(err))
	}
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if ev.GetStarted() != nil {
			break
		}
		if x := ev.GetExited(); x != nil {
			stream.Close()
			return errdefs.FailedPrecondition("sandbox %s: the image's service (%s) exited at once with code %d %s", sb.id, start, x.GetExitCode(), x.GetError())
		}
	}
	if err := stream.Err(); err != nil {
		stream.Close()
		return fmt.Errorf("sandbox %s: start the image's service: %w", sb.id, errdefs.FromConnect(err))
	}
	stream.Close()
	ready := labels[image.LabelReady]
	if ready == "" {
		return nil
	}
	deadline := time.Now().Add(limit)
	var last string
	for {
		res, err := pc.Run(ctxTimeout(ctx, 10*time.Second), connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{
			Args: []string{"/bin/sh", "-c", ready}, User: user, TimeoutMs: 5000,
		}, MaxOutputBytes: 4096}))
		switch {
		case err != nil:
			last = errdefs.FromConnect(err).Error()
		case res.Msg.GetExitCode() == 0:
			return nil
		default:
			last = fmt.Sprintf("exit code %d %s", res.Msg.GetExitCode(), strings.TrimSpace(string(res.Msg.GetStderr())))
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return errdefs.Unavailable("sandbox %s: the image's service did not become ready within %s (ready check %q: %s)", sb.id, limit, ready, last)
		}
		time.Sleep(readyEvery)
	}
}

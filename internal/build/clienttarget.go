package build

import (
	"context"
	"errors"
	"io"
	"strings"

	"connectrpc.com/connect"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// ClientTarget builds through a cluster's API with the Go client: each
// step's sandbox on Backend with Resources and Network (nil: none).
type ClientTarget struct {
	C         *client.Client
	Backend   string
	Resources *sandboxv1.Resources
	Network   *sandboxv1.NetworkPolicy
	// Progress shows pulls of a FROM image.
	Progress client.Progress
	// Credentials log in to the registry of a FROM image (nil: the
	// apiserver's own logins).
	Credentials *imagev1.RegistryCredentials
}

var _ Target = (*ClientTarget)(nil)

func (t *ClientTarget) Image(ctx context.Context, name string) (*imagev1.Image, error) {
	r, err := t.C.Images.GetImage(ctx, connect.NewRequest(&imagev1.GetImageRequest{Name: name}))
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	return r.Msg.Image, nil
}

func (t *ClientTarget) Pull(ctx context.Context, source, name string) (*imagev1.Image, error) {
	im, err := t.C.PullImage(ctx, source, name, t.Credentials, t.Progress)
	return im, errdefs.FromConnect(err)
}

func (t *ClientTarget) Tag(ctx context.Context, source, name string) (*imagev1.Image, error) {
	r, err := t.C.Images.TagImage(ctx, connect.NewRequest(&imagev1.TagImageRequest{Source: source, Name: name}))
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	return r.Msg.Image, nil
}

func (t *ClientTarget) Start(ctx context.Context, image string) (Box, error) {
	sb, err := t.C.Create(ctx, &sandboxv1.SandboxSpec{Backend: t.Backend, Image: image, Resources: t.Resources, Network: t.Network, TimeoutSeconds: 3600, Metadata: map[string]string{"opendsec.build": "1"}})
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	return &clientBox{c: t.C, sb: sb}, nil
}

type clientBox struct {
	c  *client.Client
	sb *client.Sandbox
}

func (b *clientBox) Run(ctx context.Context, args, env []string, cwd, user string, out io.Writer) (int, error) {
	envMap := map[string]string{}
	for _, kv := range env {
		if k, v, ok := strings.Cut(kv, "="); ok {
			envMap[k] = v
		}
	}
	stream, err := b.sb.Process.Start(ctx, connect.NewRequest(&agentv1.StartRequest{Process: &agentv1.ProcessConfig{Args: args, Env: envMap, Cwd: cwd, User: user}}))
	if err != nil {
		return 0, errdefs.FromConnect(err)
	}
	defer stream.Close()
	for stream.Receive() {
		ev := stream.Msg().GetEvent()
		if o := ev.GetOutput(); o != nil {
			out.Write(o.Data) //nolint:errcheck // the log's reader went away; the step goes on
		}
		if x := ev.GetExited(); x != nil {
			if x.Error != "" {
				return 0, errors.New(x.Error)
			}
			return int(x.ExitCode), nil
		}
	}
	if err := stream.Err(); err != nil {
		return 0, errdefs.FromConnect(err)
	}
	return 0, errors.New("the process stream ended without its exit")
}

func (b *clientBox) MakeDir(ctx context.Context, path, user string) error {
	_, err := b.sb.Files.MakeDir(ctx, connect.NewRequest(&agentv1.MakeDirRequest{Path: path, User: user}))
	return errdefs.FromConnect(err)
}

// writeChunk is what one WriteFile call carries (the agent takes 16 MiB).
const writeChunk = 8 << 20

func (b *clientBox) WriteFile(ctx context.Context, path string, r io.Reader, perm uint32, user string) error {
	buf := make([]byte, writeChunk)
	mode := agentv1.WriteMode_WRITE_MODE_UNSPECIFIED
	for first := true; ; first = false {
		n, rerr := io.ReadFull(r, buf)
		if n > 0 || first {
			_, err := b.sb.Files.WriteFile(ctx, connect.NewRequest(&agentv1.WriteFileRequest{Path: path, Data: buf[:n], Mode: mode, Perm: perm, User: user}))
			if err != nil {
				return errdefs.FromConnect(err)
			}
			mode = agentv1.WriteMode_WRITE_MODE_APPEND
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			return nil
		}
		if rerr != nil {
			return rerr
		}
	}
}

func (b *clientBox) Commit(ctx context.Context, name string, cfg *imagev1.ImageConfig) (*imagev1.Image, error) {
	r, err := b.c.Sandboxes.CommitSandbox(ctx, connect.NewRequest(&sandboxv1.CommitSandboxRequest{SandboxId: b.sb.ID, Name: name, Config: cfg}))
	if err != nil {
		return nil, errdefs.FromConnect(err)
	}
	return r.Msg.Image, nil
}

func (b *clientBox) Stop(ctx context.Context) error { return b.sb.Stop(ctx) }

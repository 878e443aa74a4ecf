package client

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
)

// Progress receives a long operation's progress: stage names what is being
// done (a layer), total is 0 when unknown.
type Progress func(stage string, done, total int64)

// PullImage copies an image from an OCI registry (source, e.g.
// "registry.example.com/team/app:1.0") into the store as name
// ("project/name:tag"; empty: the source's last path part and tag in the
// key's project). creds may be nil: the apiserver's own logins for that
// registry, else anonymous.
func (c *Client) PullImage(ctx context.Context, source, name string, creds *imagev1.RegistryCredentials, progress Progress) (*imagev1.Image, error) {
	stream, err := c.Images.PullImage(ctx, connect.NewRequest(&imagev1.PullImageRequest{Source: source, Name: name, Credentials: creds}))
	if err != nil {
		return nil, err
	}
	defer stream.Close()
	for stream.Receive() {
		m := stream.Msg()
		if p := m.Progress; p != nil && progress != nil {
			progress(p.Stage, p.Done, p.Total)
		}
		if m.Image != nil {
			return m.Image, nil
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return nil, errors.New("pull: the apiserver ended the stream without the image")
}

// PushImage uploads the stored image name to an OCI registry (destination
// with a tag) and returns the pushed manifest's digest.
func (c *Client) PushImage(ctx context.Context, name, destination string, creds *imagev1.RegistryCredentials, progress Progress) (string, error) {
	stream, err := c.Images.PushImage(ctx, connect.NewRequest(&imagev1.PushImageRequest{Name: name, Destination: destination, Credentials: creds}))
	if err != nil {
		return "", err
	}
	defer stream.Close()
	for stream.Receive() {
		m := stream.Msg()
		if p := m.Progress; p != nil && progress != nil {
			progress(p.Stage, p.Done, p.Total)
		}
		if m.Digest != "" {
			return m.Digest, nil
		}
	}
	if err := stream.Err(); err != nil {
		return "", err
	}
	return "", errors.New("push: the apiserver ended the stream without a digest")
}

// Commit turns what the sandbox changed in its image into one new layer
// over that image, named name ("project/name:tag") in the image store
// (pack_diff), leaving out paths exclude matches ("/root/.cache",
// "__pycache__", "*.pyc"). A running sandbox pauses while its layer is
// read.
func (s *Sandbox) Commit(ctx context.Context, name string, exclude ...string) (*imagev1.Image, error) {
	resp, err := s.c.Sandboxes.CommitSandbox(ctx, connect.NewRequest(&sandboxv1.CommitSandboxRequest{SandboxId: s.ID, Name: name, Exclude: exclude}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Image, nil
}

// WarmImage has every node prepare for the first sandbox of image on
// backend with resources (nil: a create's defaults), with a network
// interface if network: the microvm backend builds its template snapshot
// there, so that even a node's first create of it restores instead of
// booting. It returns each node's answer; a node's failure is in its
// Error. Root admin keys only.
func (c *Client) WarmImage(ctx context.Context, image, backend string, resources *sandboxv1.Resources, network bool) ([]*imagev1.NodeWarmth, error) {
	req := &imagev1.WarmImageRequest{Name: image, Backend: backend, Network: network}
	if resources != nil {
		req.CpuCores, req.MemoryMb, req.DiskMb = resources.CpuCores, resources.MemoryMb, resources.DiskMb
	}
	resp, err := c.Images.WarmImage(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Nodes, nil
}

// SetPool sets a warm pool on every node, one that joins later too (the
// cluster keeps the setting): size sandboxes of image on
// backend with resources (nil: a create's defaults), with a network
// interface if network, kept started for creates of that image and shape
// to claim (a networked one gets the create's policy then); size 0
// removes it. It returns each node's pools after the change; a node's
// failure is in its Error. Root admin keys only.
func (c *Client) SetPool(ctx context.Context, image, backend string, resources *sandboxv1.Resources, network bool, size int) ([]*imagev1.NodePools, error) {
	req := &imagev1.SetPoolRequest{Name: image, Backend: backend, Network: network, Size: int32(size)}
	if r := resources; r != nil {
		req.CpuCores, req.MemoryMb, req.DiskMb, req.Pids, req.OpenFiles = r.CpuCores, r.MemoryMb, r.DiskMb, r.Pids, r.OpenFiles
	}
	resp, err := c.Images.SetPool(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Nodes, nil
}

// ListPools is every node's warm pools, with how many are ready. Root
// admin keys only.
func (c *Client) ListPools(ctx context.Context) ([]*imagev1.NodePools, error) {
	resp, err := c.Images.ListPools(ctx, connect.NewRequest(&imagev1.ListPoolsRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Nodes, nil
}

// ClusterPools are the pools the cluster keeps (set through SetPool), as
// every node takes them, beside what ListPools says of each node.
func (c *Client) ClusterPools(ctx context.Context) ([]*imagev1.Pool, error) {
	resp, err := c.Images.ListPools(ctx, connect.NewRequest(&imagev1.ListPoolsRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.Cluster, nil
}

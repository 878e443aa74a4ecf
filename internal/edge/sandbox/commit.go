package sandbox

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	"github.com/opendsec/opendsec/api/gen/opendsec/agent/v1/agentv1connect"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/logging"
)

// CommitExcluded are left out of every commit: what the node puts into a
// sandbox (the agent's mount point and run directories, its hosts,
// hostname, resolver and machine id) and the kernel's mount points.
var CommitExcluded = []string{"/.dsec", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/etc/machine-id", "/proc", "/sys", "/dev", "/run/opendsec-*"}

// Commit turns what sb changed in its image (its writable layer) into one
// new layer over that image and names the result ref in store [paper:
// pack_diff]: created, changed and deleted files (whiteouts), opaque
// directories, links, modes and owners, less what exclude matches. A
// running sandbox is paused while its layer is read and then resumes; a
// paused one stays paused. The image keeps its base's config (ENV,
// WORKDIR, its service) unless config gives it another.
func (sb *Sandbox) Commit(ctx context.Context, store *image.Store, ref image.Ref, exclude []string, config func(base ocispec.ImageConfig) ocispec.ImageConfig) (*image.Image, error) {
	ex, err := image.ParseExclude(append(append([]string(nil), CommitExcluded...), exclude...))
	if err != nil {
		return nil, err
	}
	cr, ok := sb.be.(backend.ChangeReader)
	if !ok {
		return nil, errdefs.Unsupported("backend %q cannot commit sandboxes: its writable layer is not readable on the node", sb.be.Name())
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	switch sb.rec.State {
	case records.StateRunning, records.StatePaused:
	default:
		return nil, errdefs.FailedPrecondition("sandbox %s is %s; only a running or paused sandbox can be committed", sb.id, sb.rec.State)
	}
	wasRunning := sb.rec.State == records.StateRunning
	base, err := store.Load(digest.Digest(sb.rec.ImageDigest))
	if err != nil {
		return nil, errdefs.FailedPrecondition("sandbox %s: its image %s (%s) is no longer in the store: %v", sb.id, sb.rec.Spec.Image, sb.rec.ImageDigest, err)
	}
	switch caps := sb.be.Capabilities(); {
	case caps.ChangesWhileRunning:
		wasRunning = false // nothing to resume: the backend stops and resumes its tasks
	case caps.DiskFile:
		// The guest writes its disk through its own page cache: it syncs,
		// running, before the pause.
		if err := sb.resumeLocked(ctx); err != nil {
			return nil, err
		}
		if err := sb.syncGuest(ctx); err != nil {
			return nil, err
		}
		fallthrough
	default:
		if err := sb.freeze(ctx); err != nil {
			return nil, err
		}
	}
	if wasRunning {
		defer func() {
			if err := sb.resumeLocked(context.WithoutCancel(ctx)); err != nil {
				sb.log.Warn("resume after a commit", logging.Error, err)
			}
		}()
	}
	began := time.Now()
	upper, release, err := cr.OpenChanges(ctx, &backend.Spec{ID: sb.id, Dir: sb.dir, LayerDir: sb.rec.LayerDir})
	if err != nil {
		return nil, err
	}
	layer, perr := store.PackChanges(upper, ex, nil)
	if rerr := release(); rerr != nil {
		sb.log.Warn("release the writable layer after a commit", logging.Error, rerr)
	}
	if perr != nil {
		return nil, fmt.Errorf("sandbox %s: pack its changes: %w", sb.id, perr)
	}
	cfg := base.Config.Config
	if config != nil {
		cfg = config(cfg)
	}
	im, err := store.Commit(ref, base, []image.Layer{layer}, cfg)
	if err != nil {
		return nil, err
	}
	sb.log.Info("sandbox committed", logging.Image, ref.String(), "digest", im.Digest.String(), "layer_bytes", layer.Desc.Size, "took", time.Since(began).Round(time.Millisecond))
	return im, nil
}

// syncGuest has the sandbox's kernel write its file systems out (a VM's
// writable disk is read on the node while it is paused). Callers hold
// sb.mu.
func (sb *Sandbox) syncGuest(ctx context.Context) error {
	if sb.link == nil {
		return errdefs.FailedPrecondition("sandbox %s: no agent link to sync its disks through", sb.id)
	}
	pc := agentv1connect.NewProcessServiceClient(&http.Client{Transport: sb.link}, "http://agent")
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	r, err := pc.Run(ctx, connect.NewRequest(&agentv1.RunRequest{Process: &agentv1.ProcessConfig{Args: []string{"sync"}}}))
	if err != nil {
		return fmt.Errorf("sandbox %s: sync its disks before the commit: %w", sb.id, errdefs.FromConnect(err))
	}
	if r.Msg.ExitCode != 0 {
		return errors.New("sandbox " + string(sb.id) + ": `sync` in the sandbox failed (the image needs a sync program, as coreutils and busybox have): " + errdefs.Clip(string(r.Msg.Stderr), 200))
	}
	return nil
}

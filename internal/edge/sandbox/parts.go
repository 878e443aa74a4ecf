package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/layerfs"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/project"
)

// Parts is what a node starts its sandboxes from: its images and their
// unpacked layers, the writable layers of DiskLayer backends, and the
// agent staged in the run base. A sandbox reaches them through its
// environment; they are set at the edge's start and not changed after.
type Parts struct {
	Store *image.Store
	Cache *image.Cache
	// Layers makes the writable layers of DiskLayer backends; nil when no
	// backend needs them.
	Layers *layerfs.FS
	// Agent is the agent as staged in the run base from AgentSource;
	// Restage stages it again (if it went) and returns where.
	Agent, AgentSource string
	// AgentVersion is what the agent says it is (`aether --version`);
	// empty if it would not say.
	AgentVersion string
	Restage      func() (string, error)
	// LinkRefusals counts the agent connections the sandboxes' links
	// refused (the edge's metrics); nil: not counted.
	LinkRefusals *agentlink.Refusals
}

// Resolve checks an image's name and finds it for project.
func (p *Parts) Resolve(name, proj string) (*image.Image, error) {
	ref, err := image.ParseRef(name)
	if err != nil {
		return nil, err
	}
	// Images belong to a project and serve it and every project below it.
	if !project.Within(proj, ref.Project) {
		return nil, errdefs.PermissionDenied("image %q: belongs to project %q, not visible to project %q", name, ref.Project, proj)
	}
	return p.Store.Resolve(ref)
}

// snapshotLayers finds the image layers a snapshot was taken on, by
// digest: the name may have moved since.
func (p *Parts) snapshotLayers(ctx context.Context, snap *snapshots.Snapshot) ([]string, ocispec.ImageConfig, error) {
	layers, cfg, moved, err := p.layersAt(ctx, snap.SandboxSpec.Image, snap.ImageDigest)
	if moved {
		return nil, cfg, errdefs.FailedPrecondition("snapshot %s: image %s no longer has digest %s", snap.ID, snap.SandboxSpec.Image, snap.ImageDigest)
	}
	return layers, cfg, err
}

// recordLayers finds the image layers of a sandbox that is brought back
// (recovery, a restore in place), by digest; none if the name moved on
// (the sandbox keeps running on the layers it has).
func (p *Parts) recordLayers(ctx context.Context, rec *records.Record) ([]string, ocispec.ImageConfig, error) {
	layers, cfg, _, err := p.layersAt(ctx, rec.Spec.Image, rec.ImageDigest)
	return layers, cfg, err
}

// layersAt finds the unpacked layers of the image called name, if it
// still has digest; moved says it does not (or is gone).
func (p *Parts) layersAt(ctx context.Context, name, digest string) (layers []string, cfg ocispec.ImageConfig, moved bool, err error) {
	ref, err := image.ParseRef(name)
	if err != nil {
		return nil, cfg, false, err
	}
	im, err := p.Store.Resolve(ref)
	if err != nil || im.Digest.String() != digest {
		return nil, cfg, true, nil
	}
	layers, err = p.Cache.Layers(ctx, im, nil)
	return layers, im.Config.Config, false, err
}

// RemoveLayer removes a writable layer the node made.
func (p *Parts) RemoveLayer(dir string) error {
	if dir == "" || p.Layers == nil {
		return nil
	}
	return p.Layers.Remove(dir)
}

// ensureAgentStaged stages the agent again if its staged copy is gone (an
// edge of another version on this node pruned it, or someone cleaned the
// run base).
func (p *Parts) ensureAgentStaged() error {
	if fi, err := os.Stat(p.Agent); err == nil && fi.Mode().IsRegular() {
		return nil
	}
	staged, err := p.Restage()
	if err != nil {
		return fmt.Errorf("stage the agent again: %w", err)
	}
	// The path names the agent's digest; creates run concurrently and
	// read p.Agent, so it never changes after start.
	if staged != p.Agent {
		return fmt.Errorf("the agent at %s changed since the edge started (staged %s, now %s): restart the edge", p.AgentSource, p.Agent, staged)
	}
	return nil
}

// backendSpec builds what the backend needs to run the sandbox of rec,
// whose directory is dir and run directory runDir.
func (p *Parts) backendSpec(rec *records.Record, dir, runDir string, layers []string, cfg ocispec.ImageConfig) *backend.Spec {
	env := append([]string(nil), cfg.Env...)
	keys := make([]string, 0, len(rec.Spec.Env))
	for k := range rec.Spec.Env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, k+"="+rec.Spec.Env[k])
	}
	env = append(env, "DSEC_SANDBOX_ID="+string(rec.ID))
	if cfg.User != "" {
		// The agent takes it out of the environment: the user processes
		// that name none run as (the image's USER).
		env = append(env, agentlink.ImageUserEnv+"="+cfg.User)
	}
	r := rec.Spec.Resources
	return &backend.Spec{
		ID: rec.ID, Dir: dir, Layers: layers, Env: env, WorkDir: cfg.WorkingDir, Hostname: string(rec.ID),
		Resources: backend.Resources{CPUCores: r.CpuCores, MemoryMB: r.MemoryMb, Pids: r.Pids, DiskMB: r.DiskMb, NoFile: r.OpenFiles},
		AgentPath: p.Agent, RunDir: runDir,
		HostsFile: filepath.Join(runDir, "hosts"), ResolvConf: filepath.Join(runDir, "resolv.conf"),
		LayerDir: rec.LayerDir, Devices: rec.Spec.Devices,
	}
}

// Warm prepares the node for the first sandbox of rec's image im and
// shape on w (backend.Warmer). rec is a sandbox's record that is never
// created: its spec is normalized, its id names no directory.
func (p *Parts) Warm(ctx context.Context, w backend.Warmer, rec *records.Record, im *image.Image) (bool, error) {
	if err := p.ensureAgentStaged(); err != nil {
		return false, err
	}
	layers, err := p.Cache.Layers(ctx, im, nil)
	if err != nil {
		return false, fmt.Errorf("image %s: %w", rec.Spec.Image, err)
	}
	return w.Warm(ctx, p.backendSpec(rec, "", "", layers, im.Config.Config), rec.Spec.Network != nil)
}

package edge

import (
	"context"
	"fmt"
	"path/filepath"
	"sort"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/layerfs"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/snapshots"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/project"
)

// parts is what the node starts its sandboxes from: its images and their
// unpacked layers, the writable layers of DiskLayer backends, and the
// agent staged in the run base. A sandbox reaches them through its
// environment; they are set at the edge's start and not changed after.
type parts struct {
	store *image.Store
	cache *image.Cache
	// layers makes the writable layers of DiskLayer backends; nil when no
	// backend needs them.
	layers *layerfs.FS
	// agent is the agent as staged in the run base (runbase.go), staged
	// again from agentSource if it goes.
	agent, agentSource, runBase string
}

// resolve checks an image's name and finds it for project.
func (p *parts) resolve(name, proj string) (*image.Image, error) {
	ref, err := image.ParseRef(name)
	if err != nil {
		return nil, err
	}
	// Images belong to a project and serve it and every project below it.
	if !project.Within(proj, ref.Project) {
		return nil, errdefs.PermissionDenied("image %q: belongs to project %q, not visible to project %q", name, ref.Project, proj)
	}
	return p.store.Resolve(ref)
}

// snapshotLayers finds the image layers a snapshot was taken on, by
// digest: the name may have moved since.
func (p *parts) snapshotLayers(ctx context.Context, snap *snapshots.Snapshot) ([]string, ocispec.ImageConfig, error) {
	ref, err := image.ParseRef(snap.SandboxSpec.Image)
	if err != nil {
		return nil, ocispec.ImageConfig{}, err
	}
	im, err := p.store.Resolve(ref)
	if err != nil || im.Digest.String() != snap.ImageDigest {
		return nil, ocispec.ImageConfig{}, errdefs.FailedPrecondition("snapshot %s: image %s no longer has digest %s", snap.ID, snap.SandboxSpec.Image, snap.ImageDigest)
	}
	layers, err := p.cache.Layers(ctx, im, nil)
	return layers, im.Config.Config, err
}

// recordLayers finds the image layers of a sandbox that is brought back
// (recovery, a restore in place), by digest; none if the name moved on
// (the sandbox keeps running on the layers it has).
func (p *parts) recordLayers(ctx context.Context, rec *records.Record) ([]string, ocispec.ImageConfig, error) {
	ref, err := image.ParseRef(rec.Spec.Image)
	if err != nil {
		return nil, ocispec.ImageConfig{}, err
	}
	im, err := p.store.Resolve(ref)
	if err != nil || im.Digest.String() != rec.ImageDigest {
		return nil, ocispec.ImageConfig{}, nil
	}
	layers, err := p.cache.Layers(ctx, im, nil)
	return layers, im.Config.Config, err
}

// removeLayer removes a writable layer the node made.
func (p *parts) removeLayer(dir string) error {
	if dir == "" || p.layers == nil {
		return nil
	}
	return p.layers.Remove(dir)
}

// ensureAgentStaged stages the agent again if its staged copy is gone (an
// edge of another version on this node pruned it, or someone cleaned the
// run base).
func (p *parts) ensureAgentStaged() error {
	if fileExists(p.agent) {
		return nil
	}
	staged, err := stageAgentOrMakeRoom(p.agentSource, p.runBase)
	if err != nil {
		return fmt.Errorf("stage the agent again: %w", err)
	}
	// The path names the agent's digest; creates run concurrently and
	// read p.agent, so it never changes after start.
	if staged != p.agent {
		return fmt.Errorf("the agent at %s changed since the edge started (staged %s, now %s): restart the edge", p.agentSource, p.agent, staged)
	}
	return nil
}

// backendSpec builds what the backend needs to run the sandbox of rec,
// whose directory is dir and run directory runDir.
func (p *parts) backendSpec(rec *records.Record, dir, runDir string, layers []string, cfg ocispec.ImageConfig) *backend.Spec {
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
	r := rec.Spec.Resources
	return &backend.Spec{
		ID: rec.ID, Dir: dir, Layers: layers, Env: env, Hostname: string(rec.ID),
		Resources: backend.Resources{CPUCores: r.CpuCores, MemoryMB: r.MemoryMb, Pids: r.Pids, DiskMB: r.DiskMb, NoFile: r.OpenFiles},
		AgentPath: p.agent, RunDir: runDir,
		HostsFile: filepath.Join(runDir, "hosts"), ResolvConf: filepath.Join(runDir, "resolv.conf"),
		LayerDir: rec.LayerDir,
	}
}

package edge

import (
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/atomicfile"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
)

// Pools set through the API [ours; issue 28]. SetPool replaces or removes
// the pool of one image and shape (its identity: project, image name,
// backend and resources); the node writes every such setting to
// pools.json in its state directory and applies them over its flags' at
// each start, so a pool set (or removed) through the API stays so across
// restarts. A smaller or removed pool's extra ready sandboxes go at the
// loop's next pass; a bigger one fills into the room the node's own
// sandboxes leave.

// poolsFile holds the API's pool settings in the edge's state directory.
const poolsFile = "pools.json"

// savedPool is one API setting in poolsFile.
type savedPool struct {
	Project    string          `json:"project"`
	Size       int             `json:"size"`
	Spec       json.RawMessage `json:"spec"` // a SandboxSpec, protojson
	Generation int64           `json:"generation,omitempty"`
}

// identity is what makes two settings the same pool: its project, and
// its pool key with the image's name as written in place of the digest
// the name resolves to.
func (w *poolWant) identity() string {
	return w.Project + "|" + poolKey(w.Spec, w.Spec.Image)
}

// rebuildLocked makes wants from the flags' pools and the overrides,
// keeping the entry (and its retry state) of a pool whose setting did not
// change. Callers hold p.mu.
func (p *pools) rebuildLocked() {
	old := map[string]*poolWant{}
	for _, w := range p.wants {
		old[w.identity()] = w
	}
	var wants []*poolWant
	keep := func(w *poolWant) {
		if o := old[w.identity()]; o != nil && o.Size == w.Size && o.source == w.source {
			w = o
		}
		wants = append(wants, w)
	}
	seen := map[string]bool{}
	for _, w := range p.flags {
		id := w.identity()
		seen[id] = true
		if o, ok := p.overrides[id]; ok {
			if o.Size > 0 {
				keep(o)
			}
			continue
		}
		keep(w)
	}
	ids := make([]string, 0, len(p.overrides))
	for id := range p.overrides {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		if o := p.overrides[id]; !seen[id] && o.Size > 0 {
			keep(o)
		}
	}
	p.wants = wants
}

// skipped is why w does not fill ("": it does).
func (p *pools) skipped(w *poolWant) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return w.skipped
}

// set replaces or (size 0) removes the pool of c's image and shape, keeps
// the setting, and wakes the loop, which starts or removes sandboxes.
func (p *pools) set(c Pool) error {
	if c.Size < 0 || c.Size > maxPoolSize {
		return errdefs.InvalidArgument("size %d: want 0 (remove the pool) to %d", c.Size, maxPoolSize)
	}
	w, err := p.normalize(c, "api")
	if err != nil {
		return err
	}
	if w.Size > 0 { // a pool is removed also when its image is gone
		if _, _, err := w.resolve(p.e); err != nil {
			return err
		}
	}
	if p.draining.Load() {
		return errdefs.Unavailable("the node's pools are being drained")
	}
	p.mu.Lock()
	id := w.identity()
	prev, had := p.overrides[id]
	if had && w.Generation != 0 && prev.Generation > w.Generation {
		// The cluster set this pool again since: a late or stale push.
		p.mu.Unlock()
		p.e.log.Info("pool setting older than the node's ignored", logging.Image, w.Spec.Image, "size", w.Size, "generation", w.Generation, "holds", prev.Generation)
		return nil
	}
	p.overrides[id] = w
	if w.Size == 0 && !p.hasFlagLocked(id) && w.Generation == 0 {
		// Nothing to hide: no entry, so a flag's pool added later is not
		// hidden by this removal. (A versioned removal stays, size 0, so
		// that an older setting pushed late does not bring the pool back.)
		delete(p.overrides, id)
	}
	if err := p.saveOverridesLocked(); err != nil {
		if had {
			p.overrides[id] = prev
		} else {
			delete(p.overrides, id)
		}
		p.mu.Unlock()
		return fmt.Errorf("keep the pool's setting: %w", err)
	}
	p.rebuildLocked()
	p.mu.Unlock()
	p.e.log.Info("pool set", logging.Image, w.Spec.Image, "backend", w.Spec.Backend, "project", w.Project, "size", w.Size)
	p.poke()
	return nil
}

// hasFlagLocked reports whether a flag's pool has identity id. Callers
// hold p.mu.
func (p *pools) hasFlagLocked(id string) bool {
	for _, f := range p.flags {
		if f.identity() == id {
			return true
		}
	}
	return false
}

// list is the pools wanted now, with how many of each are ready.
func (p *pools) list() []*imagev1.Pool {
	wants := p.wantsNow()
	keys := make([]string, len(wants))
	unresolved := make([]string, len(wants))
	for i, w := range wants {
		if _, key, err := w.resolve(p.e); err == nil {
			keys[i] = key
		} else {
			unresolved[i] = "its image does not resolve: " + errdefs.Clip(err.Error(), 300)
		}
	}
	sharers := map[string][]string{} // pool key → the images of the pools of it
	for i, w := range wants {
		if keys[i] != "" {
			sharers[keys[i]] = append(sharers[keys[i]], w.Spec.Image)
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*imagev1.Pool, 0, len(wants))
	for i, w := range wants {
		r := w.Spec.Resources
		note := cmp.Or(unresolved[i], w.skipped)
		if note == "" && w.lastErr != "" {
			note = "its last start failed: " + errdefs.Clip(w.lastErr, 300)
		}
		if s := sharers[keys[i]]; note == "" && len(s) > 1 {
			// READY counts the sandboxes they share, not its own.
			note = "shares its sandboxes with the pools of " + strings.Join(others(s, w.Spec.Image), ", ") + " (one digest, one shape)"
		}
		out = append(out, &imagev1.Pool{Image: w.Spec.Image, Project: w.Project, Backend: w.Spec.Backend, CpuCores: r.CpuCores, MemoryMb: r.MemoryMb, DiskMb: r.DiskMb, Pids: r.Pids, OpenFiles: r.OpenFiles, Network: w.Spec.Network != nil,
			Size: int32(w.Size), Ready: int32(len(p.ready[keys[i]])), Source: w.source, Note: note})
	}
	return out
}

// loadOverrides reads the API's pool settings the node kept.
func (p *pools) loadOverrides() (map[string]*poolWant, error) {
	out := map[string]*poolWant{}
	data, err := os.ReadFile(filepath.Join(p.e.cfg.StateDir, poolsFile))
	if errors.Is(err, os.ErrNotExist) {
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("pools: %w", err)
	}
	var saved []savedPool
	if err := json.Unmarshal(data, &saved); err != nil {
		return nil, fmt.Errorf("pools: %s: %w", poolsFile, err)
	}
	for i, s := range saved {
		spec := &sandboxv1.SandboxSpec{}
		if err := protojson.Unmarshal(s.Spec, spec); err != nil {
			return nil, fmt.Errorf("pools: %s, setting %d: %w", poolsFile, i+1, err)
		}
		if s.Size < 0 || s.Size > maxPoolSize {
			return nil, fmt.Errorf("pools: %s, setting %d: size %d: want 0 to %d", poolsFile, i+1, s.Size, maxPoolSize)
		}
		w, err := p.normalize(Pool{Spec: spec, Project: s.Project, Size: s.Size, Generation: s.Generation}, "api")
		if err != nil {
			// A backend or limit of the node changed since: the setting
			// stays in the file (written back with the others) and is
			// said, not applied.
			p.e.log.Warn("a pool set through the API is not applied", logging.Image, spec.Image, logging.Error, err)
			p.unloadable = append(p.unloadable, s)
			continue
		}
		out[w.identity()] = w
	}
	return out, nil
}

// saveOverridesLocked writes the API's pool settings. Callers hold p.mu.
func (p *pools) saveOverridesLocked() error {
	ids := make([]string, 0, len(p.overrides))
	for id := range p.overrides {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	saved := make([]savedPool, 0, len(ids)+len(p.unloadable))
	saved = append(saved, p.unloadable...)
	for _, id := range ids {
		w := p.overrides[id]
		spec, err := protojson.Marshal(w.Spec)
		if err != nil {
			return err
		}
		saved = append(saved, savedPool{Project: w.Project, Size: w.Size, Spec: spec, Generation: w.Generation})
	}
	data, err := json.MarshalIndent(saved, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(filepath.Join(p.e.cfg.StateDir, poolsFile), data, 0o600)
}

// SetPool sets the node's warm pool of spec's image and shape to size
// sandboxes (0 removes it), resolving the image in project's view, and
// keeps the setting; it answers the node's pools after the change.
func (e *Edge) SetPool(spec *sandboxv1.SandboxSpec, project string, size int) ([]*imagev1.Pool, error) {
	return e.SetClusterPool(spec, project, size, 0)
}

// SetClusterPool is SetPool of the cluster's setting of that generation
// (poolset.go's Pool.Generation): one older than the node holds for the
// same pool is ignored, and the node's pools are answered as they are.
func (e *Edge) SetClusterPool(spec *sandboxv1.SandboxSpec, project string, size int, generation int64) ([]*imagev1.Pool, error) {
	if spec == nil {
		return nil, errdefs.InvalidArgument("spec: missing")
	}
	if spec.Network != nil && e.net == nil && size > 0 {
		return nil, errdefs.FailedPrecondition("spec.network: node %s runs without sandbox networking (%s); set the pool without a network", e.node, e.netOff)
	}
	if err := e.pools.set(Pool{Spec: spec, Project: project, Size: size, Generation: generation}); err != nil {
		return nil, err
	}
	// The loop's next pass starts or removes sandboxes: the answer has
	// the new size and the ready count of before.
	return e.pools.list(), nil
}

// ListPools is the node's warm pools and how many of each are ready.
func (e *Edge) ListPools() []*imagev1.Pool { return e.pools.list() }

// others is list without one occurrence of self.
func others(list []string, self string) []string {
	out := make([]string, 0, len(list))
	skipped := false
	for _, s := range list {
		if s == self && !skipped {
			skipped = true
			continue
		}
		out = append(out, s)
	}
	return out
}

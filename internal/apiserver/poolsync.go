package apiserver

import (
	"context"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/iam/fsm"
	"github.com/opendsec/opendsec/internal/watcher"
)

// Cluster-wide warm pools [ours; docs/design.md, "Warm pools"]. SetPool
// keeps each setting in IAM (fsm.PoolSetting) before it pushes it to the
// nodes it reaches. Every Config.PoolSyncEvery each apiserver compares the
// healthy nodes' pools set through the API with the kept settings and
// pushes what differs: a node that joined later, was away or lost its
// state directory takes the pool, and one that missed a removal drops it.
// A setting younger than three passes is left to the call that set it
// (its push may be in flight, or this replica may not hold a newer one
// yet), so that an apiserver does not push an older size over a newer one.

// DefaultPoolSyncEvery is how often an apiserver brings the nodes' pools
// to the kept settings.
const DefaultPoolSyncEvery = 10 * time.Second

// poolSettle is how old a setting must be for the reconciler to push it.
func (s *Server) poolSettle() time.Duration { return 3 * s.cfg.PoolSyncEvery }

// poolSync is what the reconciler remembers between passes, so that a
// node's refusal is logged once and not pushed again and again.
type poolSync struct {
	mu sync.Mutex
	// refused is the last error a node gave for a setting, by node and
	// key; unmatched the settings a node took but lists otherwise (its
	// limits normalise the shape differently), by the setting's time.
	refused   map[string]string
	unmatched map[string]time.Time
}

// poolIdentity names a pool as the kept settings and the nodes' listings
// both describe it.
func poolIdentity(project, image, backend string, r *sandboxv1.Resources, network bool) string {
	return fmt.Sprintf("%s|%s|%s|cpu=%g|mem=%d|disk=%d|pids=%d|files=%d|net=%t", project, image, backend,
		r.GetCpuCores(), r.GetMemoryMb(), r.GetDiskMb(), r.GetPids(), r.GetOpenFiles(), network)
}

func settingKey(project string, spec *sandboxv1.SandboxSpec) string {
	return poolIdentity(project, spec.Image, spec.Backend, spec.Resources, spec.Network != nil)
}

func listedKey(p *imagev1.Pool) string {
	return poolIdentity(p.Project, p.Image, p.Backend, &sandboxv1.Resources{CpuCores: p.CpuCores, MemoryMb: p.MemoryMb, DiskMb: p.DiskMb, Pids: p.Pids, OpenFiles: p.OpenFiles}, p.Network)
}

// settingSpec is a kept setting's sandbox spec.
func settingSpec(st fsm.PoolSetting) (*sandboxv1.SandboxSpec, error) {
	spec := &sandboxv1.SandboxSpec{}
	return spec, protojson.Unmarshal(st.Spec, spec)
}

// keepPool keeps a normalised pool setting (size 0: its removal) in IAM,
// and answers its generation: when it was set, which nodes keep with it
// so that an older setting pushed late does not undo it.
func (s *Server) keepPool(ctx context.Context, project string, spec *sandboxv1.SandboxSpec, size int32) (int64, error) {
	data, err := protojson.Marshal(spec)
	if err != nil {
		return 0, err
	}
	at := time.Now().UTC()
	key := settingKey(project, spec)
	for _, st := range s.iam.State().Pools() {
		if st.Key == key && !at.After(st.At) {
			// Another apiserver's clock ran ahead: this setting is the
			// newer one all the same.
			at = st.At.Add(time.Microsecond)
		}
	}
	return at.UnixNano(), s.iam.SetPool(ctx, fsm.PoolSetting{Key: key, Project: project, Spec: data, Size: size, At: at})
}

// keptPoolNamed finds the kept pool a removal names, when its spec did
// not normalise (nerr) or normalised to no kept pool: the one of the
// project, image, backend and network whose shape has every field the
// call gave. It answers nil when none is kept, and an error when several
// are and the call does not say which.
func (s *Server) keptPoolNamed(project string, m *imagev1.SetPoolRequest, normalised *sandboxv1.SandboxSpec, nerr error) (*sandboxv1.SandboxSpec, error) {
	settings := s.iam.State().Pools()
	if nerr == nil {
		key := settingKey(project, normalised)
		for _, st := range settings {
			if st.Key == key {
				return nil, nil // the normalised spec names it
			}
		}
	}
	var found []*sandboxv1.SandboxSpec
	for _, st := range settings {
		if st.Size == 0 || st.Project != project {
			continue
		}
		spec, err := settingSpec(st)
		if err != nil {
			continue
		}
		r := spec.GetResources()
		given := func(want, have float64) bool { return want == 0 || want == have }
		if spec.Image == m.Name && (m.Backend == "" || m.Backend == spec.Backend) && m.Network == (spec.Network != nil) &&
			given(m.CpuCores, r.GetCpuCores()) && given(float64(m.MemoryMb), float64(r.GetMemoryMb())) && given(float64(m.DiskMb), float64(r.GetDiskMb())) &&
			given(float64(m.Pids), float64(r.GetPids())) && given(float64(m.OpenFiles), float64(r.GetOpenFiles())) {
			found = append(found, spec)
		}
	}
	switch {
	case len(found) == 1:
		return found[0], nil
	case len(found) > 1:
		return nil, errdefs.InvalidArgument("the cluster keeps %d pools of %s that match: give the shape of the one to remove (--backend, --cpu, --memory, --disk, --pids, --open-files)", len(found), m.Name)
	}
	return nil, nil
}

// clusterPools are the kept settings that are not removals, as listed.
func (s *Server) clusterPools() []*imagev1.Pool {
	var out []*imagev1.Pool
	for _, st := range s.iam.State().Pools() {
		if st.Size == 0 {
			continue
		}
		spec, err := settingSpec(st)
		if err != nil {
			continue
		}
		r := spec.GetResources()
		out = append(out, &imagev1.Pool{Image: spec.Image, Project: st.Project, Backend: spec.Backend, CpuCores: r.GetCpuCores(), MemoryMb: r.GetMemoryMb(), DiskMb: r.GetDiskMb(),
			Pids: r.GetPids(), OpenFiles: r.GetOpenFiles(), Network: spec.Network != nil, Size: st.Size, Source: "cluster"})
	}
	return out
}

// syncPools brings every healthy node's pools to the kept settings.
func (s *Server) syncPools(ctx context.Context, now time.Time) {
	settings := s.iam.State().Pools()
	if len(settings) == 0 {
		return
	}
	var wg sync.WaitGroup
	for _, n := range s.watcher.View().Healthy() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.syncPoolsOn(ctx, n, settings, now)
		}()
	}
	wg.Wait()
}

func (s *Server) syncPoolsOn(ctx context.Context, n *watcher.NodeView, settings []fsm.PoolSetting, now time.Time) {
	edge := s.edges.Get(n.Addr).Edge
	lctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := edge.ListPools(lctx, connect.NewRequest(&edgev1.ListPoolsRequest{}))
	if err != nil {
		return // the watcher and the next pass see to a node that does not answer
	}
	have := map[string]int32{} // the node's pools set through the API
	for _, p := range resp.Msg.Pools {
		if p.Source == "api" {
			have[listedKey(p)] = p.Size
		}
	}
	for _, st := range settings {
		size, listed := have[st.Key]
		if now.Sub(st.At) < s.poolSettle() || (st.Size == 0 && !listed) || (st.Size > 0 && listed && size == st.Size) {
			continue
		}
		k := n.ID + " " + st.Key
		s.pools.mu.Lock()
		skip := s.pools.unmatched[k].Equal(st.At)
		s.pools.mu.Unlock()
		if skip {
			continue
		}
		spec, err := settingSpec(st)
		if err != nil {
			s.noteRefusal(n.ID, st, fmt.Errorf("its kept spec does not parse: %w", err))
			continue
		}
		r, err := edge.SetPool(lctx, connect.NewRequest(&edgev1.SetPoolRequest{Spec: spec, Project: st.Project, Size: st.Size, Generation: st.At.UnixNano()}))
		if err != nil {
			s.noteRefusal(n.ID, st, err)
			continue
		}
		s.noteRefusal(n.ID, st, nil)
		s.log.Info("pool brought to the cluster's setting", "node", n.ID, "image", spec.Image, "backend", spec.Backend, "size", st.Size, "had", size)
		if st.Size > 0 && !listsPool(r.Msg.Pools, st) {
			s.pools.mu.Lock()
			s.pools.unmatched[k] = st.At
			s.pools.mu.Unlock()
			// Its normalisation gave another shape, or it holds a newer
			// setting than this replica does yet.
			s.log.Warn("a node took a pool setting but lists the pool otherwise: not pushed again until the setting changes", "node", n.ID, "pool", st.Key)
		}
	}
}

// listsPool reports whether pools holds st's pool at st's size.
func listsPool(pools []*imagev1.Pool, st fsm.PoolSetting) bool {
	for _, p := range pools {
		if p.Source == "api" && listedKey(p) == st.Key && p.Size == st.Size {
			return true
		}
	}
	return false
}

// noteRefusal logs a node's refusal of a setting when it is new, and
// forgets it (err nil) once the node takes the setting.
func (s *Server) noteRefusal(node string, st fsm.PoolSetting, err error) {
	k := node + " " + st.Key
	s.pools.mu.Lock()
	defer s.pools.mu.Unlock()
	if err == nil {
		delete(s.pools.refused, k)
		return
	}
	msg := errdefs.Clip(err.Error(), 300)
	if s.pools.refused[k] != msg {
		s.pools.refused[k] = msg
		s.log.Warn("a node refused the cluster's pool setting; trying again each pass", "pool", st.Key, "size", st.Size, "node", node, "err", msg)
	}
}

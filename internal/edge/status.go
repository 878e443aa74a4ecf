package edge

import (
	"sort"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/capacity"
	"github.com/opendsec/opendsec/internal/version"
)

// Status reports capacity, backends and usage per project, task and backend.
func (e *Edge) Status() *edgev1.NodeStatus {
	c := e.cfg.Capacity
	st := &edgev1.NodeStatus{
		NodeId:   string(e.node),
		Capacity: &edgev1.Usage{Sandboxes: c.MaxSandboxes, CpuCores: c.CPUCores, MemoryMb: c.MemoryMB},
		Version:  version.Version,
		Host:     &edgev1.Usage{CpuCores: c.HostCPUCores, MemoryMb: c.HostMemoryMB},
		Cgroup:   e.cgroup,
	}
	for name, b := range e.backends.usable {
		caps := b.Capabilities()
		bs := &edgev1.BackendStatus{Name: name, CanPause: caps.Pause, CanSnapshot: caps.Snapshot, Isolation: caps.Isolation}
		if d, ok := b.(backend.Describer); ok {
			bs.Detail = d.Describe()
		}
		st.Backends = append(st.Backends, bs)
	}
	for name, why := range e.backends.unavailable {
		st.Backends = append(st.Backends, &edgev1.BackendStatus{Name: name, UnavailableReason: why})
	}
	sort.Slice(st.Backends, func(i, j int) bool { return st.Backends[i].Name < st.Backends[j].Name })
	type key = groupKey
	groups := map[key]*capacity.Usage{}
	boxes, stamp := e.reg.stamped()
	st.Usage = stamp
	for _, sb := range boxes {
		v := sb.View()
		if v.State == sandboxv1.SandboxState_SANDBOX_STATE_FAILED && sb.Released() {
			continue // holds nothing: not counted against node or quota
		}
		k := key{Project: v.Project, Task: v.Spec.Task, Backend: v.Spec.Backend}
		if groups[k] == nil {
			groups[k] = &capacity.Usage{}
		}
		groups[k].Add(v.Spec.Resources.CpuCores, v.Spec.Resources.MemoryMb, 1)
	}
	var total capacity.Usage
	used := e.usage.totals()
	for k, u := range groups {
		g := used[k]
		delete(used, k)
		st.Groups = append(st.Groups, &edgev1.GroupUsage{Project: k.Project, Task: k.Task, Backend: k.Backend, Usage: u.Proto(), CpuSeconds: g.CPUSeconds, MemoryGbSeconds: g.MemoryGBSeconds})
		total.Sandboxes += u.Sandboxes
		total.CPU += u.CPU
		total.MemoryMB += u.MemoryMB
	}
	for k, g := range used { // groups that hold nothing now
		st.Groups = append(st.Groups, &edgev1.GroupUsage{Project: k.Project, Task: k.Task, Backend: k.Backend, Usage: &edgev1.Usage{}, CpuSeconds: g.CPUSeconds, MemoryGbSeconds: g.MemoryGBSeconds})
	}
	sort.Slice(st.Groups, func(i, j int) bool {
		a, b := st.Groups[i], st.Groups[j]
		if a.Project != b.Project {
			return a.Project < b.Project
		}
		if a.Task != b.Task {
			return a.Task < b.Task
		}
		return a.Backend < b.Backend
	})
	st.Allocated = total.Proto()
	return st
}

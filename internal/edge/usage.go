package edge

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/opendsec/opendsec/internal/atomicfile"
	"github.com/opendsec/opendsec/internal/edge/sandbox"
)

// usageFile keeps what the node's sandboxes used, by group, across
// restarts of the edge (the state directory's).
const usageFile = "usage.json"

// groupKey is what usage is accounted by: a project, a task of it, a
// backend.
type groupKey struct {
	Project string `json:"project"`
	Task    string `json:"task,omitempty"`
	Backend string `json:"backend"`
}

// groupUse is what a group's sandboxes used on this node.
type groupUse struct {
	CPUSeconds      float64 `json:"cpu_seconds"`
	MemoryGBSeconds float64 `json:"memory_gb_seconds"`
}

// usageMeter adds up what sandboxes use, by group, and keeps the totals
// in a file of the state directory, rewritten at each sample that added
// something: an edge killed loses at most one sample (5 s) of them.
type usageMeter struct {
	path string
	mu   sync.Mutex
	use  map[groupKey]groupUse
}

// usageRecord is usageFile's content.
type usageRecord struct {
	Groups []struct {
		groupKey
		groupUse
	} `json:"groups"`
}

// openUsageMeter reads the totals kept in dir, if any. A file that cannot
// be read is an error: starting from zero would lose what it held.
func openUsageMeter(dir string) (*usageMeter, error) {
	m := &usageMeter{path: filepath.Join(dir, usageFile), use: map[groupKey]groupUse{}}
	data, err := os.ReadFile(m.path)
	if errors.Is(err, fs.ErrNotExist) {
		return m, nil
	}
	if err != nil {
		return nil, err
	}
	var rec usageRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, fmt.Errorf("%s: %w (move it away to start the node's usage from zero)", m.path, err)
	}
	for _, g := range rec.Groups {
		m.use[g.groupKey] = g.groupUse
	}
	return m, nil
}

// add takes one round of samples and saves the totals if they grew.
func (m *usageMeter) add(uses []sandbox.Use) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	grew := false
	for _, u := range uses {
		if u.CPUSeconds <= 0 && u.MemoryGBSeconds <= 0 {
			continue
		}
		k := groupKey{u.Project, u.Task, u.Backend}
		if _, known := m.use[k]; !known && len(m.use) >= maxUsageGroups {
			k.Task = otherTasks // bounded: a tenant that names a task per sandbox
		}
		g := m.use[k]
		g.CPUSeconds += max(u.CPUSeconds, 0)
		g.MemoryGBSeconds += max(u.MemoryGBSeconds, 0)
		m.use[k] = g
		grew = true
	}
	if !grew {
		return nil
	}
	var rec usageRecord
	for k, g := range m.use {
		rec.Groups = append(rec.Groups, struct {
			groupKey
			groupUse
		}{k, g})
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return atomicfile.Write(m.path, data, 0o600)
}

// maxUsageGroups bounds the (project, task, backend) groups a node keeps
// totals of (and exports as metric series); use of further tasks is added
// to its project's otherTasks group.
const maxUsageGroups = 1000

// otherTasks is the task of the use of tasks past maxUsageGroups, and of
// the sandboxes gauge's tasks past maxTaskLabels.
const otherTasks = "(other)"

// totals is a copy of the totals by group.
func (m *usageMeter) totals() map[groupKey]groupUse {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[groupKey]groupUse, len(m.use))
	for k, g := range m.use {
		out[k] = g
	}
	return out
}

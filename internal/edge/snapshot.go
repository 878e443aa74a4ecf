package edge

import "github.com/opendsec/opendsec/internal/sandboxid"

// snapshot is a memory snapshot held by this node.
type snapshot struct {
	id sandboxid.SnapshotID
}

// loadSnapshots finds the snapshots a previous run left.
func (e *Edge) loadSnapshots() {}

package edge

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// recover re-attaches the sandboxes a previous run of the edge left: running
// and paused ones get their agent link back; half-created or half-removed
// ones are removed.
func (e *Edge) recover(ctx context.Context) {
	root := e.dirs.sandboxes()
	ents, err := os.ReadDir(root)
	if err != nil {
		e.log.Error("read sandbox directory", logging.Error, err)
		e.recoveryIncomplete = true
		return
	}
	for _, ent := range ents {
		dir := filepath.Join(root, ent.Name())
		if !ent.IsDir() {
			e.dirs.removeOrphan(dir, errors.New("not a sandbox's directory"), e.log)
			continue
		}
		rec, err := e.records.Get(sandboxid.ID(ent.Name()))
		if errors.Is(err, fs.ErrNotExist) {
			e.dirs.removeOrphan(dir, err, e.log)
			continue
		}
		if err != nil {
			// A newer release's layout (a node downgraded), or a record
			// changed by hand: kept, with all it names, for the release
			// that reads it; nothing running is taken for an orphan.
			e.log.Error("could not read a sandbox's record; it is kept, and nothing is swept while it is there", "dir", dir, logging.Error, err)
			e.recoveryIncomplete = true
			continue
		}
		log := e.log.With(logging.SandboxID, rec.ID)
		if err := e.recoverOne(ctx, rec); err != nil {
			log.Error("could not re-attach sandbox; it is kept for inspection and its removal will be retried", logging.Error, err)
			continue
		}
		log.Info("re-attached sandbox after edge restart", "state", rec.State)
	}
}

func (e *Edge) recoverOne(ctx context.Context, rec *records.Record) error {
	if _, node, err := sandboxid.Parse(string(rec.ID)); err != nil || node != e.node {
		return errdefs.FailedPrecondition("record of %s does not belong to node %s", rec.ID, e.node)
	}
	name := rec.Spec.Backend
	if rec.Handle != nil {
		name = rec.Handle.Backend
	}
	be, ok := e.backends.usable[name]
	if !ok {
		return errdefs.FailedPrecondition("backend %q is not available on this node any more", name)
	}
	if rec.Project == poolProject {
		return e.pools.adopt(ctx, rec, be)
	}
	sb := e.newSandbox(rec, be)
	r := rec.Spec.Resources
	// A failed sandbox holds nothing once its backend has nothing of it;
	// one whose removal failed before the restart is retried here, and
	// stays counted if that fails again.
	gone := false
	if rec.State == records.StateFailed {
		err := be.Destroy(ctx, rec.ID)
		if err == nil {
			err = e.parts.RemoveLayer(rec.LayerDir)
		}
		if err != nil {
			e.log.Error("remove what a failed sandbox left", logging.SandboxID, rec.ID, logging.Error, err)
		} else {
			gone = true
			sb.MarkReleased()
		}
	}
	e.reg.adopt(sb, !gone, e.diskOf(be, r))
	if rec.State == records.StateFailed {
		return nil
	}

	return sb.Reattach(ctx, &e.wg)
}

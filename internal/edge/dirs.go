package edge

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/layerfs"
	"github.com/opendsec/opendsec/internal/edge/records"
	"github.com/opendsec/opendsec/internal/edge/rootfs"
	"github.com/opendsec/opendsec/internal/logging"
	"github.com/opendsec/opendsec/internal/sandboxid"
)

// nodeDirs is where a node keeps its sandboxes: each has a directory
// under the state directory (its record, a VM's disk, checkpoints) and a
// run directory under the run base (its agent's socket, hosts and
// resolv.conf, mounted at /.dsec/run in it).
type nodeDirs struct {
	stateDir, runBase string
	node              sandboxid.NodeID
}

// sandboxes is the directory of the sandboxes' directories.
func (d nodeDirs) sandboxes() string { return filepath.Join(d.stateDir, "sandboxes") }

// runs is the directory of the sandboxes' run directories.
func (d nodeDirs) runs() string { return filepath.Join(d.runBase, string(d.node)) }

func (d nodeDirs) sandbox(id sandboxid.ID) string { return filepath.Join(d.sandboxes(), string(id)) }

func (d nodeDirs) run(id sandboxid.ID) string { return filepath.Join(d.runs(), string(id)) }

// maxSocketPath is the longest path a Unix socket can be bound at.
const maxSocketPath = 107

// sweepRuns removes run directories of sandboxes that have no directory
// of their own any more (a crash during a removal).
func (d nodeDirs) sweepRuns(log *slog.Logger) {
	ents, _ := os.ReadDir(d.runs())
	for _, ent := range ents {
		if _, err := os.Stat(d.sandbox(sandboxid.ID(ent.Name()))); errors.Is(err, fs.ErrNotExist) {
			log.Warn("removing the run directory of a sandbox that is gone", "dir", filepath.Join(d.runs(), ent.Name()))
			os.RemoveAll(filepath.Join(d.runs(), ent.Name())) //nolint:errcheck // best effort
		}
	}
}

// removeOrphan deletes a sandbox directory without a readable record, and
// its run directory, unless something is still mounted in it.
func (d nodeDirs) removeOrphan(dir string, why error, log *slog.Logger) {
	if errors.Is(why, fs.ErrNotExist) {
		why = errors.New("no record")
	}
	if mounts, _ := rootfs.MountsUnder(dir); len(mounts) > 0 {
		for _, m := range mounts {
			rootfs.Unmount(m) //nolint:errcheck // checked again below
		}
		if still, _ := rootfs.MountsUnder(dir); len(still) > 0 {
			log.Error("orphan sandbox directory is still mounted; left in place", "dir", dir, "mounts", still)
			return
		}
	}
	log.Warn("removing orphan sandbox directory", "dir", dir, "why", why)
	os.RemoveAll(dir)
	os.RemoveAll(filepath.Join(d.runs(), filepath.Base(dir)))
}

// sweepBackends destroys what backends with an Inventory find running of
// sandboxes this node has no record of (known says which it has): a
// create or a fork's copy a crash cut before its record, or a record
// removed before its processes ended.
func (d nodeDirs) sweepBackends(ctx context.Context, backends map[string]backend.Backend, known func(sandboxid.ID) bool, log *slog.Logger) {
	for _, be := range backends {
		inv, ok := be.(backend.Inventory)
		if !ok {
			continue
		}
		ids, err := inv.Found(ctx, d.node)
		if err != nil {
			log.Warn("list what the backend runs", logging.Backend, be.Name(), logging.Error, err)
			continue
		}
		for _, id := range ids {
			if _, err := os.Stat(d.sandbox(id)); known(id) || !errors.Is(err, fs.ErrNotExist) {
				continue // recorded (a record recovery could not read stays for inspection), or unsure
			}
			log.Warn("removing what a sandbox with no record left running", logging.SandboxID, id, logging.Backend, be.Name())
			if err := be.Destroy(ctx, id); err != nil {
				log.Error("remove an orphan sandbox's processes", logging.SandboxID, id, logging.Error, err)
			}
		}
	}
}

// sweepLayers removes writable layers that no record names: a crash came
// between making one and recording it, or the record is gone.
func sweepLayers(layers *layerfs.FS, recs records.Store, log *slog.Logger) {
	if layers == nil {
		return
	}
	all, unreadable := recs.List()
	if len(unreadable) > 0 {
		log.Warn("not removing writable layers no record names: a record could not be read", "records", len(unreadable))
		return
	}
	named := map[string]bool{}
	for _, rec := range all {
		if rec.LayerDir != "" {
			named[rec.LayerDir] = true
		}
	}
	for _, l := range layers.Layers() {
		if named[l] {
			continue
		}
		log.Warn("removing a writable layer no sandbox owns", "layer", l)
		if err := layers.Remove(l); err != nil {
			log.Error("remove an orphan writable layer", "layer", l, logging.Error, err)
		}
	}
}

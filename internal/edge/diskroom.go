package edge

import (
	"sync"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// The state disk [ours]. A writable layer is a sparse image (layerfs): its
// blocks are taken as its sandbox writes. If the file system holding the
// images fills, a write inside a sandbox that had room in its own layer
// fails when the kernel writes it back, after the call reported success,
// and the data is lost. So the edge admits a layer only while the disk has
// room for every admitted layer to be written in full, and it writes a
// snapshot or an offload only into the room that leaves.

// Defaults of what the layers' file system keeps free beyond the layers'
// promise: 2 % of its size, within these bounds.
const (
	minKeepFreeMB = 64
	maxKeepFreeMB = 1024
)

// diskRoom is where layers live and what their file system keeps free.
type diskRoom struct {
	dir      string
	dev      uint64
	keepFree int64 // bytes
	// overcommit > 1 is the operator's choice to admit more than the disk
	// holds (Config.DiskOvercommit); then budgetMB bounds the limits' sum
	// and the room check is off.
	overcommit float64
	budgetMB   int64
}

func newDiskRoom(dir string, overcommit float64, keepFreeMB int64) (diskRoom, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return diskRoom{}, err
	}
	var fi unix.Stat_t
	if err := unix.Stat(dir, &fi); err != nil {
		return diskRoom{}, err
	}
	if keepFreeMB <= 0 {
		keepFreeMB = min(max(int64(st.Blocks)*st.Bsize>>20/50, minKeepFreeMB), maxKeepFreeMB)
	}
	if overcommit <= 0 {
		overcommit = 1
	}
	return diskRoom{
		dir: dir, dev: fi.Dev, keepFree: keepFreeMB << 20, overcommit: overcommit,
		budgetMB: int64(float64(int64(st.Bavail)*st.Bsize>>20) * overcommit),
	}, nil
}

// admitLayerLocked reserves room for a layer of sizeMB, or says why there
// is none. Callers hold e.mu.
func (e *Edge) admitLayerLocked(sizeMB int64) error {
	d := e.disk
	if d.overcommit > 1 {
		if e.diskMB+sizeMB > d.budgetMB {
			return errdefs.ResourceExhausted("node full: disk limits of %d of %d MiB admitted (%g × the free space), %d asked", e.diskMB, d.budgetMB, d.overcommit, sizeMB)
		}
		return nil
	}
	free, promised, err := e.diskPromisedLocked(d.dir, sizeMB)
	if err != nil {
		return errdefs.Unavailable("writable layers: cannot read the free space of %s: %v", d.dir, err)
	}
	if free-promised-d.keepFree < sizeMB<<20 {
		return errdefs.ResourceExhausted("node disk full: a writable layer of %d MiB (disk_mb) asked; %s has %d MiB free, %d MiB of it promised to the layers of this node's sandboxes and %d MiB kept free; ask for a smaller disk_mb or free space on the node",
			sizeMB, d.dir, free>>20, promised>>20, d.keepFree>>20)
	}
	return nil
}

// diskPromisedLocked returns the free bytes of dir's file system and, if
// it holds the layers, what they may still write. extraMB is about to be
// added: when even every admitted layer written in full leaves room for
// it, the layers are not looked at (one statfs per admission in the common
// case). Callers hold e.mu.
func (e *Edge) diskPromisedLocked(dir string, extraMB int64) (free, promised int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, err
	}
	free = int64(st.Bavail) * st.Bsize
	if dir != e.disk.dir {
		var fi unix.Stat_t
		if err := unix.Stat(dir, &fi); err != nil {
			return 0, 0, err
		}
		if fi.Dev != e.disk.dev {
			return free, 0, nil
		}
	}
	admitted := e.diskMB << 20
	if free-admitted-e.diskPending-e.disk.keepFree >= extraMB<<20 || e.layers == nil {
		return free, admitted + e.diskPending, nil
	}
	unwritten, sizes := e.layers.Promised()
	// Admitted layers not made yet, and VMs' disks (not counted by the
	// layers), owe their whole size; snapshots being written, theirs.
	return free, unwritten + max(admitted-sizes, 0) + e.diskPending, nil
}

// reserveDiskFor holds room on dir's file system for need bytes of new
// state (a snapshot, an offload) without eating into what the layers are
// promised, until release is called once it is written: two writes at
// once do not both count on the same free space.
func (e *Edge) reserveDiskFor(dir string, need int64, what string) (release func(), err error) {
	if e.disk.overcommit > 1 {
		return func() {}, nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	free, promised, err := e.diskPromisedLocked(dir, need>>20+1)
	if err != nil {
		return nil, errdefs.Unavailable("%s: cannot read the free space of %s: %v", what, dir, err)
	}
	if free-promised-e.disk.keepFree < need {
		return nil, errdefs.ResourceExhausted("node disk full: %s needs about %d MiB; %s has %d MiB free, %d MiB of it promised to this node's sandboxes' disks and writes in progress, and %d MiB kept free",
			what, need>>20, dir, free>>20, promised>>20, e.disk.keepFree>>20)
	}
	e.diskPending += need
	var once sync.Once
	return func() {
		once.Do(func() {
			e.mu.Lock()
			e.diskPending -= need
			e.mu.Unlock()
		})
	}, nil
}

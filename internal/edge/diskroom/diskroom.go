// Package diskroom is a node's state disk as its edge admits work onto
// it: the writable layers' promise, what the file system keeps free,
// snapshots and offloads being written, and (with a disk ledger) what
// other edges on the same disk promised.
package diskroom

import (
	"fmt"
	"log/slog"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/diskledger"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/logging"
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

// Room is where layers live, what their file system keeps free, and
// what this edge promised of it. Its lock is its own and is taken last: no
// lock of the edge is taken under it (only the disk ledger's, which other
// edges share).
type Room struct {
	dir      string
	dev      uint64
	keepFree int64 // bytes
	// overcommit > 1 is the operator's choice to admit more than the disk
	// holds (Config.DiskOvercommit); then budgetMB bounds the limits' sum
	// and the room check is off.
	overcommit float64
	budgetMB   int64
	// layers says what the writable layers may still write; nil without
	// layers.
	layers interface {
		Promised() (unwritten, sizes int64)
	}
	// ledger holds this edge's promise of the disk's free space beside
	// other edges' on it; nil without Config.DiskLedgerDir.
	ledger *diskledger.Ledger
	log    *slog.Logger

	mu         sync.Mutex
	admittedMB int64 // guarded by mu; disk limits admitted on dir
	// pending is what snapshots and offloads being written hold of the
	// disk (reserve), in bytes.
	pending int64 // guarded by mu
}

// New is the room of dir's file system: keepFreeMB kept free (0: 2 % of
// it, 64 MiB to 1 GiB), and overcommit > 1 to admit disk limits of that
// many times the free space without the room check.
func New(dir string, overcommit float64, keepFreeMB int64, log *slog.Logger) (*Room, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return nil, err
	}
	var fi unix.Stat_t
	if err := unix.Stat(dir, &fi); err != nil {
		return nil, err
	}
	if keepFreeMB <= 0 {
		keepFreeMB = min(max(int64(st.Blocks)*st.Bsize>>20/50, minKeepFreeMB), maxKeepFreeMB)
	}
	if overcommit <= 0 {
		overcommit = 1
	}
	return &Room{
		dir: dir, dev: fi.Dev, keepFree: keepFreeMB << 20, overcommit: overcommit,
		budgetMB: int64(float64(int64(st.Bavail)*st.Bsize>>20) * overcommit), log: log,
	}, nil
}

// Admit counts a sandbox's disk limit of sizeMB on the disk, or says why
// there is no room for it.
func (d *Room) Admit(sizeMB int64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if sizeMB <= 0 {
		return nil
	}
	if d.overcommit > 1 {
		if d.admittedMB+sizeMB > d.budgetMB {
			return errdefs.ResourceExhausted("node full: disk limits of %d of %d MiB admitted (%g × the free space), %d asked", d.admittedMB, d.budgetMB, d.overcommit, sizeMB)
		}
		d.admittedMB += sizeMB
		return nil
	}
	err := d.raiseLocked(d.dir, sizeMB<<20, func(free, promised, others int64, err error) error {
		if err != nil {
			return errdefs.Unavailable("writable layers: cannot read the free space of %s: %v", d.dir, err)
		}
		return errdefs.ResourceExhausted("node disk full: a writable layer of %d MiB (disk_mb) asked; %s has %d MiB free, %d MiB of it promised to the layers of this node's sandboxes%s and %d MiB kept free; ask for a smaller disk_mb or free space on the node",
			sizeMB, d.dir, free>>20, promised>>20, othersPhrase(others), d.keepFree>>20)
	})
	if err == nil {
		d.admittedMB += sizeMB
	}
	return err
}

// Count counts a disk limit admitted before (a recovered sandbox's), or,
// negative, one given back (then Publish lowers the ledger's promise).
func (d *Room) Count(sizeMB int64) {
	d.mu.Lock()
	d.admittedMB += sizeMB
	d.mu.Unlock()
}

func othersPhrase(others int64) string {
	if others == 0 {
		return ""
	}
	return fmt.Sprintf(", %d MiB to other edges' sandboxes on this disk,", others>>20)
}

// raiseLocked checks that dir's file system has need bytes beyond what
// is promised (this edge's sandboxes' disks and writes in progress, and,
// on the layers' file system, what the other edges sharing it promised:
// the disk ledger) and what it keeps free, and promises them in the
// ledger; else it returns refuse's error. Callers hold d.mu, and count
// need in admittedMB or pending once it returns nil.
func (d *Room) raiseLocked(dir string, need int64, refuse func(free, promised, others int64, err error) error) error {
	var refused error
	onLayers := d.holds(dir)
	check := func(others int64) (int64, error) {
		free, promised, err := d.promisedLocked(dir, onLayers, need, others)
		if err != nil {
			refused = refuse(0, 0, others, err)
		} else if free-promised-others-d.keepFree < need {
			refused = refuse(free, promised, others, nil)
		}
		return promised + need, refused
	}
	if d.ledger == nil || !onLayers {
		_, err := check(0)
		return err
	}
	if err := d.ledger.Raise(check); err != nil && refused == nil {
		// The ledger itself failed (its directory, its lock): the edge
		// cannot know what others promised, so it promises nothing more.
		return errdefs.Unavailable("disk ledger %s: %v", d.ledger.Dir(), err)
	}
	return refused
}

// holds tells whether dir is on the file system of the layers.
func (d *Room) holds(dir string) bool {
	if dir == d.dir {
		return true
	}
	var fi unix.Stat_t
	return unix.Stat(dir, &fi) == nil && fi.Dev == d.dev
}

// promisedLocked returns the free bytes of dir's file system and, if
// it holds the layers (onLayers), what they may still write. extra bytes are about to
// be added: when even every admitted layer written in full leaves room for
// them beside others' promise, the layers are not looked at (one statfs
// per admission in the common case). Callers hold d.mu.
func (d *Room) promisedLocked(dir string, onLayers bool, extra, others int64) (free, promised int64, err error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return 0, 0, err
	}
	free = int64(st.Bavail) * st.Bsize
	if !onLayers {
		return free, 0, nil
	}
	admitted := d.admittedMB << 20
	if free-admitted-d.pending-others-d.keepFree >= extra || d.layers == nil {
		return free, admitted + d.pending, nil
	}
	return free, d.promisedExactlyLocked(d.layers.Promised()), nil
}

// promisedExactlyLocked is what this edge's sandboxes may still write to
// the layers' file system, given what its layers may still write and
// their sizes: admitted layers not made yet, and VMs' disks (not counted
// by the layers), owe their whole size; snapshots being written, theirs.
// Callers hold d.mu.
func (d *Room) promisedExactlyLocked(unwritten, sizes int64) int64 {
	return unwritten + max(d.admittedMB<<20-sizes, 0) + d.pending
}

// Publish lowers this edge's promise in the disk ledger to what its
// sandboxes may still write (a raise promises a layer or a snapshot in
// full; the layers' writes and removals lower it). Called on the metrics
// tick and when a sandbox gives its disk back.
func (d *Room) Publish() {
	if d.ledger == nil {
		return
	}
	var unwritten, sizes int64
	if d.layers != nil {
		unwritten, sizes = d.layers.Promised()
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := d.ledger.Set(d.promisedExactlyLocked(unwritten, sizes)); err != nil {
		d.log.Warn("record this edge's disk promise in the ledger", logging.Error, err)
	}
}

// Reserve holds room on dir's file system for need bytes of new
// state (a snapshot, an offload) without eating into what the layers are
// promised, until release is called once it is written: two writes at
// once do not both count on the same free space.
func (d *Room) Reserve(dir string, need int64, what string) (release func(), err error) {
	if d.overcommit > 1 {
		return func() {}, nil
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	err = d.raiseLocked(dir, need, func(free, promised, others int64, err error) error {
		if err != nil {
			return errdefs.Unavailable("%s: cannot read the free space of %s: %v", what, dir, err)
		}
		return errdefs.ResourceExhausted("node disk full: %s needs about %d MiB; %s has %d MiB free, %d MiB of it promised to this node's sandboxes' disks and writes in progress%s and %d MiB kept free",
			what, need>>20, dir, free>>20, promised>>20, othersPhrase(others), d.keepFree>>20)
	})
	if err != nil {
		return nil, err
	}
	d.pending += need
	var once sync.Once
	return func() {
		once.Do(func() {
			d.mu.Lock()
			d.pending -= need
			d.mu.Unlock()
			d.Publish()
		})
	}, nil
}

// Close lets go of the ledger. The sandboxes' layers stay promised by
// their blocks on disk until an edge takes them back at its start.
func (d *Room) Close() {
	if d.ledger != nil {
		d.ledger.Close()
	}
}

// SetLayers has the room ask layers what the writable layers may still
// write, rather than count every admitted layer as written in full.
func (d *Room) SetLayers(layers interface {
	Promised() (unwritten, sizes int64)
}) {
	d.layers = layers
}

// OpenLedger records this edge's (node's) promise of the layers' disk in
// the disk ledger in dir, beside other edges' on the same disk; not with
// overcommit, which checks no room.
func (d *Room) OpenLedger(dir, node string) error {
	if d.overcommit > 1 {
		return nil
	}
	l, err := diskledger.Open(dir, d.dir, node)
	if err != nil {
		return err
	}
	d.ledger = l
	return nil
}

// BudgetMB bounds the sum of the disk limits admitted: the free space,
// times the overcommit.
func (d *Room) BudgetMB() int64 { return d.budgetMB }

// SetKeepFree sets what the file system keeps free beyond the promises,
// in bytes (tests of a full disk).
func (d *Room) SetKeepFree(bytes int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.keepFree = bytes
}

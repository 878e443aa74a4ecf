package microvm

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/sparsefile"
)

// Memory snapshots [ours; docs/design.md, "microvm backend"]. A guest's
// RAM is a file in shared memory that QEMU maps shared. A snapshot stops the guest, has
// QEMU write only its device state (x-ignore-shared: RAM stays in the
// file, so this takes milliseconds and kilobytes), copies the RAM file and
// the writable disk next to it (sparse; a reflink where the file system
// has them), and lets the source go on with its own RAM file. A copy
// starts a QEMU with the same devices that maps the snapshot's RAM file
// privately, copy-on-write (copies share the pages they do not write),
// takes the device state in, and runs on from there with a copy of the
// writable disk of its own.

// Snapshot implements backend.Snapshotter. The source keeps running.
func (b *Backend) Snapshot(ctx context.Context, id sandboxid.ID, ref backend.SnapshotRef) (*backend.SnapshotInfo, error) {
	bx, g, err := b.guestOf(id)
	if err != nil {
		return nil, err
	}
	if len(g.Devices) > 0 {
		return nil, errdefs.FailedPrecondition("%s: sandbox %s has host PCI devices (%s), whose state does not migrate: it cannot be snapshotted or forked", b.name, id, strings.Join(g.Devices, ", "))
	}
	v, err := b.vmmOf(bx)
	if err != nil {
		return nil, err
	}
	return v.snapshot(ctx, bx, g, ref)
}

// keepGuestFiles puts in a snapshot what a copy needs beside the VMM's
// state, while the source is stopped: its RAM file (under QEMU; in two
// parallel halves) and its writable disk, copied at once; the initramfs,
// which never changes, and the root disk as links (the source may be
// removed before the last copy is made); and the guest's description.
func keepGuestFiles(ctx context.Context, g Guest, ref backend.SnapshotRef) (*backend.SnapshotInfo, error) {
	if err := sparsefile.LinkOrCopy(ctx, g.Initrd, filepath.Join(ref.Dir, "initrd.cpio")); err != nil {
		return nil, err
	}
	// The image's own kernel it boots goes with the snapshot: a node that
	// never ran the image's guests restores it from there (imageKernelHere).
	if g.Kernel != "" {
		if err := sparsefile.LinkOrCopy(ctx, g.Kernel, filepath.Join(ref.Dir, snapshotKernel)); err != nil {
			return nil, err
		}
	}
	copies := [][2]string{{g.WritableDisk, filepath.Join(ref.Dir, "rw.ext4")}}
	if g.MemFile != "" {
		copies = append([][2]string{{g.MemFile, filepath.Join(ref.Dir, "mem")}}, copies...)
	}
	if err := sparsefile.CopyAll(ctx, copies, 2); err != nil {
		return nil, err
	}
	if err := shareRoot(g.RootDisk, g.Root, filepath.Join(ref.Dir, "root.ext4")); err != nil {
		return nil, err
	}
	snap := g
	snap.MemFile, snap.WritableDisk, snap.Initrd, snap.BootInitrd, snap.RootDisk = "", "", "", nil, filepath.Join(ref.Dir, "root.ext4")
	data, _ := json.Marshal(snap)
	if err := os.WriteFile(filepath.Join(ref.Dir, "guest.json"), data, 0o600); err != nil {
		return nil, err
	}
	return &backend.SnapshotInfo{SizeBytes: allocated(ref.Dir)}, nil
}

// agentLeftWait bounds agentLeft: a guest that has not closed its port by
// then is snapshotted anyway (its copies' edges then drop the stale
// session, which costs them about two seconds).
const agentLeftWait = 300 * time.Millisecond

// agentLeft waits until the guest has closed the agent's port. The edge
// detaches before a snapshot, and QEMU sees that at once, but the guest's
// agent may still be in that session: stopped then, every copy would start
// with its agent reading the old session's stream, deaf to its new edge
// until the edge gives up on it (a second) and QEMU reconnects (another).
// Once the agent has left the session it closes the port, and while no
// host is there it opens and closes it every 20 ms; QEMU reports the
// guest's side as the chardev's frontend-open.
func agentLeft(ctx context.Context, q *qmpConn, wait time.Duration) bool {
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		ch, found, err := agentChannel(q)
		if err != nil {
			return false
		}
		if found && !ch.FrontendOpen {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	return false
}

// waitMigration polls the session until its QEMU's migration completed.
// loadError is a snapshot's state that did not load: its incoming
// migration failed, or QEMU ended (as it does on a stream it cannot read)
// while loading it.
type loadError struct{ err error }

func (e *loadError) Error() string { return e.err.Error() }
func (e *loadError) Unwrap() error { return e.err }

func waitMigration(ctx context.Context, q *qmpConn) error {
	for {
		out, err := q.call("query-migrate", nil)
		if err != nil {
			return err
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		json.Unmarshal(out, &st) //nolint:errcheck // an empty status polls again
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("microvm: migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// allocated is the disk space the files under dir take.
func allocated(dir string) int64 {
	var n int64
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil {
			if st, ok := fi.Sys().(interface{ Blocks() int64 }); ok {
				n += st.Blocks() * 512
				continue
			}
			n += fi.Size()
		}
	}
	return n
}

// Restore implements backend.Snapshotter: a new guest from a snapshot,
// with its own writable disk and agent socket, mapping the snapshot's RAM
// copy-on-write. A sandbox restored in place (its own offload, after
// Release: spec names a guest the backend has) gets a RAM file of its
// own again, a copy of the snapshot's, so that the snapshot can go and
// its later forks stay as fast as before it was offloaded.
//
// A copy of a guest with a network runs on its own namespace's TAP with
// that namespace's MAC; its guest takes that MAC and address itself in its
// first request (Handle.Network; guestnet.Readdress), since its memory
// holds its source's.
func (b *Backend) Restore(ctx context.Context, ref backend.SnapshotRef, spec *backend.Spec) (*backend.Handle, error) {
	var g Guest
	data, err := os.ReadFile(filepath.Join(ref.Dir, "guest.json"))
	if err == nil {
		err = json.Unmarshal(data, &g)
	}
	if err != nil {
		return nil, errdefs.NotFound("snapshot %s: no guest description: %v", ref.ID, err)
	}
	if accel, took := b.Accel(), cmp.Or(g.Accel, "tcg"); g.VMM == "" && accel != "" && took != accel {
		// A guest's CPU state does not cross between KVM and TCG.
		return nil, errdefs.FailedPrecondition("microvm: snapshot %s was taken of a guest under %s; this node runs guests under %s", ref.ID, took, accel)
	}
	var nic *GuestNet
	switch {
	case spec.NetNS != "" && g.NetNS != "":
		n, err := readGuestNet(ctx, spec.NetNS)
		if err != nil {
			return nil, err
		}
		g.NetNS, g.MAC, nic = spec.NetNS, n.MAC, &n
	case spec.NetNS != "":
		return nil, errdefs.FailedPrecondition("microvm: snapshot %s is of a guest without a network interface; a copy cannot have one", ref.ID)
	case g.NetNS != "":
		return nil, errdefs.FailedPrecondition("microvm: snapshot %s is of a guest with a network interface; its copy needs a network too", ref.ID)
	}
	b.mu.Lock()
	_, inPlace := b.boxes[spec.ID]
	b.mu.Unlock()
	bx := newBox(spec, g.VMM)
	if err := os.MkdirAll(bx.Dir, 0o700); err != nil {
		return nil, err
	}
	if inPlace {
		if err := clearReleased(bx.Dir); err != nil {
			return nil, err
		}
	}
	g.WritableDisk = filepath.Join(bx.Dir, "rw.ext4")
	if err := sparsefile.Copy(ctx, filepath.Join(ref.Dir, "rw.ext4"), g.WritableDisk, 1); err != nil {
		return nil, err
	}
	// It runs from its source's initramfs; booted later, from its own.
	if err := bootInitrdLater(ctx, &g, bx.Dir, filepath.Join(ref.Dir, "initrd.cpio"), guestConfig(spec, nic)); err != nil {
		return nil, err
	}
	// The root disk the guest ran on is the snapshot's: a link to its
	// node's, or, pulled from another node, a file of its own (this node's
	// root of the same image, built anew, is not the same bytes).
	snapRoot := filepath.Join(ref.Dir, "root.ext4")
	if !sameFile(snapRoot, g.Root) {
		g.Root = snapRoot
	}
	if err := shareRoot(snapRoot, g.Root, filepath.Join(bx.Dir, "root.ext4")); err != nil {
		return nil, err
	}
	g.RootDisk = filepath.Join(bx.Dir, "root.ext4")
	if err := imageKernelHere(ctx, &g, ref.Dir, bx.Dir); err != nil {
		return nil, err
	}
	g.Console, g.AgentChardev, g.AgentSocket = "", agentChardev(spec), agentSocket(spec)
	g.CPUCores = spec.CPUCores
	v, err := b.vmmOf(bx)
	if err != nil {
		return nil, err
	}
	if inPlace && v.sharesMemory() {
		g.MemFile, g.MemShared = memFile(spec.ID), true
		err = b.restoreOwnRAM(ctx, bx, g, ref)
	} else {
		err = v.restore(ctx, bx, g, ref, func() error { return b.limitGuestCPU(bx, g, v) })
	}
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	b.boxes[spec.ID] = bx
	b.mu.Unlock()
	state, _ := json.Marshal(bx)
	return &backend.Handle{ID: spec.ID, Backend: b.name, Version: 1, State: state, Network: nic}, nil
}

// snapshotKernel is the image's own kernel in a snapshot of a guest that
// boots one.
const snapshotKernel = "vmlinuz"

// imageKernelHere gives the guest of a snapshot that keeps its image's
// own kernel a link of that copy in its own directory dir, and boots it
// from there: on a node that never ran the image's guests (or whose
// cache's pruning took the kernel) the path the guest recorded is
// missing, and a copy of a copy must not depend on its source's directory,
// which goes when its source does. A guest of the node's kernel, or an
// older snapshot without the copy, keeps its path (hostFilesPresent
// checks it).
func imageKernelHere(ctx context.Context, g *Guest, snapDir, dir string) error {
	if g.Kernel == "" {
		return nil
	}
	kept := filepath.Join(snapDir, snapshotKernel)
	if _, err := os.Stat(kept); err != nil {
		return nil
	}
	own := filepath.Join(dir, snapshotKernel)
	// A released guest restored in place had one: linked anew, never
	// written through.
	if err := os.Remove(own); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := sparsefile.LinkOrCopy(ctx, kept, own); err != nil {
		return err
	}
	g.Kernel = own
	return nil
}

// sameFile says whether paths a and b name one file.
func sameFile(a, b string) bool {
	fa, err := os.Stat(a)
	if err != nil {
		return false
	}
	fb, err := os.Stat(b)
	return err == nil && os.SameFile(fa, fb)
}

// clearReleased removes, from the directory of a released guest about to
// be restored in place, the names Restore makes anew. Several are hard
// links whose other name is in the snapshot (the initramfs it ran from);
// writing through them would change the snapshot being restored.
func clearReleased(dir string) error {
	for _, name := range []string{"rw.ext4", "root.ext4", "initrd.cpio", "initrd-runs.cpio", "initrd-own.cpio"} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// restoreOwnRAM restores g, whose RAM is a shared file of its own
// (g.MemFile), from the snapshot in ref: that file a copy of the
// snapshot's, made while QEMU starts (QEMU maps it at its start and reads
// it only once the device state is in, after started), or, for a
// snapshot whose RAM is in its stream, filled by the stream.
func (b *Backend) restoreOwnRAM(ctx context.Context, bx *box, g Guest, ref backend.SnapshotRef) error {
	filled := make(chan error, 1)
	fill, err := sparsefile.Prepare(filepath.Join(ref.Dir, "mem"), g.MemFile)
	switch {
	case err == nil:
		go func() { filled <- fill(ctx, 2) }()
	case errors.Is(err, fs.ErrNotExist):
		filled <- nil // the stream has it
	default:
		return err
	}
	var fillErr error
	var waited sync.Once
	waitFill := func() error { waited.Do(func() { fillErr = <-filled }); return fillErr }
	started := func() error {
		err := b.limitGuestCPU(bx, g, b.qemu)
		return errors.Join(waitFill(), err)
	}
	if err := b.qemu.restore(ctx, bx, g, ref, started); err != nil {
		// Its RAM file holds the node's memory: it goes with the failed
		// restore (once the copy into it has ended).
		waitFill() //nolint:errcheck // reporting err
		os.Remove(g.MemFile)
		return err
	}
	return nil
}

// Release implements backend.Releaser: after an offload's snapshot the
// guest's VMM ends and its RAM file goes, which gives the node its memory
// back; the guest's directory stays for the Restore in place.
func (b *Backend) Release(ctx context.Context, id sandboxid.ID) error {
	bx, g, err := b.guestOf(id)
	if err != nil {
		return err
	}
	if g.VMM != "" {
		// A Firecracker guest's restore in place would map the
		// checkpoint's RAM privately, which the edge deletes once it is
		// back: its disk would stay taken, uncounted, while the guest
		// runs. Until it gets a RAM file of its own, it is frozen instead.
		return errdefs.Unsupported("microvm: %s runs on %s, whose guests are not offloaded yet; it stays frozen", id, g.VMM)
	}
	if err := bx.kill(0); err != nil {
		return err
	}
	if g.MemShared && g.MemFile != "" {
		if err := os.Remove(g.MemFile); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("microvm: give the RAM of %s back: %w", id, err)
		}
	}
	return nil
}

var (
	_ backend.Snapshotter = (*Backend)(nil)
	_ backend.Releaser    = (*Backend)(nil)
)

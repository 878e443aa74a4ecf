package microvm

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend"
)

// Firecracker as the backend's vmm: one Firecracker per guest, driven
// through its API socket in the guest's directory.

func (f *Firecracker) title() string { return "Firecracker" }

func (f *Firecracker) id() string { return vmmFirecracker }

func (f *Firecracker) modules(net bool) []string {
	if net {
		return append(append([]string{}, FirecrackerModules...), NetModules...)
	}
	return FirecrackerModules
}

// sharesMemory is false: Firecracker writes a snapshot's memory itself.
func (f *Firecracker) sharesMemory() bool { return false }

func (f *Firecracker) api(bx *box) *fcAPI { return newFCAPI(filepath.Join(bx.Dir, fcSocket)) }

func (f *Firecracker) pause(ctx context.Context, bx *box) error { return f.api(bx).pause(ctx) }

func (f *Firecracker) resume(ctx context.Context, bx *box) error { return f.api(bx).resume(ctx) }

func (f *Firecracker) paused(ctx context.Context, bx *box) bool {
	i, err := f.api(bx).info(ctx)
	return err == nil && i.State == "Paused"
}

// snapshot pauses the guest, has Firecracker write its state and memory,
// copies the writable disk while the guest is still paused (so disk and
// memory are of one moment), and resumes it.
func (f *Firecracker) snapshot(ctx context.Context, bx *box, g Guest, ref backend.SnapshotRef) (*backend.SnapshotInfo, error) {
	api := f.api(bx)
	if err := api.pause(ctx); err != nil {
		return nil, err
	}
	defer api.resume(context.WithoutCancel(ctx)) //nolint:errcheck // Status reports a guest left paused
	if err := api.createSnapshot(ctx, fcSnapshotCreate{SnapshotType: "Full", SnapshotPath: filepath.Join(ref.Dir, "state"), MemFilePath: filepath.Join(ref.Dir, "mem")}); err != nil {
		return nil, err
	}
	g.MemFile = "" // Firecracker wrote the RAM itself
	return keepGuestFiles(ctx, g, ref)
}

// restore starts a copy in bx from the snapshot in ref (Firecracker
// reopens the disks and the vsock socket by the relative names in the
// snapshot, in the copy's directory) and maps its memory file privately,
// so copies share its pages copy-on-write.
func (f *Firecracker) restore(ctx context.Context, bx *box, g Guest, ref backend.SnapshotRef, started func() error) error {
	if err := f.configured(bx); err != nil {
		return err
	}
	if err := bx.saveGuest(g); err != nil {
		return err
	}
	vm, err := f.start(ctx, bx, g)
	if err != nil {
		return err
	}
	if err := started(); err != nil {
		vm.kill()
		return err
	}
	err = vm.api.loadSnapshot(ctx, fcSnapshotLoad{SnapshotPath: filepath.Join(ref.Dir, "state"),
		MemBackend: fcMemoryBackend{BackendType: "File", BackendPath: filepath.Join(ref.Dir, "mem")}, ResumeVM: true})
	if err != nil {
		vm.kill()
	}
	return err
}

// consoleTail is the end of the guest's console ring (see fcConsoleFIFO),
// or of console.log for a guest an older release started.
func (f *Firecracker) consoleTail(ctx context.Context, bx *box, g Guest) string {
	if _, err := os.Stat(filepath.Join(bx.Dir, fcConsoleFIFO)); err != nil {
		return strings.TrimPrefix(tail(filepath.Join(bx.Dir, "console.log")), "; console: ")
	}
	return strings.TrimPrefix(consoleTail(bx.Dir), "; console: ")
}

// reattach drains the console FIFO again: it filled while no edge did.
// (A guest started by an older release writes console.log instead.)
func (f *Firecracker) reattach(bx *box, log *slog.Logger) {
	if _, err := os.Stat(filepath.Join(bx.Dir, fcConsoleFIFO)); err != nil {
		return
	}
	if _, err := drainConsole(bx.Dir, log, reattachWait); err != nil {
		log.Warn("microvm: the guest's console is not drained", "dir", bx.Dir, "err", err)
	}
}

package microvm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
)

var _ backend.ChangeReader = (*Backend)(nil)

// OpenChanges implements backend.ChangeReader: the guest's overlay upper
// directory on its writable disk, which the node mounts read-only (a loop
// device, the journal not replayed: the guest synced and is paused, so
// what is on the disk is whole, and the guest's own mount is left as it
// was).
func (b *Backend) OpenChanges(ctx context.Context, spec *backend.Spec) (string, func() error, error) {
	bx := newBox(spec, "")
	disk := filepath.Join(bx.Dir, "rw.ext4")
	if _, err := os.Stat(disk); err != nil {
		return "", nil, errdefs.FailedPrecondition("sandbox %s: its writable disk %s is gone", spec.ID, disk)
	}
	mnt := filepath.Join(bx.Dir, "changes")
	if err := os.MkdirAll(mnt, 0o700); err != nil {
		return "", nil, err
	}
	unix.Unmount(mnt, unix.MNT_DETACH) //nolint:errcheck // a mount left by an edge that died mid-commit
	out, err := exec.CommandContext(ctx, "mount", "-t", "ext4", "-o", "ro,loop,noload", disk, mnt).CombinedOutput()
	if err != nil {
		return "", nil, fmt.Errorf("sandbox %s: mount its writable disk read-only: %v: %s", spec.ID, err, strings.TrimSpace(string(out)))
	}
	release := func() error {
		if err := unix.Unmount(mnt, 0); err != nil {
			return fmt.Errorf("unmount %s: %w", mnt, err)
		}
		return os.Remove(mnt)
	}
	upper := filepath.Join(mnt, "upper")
	if _, err := os.Stat(upper); err != nil {
		release() //nolint:errcheck // reported below
		return "", nil, errdefs.FailedPrecondition("sandbox %s: its writable disk has no upper directory (the guest never mounted its root)", spec.ID)
	}
	return upper, release, nil
}

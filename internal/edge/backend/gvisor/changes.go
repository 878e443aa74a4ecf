package gvisor

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

var _ backend.ChangeReader = (*Backend)(nil)

// OpenChanges implements backend.ChangeReader for sandboxes on the newer
// runsc, whose sentry serializes its writable layer (in its memory or its
// own file) as an overlayfs upper directory's tar (`runsc tar
// rootfs-upper`); it is unpacked into the sandbox's directory. The sentry
// must answer, so the edge does not freeze the sandbox first
// (Capabilities.ChangesWhileRunning): runsc stops its tasks inside the
// sentry (`runsc pause`) for the serialization. A sandbox the user paused
// is refused: freezing its cgroup again right after a thaw crashed the
// systrap platform's processes here. Debian's runsc has no such call: its
// sandboxes cannot be committed.
func (b *Backend) OpenChanges(ctx context.Context, spec *backend.Spec) (string, func() error, error) {
	bx, err := b.get(spec.ID)
	if err != nil {
		return "", nil, err
	}
	rt := b.rtOf(bx)
	if !rt.modern {
		return "", nil, errdefs.Unsupported("gvisor: sandbox %s runs on Debian's runsc, which keeps its writable layer in its memory and cannot write it out; gvisor sandboxes that run on the newer runsc (option %s=%s) can be committed", spec.ID, NewerForOption, NewerForAll)
	}
	cli := rt.cli(filepath.Join(bx.dir, "runsc.log"))
	if b.cg.Group(bx.runscID).Frozen() {
		return "", nil, errdefs.FailedPrecondition("gvisor: sandbox %s is paused; resume it to commit it (its sentry must answer)", spec.ID)
	}
	if _, err := cli.Run(ctx, "pause", bx.runscID); err != nil {
		return "", nil, fmt.Errorf("gvisor: stop sandbox %s's tasks: %w", spec.ID, err)
	}
	tarPath := filepath.Join(bx.dir, "upper.tar")
	_, terr := cli.Run(ctx, "tar", "rootfs-upper", "--file", tarPath, bx.runscID)
	if _, err := cli.Run(context.WithoutCancel(ctx), "resume", bx.runscID); err != nil && terr == nil {
		terr = fmt.Errorf("gvisor: resume sandbox %s's tasks: %w", spec.ID, err)
	}
	defer os.Remove(tarPath)
	if terr != nil {
		return "", nil, fmt.Errorf("gvisor: write out sandbox %s's writable layer: %w", spec.ID, terr)
	}
	dir := filepath.Join(bx.dir, "changes")
	os.RemoveAll(dir)
	if err := os.Mkdir(dir, 0o700); err != nil {
		return "", nil, err
	}
	release := func() error { return os.RemoveAll(dir) }
	f, err := os.Open(tarPath)
	if err != nil {
		release() //nolint:errcheck // reported below
		return "", nil, err
	}
	defer f.Close()
	if err := image.UnpackUpper(f, dir, image.MaxLayerBytes); err != nil {
		release() //nolint:errcheck // reported below
		return "", nil, fmt.Errorf("gvisor: sandbox %s's writable layer: %w", spec.ID, err)
	}
	return dir, release, nil
}

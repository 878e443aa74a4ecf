package container

import (
	"context"
	"os"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
)

var _ backend.ChangeReader = (*Backend)(nil)

// OpenChanges implements backend.ChangeReader: the writable layer's upper
// directory, on the node's disk.
func (b *Backend) OpenChanges(ctx context.Context, spec *backend.Spec) (string, func() error, error) {
	upper := spec.RootfsLayout().Upper
	if fi, err := os.Stat(upper); err != nil || !fi.IsDir() {
		return "", nil, errdefs.FailedPrecondition("sandbox %s: its writable layer %s is gone", spec.ID, upper)
	}
	return upper, func() error { return nil }, nil
}

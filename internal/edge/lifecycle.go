package edge

import (
	"context"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
)

// Resume continues a paused sandbox.
func (e *Edge) Resume(ctx context.Context, id, scope string) (*sandboxv1.Sandbox, error) {
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	return sb.Resume(ctx)
}

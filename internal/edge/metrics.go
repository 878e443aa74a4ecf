package edge

import (
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// Metrics returns sb's recorded samples between start and end (zero:
// unbounded), oldest first.
func (e *Edge) Metrics(id, scope string, start, end time.Time) ([]*sandboxv1.MetricsSample, error) {
	if !start.IsZero() && !end.IsZero() && end.Before(start) {
		return nil, errdefs.InvalidArgument("end %s is before start %s", end.Format(time.RFC3339), start.Format(time.RFC3339))
	}
	sb, err := e.lookup(id, scope)
	if err != nil {
		return nil, err
	}
	return sb.Samples(start, end), nil
}

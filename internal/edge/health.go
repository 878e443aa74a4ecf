package edge

import (
	"time"

	"github.com/opendsec/opendsec/internal/edge/sandbox"
)

// healthLoop checks every sandbox each tick, and starts the compactions
// the checks ask for.
func (e *Edge) healthLoop() {
	defer e.wg.Done()
	tick := time.NewTicker(sandbox.HealthEvery)
	defer tick.Stop()
	for {
		select {
		case <-e.stop:
			return
		case now := <-tick.C:
			for _, sb := range e.reg.all() {
				sb.CheckHealth(now, &e.wg, e.snaps)
			}
		}
	}
}

package microvm

import (
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/spawn"
)

// clockTicks is the kernel's USER_HZ, the unit of /proc/PID/stat's times
// (100 on every Linux architecture Go runs on).
const clockTicks = 100

// Usage implements backend.UsageReader from the host: a guest is its VMM
// process, whose CPU time is every vCPU's and whose proportional set size
// (the pages it shares with other guests, a fork's copies or a snapshot's
// file, counted in parts) is its memory; the limit is the guest's RAM.
func (b *Backend) Usage(id sandboxid.ID) (backend.Usage, error) {
	bx, err := b.get(id)
	if err != nil {
		return backend.Usage{}, err
	}
	pid, ok := bx.pid()
	if !ok {
		return backend.Usage{}, errdefs.Unavailable("microvm: sandbox %s: its VMM does not run", id)
	}
	st, ok := spawn.ReadStat(pid)
	if !ok {
		return backend.Usage{}, errdefs.Unavailable("microvm: sandbox %s: its VMM's /proc stat cannot be read", id)
	}
	mem, err := spawn.ReadPSS(pid)
	if err != nil {
		return backend.Usage{}, err
	}
	u := backend.Usage{CPUNanos: st.CPUTicks * (1e9 / clockTicks), MemoryBytes: mem}
	if g, err := bx.loadGuest(); err == nil {
		u.LimitBytes = int64(g.MemoryMB) << 20
	}
	return u, nil
}

var _ backend.UsageReader = (*Backend)(nil)

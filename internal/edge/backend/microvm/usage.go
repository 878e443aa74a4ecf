package microvm

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

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
	mem, err := processPSS(pid)
	if err != nil {
		return backend.Usage{}, err
	}
	u := backend.Usage{CPUNanos: st.CPUTicks * (1e9 / clockTicks), MemoryBytes: mem}
	if g, err := bx.loadGuest(); err == nil {
		u.LimitBytes = int64(g.MemoryMB) << 20
	}
	return u, nil
}

// processPSS is a process's proportional set size in bytes
// (/proc/PID/smaps_rollup).
func processPSS(pid int) (int64, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return parsePSS(f)
}

func parsePSS(f interface{ Read([]byte) (int, error) }) (int64, error) {
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 3 && fields[0] == "Pss:" && fields[2] == "kB" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("microvm: smaps_rollup Pss %q: %w", fields[1], err)
			}
			return kb << 10, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("microvm: smaps_rollup has no Pss line")
}

var _ backend.UsageReader = (*Backend)(nil)

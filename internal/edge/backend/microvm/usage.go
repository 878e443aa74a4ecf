package microvm

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/sandboxid"
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
	cpu, err := processCPU(pid)
	if err != nil {
		return backend.Usage{}, err
	}
	mem, err := processPSS(pid)
	if err != nil {
		return backend.Usage{}, err
	}
	u := backend.Usage{CPUNanos: cpu, MemoryBytes: mem}
	if g, err := bx.loadGuest(); err == nil {
		u.LimitBytes = int64(g.MemoryMB) << 20
	}
	return u, nil
}

// processCPU is a process's user and system time, in nanoseconds.
func processCPU(pid int) (uint64, error) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	return parseStatCPU(data)
}

// parseStatCPU reads utime and stime (fields 14 and 15) of a
// /proc/PID/stat line; the command's name, in parentheses, may hold spaces.
func parseStatCPU(data []byte) (uint64, error) {
	end := bytes.LastIndexByte(data, ')')
	if end < 0 {
		return 0, fmt.Errorf("microvm: /proc stat %q: no command name", clip(data))
	}
	fields := strings.Fields(string(data[end+1:]))
	// fields[0] is field 3 (state): utime is field 14, fields[11].
	if len(fields) < 13 {
		return 0, fmt.Errorf("microvm: /proc stat %q: %d fields after the name, want 13 or more", clip(data), len(fields))
	}
	var ticks uint64
	for _, f := range fields[11:13] {
		n, err := strconv.ParseUint(f, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("microvm: /proc stat %q: %w", clip(data), err)
		}
		ticks += n
	}
	return ticks * (1e9 / clockTicks), nil
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

func clip(b []byte) string { return errdefs.Clip(string(b), 80) }

var _ backend.UsageReader = (*Backend)(nil)

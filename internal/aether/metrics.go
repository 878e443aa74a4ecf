package aether

import (
	"bufio"
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
)

// Metrics samples CPU over 100 ms and reads memory and disk use. Memory
// comes from the sandbox's cgroup when it is visible (containers), else
// from /proc/meminfo (gVisor reports the sandbox's own).
func (s *agentService) Metrics(ctx context.Context, req *connect.Request[agentv1.MetricsRequest]) (*connect.Response[agentv1.MetricsResponse], error) {
	out := &agentv1.MetricsResponse{CpuCount: uint32(runtime.NumCPU())}
	busy1, total1 := cpuTimes()
	select {
	case <-time.After(100 * time.Millisecond):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	busy2, total2 := cpuTimes()
	if total2 > total1 {
		out.CpuUsedPct = 100 * float64(busy2-busy1) / float64(total2-total1)
	}
	mi := meminfo("/proc/meminfo")
	out.MemTotalBytes = mi["MemTotal"]
	out.MemUsedBytes = mi["MemTotal"] - mi["MemAvailable"]
	out.MemCacheBytes = mi["Cached"]
	if used, err := readInt("/sys/fs/cgroup/memory/memory.usage_in_bytes"); err == nil {
		out.MemUsedBytes = used
		if limit, err := readInt("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err == nil && limit < out.MemTotalBytes {
			out.MemTotalBytes = limit
		}
	}
	var st unix.Statfs_t
	if unix.Statfs("/", &st) == nil {
		out.DiskTotalBytes = int64(st.Blocks) * st.Bsize
		out.DiskUsedBytes = int64(st.Blocks-st.Bfree) * st.Bsize
	}
	return connect.NewResponse(out), nil
}

func cpuTimes() (busy, total uint64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	f := strings.Fields(line)
	for i, v := range f[1:] {
		n, _ := strconv.ParseUint(v, 10, 64)
		total += n
		if i != 3 && i != 4 { // idle, iowait
			busy += n
		}
	}
	return busy, total
}

// meminfo reads a meminfo file's fields, in bytes.
func meminfo(path string) map[string]int64 {
	out := map[string]int64{}
	f, err := os.Open(path)
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		out[k] = n * 1024
	}
	return out
}

func readInt(p string) (int64, error) {
	data, err := os.ReadFile(p)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
}

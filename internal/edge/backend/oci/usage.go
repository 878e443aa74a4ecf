package oci

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/opendsec/opendsec/internal/edge/backend"
)

// ReadUsage reads id's cpuacct and memory cgroups from the host: it
// neither enters nor wakes the sandbox.
func ReadUsage(id string) (backend.Usage, error) {
	var u backend.Usage
	cpu, err := readUint(filepath.Join(cgroupRoot, "cpuacct", CgroupParent, id, "cpuacct.usage"))
	if err != nil {
		return u, fmt.Errorf("cpu use of %s: %w", id, err)
	}
	mem := filepath.Join(cgroupRoot, "memory", CgroupParent, id)
	used, err := readUint(filepath.Join(mem, "memory.usage_in_bytes"))
	if err != nil {
		return u, fmt.Errorf("memory use of %s: %w", id, err)
	}
	limit, _ := readUint(filepath.Join(mem, "memory.limit_in_bytes"))
	stat := memoryStat(filepath.Join(mem, "memory.stat"))
	u.CPUNanos, u.LimitBytes = cpu, int64(limit)
	u.CacheBytes = int64(stat["total_cache"])
	u.MemoryBytes = int64(used) - int64(min(stat["total_inactive_file"], used))
	return u, nil
}

func readUint(p string) (uint64, error) {
	data, err := os.ReadFile(p)
	if err != nil {
		return 0, err
	}
	return strconv.ParseUint(strings.TrimSpace(string(data)), 10, 64)
}

func memoryStat(p string) map[string]uint64 {
	out := map[string]uint64{}
	f, err := os.Open(p)
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseUint(v, 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}

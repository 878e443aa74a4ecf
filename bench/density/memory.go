package main

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/opendsec/opendsec/internal/spawn"
)

// Where an idle sandbox's host memory goes (issue 28): the kernel's
// counters from /proc/meminfo before and after a burst, and the agents'
// proportional set size (their shared text counts in parts), each over the
// sandboxes made.

// memFields are the /proc/meminfo counters the breakdown prints.
var memFields = []string{"AnonPages", "Shmem", "Slab", "KernelStack", "PageTables", "Percpu", "Cached"}

// meminfo reads /proc/meminfo in KiB by field.
func meminfo() map[string]int64 {
	out := map[string]int64{}
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
		out[name] = kb
	}
	return out
}

// processPSS sums the PSS of every process whose command name is comm,
// in KiB, and counts them.
func processPSS(comm string) (int64, int) {
	var total int64
	n := 0
	for _, pid := range pidsNamed(comm) {
		if pss, err := spawn.ReadPSS(pid); err == nil {
			total += pss >> 10
			n++
		}
	}
	return total, n
}

// pidsNamed are the processes whose command name is comm.
func pidsNamed(comm string) []int {
	var out []int
	for _, pid := range spawn.Pids() {
		c, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "comm"))
		if err == nil && strings.TrimSpace(string(c)) == comm {
			out = append(out, pid)
		}
	}
	return out
}

// printMemoryBreakdown prints each counter's growth and the agents' PSS
// per sandbox, in MiB.
func printMemoryBreakdown(before, after map[string]int64, n int, agentPSS int64, agents int) {
	if n == 0 {
		return
	}
	per := func(kb int64) string { return fmt.Sprintf("%.2f", float64(kb)/1024/float64(n)) }
	var parts []string
	for _, f := range memFields {
		parts = append(parts, f+" "+per(after[f]-before[f]))
	}
	fmt.Printf("memory per sandbox, MiB (growth of /proc/meminfo over the burst): %s; the %d agents' PSS %s\n", strings.Join(parts, ", "), agents, per(agentPSS))
}

// settle waits, at most limit, until the host's CPUs are mostly idle
// again (80 % over a second) and the kernel holds no more cgroups than
// before the bench began (cgroupBaseline): it removes a burst's cgroups,
// mounts and loop devices well after the runtime returned, and a burst
// measured meanwhile pays for the last one's (measured: each bare burst
// of 1,000 ran faster than the one before it).
func settle(limit time.Duration) {
	for deadline := time.Now().Add(limit); time.Now().Before(deadline); {
		idle0, total0 := cpuTimes()
		time.Sleep(time.Second)
		idle1, total1 := cpuTimes()
		if total1 > total0 && float64(idle1-idle0)/float64(total1-total0) >= 0.8 && cgroupCount() <= cgroupBaseline+16 {
			return
		}
	}
}

// cgroupBaseline is cgroupCount when the bench began.
var cgroupBaseline = cgroupCount()

// cgroupCount is the number of cgroups the kernel holds in all
// hierarchies, dying ones included (/proc/cgroups).
func cgroupCount() int {
	data, err := os.ReadFile("/proc/cgroups")
	if err != nil {
		return 0
	}
	n := 0
	for _, line := range strings.Split(string(data), "\n") {
		if f := strings.Fields(line); len(f) == 4 && !strings.HasPrefix(line, "#") {
			c, _ := strconv.Atoi(f[2])
			n += c
		}
	}
	return n
}

// cpuTimes are the idle and total jiffies of all CPUs (/proc/stat).
func cpuTimes() (idle, total uint64) {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0
	}
	line, _, _ := strings.Cut(string(data), "\n")
	for i, f := range strings.Fields(line)[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		total += v
		if i == 3 || i == 4 { // idle, iowait
			idle += v
		}
	}
	return idle, total
}

// childrenCPU is the CPU time of this process's children it has waited
// for (RUSAGE_CHILDREN).
func childrenCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// processCPU is the CPU time of every process whose command name is
// comm, all its threads, so far.
func processCPU(comm string) time.Duration {
	var ticks uint64
	for _, pid := range pidsNamed(comm) {
		if st, ok := spawn.ReadStat(pid); ok {
			ticks += st.CPUTicks
		}
	}
	return time.Duration(ticks) * (time.Second / 100) // USER_HZ
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

package spawn

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// ProcStat is what /proc/PID/stat says of a process.
type ProcStat struct {
	PID   int
	PPID  int
	PGID  int
	State string
	RSS   int64 // pages
	// CPUTicks is its user and system time (utime + stime), in clock ticks
	// (USER_HZ).
	CPUTicks uint64
	// StartTime is when it started, in clock ticks after boot: it tells a
	// process from a later one of the same pid.
	StartTime uint64
}

// ReadStat parses /proc/PID/stat. The command name may contain spaces and
// parentheses, so fields are taken after the last ')'.
func ReadStat(pid int) (ProcStat, bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return ProcStat{}, false
	}
	return parseStat(pid, data)
}

func parseStat(pid int, data []byte) (ProcStat, bool) {
	i := bytes.LastIndexByte(data, ')')
	if i < 0 || i+2 > len(data) {
		return ProcStat{}, false
	}
	f := strings.Fields(string(data[i+2:]))
	if len(f) < 22 {
		return ProcStat{}, false
	}
	ppid, _ := strconv.Atoi(f[1])
	pgid, _ := strconv.Atoi(f[2])
	rss, _ := strconv.ParseInt(f[21], 10, 64)
	utime, err := strconv.ParseUint(f[11], 10, 64)
	if err != nil {
		return ProcStat{}, false
	}
	stime, err := strconv.ParseUint(f[12], 10, 64)
	if err != nil {
		return ProcStat{}, false
	}
	start, _ := strconv.ParseUint(f[19], 10, 64)
	return ProcStat{PID: pid, PPID: ppid, PGID: pgid, State: f[0], RSS: rss, CPUTicks: utime + stime, StartTime: start}, true
}

// ReadPSS is a process's proportional set size in bytes (the Pss line
// of /proc/PID/smaps_rollup): pages it shares count in parts.
func ReadPSS(pid int) (int64, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return parsePSS(f)
}

func parsePSS(r io.Reader) (int64, error) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 3 && fields[0] == "Pss:" && fields[2] == "kB" {
			kb, err := strconv.ParseInt(fields[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("smaps_rollup Pss %q: %w", fields[1], err)
			}
			return kb << 10, nil
		}
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, errors.New("smaps_rollup has no Pss line")
}

// Pids lists the numeric entries of /proc.
func Pids() []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	pids := make([]int, 0, len(ents))
	for _, e := range ents {
		if pid, err := strconv.Atoi(e.Name()); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

func zombieChildren(parent int) []int {
	var out []int
	for _, pid := range Pids() {
		if st, ok := ReadStat(pid); ok && st.PPID == parent && st.State == "Z" {
			out = append(out, pid)
		}
	}
	return out
}

// Descendants returns every live descendant of root.
func Descendants(root int) []int {
	children := map[int][]int{}
	for _, pid := range Pids() {
		if st, ok := ReadStat(pid); ok {
			children[st.PPID] = append(children[st.PPID], pid)
		}
	}
	var out []int
	stack := []int{root}
	for len(stack) > 0 {
		p := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		for _, c := range children[p] {
			out = append(out, c)
			stack = append(stack, c)
		}
	}
	return out
}

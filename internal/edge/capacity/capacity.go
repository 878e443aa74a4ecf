// Package capacity is what a node admits sandboxes against: totals of
// their CPU and memory limits (overcommitted), a count, and the host's size
// as the bound of any one sandbox.
package capacity

import (
	"bufio"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	edgev1 "github.com/opendsec/opendsec/api/gen/opendsec/edge/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// Node is what an edge admits against: the sum of the limits of its
// sandboxes (paused ones too) stays within it. Limits are caps, not
// reservations, so the totals may exceed the host (overcommit), but one
// sandbox never asks for more than the host has.
type Node struct {
	CPUCores     float64 // admitted total
	MemoryMB     int64   // admitted total
	MaxSandboxes int64
	// SandboxBound says what set MaxSandboxes: the host resource that runs
	// out first (SandboxLimit), or the operator's setting.
	SandboxBound string
	// HostCPUCores and HostMemoryMB bound a single sandbox.
	HostCPUCores float64
	HostMemoryMB int64
}

// Default overcommit factors: the sum of the sandboxes' CPU limits may be
// 8 times the cores (most agent sandboxes idle most of the time), the sum
// of their memory limits 1.5 times the memory. A node sets its own
// (edge.Config.CPUOvercommit, dsec edge --cpu-overcommit): a dense node of small
// sandboxes (0.1 core each) needs 50 or more to hold 1,000 on 2 cores.
const (
	DefaultCPUOvercommit    = 8
	DefaultMemoryOvercommit = 1.5
	reservedMemoryMB        = 512
)

// Host reads the host: all cores and memory, minus a reserve for the node
// itself, with the given overcommit factors for the totals (0: the
// default). The number of sandboxes is what the host's memory, tasks and
// file descriptors allow (SandboxLimit); WithMaxSandboxes sets it instead.
func Host(cpuOvercommit, memoryOvercommit float64) Node {
	if cpuOvercommit <= 0 {
		cpuOvercommit = DefaultCPUOvercommit
	}
	if memoryOvercommit <= 0 {
		memoryOvercommit = DefaultMemoryOvercommit
	}
	cores := float64(runtime.NumCPU())
	mem := hostMemoryMB() - reservedMemoryMB
	if mem < 256 {
		mem = 256
	}
	count, bound := SandboxLimit(ReadHostLimits(mem))
	return Node{
		CPUCores: cores * cpuOvercommit, MemoryMB: int64(float64(mem) * memoryOvercommit), MaxSandboxes: count, SandboxBound: bound,
		HostCPUCores: cores, HostMemoryMB: mem,
	}
}

// WithMaxSandboxes is c admitting at most n sandboxes, an operator's
// setting (dsec edge --max-sandboxes); n <= 0 leaves c as it is.
func (c Node) WithMaxSandboxes(n int64) Node {
	if n > 0 {
		c.MaxSandboxes, c.SandboxBound = n, "the operator's setting"
	}
	return c
}

func hostMemoryMB() int64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 1024
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb / 1024
		}
	}
	return 1024
}

// Usage is a running total of admitted sandboxes and their limits.
type Usage struct {
	Sandboxes int64
	CPU       float64
	MemoryMB  int64
}

// Add counts n sandboxes of this size (n < 0 takes them off).
func (u *Usage) Add(cpu float64, mem int64, n int64) {
	u.Sandboxes += n
	u.CPU += cpu * float64(n)
	u.MemoryMB += mem * n
}

// Proto is u on the wire.
func (u Usage) Proto() *edgev1.Usage {
	return &edgev1.Usage{Sandboxes: u.Sandboxes, CpuCores: u.CPU, MemoryMb: u.MemoryMB}
}

// Admit checks that n more sandboxes of this size fit on node beside cur.
// A refusal is a *Refusal naming the resource.
func (c Node) Admit(node string, cur Usage, cpu float64, mem, n int64) error {
	switch {
	case cpu > c.HostCPUCores:
		return errdefs.InvalidArgument("resources.cpu_cores %g: over node %s's %g cores", cpu, node, c.HostCPUCores)
	case mem > c.HostMemoryMB:
		return errdefs.InvalidArgument("resources.memory_mb %d: over node %s's %d MiB", mem, node, c.HostMemoryMB)
	case cur.Sandboxes+n > c.MaxSandboxes:
		return full("sandboxes", errdefs.ResourceExhausted("node full: %d sandboxes, its limit is %d", cur.Sandboxes, c.MaxSandboxes))
	case cur.CPU+cpu*float64(n) > c.CPUCores+1e-9:
		return full("cpu_cores", errdefs.ResourceExhausted("node full: %.1f of %.1f cpu cores free, %g asked", c.CPUCores-cur.CPU, c.CPUCores, cpu*float64(n)))
	case cur.MemoryMB+mem*n > c.MemoryMB:
		return full("memory", errdefs.ResourceExhausted("node full: %d of %d MiB memory free, %d asked", c.MemoryMB-cur.MemoryMB, c.MemoryMB, mem*n))
	}
	return nil
}

// RoomRetryAfter is the pause a create refused for a full node's count,
// CPU or memory asks for (errdefs.RetryAfter): about how long a sandbox
// takes to end and give its room back. A refusal for disk is not marked:
// a full disk seldom frees itself within a client's wait.
const RoomRetryAfter = time.Second

// full is a refusal for want of resource that room freed by ending
// sandboxes answers: the client is asked to send the create again.
func full(resource string, err error) *Refusal {
	return &Refusal{resource, errdefs.RetryAfter(err, RoomRetryAfter)}
}

// Refusal is an admission refused for want of Resource ("sandboxes",
// "cpu_cores", "memory"); it unwraps to its classified error.
type Refusal struct {
	Resource string
	err      error
}

// Refused is err as a refusal for want of resource.
func Refused(resource string, err error) *Refusal { return &Refusal{resource, err} }

func (r *Refusal) Error() string { return r.err.Error() }
func (r *Refusal) Unwrap() error { return r.err }

package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
)

// cmdNodes lists the edges: health, allocation against capacity, backends.
func cmdNodes(ctx context.Context, _ []string) error {
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	r, err := c.Sandboxes.ListNodes(ctx, connect.NewRequest(&sandboxv1.ListNodesRequest{}))
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tADDRESS\tHEALTH\tVERSION\tCGROUP\tSANDBOXES\tCPU CORES\tMEMORY MIB\tBACKENDS")
	for _, n := range r.Msg.Nodes {
		health := "healthy"
		if !n.Healthy {
			health = "unreachable: " + n.Error
		}
		var bs []string
		for name, why := range n.Backends {
			if why != "" {
				name += " (unavailable: " + why + ")"
			} else if d := n.BackendDetails[name]; d != "" {
				name += " (" + d + ")"
			}
			bs = append(bs, name)
		}
		sort.Strings(bs)
		a, cp := n.GetAllocated(), n.GetCapacity()
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d/%d\t%s/%s\t%d/%d\t%s\n", n.Id, n.Address, health, orDash(n.Version), orDash(n.Cgroup),
			a.GetSandboxes(), cp.GetSandboxes(), cores(a.GetCpuCores()), cores(cp.GetCpuCores()), a.GetMemoryMb(), cp.GetMemoryMb(), strings.Join(bs, ", "))
	}
	return tw.Flush()
}

// cores prints a CPU figure to the hundredth of a core: sums of
// fractional allocations carry float noise (127.999999999997).
func cores(v float64) string {
	return strconv.FormatFloat(math.Round(v*100)/100, 'f', -1, 64)
}

// orDash is s, or "-" when it is empty (a column with nothing to say).
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

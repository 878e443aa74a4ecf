package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"text/tabwriter"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
)

const poolUsage = `usage: dsec pool <set IMAGE --size N [--backend B] [--cpu N] [--memory MB] [--disk MB] [--pids N] [--open-files N] [--network] | ls>
  set  keep N sandboxes of IMAGE and shape started on every node, for
       creates of that image and shape to claim (--network: sandboxes
       with a network, for creates with one, which get their policy);
       --size 0 removes the pool. The cluster keeps the setting: a node
       that joins later, or was away, takes it within a minute.
  ls   every node's pools (size, ready, and where the setting came from:
       "api" for the cluster's, "flag" for the node's --pool), then the
       cluster's settings`

// cmdPool sets and lists the nodes' warm pools (root admin keys).
func cmdPool(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return errors.New(poolUsage)
	}
	switch args[0] {
	case "set":
		return poolSet(ctx, args[1:])
	case "ls":
		if len(args) > 1 {
			return errors.New("pool ls: takes no arguments")
		}
		c, err := client.FromEnv()
		if err != nil {
			return err
		}
		resp, err := c.Images.ListPools(ctx, connect.NewRequest(&imagev1.ListPoolsRequest{}))
		if err != nil {
			return err
		}
		return printPools(resp.Msg.Nodes, resp.Msg.Cluster)
	default:
		return fmt.Errorf("pool: unknown verb %q\n%s", args[0], poolUsage)
	}
}

func poolSet(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("pool set", flag.ContinueOnError)
	size := fs.Int("size", -1, "sandboxes each node keeps started (0 removes the pool)")
	backend := fs.String("backend", "container", "the backend its sandboxes run on: container, gvisor or microvm")
	cpu := fs.Float64("cpu", 0, "their vCPUs (0: a create's default)")
	memory := fs.Int64("memory", 0, "their memory in MiB (0: a create's default)")
	disk := fs.Int64("disk", 0, "their disk in MiB (0: a create's default)")
	pids := fs.Int64("pids", 0, "their process and thread bound (0: a create's default)")
	openFiles := fs.Int64("open-files", 0, "their open files per process (0: a create's default)")
	network := fs.Bool("network", false, "they have a network interface (nothing out until a create claims one with its policy)")
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || *size < 0 {
		return errors.New("pool set: usage: dsec pool set IMAGE --size N [--backend B] [--cpu N] [--memory MB] [--disk MB] [--pids N] [--open-files N] [--network]")
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	nodes, err := c.SetPool(ctx, pos[0], *backend, &sandboxv1.Resources{CpuCores: *cpu, MemoryMb: *memory, DiskMb: *disk, Pids: *pids, OpenFiles: *openFiles}, *network, *size)
	if err != nil {
		return err
	}
	return printPools(nodes, nil)
}

// printPools prints each node's pools and the cluster's settings, and
// fails if a node did not answer.
func printPools(nodes []*imagev1.NodePools, cluster []*imagev1.Pool) error {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "NODE\tIMAGE\tBACKEND\tCPU\tMEMORY\tDISK\tNETWORK\tSIZE\tREADY\tSET BY\tNOTE")
	failed := 0
	for _, n := range nodes {
		if n.Error != "" {
			failed++
			fmt.Fprintf(w, "%s\t-\t-\t-\t-\t-\t-\t-\t-\t-\tfailed: %s\n", n.Node, n.Error)
			continue
		}
		if len(n.Pools) == 0 {
			fmt.Fprintf(w, "%s\t(no pools)\t\t\t\t\t\t\t\t\t\n", n.Node)
		}
		for _, p := range n.Pools {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%dM\t%dM\t%v\t%d\t%d\t%s\t%s\n", n.Node, p.Image, p.Backend, cores(p.CpuCores), p.MemoryMb, p.DiskMb, p.Network, p.Size, p.Ready, p.Source, p.Note)
		}
	}
	for _, p := range cluster {
		fmt.Fprintf(w, "(cluster)\t%s\t%s\t%s\t%dM\t%dM\t%v\t%d\t-\tcluster\tevery node keeps it\n", p.Image, p.Backend, cores(p.CpuCores), p.MemoryMb, p.DiskMb, p.Network, p.Size)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("pool: %d of %d nodes failed", failed, len(nodes))
	}
	return nil
}

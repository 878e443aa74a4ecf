package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
)

// cmdFork forks a sandbox and prints one line per copy: its id, or the error.
func cmdFork(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("fork", flag.ExitOnError)
	n := fs.Int("n", 1, "number of copies (1 to 100)")
	timeout := fs.Int64("timeout", 0, "time to live of the copies in seconds (0: the source's)")
	spread := fs.Bool("spread", false, "place each copy on the less loaded of sampled nodes (default: the source's node while it has room)")
	fs.Parse(args)
	if fs.NArg() != 1 {
		return fmt.Errorf("fork: usage: dsec fork [-n N] [--spread] SANDBOX_ID")
	}
	placement := sandboxv1.ForkPlacement_FORK_PLACEMENT_UNSPECIFIED
	if *spread {
		placement = sandboxv1.ForkPlacement_FORK_PLACEMENT_SPREAD
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	resp, err := c.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: fs.Arg(0), Count: int32(*n), TimeoutSeconds: *timeout, Placement: placement}))
	if err != nil {
		return err
	}
	failed := 0
	for _, r := range resp.Msg.Results {
		if r.Sandbox != nil {
			fmt.Println(r.Sandbox.Id)
			continue
		}
		failed++
		fmt.Fprintf(os.Stderr, "dsec: a copy failed: %s: %s\n", r.ErrorCode, r.ErrorMessage)
	}
	fmt.Fprintf(os.Stderr, "source paused %s\n", (time.Duration(resp.Msg.SourcePauseUs) * time.Microsecond).Round(time.Millisecond))
	if resp.Msg.SourceError != "" {
		return fmt.Errorf("fork: the source was lost: %s", resp.Msg.SourceError)
	}
	if failed > 0 {
		return fmt.Errorf("fork: %d of %d copies failed", failed, len(resp.Msg.Results))
	}
	return nil
}

// cmdSnapshot: snapshot ID | snapshot ls [ID] | snapshot rm SNAP... | snapshot restore SNAP
func cmdSnapshot(ctx context.Context, args []string) error {
	usage := fmt.Errorf("snapshot: usage: dsec snapshot SANDBOX_ID | ls [SANDBOX_ID] | rm SNAPSHOT_ID... | restore SNAPSHOT_ID")
	if len(args) == 0 {
		return usage
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	switch args[0] {
	case "ls":
		req := &sandboxv1.ListSnapshotsRequest{}
		if len(args) > 1 {
			req.SandboxId = args[1]
		}
		resp, err := c.Sandboxes.ListSnapshots(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "ID\tSOURCE\tPROJECT\tSIZE\tAGE")
		for _, s := range resp.Msg.Snapshots {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%.1f MiB\t%s\n", s.Id, s.SourceSandboxId, s.Project, float64(s.SizeBytes)/(1<<20), time.Since(s.CreatedAt.AsTime()).Round(time.Second))
		}
		return tw.Flush()
	case "rm":
		for _, id := range args[1:] {
			if _, err := c.Sandboxes.DeleteSnapshot(ctx, connect.NewRequest(&sandboxv1.DeleteSnapshotRequest{SnapshotId: id})); err != nil {
				return fmt.Errorf("rm %s: %s", id, describe(err))
			}
			fmt.Println(id)
		}
		return nil
	case "restore":
		if len(args) != 2 {
			return usage
		}
		resp, err := c.Sandboxes.RestoreSnapshot(ctx, connect.NewRequest(&sandboxv1.RestoreSnapshotRequest{SnapshotId: args[1]}))
		if err != nil {
			return err
		}
		fmt.Println(resp.Msg.Sandbox.Id)
		return nil
	}
	if len(args) != 1 {
		return usage
	}
	resp, err := c.Sandboxes.SnapshotSandbox(ctx, connect.NewRequest(&sandboxv1.SnapshotSandboxRequest{SandboxId: args[0]}))
	if err != nil {
		return err
	}
	fmt.Println(resp.Msg.Snapshot.Id)
	return nil
}

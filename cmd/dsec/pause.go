package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
)

// cmdPause is dsec pause and dsec resume: of sandboxes by id, or of every
// sandbox of a task (--task), at a depth (--offload, --filesystem).
func cmdPause(ctx context.Context, verb string, args []string) error {
	fs := flag.NewFlagSet(verb, flag.ExitOnError)
	task := fs.String("task", "", "every sandbox of this task label, on every node, in parallel")
	offload, filesystem := false, false
	if verb == "pause" {
		fs.BoolVar(&offload, "offload", false, "write memory to the node's disk and give it back (gvisor); frozen where the backend cannot")
		fs.BoolVar(&filesystem, "filesystem", false, "keep the files only: every process ends, and the resume starts the sandbox afresh (a new boot id, the image's service)")
	}
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: dsec %s [flags] ID... | dsec %s --task TASK [flags]\n", verb, verb)
		fs.PrintDefaults()
	}
	fs.Parse(args)
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	depth := sandboxv1.PauseDepth_PAUSE_DEPTH_FREEZE
	switch {
	case offload && filesystem:
		return fmt.Errorf("%s: --offload or --filesystem, not both", verb)
	case offload:
		depth = sandboxv1.PauseDepth_PAUSE_DEPTH_OFFLOAD
	case filesystem:
		depth = sandboxv1.PauseDepth_PAUSE_DEPTH_FILESYSTEM
	}
	switch {
	case *task != "" && fs.NArg() > 0:
		return fmt.Errorf("%s: name sandbox ids or --task, not both", verb)
	case *task != "":
		return pauseTask(ctx, c, verb, *task, depth)
	case fs.NArg() == 0:
		return fmt.Errorf("%s: name sandbox ids, or --task TASK", verb)
	}
	for _, id := range fs.Args() {
		var note string
		if verb == "pause" {
			out, perr := c.Sandbox(id).Pause(ctx, depth)
			err = perr
			if out != nil {
				note = noteOf(out.MemoryReleasedBytes, out.Note)
			}
		} else {
			_, err = c.Sandboxes.ResumeSandbox(ctx, connect.NewRequest(&sandboxv1.ResumeSandboxRequest{SandboxId: id}))
		}
		if err != nil {
			return fmt.Errorf("%s %s: %s", verb, id, describe(err))
		}
		fmt.Println(strings.TrimSpace(id + " " + note))
	}
	return nil
}

// pauseTask pauses or resumes a task and prints a line per sandbox; it
// fails if any sandbox did.
func pauseTask(ctx context.Context, c *client.Client, verb, task string, depth sandboxv1.PauseDepth) error {
	began := time.Now()
	var results []*sandboxv1.TaskSandboxResult
	var released int64
	if verb == "pause" {
		out, err := c.PauseTask(ctx, task, depth)
		if err != nil {
			return fmt.Errorf("pause --task %s: %s", task, describe(err))
		}
		results, released = out.Results, out.MemoryReleasedBytes
	} else {
		out, err := c.ResumeTask(ctx, task)
		if err != nil {
			return fmt.Errorf("resume --task %s: %s", task, describe(err))
		}
		results = out.Results
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SANDBOX\tNODE\tSTATE\tTOOK\tNOTE")
	failed := 0
	for _, r := range results {
		state, note := "", noteOf(r.MemoryReleasedBytes, r.Note)
		if r.Sandbox != nil {
			state = strings.ToLower(strings.TrimPrefix(r.Sandbox.State.String(), "SANDBOX_STATE_"))
			if d := r.Sandbox.PauseDepth; d != sandboxv1.PauseDepth_PAUSE_DEPTH_UNSPECIFIED {
				state += " (" + strings.ToLower(strings.TrimPrefix(d.String(), "PAUSE_DEPTH_")) + ")"
			}
		}
		if r.ErrorCode != "" {
			failed++
			state, note = "error", r.ErrorCode+": "+r.ErrorMessage
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r.SandboxId, r.NodeId, state, (time.Duration(r.TookUs) * time.Microsecond).Round(time.Millisecond), note)
	}
	tw.Flush()
	fmt.Printf("%d sandboxes of task %s in %s", len(results), task, time.Since(began).Round(time.Millisecond))
	if released > 0 {
		fmt.Printf("; %s of memory given back", mib(released))
	}
	fmt.Println()
	if failed > 0 {
		return fmt.Errorf("%s --task %s: %d of %d failed", verb, task, failed, len(results))
	}
	return nil
}

func noteOf(released int64, note string) string {
	if released > 0 {
		note = strings.TrimSpace(mib(released) + " given back " + note)
	}
	return note
}

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

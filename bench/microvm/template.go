package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/agentlink"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/sparsefile"
)

// createToAnswer creates n+1 sandboxes of spec one after another, each
// until its first command answers, and returns the last n (the first makes
// the image's root disk and, with templates on, its template) and the
// creates' own part of each.
func createToAnswer(ctx context.Context, cl *client.Client, spec *sandboxv1.SandboxSpec, n int) (answered, created []time.Duration, err error) {
	for i := range n + 1 {
		t0 := time.Now()
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			return nil, nil, err
		}
		took := time.Since(t0)
		r, err := sb.Shell(ctx, "true")
		if err != nil || r.ExitCode != 0 {
			return nil, nil, fmt.Errorf("first exec: %v %v", r, err)
		}
		if i > 0 {
			answered, created = append(answered, time.Since(t0)), append(created, took)
		}
		sb.Stop(ctx) //nolint:errcheck // measured
	}
	return answered, created, nil
}

// coldCreates is createToAnswer on a cluster whose microvm backend boots
// every guest (templates off).
func coldCreates(ctx context.Context, store, agent, guest, init string, spec *sandboxv1.SandboxSpec, n int) ([]time.Duration, error) {
	c, err := benchcluster.Start(ctx, store, agent, benchcluster.Backend{Name: target.name, Factory: target.factory,
		Config: map[string]string{"guest": guest, "init": init, "templates": "off"}}, nil)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return nil, err
	}
	answered, _, err := createToAnswer(ctx, cl, spec, n)
	return answered, err
}

// findTemplate is the template snapshot the cluster in work made.
func findTemplate(work string) (string, error) {
	var found string
	err := filepath.WalkDir(work, func(path string, d fs.DirEntry, err error) error {
		if err != nil || found != "" {
			return fs.SkipDir
		}
		if d.Name() == "ready" && filepath.Base(filepath.Dir(filepath.Dir(path))) == "templates" {
			found = filepath.Dir(path)
		}
		return nil
	})
	if found == "" {
		return "", fmt.Errorf("no template snapshot under %s (%v)", work, err)
	}
	return found, nil
}

// bareCopy is a bare QEMU restore of a template: its guest, its agent's
// link, and what ends both.
type bareCopy struct {
	guest *microvm.BareGuest
	link  *agentlink.Link
	end   func()
}

// bareRestore restores the template tpl with bare QEMU steps and returns
// how long until the guest runs and until its agent answers.
func bareRestore(ctx context.Context, q *microvm.QEMU, tpl string) (running, answered time.Duration, err error) {
	c, running, answered, err := startBareCopy(ctx, q, tpl)
	if err == nil {
		c.end()
	}
	return running, answered, err
}

// startBareCopy restores tpl with bare QEMU steps, until its agent
// answers.
func startBareCopy(ctx context.Context, q *microvm.QEMU, tpl string) (c *bareCopy, running, answered time.Duration, err error) {
	dir, err := os.MkdirTemp("", "dsec-bench-restore-")
	if err != nil {
		return nil, 0, 0, err
	}
	c = &bareCopy{end: func() { os.RemoveAll(dir) }}
	fail := func(err error) (*bareCopy, time.Duration, time.Duration, error) {
		c.end()
		return nil, 0, 0, err
	}
	var g microvm.Guest
	data, err := os.ReadFile(filepath.Join(tpl, "guest.json"))
	if err == nil {
		err = json.Unmarshal(data, &g)
	}
	if err != nil {
		return fail(err)
	}
	g.RootDisk, g.Initrd, g.WritableDisk = filepath.Join(tpl, "root.ext4"), filepath.Join(tpl, "initrd.cpio"), filepath.Join(dir, "rw.ext4")
	if err := sparsefile.Copy(ctx, filepath.Join(tpl, "rw.ext4"), g.WritableDisk, 1); err != nil {
		return fail(err)
	}
	if c.link, err = agentlink.Listen(filepath.Join(dir, "a.sock"), nil); err != nil {
		return fail(err)
	}
	c.end = func() { c.link.Close(); os.RemoveAll(dir) }
	g.AgentChardev = "socket,id=agent,path=" + c.link.Path() + ",server=off,reconnect=1"
	g.MemFile, g.MemShared, g.Incoming, g.Console = filepath.Join(tpl, "mem"), false, true, filepath.Join(dir, "console.log")
	t0 := time.Now()
	if c.guest, err = q.StartBare(ctx, dir, g); err != nil {
		return fail(err)
	}
	c.end = func() { c.guest.Kill(); c.link.Close(); os.RemoveAll(dir) }
	if err := c.guest.Incoming(ctx, filepath.Join(tpl, "state")); err != nil {
		return fail(err)
	}
	running = time.Since(t0)
	wait, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := c.link.WaitServing(wait); err != nil {
		return fail(fmt.Errorf("bare restore: the agent did not answer: %w", err))
	}
	return c, running, time.Since(t0), nil
}

// printCreateTable prints the create figures of one run.
func printCreateTable(host, accel string, n int, bootBare, restoreRunning, restoreAnswered, templated, templatedCreate, cold []time.Duration) {
	fmt.Printf("%s create (%s), median of %d (machine %s, accelerator %s)\n", target.name, target.image, n, host, accel)
	row := func(name string, d time.Duration) { fmt.Printf("%-62s %8s\n", name, benchstat.Ms(d, 0)) }
	row("bare QEMU restore of the template to a running guest", median(restoreRunning))
	row("bare QEMU restore of the template to the agent's answer", median(restoreAnswered))
	row("bare QEMU boot to the init's marker (probe)", median(bootBare))
	fmt.Printf("%-62s %8s  (create answered after %s)\n", "dsec create (template) to the first command's answer", benchstat.Ms(median(templated), 0), benchstat.Ms(median(templatedCreate), 0))
	row("dsec create (templates off: a boot) to the first answer", median(cold))
	ratio := func(a, b []time.Duration) float64 { return float64(median(a)) / float64(median(b)) }
	fmt.Printf("ratio ours / bare restore to running: %.2fx; to the agent's answer: %.2fx; template / cold create: %.2fx\n",
		ratio(templated, restoreRunning), ratio(templated, restoreAnswered), ratio(templated, cold))
}

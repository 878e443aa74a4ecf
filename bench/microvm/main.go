// Command microvm measures the microvm backend against what it wraps, in
// one run: create to the first answered command, through the apiserver,
// (a restore of the node's template snapshot of the image) against a bare
// QEMU restore of that snapshot (to a running guest, and to its agent's
// answer), a bare QEMU boot of the same guest kernel to its init's marker
// (the backend's probe boot) and a create with templates off (a boot),
// medians of -n runs; and fork(count) with
// memory, until every copy answers, against the bare QEMU steps (stop +
// migrate of a shared-RAM guest, then count -incoming QEMUs), gvisor's
// fork of the same image and preparation, and count cold creates that
// each prepare; and the memory of the copies against cold guests. Needs
// root, QEMU, runsc, the guest kernel (make deps), bin/dsec-vminit and
// bin/aether (make build) and root/busybox:latest (make images).
//
// With -backend vm the same is measured of the vm backend (QEMU's q35
// machine with its firmware) against bare q35 steps; -image
// root/debian-systemd:13 has its guests boot systemd, and an image with a
// kernel of its own (root/debian-kernel:13) is also booted bare: q35, its
// kernel and initramfs, its root as one disk, to systemd's local-fs.target
// (where a vm sandbox's systemd starts the agent) and to its default
// target, against the create that boots it (templates off).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/edge/backend/gvisor"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/edge/backend/vm"
	"github.com/opendsec/opendsec/internal/embed"
	"github.com/opendsec/opendsec/internal/spawn"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with root/busybox:latest")
	agent := flag.String("agent", "bin/aether", "aether binary")
	init := flag.String("init", "bin/dsec-vminit", "the guest's init")
	guest := flag.String("guest", ".cache/guest", "the guest kernel (scripts/guest-kernel.sh)")
	n := flag.Int("n", 5, "runs of each")
	countList := flag.String("counts", "1,4,8", "fork counts")
	reps := flag.Int("reps", 3, "runs per fork count; the table shows the median by ours")
	concurrent := flag.Int("concurrent", 0, "also fork this many copies at once against as many bare restores (0: not)")
	flag.StringVar(&target.name, "backend", microvm.Name, "the backend measured: microvm, or vm (q35)")
	flag.StringVar(&target.image, "image", "root/busybox:latest", "the image its sandboxes run")
	flag.Parse()
	switch target.name {
	case microvm.Name:
		target.machine, target.factory = microvm.MachineMicrovm, microvm.New
	case vm.Name:
		target.machine, target.factory = microvm.MachineQ35, vm.New
	default:
		fmt.Fprintf(os.Stderr, "bench: -backend %q: want microvm or vm\n", target.name)
		os.Exit(2)
	}
	var counts []int
	for _, f := range strings.Split(*countList, ",") {
		c, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || c < 1 {
			fmt.Fprintf(os.Stderr, "bench: -counts %q: want positive numbers, comma-separated\n", *countList)
			os.Exit(2)
		}
		counts = append(counts, c)
	}
	if err := run(context.Background(), *store, *agent, *init, *guest, *n, counts, max(*reps, 1), *concurrent); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// target is the backend measured (-backend) and its image (-image).
var target struct {
	name, image, machine string
	factory              backend.Factory
}

func median(d []time.Duration) time.Duration {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d[len(d)/2]
}

func run(ctx context.Context, store, agent, init, guest string, n int, counts []int, reps, concurrent int) error {
	for _, p := range []*string{&init, &guest} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return err
		}
		*p = abs
	}
	q := &microvm.QEMU{Binary: "qemu-system-x86_64", Kernel: filepath.Join(guest, "vmlinux"), Init: init, Modules: filepath.Join(guest, "modules"), Machine: target.machine}
	if mods := filepath.Join(guest, "modules.img"); target.machine == microvm.MachineQ35 {
		if _, err := os.Stat(mods); err == nil {
			q.ModulesDisk = mods // as the vm backend's guests have it
		}
	}
	var bare []time.Duration
	accel := ""
	for range n {
		dir, err := os.MkdirTemp("", "dsec-bench-probe-")
		if err != nil {
			return err
		}
		res, err := q.Probe(ctx, dir)
		os.RemoveAll(dir)
		if err != nil {
			return err
		}
		bare, accel = append(bare, res.Boot), res.Accel
	}
	memory := int64(256)
	if target.machine == microvm.MachineQ35 {
		memory = 512 // an image's systemd beside the agent
	}
	spec := &sandboxv1.SandboxSpec{Backend: target.name, Image: target.image, Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: memory, DiskMb: 256}}
	cold, err := coldCreates(ctx, store, agent, guest, init, spec, n)
	if err != nil {
		return err
	}
	// Room for the concurrent fork's copies (1 core each) beside its source.
	roomy := func(cfg *embed.Config) { cfg.CPUOvercommit = float64(max(8, concurrent)) }
	c, err := benchcluster.Start(ctx, store, agent, benchcluster.Backend{Name: target.name, Factory: target.factory, Config: map[string]string{"guest": guest, "init": init}}, roomy)
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	ours, creates, err := createToAnswer(ctx, cl, spec, n)
	if err != nil {
		return err
	}
	tpl, err := findTemplate(c.Work)
	if err != nil {
		return err
	}
	var restoreRunning, restoreAnswered []time.Duration
	for range n {
		running, answered, err := bareRestore(ctx, q, tpl)
		if err != nil {
			return err
		}
		restoreRunning, restoreAnswered = append(restoreRunning, running), append(restoreAnswered, answered)
	}
	host, _ := os.Hostname()
	printCreateTable(host, accel, n, bare, restoreRunning, restoreAnswered, ours, creates, cold)
	if target.machine == microvm.MachineQ35 {
		localFS, booted, err := bareImageBoot(ctx, store, target.image, accel, memory, n)
		if err != nil {
			return err
		}
		if localFS != nil {
			fmt.Printf("%-62s %8s\n", "bare q35 boot of the image, its kernel, to local-fs.target", benchstat.Ms(median(localFS), 0))
			fmt.Printf("%-62s %8s\n", "  ... and to its default target (the whole boot)", benchstat.Ms(median(booted), 0))
			fmt.Printf("ratio cold create (a boot) to the first answer / bare boot to local-fs.target (where ours starts its agent): %.2fx\n", float64(median(cold))/float64(median(localFS)))
		}
	}
	if err := pauseResume(ctx, cl, q, spec, tpl, n); err != nil {
		return fmt.Errorf("pause and resume: %w", err)
	}
	if err := forks(ctx, cl, q, spec, store, agent, counts, reps); err != nil {
		return err
	}
	if concurrent > 0 {
		return concurrentRestores(ctx, cl, q, spec, agent, concurrent)
	}
	return nil
}

// concurrentRestores forks one prepared source into n copies at once
// through the API, until every copy answers, against n bare QEMU restores
// of one snapshot started at once, until every one runs.
func concurrentRestores(ctx context.Context, cl *client.Client, q *microvm.QEMU, spec *sandboxv1.SandboxSpec, agent string, n int) error {
	ours, paused, ids, err := forkOnce(ctx, cl, spec, n)
	if err != nil {
		return fmt.Errorf("%s fork(%d): %w", target.name, n, err)
	}
	mem := pss(ids)
	for _, id := range ids {
		cl.Sandbox(id).Stop(ctx) //nolint:errcheck // measured
	}
	bare, stopped, err := bareFork(ctx, q, agent, int(spec.Resources.MemoryMb), n)
	if err != nil {
		return fmt.Errorf("bare fork(%d): %w", n, err)
	}
	fmt.Printf("\n%d copies of one snapshot at once: %s fork %s until every copy answers (source paused %s; copies' QEMU PSS %d MiB); bare QEMU %s until every copy runs (stopped %s); %.2fx\n",
		n, target.name, benchstat.Ms(ours, 0), benchstat.Ms(paused, 0), mem>>20, benchstat.Ms(bare, 0), benchstat.Ms(stopped, 0), float64(ours)/float64(bare))
	return nil
}

// forks runs the fork table: for each count, fork through the API, the
// bare QEMU steps, gvisor's fork of the same image and preparation, and
// cold creates that each prepare; then the memory of the largest count's
// copies against as many cold guests.
func forks(ctx context.Context, cl *client.Client, q *microvm.QEMU, spec *sandboxv1.SandboxSpec, store, agent string, counts []int, reps int) error {
	g, err := benchcluster.Start(ctx, store, agent, benchcluster.Backend{Name: gvisor.Name, Factory: gvisor.New}, nil)
	if err != nil {
		return err
	}
	defer g.Close()
	gcl, err := client.New(g.APIURL, benchstat.EnvValue(g.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	gspec := &sandboxv1.SandboxSpec{Backend: "gvisor", Image: spec.Image, Resources: spec.Resources}
	stop := func(c *client.Client, ids []string) {
		for _, id := range ids {
			c.Sandbox(id).Stop(ctx) //nolint:errcheck // measured
		}
	}
	var rows []forkRow
	var memOurs, memCold int64
	for _, count := range counts {
		var runs []forkRow
		for rep := range reps {
			r := forkRow{count: count}
			var ids []string
			if r.ours, r.oursPause, ids, err = forkOnce(ctx, cl, spec, count); err != nil {
				return fmt.Errorf("%s fork(%d): %w", target.name, count, err)
			}
			last := rep == reps-1 && count == counts[len(counts)-1]
			if last {
				memOurs = pss(ids)
			}
			stop(cl, ids)
			if r.bare, r.barePause, err = bareFork(ctx, q, agent, int(spec.Resources.MemoryMb), count); err != nil {
				return fmt.Errorf("bare fork(%d): %w", count, err)
			}
			if r.gvisor, r.gvisorPause, ids, err = forkOnce(ctx, gcl, gspec, count); err != nil {
				return fmt.Errorf("gvisor fork(%d): %w", count, err)
			}
			stop(gcl, ids)
			if r.cold, ids, err = coldOnce(ctx, cl, spec, count); err != nil {
				return fmt.Errorf("%d cold creates: %w", count, err)
			}
			if last {
				memCold = pss(ids)
			}
			stop(cl, ids)
			runs = append(runs, r)
		}
		rows = append(rows, medianRow(runs))
	}
	printForkTable(rows)
	n := counts[len(counts)-1]
	fmt.Printf("\nQEMU memory (PSS) of %d forked copies: %d MiB; of %d cold guests, each with the same 32 MiB written: %d MiB (%.2fx)\n",
		n, memOurs>>20, n, memCold>>20, float64(memOurs)/float64(memCold))
	return nil
}

// pss sums the proportional set size of the QEMU processes of sandboxes.
func pss(ids []string) int64 {
	var total int64
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		cmdline, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(cmdline), "qemu-system") {
			continue
		}
		for _, id := range ids {
			if !strings.Contains(string(cmdline), id) {
				continue
			}
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
			if b, err := spawn.ReadPSS(pid); err == nil { // 0 when unreadable
				total += b
			}
		}
	}
	return total
}

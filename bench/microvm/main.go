// Command microvm measures a microvm sandbox's create to its first answered
// command, through the apiserver, against a bare QEMU boot of the same
// guest kernel to its init's marker (the backend's probe boot), in one run,
// medians of -n runs each. Needs root, QEMU, the guest kernel (make deps),
// bin/dsec-vminit and bin/aether (make build) and root/busybox:latest
// (make images).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"connectrpc.com/connect"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
)

func main() {
	store := flag.String("store", ".cache/images", "image store with root/busybox:latest")
	agent := flag.String("agent", "bin/aether", "aether binary")
	init := flag.String("init", "bin/dsec-vminit", "the guest's init")
	guest := flag.String("guest", ".cache/guest", "the guest kernel (scripts/guest-kernel.sh)")
	n := flag.Int("n", 5, "runs of each")
	flag.Parse()
	if err := run(context.Background(), *store, *agent, *init, *guest, *n); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func median(d []time.Duration) time.Duration {
	sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	return d[len(d)/2]
}

func run(ctx context.Context, store, agent, init, guest string, n int) error {
	for _, p := range []*string{&init, &guest} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			return err
		}
		*p = abs
	}
	q := &microvm.QEMU{Binary: "qemu-system-x86_64", Kernel: filepath.Join(guest, "vmlinux"), Init: init, Modules: filepath.Join(guest, "modules")}
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
	c, err := benchcluster.Start(ctx, store, agent, benchcluster.Backend{Name: microvm.Name, Factory: microvm.New, Config: map[string]string{"guest": guest, "init": init}}, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	spec := &sandboxv1.SandboxSpec{Backend: "microvm", Image: "root/busybox:latest", Resources: &sandboxv1.Resources{CpuCores: 1, MemoryMb: 256, DiskMb: 256}}
	var ours, creates []time.Duration
	for i := range n + 1 {
		t0 := time.Now()
		sb, err := cl.Create(ctx, spec)
		if err != nil {
			return err
		}
		created := time.Since(t0)
		r, err := sb.Shell(ctx, "true")
		if err != nil || r.ExitCode != 0 {
			return fmt.Errorf("first exec: %v %v", r, err)
		}
		if i > 0 { // the first builds the image's root disk
			ours, creates = append(ours, time.Since(t0)), append(creates, created)
		}
		sb.Stop(ctx) //nolint:errcheck // measured
	}
	host, _ := os.Hostname()
	fmt.Printf("microvm boot, median of %d (machine %s, accelerator %s)\n", n, host, accel)
	fmt.Printf("%-56s %8s\n", "bare QEMU boot to the init's marker (probe)", benchstat.Ms(median(bare), 0))
	fmt.Printf("%-56s %8s  (create answered after %s)\n", "dsec create to the first command's answer", benchstat.Ms(median(ours), 0), benchstat.Ms(median(creates), 0))
	fmt.Printf("ratio ours / bare: %.2fx\n", float64(median(ours))/float64(median(bare)))
	return forkVsCold(ctx, cl, spec, 4)
}

// forkVsCold forks a sandbox into count copies (with memory) and makes
// count sandboxes cold, each until every one answers a command, and sums
// the QEMU processes' proportional memory (PSS) of each set.
func forkVsCold(ctx context.Context, cl *client.Client, spec *sandboxv1.SandboxSpec, count int) error {
	src, err := cl.Create(ctx, spec)
	if err != nil {
		return err
	}
	defer src.Stop(ctx) //nolint:errcheck // measured
	if _, err := src.Shell(ctx, "dd if=/dev/urandom of=/tmp/state bs=1M count=32 2>/dev/null"); err != nil {
		return err
	}
	answered := func(ids []string) error {
		errs := make(chan error, len(ids))
		for _, id := range ids {
			go func() {
				r, err := cl.Sandbox(id).Shell(ctx, "true")
				if err == nil && r.ExitCode != 0 {
					err = fmt.Errorf("exit %d", r.ExitCode)
				}
				errs <- err
			}()
		}
		for range ids {
			if err := <-errs; err != nil {
				return err
			}
		}
		return nil
	}
	t0 := time.Now()
	resp, err := cl.Sandboxes.ForkSandbox(ctx, connect.NewRequest(&sandboxv1.ForkSandboxRequest{SandboxId: src.ID, Count: int32(count)}))
	if err != nil {
		return err
	}
	var forked []string
	for _, r := range resp.Msg.Results {
		if r.Sandbox == nil {
			return fmt.Errorf("copy: %s %s", r.ErrorCode, r.ErrorMessage)
		}
		forked = append(forked, r.Sandbox.Id)
	}
	if err := answered(forked); err != nil {
		return err
	}
	forkTook := time.Since(t0)
	forkPSS := pss(forked)
	t0 = time.Now()
	var cold []string
	made := make(chan string, count)
	for range count {
		go func() {
			sb, err := cl.Create(ctx, spec)
			if err != nil {
				made <- ""
				return
			}
			made <- sb.ID
		}()
	}
	for range count {
		if id := <-made; id != "" {
			cold = append(cold, id)
		}
	}
	if len(cold) != count {
		return fmt.Errorf("%d of %d cold creates failed", count-len(cold), count)
	}
	if err := answered(cold); err != nil {
		return err
	}
	coldTook := time.Since(t0)
	// The cold ones touch the same 32 MiB the source did, for a fair PSS.
	for _, id := range cold {
		cl.Sandbox(id).Shell(ctx, "dd if=/dev/urandom of=/tmp/state bs=1M count=32 2>/dev/null") //nolint:errcheck // measured below
	}
	coldPSS := pss(cold)
	for _, id := range append(forked, cold...) {
		cl.Sandbox(id).Stop(ctx) //nolint:errcheck // measured
	}
	fmt.Printf("%-56s %8s  (source paused %s)\n", fmt.Sprintf("fork(%d) until every copy answers", count), benchstat.Ms(forkTook, 0), benchstat.Ms(time.Duration(resp.Msg.SourcePauseUs)*time.Microsecond, 0))
	fmt.Printf("%-56s %8s\n", fmt.Sprintf("%d cold creates until every one answers", count), benchstat.Ms(coldTook, 0))
	fmt.Printf("QEMU memory (PSS) of the %d copies %d MiB, of %d cold guests with the same 32 MiB written %d MiB\n", count, forkPSS>>20, count, coldPSS>>20)
	fmt.Printf("ratio fork / cold: time %.2fx, memory %.2fx\n", float64(forkTook)/float64(coldTook), float64(forkPSS)/float64(coldPSS))
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
			data, _ := os.ReadFile(filepath.Join(filepath.Dir(p), "smaps_rollup"))
			for _, line := range strings.Split(string(data), "\n") {
				if v, ok := strings.CutPrefix(line, "Pss:"); ok {
					var kb int64
					fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb) //nolint:errcheck // 0 when unreadable
					total += kb << 10
				}
			}
		}
	}
	return total
}

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
	"time"

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
	return nil
}

// Command images benchmarks what the images issue builds, one run on one
// machine, each beside the raw work it wraps:
//   - commit of a container sandbox holding -commit-mib MiB of changes
//     (create to image named) against `tar -cz` of the same upper
//     directory, the bare packing;
//   - a Dockerfile rebuild with every step cached against its first build;
//   - the first sandbox of a -image-mib MiB image on a node that never ran
//     it (its layers unpacked first) against the next sandbox there
//     (create to first exec).
//
// Needs root, crun, tar and the agent; uses a scratch image store.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	agentv1 "github.com/opendsec/opendsec/api/gen/opendsec/agent/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/bench/internal/benchcluster"
	"github.com/opendsec/opendsec/bench/internal/benchstat"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/build"
	"github.com/opendsec/opendsec/internal/edge/backend/container"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/image/baseimage"
)

func main() {
	commitMiB := flag.Int("commit-mib", 100, "MiB a committed sandbox changed")
	imageMiB := flag.Int("image-mib", 500, "MiB of the image a cold node starts")
	agent := flag.String("agent", "bin/aether", "aether binary")
	flag.Parse()
	if err := run(context.Background(), *commitMiB, *imageMiB, *agent); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func ms(d time.Duration) string { return benchstat.Ms(d, 0) }

func run(ctx context.Context, commitMiB, imageMiB int, agent string) error {
	storeDir, err := os.MkdirTemp("", "dsec-bench-images-store-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(storeDir)
	store, err := image.OpenStore(storeDir)
	if err != nil {
		return err
	}
	ref, _ := image.ParseRef("root/busybox:latest")
	if _, err := baseimage.Build(ctx, store, "busybox", ref, baseimage.Options{}); err != nil {
		return err
	}
	be := benchcluster.Backend{Name: container.Name, Factory: container.New, Config: map[string]string{"runtime": "crun"}}
	c, err := benchcluster.Start(ctx, storeDir, agent, be, nil)
	if err != nil {
		return err
	}
	cl, err := client.New(c.APIURL, benchstat.EnvValue(c.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		c.Close()
		return err
	}
	res := &sandboxv1.Resources{CpuCores: 1, MemoryMb: 512, DiskMb: int64(max(commitMiB, imageMiB)*2 + 256)}

	// Commit of commitMiB of changes, against tar -cz of the upper dir.
	sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: res})
	if err != nil {
		c.Close()
		return err
	}
	if r, err := sb.Shell(ctx, fmt.Sprintf("mkdir -p /data && for i in $(seq 1 %d); do head -c 1048576 /dev/urandom > /data/f$i; done", commitMiB)); err != nil || r.ExitCode != 0 {
		c.Close()
		return fmt.Errorf("write the changes: %v %s", err, r.GetStderr())
	}
	t0 := time.Now()
	if _, err := sb.Commit(ctx, "root/changed:1"); err != nil {
		c.Close()
		return err
	}
	commit := time.Since(t0)
	upper := filepath.Join(c.Work, "state", "edge", "layers")
	var upperDir string
	filepath.Walk(upper, func(p string, fi os.FileInfo, err error) error { //nolint:errcheck // a search
		if err == nil && fi.IsDir() && filepath.Base(p) == "upper" && upperDir == "" {
			if _, e := os.Stat(filepath.Join(p, "data")); e == nil {
				upperDir = p
			}
		}
		return nil
	})
	var tarTime time.Duration
	if upperDir != "" {
		t0 = time.Now()
		if out, err := exec.Command("tar", "-cz", "-f", filepath.Join(c.Work, "upper.tar.gz"), "-C", upperDir, ".").CombinedOutput(); err != nil {
			c.Close()
			return fmt.Errorf("tar: %v %s", err, out)
		}
		tarTime = time.Since(t0)
	}
	sb.Stop(ctx)
	fmt.Printf("commit of %d MiB of changes: ours %s  tar -cz of the upper dir %s  ratio %.2f\n", commitMiB, ms(commit), ms(tarTime), commit.Seconds()/tarTime.Seconds())

	// A Dockerfile rebuild with every step cached, against its first build.
	dir, _ := os.MkdirTemp("", "dsec-bench-build-")
	defer os.RemoveAll(dir)
	os.WriteFile(filepath.Join(dir, "app.txt"), []byte("app\n"), 0o644)
	df := "FROM root/busybox:latest\nENV A=1\nCOPY app.txt /app/\nRUN echo built > /app/built\nWORKDIR /app\nRUN cat built app.txt > both\nCMD [\"cat\", \"both\"]\n"
	ins, err := build.Parse(stringsReader(df))
	if err != nil {
		c.Close()
		return err
	}
	target := &build.ClientTarget{C: cl, Backend: "container"}
	var times [2]time.Duration
	for i := range times {
		t0 = time.Now()
		r, err := build.Build(ctx, target, ins, build.Options{Context: dir, Tag: "root/built:1", CacheProject: "root"})
		if err != nil {
			c.Close()
			return err
		}
		times[i] = time.Since(t0)
		if i == 1 && r.Cached != 3 {
			c.Close()
			return fmt.Errorf("the rebuild ran %d of 3 steps again", 3-r.Cached)
		}
	}
	fmt.Printf("Dockerfile of 7 steps (3 layers): first build %s  rebuild, all cached %s  ratio %.3f\n", ms(times[0]), ms(times[1]), times[1].Seconds()/times[0].Seconds())

	// An image of imageMiB, first sandbox on a node that never ran it.
	sb, err = cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/busybox:latest", Resources: res})
	if err != nil {
		c.Close()
		return err
	}
	if r, err := sb.Shell(ctx, fmt.Sprintf("mkdir -p /big && for i in $(seq 1 %d); do head -c 1048576 /dev/urandom > /big/f$i; done", imageMiB)); err != nil || r.ExitCode != 0 {
		c.Close()
		return fmt.Errorf("write the image's files: %v", err)
	}
	if _, err := sb.Commit(ctx, "root/big:1"); err != nil {
		c.Close()
		return err
	}
	sb.Stop(ctx)
	c.Close()
	cold, err := benchcluster.Start(ctx, storeDir, agent, be, nil) // a new node: an empty layer cache
	if err != nil {
		return err
	}
	defer cold.Close()
	cl, err = client.New(cold.APIURL, benchstat.EnvValue(cold.ClientEnv, "DSEC_API_KEY"))
	if err != nil {
		return err
	}
	var first [2]time.Duration
	for i := range first {
		t0 = time.Now()
		sb, err := cl.Create(ctx, &sandboxv1.SandboxSpec{Backend: "container", Image: "root/big:1", Resources: res})
		if err != nil {
			return err
		}
		if r, err := sb.Run(ctx, &agentv1.ProcessConfig{Args: []string{"true"}}); err != nil || r.ExitCode != 0 {
			return fmt.Errorf("first exec: %v", err)
		}
		first[i] = time.Since(t0)
		sb.Stop(ctx)
	}
	how := "its layers unpacked on the node first"
	big, _ := image.ParseRef("root/big:1")
	if st, err := image.OpenStore(storeDir); err == nil {
		if im, err := st.Resolve(big); err == nil && st.HasEROFS(im.Manifest.Layers[len(im.Manifest.Layers)-1].Digest) {
			how = "its layers mounted from their EROFS forms in the store, nothing unpacked"
		}
	}
	fmt.Printf("first sandbox of a %d MiB image: on a node that never ran it %s  on one that did %s  ratio %.2f (%s)\n", imageMiB, ms(first[0]), ms(first[1]), first[0].Seconds()/first[1].Seconds(), how)
	return nil
}

func stringsReader(s string) *strings.Reader { return strings.NewReader(s) }

// Command vmroot benchmarks a microVM root disk as the microvm backend
// makes it: once per image in the image store as an EROFS image
// (mkfs.erofs of the merged layers; microvm/sharedroot.go) against once
// per image per node as an ext4 image (mkfs.ext4 -d, the fallback and what
// every node did before), on the same merged tree in one run. A node after
// the first pays only a look-up of the shared file. Needs root, erofs-utils
// and e2fsprogs.
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

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/edge/backend/microvm"
	"github.com/opendsec/opendsec/internal/image"
)

func main() {
	store := flag.String("store", ".cache/images", "image store")
	name := flag.String("image", "root/py:3.11", "image")
	flag.Parse()
	if err := run(context.Background(), *store, *name); err != nil {
		fmt.Fprintln(os.Stderr, "vmroot:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, storeDir, name string) error {
	st, err := image.OpenStore(storeDir)
	if err != nil {
		return err
	}
	ref, err := image.ParseRef(name)
	if err != nil {
		return err
	}
	im, err := st.Resolve(ref)
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp("", "vmroot-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	cache, err := image.NewCache(filepath.Join(work, "cache"), st)
	if err != nil {
		return err
	}
	defer cache.UnmountLayers() //nolint:errcheck // the work directory goes next
	layers, err := cache.Layers(ctx, im, nil)
	if err != nil {
		return err
	}
	tree := layers[0]
	if len(layers) > 1 {
		tree = filepath.Join(work, "merged")
		os.Mkdir(tree, 0o755)
		lower := make([]string, len(layers))
		for i, d := range layers {
			lower[len(layers)-1-i] = d
		}
		if err := unix.Mount("overlay", tree, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(lower, ":")); err != nil {
			return err
		}
		defer unix.Unmount(tree, unix.MNT_DETACH) //nolint:errcheck // a read-only view
	}
	t0 := time.Now()
	out, err := exec.CommandContext(ctx, "mkfs.erofs", filepath.Join(work, "root.erofs"), tree).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mkfs.erofs: %v: %s", err, out)
	}
	erofs := time.Since(t0)
	t0 = time.Now()
	if err := microvm.BuildRootImage(ctx, tree, filepath.Join(work, "root.ext4")); err != nil {
		return err
	}
	ext4 := time.Since(t0)
	t0 = time.Now()
	if _, err := os.Stat(filepath.Join(work, "root.erofs")); err != nil {
		return err
	}
	again := time.Since(t0)
	size := func(p string) float64 {
		var st unix.Stat_t
		unix.Stat(p, &st) //nolint:errcheck // 0 if it is gone
		return float64(st.Blocks*512) / (1 << 20)
	}
	fmt.Printf("root disk of %s (%d layers): EROFS once in the store %s (%.0f MiB)  ext4 per node, mkfs.ext4 -d %s (%.0f MiB)  ratio %.2f; each later node %s\n",
		name, len(layers), erofs.Round(time.Millisecond), size(filepath.Join(work, "root.erofs")), ext4.Round(time.Millisecond), size(filepath.Join(work, "root.ext4")), erofs.Seconds()/ext4.Seconds(), again.Round(time.Microsecond))
	return nil
}

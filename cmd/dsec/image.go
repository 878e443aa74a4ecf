package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/image/baseimage"
	"github.com/opendsec/opendsec/internal/progress"
)

const imageUsage = `usage: dsec image <ls [--all] | pull REFERENCE [--as NAME] | push NAME REFERENCE | commit SANDBOX NAME [--exclude PATTERN]... | tag SOURCE NAME | gc | import NAME FILE | rm NAME | build RECIPE [--store DIR | -o FILE | --rootfs DIR] [flags] | build -t NAME [-f Dockerfile] DIR | export NAME FILE | copy --from DIR --to DIR NAME... | warm NAME [--backend B] [--cpu N] [--memory MB] [--disk MB] [--network]>

build recipes:
`

func cmdImage(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return imageHelp()
	}
	switch args[0] {
	case "ls":
		all := len(args) == 2 && (args[1] == "--all" || args[1] == "-a")
		if len(args) > 2 || len(args) == 2 && !all {
			return fmt.Errorf("image ls: usage: dsec image ls [--all] (--all also lists build steps' cache images)")
		}
		return imageLs(ctx, all)
	case "import":
		if len(args) != 3 {
			return fmt.Errorf("image import: usage: dsec image import NAME FILE")
		}
		return imageImport(ctx, args[1], args[2])
	case "rm":
		if len(args) != 2 {
			return fmt.Errorf("image rm: usage: dsec image rm NAME")
		}
		c, err := client.FromEnv()
		if err != nil {
			return err
		}
		resp, err := c.Images.DeleteImage(ctx, connect.NewRequest(&imagev1.DeleteImageRequest{Name: args[1]}))
		if err != nil {
			return err
		}
		fmt.Printf("removed %s; %.1f MiB of the image store freed\n", args[1], float64(resp.Msg.FreedBytes)/(1<<20))
		return nil
	case "pull":
		return imagePull(ctx, args[1:])
	case "push":
		return imagePush(ctx, args[1:])
	case "commit":
		return imageCommit(ctx, args[1:])
	case "gc":
		return imageGC(ctx)
	case "tag":
		if len(args) != 3 {
			return fmt.Errorf("image tag: usage: dsec image tag SOURCE NAME")
		}
		c, err := client.FromEnv()
		if err != nil {
			return err
		}
		resp, err := c.Images.TagImage(ctx, connect.NewRequest(&imagev1.TagImageRequest{Source: args[1], Name: args[2]}))
		if err != nil {
			return err
		}
		fmt.Printf("%s %s\n", resp.Msg.Image.Name, resp.Msg.Image.Digest)
		return nil
	case "build":
		return imageBuild(ctx, args[1:])
	case "export":
		return imageExport(args[1:])
	case "copy":
		return imageCopy(ctx, args[1:])
	case "warm":
		return imageWarm(ctx, args[1:])
	}
	return imageHelp()
}

func imageHelp() error {
	var b strings.Builder
	b.WriteString(imageUsage)
	for name, r := range baseimage.Recipes {
		fmt.Fprintf(&b, "  %-8s %s: %s\n", name, r.Name, r.Description)
	}
	return fmt.Errorf("%s", b.String())
}

// imageLs lists the images; a build's step cache (PROJECT/build-cache:KEY,
// internal/build) only with all, with a count of what it left out.
func imageLs(ctx context.Context, all bool) error {
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	resp, err := c.Images.ListImages(ctx, connect.NewRequest(&imagev1.ListImagesRequest{}))
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tDIGEST\tLAYERS\tSIZE")
	hidden := 0
	for _, im := range resp.Msg.Images {
		if !all && strings.Contains(im.Name, "/build-cache:") {
			hidden++
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%.1f MiB\n", im.Name, im.Digest[:19], im.Layers, float64(im.SizeBytes)/(1<<20))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if hidden > 0 {
		fmt.Fprintf(os.Stderr, "(%d build cache images not shown; dsec image ls --all lists them)\n", hidden)
	}
	return nil
}

func imageImport(ctx context.Context, name, file string) error {
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	f, err := os.Open(file)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, _ := f.Stat()
	bar := progress.New(os.Stderr)
	r := &progressReader{r: f, total: fi.Size(), bar: bar}
	out, err := c.ImportImage(ctx, name, r, fi.Size())
	bar.Done("")
	if err != nil {
		return err
	}
	fmt.Printf("%s %s\n", out["name"], out["digest"])
	return nil
}

type progressReader struct {
	r     *os.File
	n     int64
	total int64
	bar   *progress.Bar
}

func (p *progressReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.n += int64(n)
	p.bar.Update("uploading", p.n, p.total)
	return n, err
}

// imageBuild builds a base image straight into a store directory (on the
// node that has the store mounted), or into an archive to import.
func imageBuild(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return imageHelp()
	}
	if _, ok := baseimage.Recipes[args[0]]; !ok {
		return imageBuildDockerfile(ctx, args)
	}
	recipe := args[0]
	fs := flag.NewFlagSet("image build", flag.ExitOnError)
	name := fs.String("name", "", "image name (default: the recipe's)")
	storeDir := fs.String("store", "", "image store directory to build into (e.g. STATE/images)")
	output := fs.String("o", "", "write an OCI archive here instead (import it with dsec image import)")
	cacheDir := fs.String("cache-dir", ".cache", "where downloads are kept for offline rebuilds")
	mirror := fs.String("mirror", "", "Debian mirror (default: the host's apt source)")
	rootfs := fs.String("rootfs", "", "write the recipe's root file system into this new or empty directory instead of an image (a machine's disk is made from it)")
	fs.Parse(args[1:])
	r, ok := baseimage.Recipes[recipe]
	if !ok {
		return imageHelp()
	}
	if *name == "" {
		*name = r.Name
	}
	ref, err := image.ParseRef(*name)
	if err != nil {
		return err
	}
	given := 0
	for _, v := range []string{*storeDir, *output, *rootfs} {
		if v != "" {
			given++
		}
	}
	if given != 1 {
		return fmt.Errorf("image build: give exactly one of --store DIR, -o FILE or --rootfs DIR")
	}
	abs, _ := filepath.Abs(*cacheDir)
	if *rootfs != "" {
		if *name != r.Name {
			return fmt.Errorf("image build: --name with --rootfs: a root file system has no image name")
		}
		bar := progress.New(os.Stderr)
		err := baseimage.BuildRoot(ctx, recipe, *rootfs, baseimage.Options{CacheDir: abs, Mirror: *mirror, Progress: bar.Update})
		bar.Done("")
		if err != nil {
			return err
		}
		fmt.Printf("%s: the root of %s\n", *rootfs, recipe)
		return nil
	}
	dir := *storeDir
	if dir == "" {
		tmp, err := os.MkdirTemp(filepath.Dir(*output), ".dsec-build-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = tmp
	}
	store, err := image.OpenStore(dir)
	if err != nil {
		return err
	}
	bar := progress.New(os.Stderr)
	im, err := baseimage.Build(ctx, store, recipe, ref, baseimage.Options{CacheDir: abs, Mirror: *mirror, Progress: bar.Update})
	bar.Done("")
	if err != nil {
		return err
	}
	if *output != "" {
		f, err := os.Create(*output)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := store.Export(im, f); err != nil {
			return err
		}
	}
	fmt.Printf("%s %s (%.1f MiB)\n", im.Ref, im.Digest, float64(im.Size())/(1<<20))
	return nil
}

func imageExport(args []string) error {
	fs := flag.NewFlagSet("image export", flag.ExitOnError)
	storeDir := fs.String("store", "", "image store directory")
	fs.Parse(args)
	if fs.NArg() != 2 || *storeDir == "" {
		return fmt.Errorf("image export: usage: dsec image export --store DIR NAME FILE")
	}
	store, err := image.OpenStore(*storeDir)
	if err != nil {
		return err
	}
	ref, err := image.ParseRef(fs.Arg(0))
	if err != nil {
		return err
	}
	im, err := store.Resolve(ref)
	if err != nil {
		return err
	}
	f, err := os.Create(fs.Arg(1))
	if err != nil {
		return err
	}
	defer f.Close()
	return store.Export(im, f)
}

// imageCopy copies images from one store directory to another, without a
// cluster (make bundle takes the images it ships so).
func imageCopy(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("image copy", flag.ExitOnError)
	from := fs.String("from", "", "the image store to copy from")
	to := fs.String("to", "", "the image store to copy into (made if missing)")
	fs.Parse(args)
	if fs.NArg() == 0 || *from == "" || *to == "" {
		return fmt.Errorf("image copy: usage: dsec image copy --from DIR --to DIR NAME...")
	}
	src, err := image.OpenStore(*from)
	if err != nil {
		return fmt.Errorf("image copy: --from: %w", err)
	}
	dst, err := image.OpenStore(*to)
	if err != nil {
		return fmt.Errorf("image copy: --to: %w", err)
	}
	for _, name := range fs.Args() {
		ref, err := image.ParseRef(name)
		if err != nil {
			return fmt.Errorf("image copy: %w", err)
		}
		im, err := src.Resolve(ref)
		if err != nil {
			return fmt.Errorf("image copy: %s: %w", name, err)
		}
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(src.Export(im, pw)) }()
		got, err := dst.Import(ctx, pr, ref, image.ImportOptions{})
		pr.CloseWithError(err)
		if err != nil {
			return fmt.Errorf("image copy: %s: %w", name, err)
		}
		if got.Digest != im.Digest {
			return fmt.Errorf("image copy: %s: copied as %s, was %s", name, got.Digest, im.Digest)
		}
		fmt.Printf("%s %s\n", name, got.Digest)
	}
	return nil
}

// imageGC frees the store's unused blobs and prunes every node's layers.
func imageGC(ctx context.Context) error {
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	resp, err := c.Images.CollectGarbage(ctx, connect.NewRequest(&imagev1.CollectGarbageRequest{}))
	if err != nil {
		return err
	}
	fmt.Printf("image store: %.1f MiB freed\n", float64(resp.Msg.StoreFreedBytes)/(1<<20))
	for _, n := range resp.Msg.Nodes {
		if n.Error != "" {
			fmt.Printf("node %s: not pruned: %s\n", n.Node, n.Error)
			continue
		}
		fmt.Printf("node %s: %.1f MiB freed\n", n.Node, float64(n.FreedBytes)/(1<<20))
		for _, r := range n.Removed {
			fmt.Printf("  %s\n", r)
		}
	}
	return nil
}

// imageWarm has every node prepare for the first sandbox of an image and
// shape (microvm: its template snapshot) and prints each node's answer.
func imageWarm(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("image warm", flag.ContinueOnError)
	backend := fs.String("backend", "microvm", "the backend its sandboxes run on")
	cpu := fs.Float64("cpu", 0, "their vCPUs (0: a create's default)")
	memory := fs.Int64("memory", 0, "their memory in MiB (0: a create's default)")
	disk := fs.Int64("disk", 0, "their disk in MiB (0: a create's default)")
	network := fs.Bool("network", false, "they have a network interface (another template than without)")
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return errors.New("image warm: usage: dsec image warm NAME [--backend B] [--cpu N] [--memory MB] [--disk MB] [--network]")
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	// The nodes answer once each has booted and snapshotted its guest
	// (seconds under TCG): the bar shows the time going meanwhile.
	bar, stage, done, drawn := progress.New(os.Stderr), "warming "+pos[0]+" on every node", make(chan struct{}), make(chan struct{})
	go func() {
		defer close(drawn)
		for t := time.NewTicker(500 * time.Millisecond); ; {
			bar.Update(stage, 0, 0)
			select {
			case <-done:
				t.Stop()
				return
			case <-t.C:
			}
		}
	}()
	nodes, err := c.WarmImage(ctx, pos[0], *backend, &sandboxv1.Resources{CpuCores: *cpu, MemoryMb: *memory, DiskMb: *disk}, *network)
	close(done)
	<-drawn
	bar.Done("")
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "NODE\tTOOK\tRESULT")
	failed := 0
	for _, n := range nodes {
		result := n.Note
		if n.Error != "" {
			result, failed = "failed: "+n.Error, failed+1
		}
		fmt.Fprintf(w, "%s\t%.1fs\t%s\n", n.Node, float64(n.TookMs)/1000, result)
	}
	if err := w.Flush(); err != nil {
		return err
	}
	if failed > 0 {
		return fmt.Errorf("image warm: %d of %d nodes failed", failed, len(nodes))
	}
	return nil
}

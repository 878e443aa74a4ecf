package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	sandboxv1 "github.com/opendsec/opendsec/api/gen/opendsec/sandbox/v1"
	"github.com/opendsec/opendsec/client"
	"github.com/opendsec/opendsec/internal/build"
	"github.com/opendsec/opendsec/internal/image"
	"github.com/opendsec/opendsec/internal/progress"
)

// imageBuildDockerfile builds an image from a Dockerfile through the API:
// dsec image build -f Dockerfile -t project/name:tag DIR.
func imageBuildDockerfile(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("image build", flag.ContinueOnError)
	file := fs.String("f", "", "the Dockerfile (default: DIR/Dockerfile)")
	tag := fs.String("t", "", "the image's name, project/name:tag (required)")
	var buildArgs repeated
	fs.Var(&buildArgs, "build-arg", "NAME=VALUE for an ARG, repeatable")
	noCache := fs.Bool("no-cache", false, "run every step again")
	backendName := fs.String("backend", "container", "the backend each step's sandbox runs on (container or microvm: gVisor sandboxes cannot be committed)")
	internet := fs.Bool("internet", false, "let RUN steps reach the internet (pip, apt); without it they have no network")
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 || *tag == "" {
		return errors.New("image build: usage: dsec image build [-f Dockerfile] -t project/name:tag [--build-arg K=V]... [--no-cache] [--internet] DIR")
	}
	ref, err := image.ParseRef(*tag)
	if err != nil {
		return err
	}
	dockerfile := *file
	if dockerfile == "" {
		dockerfile = filepath.Join(pos[0], "Dockerfile")
	}
	f, err := os.Open(dockerfile)
	if err != nil {
		return err
	}
	ins, err := build.Parse(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("%s: %w", dockerfile, err)
	}
	ba := map[string]string{}
	for _, a := range buildArgs {
		k, v, ok := strings.Cut(a, "=")
		if !ok || k == "" {
			return fmt.Errorf("--build-arg %q: want NAME=VALUE", a)
		}
		ba[k] = v
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	bar := progress.New(os.Stderr)
	t := &build.ClientTarget{C: c, Backend: *backendName, Progress: bar.Update}
	if *internet {
		t.Network = &sandboxv1.NetworkPolicy{Internet: true}
	}
	res, err := build.Build(ctx, t, ins, build.Options{Context: pos[0], Tag: ref.String(), CacheProject: ref.Project, BuildArgs: ba, NoCache: *noCache, Log: os.Stdout})
	bar.Done("")
	if err != nil {
		return err
	}
	fmt.Printf("%s %s (%d steps, %d cached)\n", res.Image.Name, res.Image.Digest, res.Steps, res.Cached)
	return nil
}

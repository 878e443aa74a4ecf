package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strings"

	"github.com/opendsec/opendsec/client"
)

// repeated is a flag that may be given several times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, ",") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }

func imageCommit(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("image commit", flag.ContinueOnError)
	var exclude repeated
	fs.Var(&exclude, "exclude", `a path to leave out, repeatable: "/abs/path" from the root or "name" at any depth, with '*', '?', '[...]' ("/root/.cache", "*.pyc")`)
	pos, err := parseAnywhere(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return errors.New("image commit: usage: dsec image commit SANDBOX project/name:tag [--exclude PATTERN]...")
	}
	c, err := client.FromEnv()
	if err != nil {
		return err
	}
	im, err := c.Sandbox(pos[0]).Commit(ctx, pos[1], exclude...)
	if err != nil {
		return err
	}
	fmt.Printf("%s %s (%d layers, %.1f MiB)\n", im.Name, im.Digest, im.Layers, float64(im.SizeBytes)/(1<<20))
	return nil
}

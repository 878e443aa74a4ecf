package build

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"path"
	"sort"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	imagev1 "github.com/opendsec/opendsec/api/gen/opendsec/image/v1"
	"github.com/opendsec/opendsec/internal/errdefs"
)

// Target is what a build needs of a cluster (the Go client's calls;
// internal/build/clienttarget.go; a fake in tests).
type Target interface {
	// Image returns the stored image called name, or a not-found error.
	Image(ctx context.Context, name string) (*imagev1.Image, error)
	// Pull copies a registry image into the store as name.
	Pull(ctx context.Context, source, name string) (*imagev1.Image, error)
	// Tag names a stored image once more.
	Tag(ctx context.Context, source, name string) (*imagev1.Image, error)
	// Start runs a sandbox of image for one step.
	Start(ctx context.Context, image string) (Box, error)
}

// Box is one step's sandbox.
type Box interface {
	// Run runs args with env (KEY=VALUE), in cwd, as user, streaming its
	// output to out, and returns its exit code.
	Run(ctx context.Context, args, env []string, cwd, user string, out io.Writer) (int, error)
	MakeDir(ctx context.Context, path, user string) error
	WriteFile(ctx context.Context, path string, r io.Reader, perm uint32, user string) error
	// Commit names the sandbox's image with its changes and cfg.
	Commit(ctx context.Context, name string, cfg *imagev1.ImageConfig) (*imagev1.Image, error)
	Stop(ctx context.Context) error
}

// Options are a build's inputs.
type Options struct {
	// Context is the build context directory COPY and ADD read from.
	Context string
	// Tag names the result ("project/name:tag"); CacheProject is the
	// project whose "build-cache" image names hold the steps.
	Tag, CacheProject string
	BuildArgs         map[string]string
	// NoCache runs every step again (and refreshes the cache).
	NoCache bool
	// Log receives the build's log: steps, their output, cache hits.
	Log io.Writer
	// Step, if set, is told the index of each instruction as it begins
	// (before its line in Log).
	Step func(index int)
}

// Result is a built image and what the build did.
type Result struct {
	Image         *imagev1.Image
	Steps, Cached int
}

// StepError is a build's failure at one instruction.
type StepError struct {
	Step int // index of the instruction
	Err  error
}

func (e *StepError) Error() string { return e.Err.Error() }
func (e *StepError) Unwrap() error { return e.Err }

// state is the image a build has reached and the config it carries.
type state struct {
	image  string // a name of it
	digest string
	cfg    *imagev1.ImageConfig
	args   map[string]string // ARGs in scope (and their values)
	ignore *Ignore           // the context's .dockerignore
}

// Build runs the Dockerfile's instructions.
func Build(ctx context.Context, t Target, ins []Instruction, o Options) (*Result, error) {
	log := o.Log
	if log == nil {
		log = io.Discard
	}
	res := &Result{}
	st := &state{args: map[string]string{}}
	if o.Context != "" {
		ig, err := LoadIgnore(o.Context)
		if err != nil {
			return nil, err
		}
		st.ignore = ig
	}
	globals := map[string]string{}
	for i, in := range ins {
		if o.Step != nil {
			o.Step(i)
		}
		step := fmt.Sprintf("STEP %d/%d: %s %s", i+1, len(ins), in.Cmd, errdefs.Clip(in.Text, 200))
		fmt.Fprintln(log, step)
		res.Steps++
		began := time.Now()
		var err error
		cached := false
		switch in.Cmd {
		case "ARG":
			err = st.arg(in, o.BuildArgs, globals)
		case "FROM":
			err = st.from(ctx, t, in, globals, log)
		case "ENV":
			err = st.env(in)
		case "LABEL":
			err = st.label(in)
		case "WORKDIR":
			err = st.workdir(in)
		case "USER":
			err = st.user(in)
		case "CMD", "ENTRYPOINT":
			err = st.command(in)
		case "EXPOSE":
			// Recorded by docker for port publishing; sandboxes reach
			// every port through the port proxy.
		case "RUN", "COPY", "ADD":
			cached, err = st.layerStep(ctx, t, in, o, log)
		}
		if err != nil {
			return nil, &StepError{Step: i, Err: err}
		}
		if cached {
			res.Cached++
			fmt.Fprintln(log, "--> cached")
		} else if in.Cmd == "RUN" || in.Cmd == "COPY" || in.Cmd == "ADD" {
			fmt.Fprintf(log, "--> %s (%s)\n", st.digest[:min(19, len(st.digest))], time.Since(began).Round(time.Millisecond))
		}
	}
	// The result: the last step's image with the config as it ends, which
	// a final commit writes unless that image already carries it.
	key := cacheKey(st.digest, st.cfg, "CONFIG", nil)
	name := o.CacheProject + "/build-cache:" + key
	im, err := t.Image(ctx, name)
	switch {
	case err == nil && !o.NoCache:
	case err == nil || errdefs.IsNotFound(err):
		if im, err = st.commitConfig(ctx, t, name); err != nil {
			return nil, err
		}
	default:
		return nil, err
	}
	if im, err = t.Tag(ctx, im.Name, o.Tag); err != nil {
		return nil, err
	}
	res.Image = im
	return res, nil
}

func (st *state) arg(in Instruction, given, globals map[string]string) error {
	name, def, hasDef := strings.Cut(strings.TrimSpace(in.Text), "=")
	if !validName(name) {
		return lineErr(in.Line, "ARG %q: want ARG NAME or ARG NAME=default", errdefs.Clip(in.Text, 60))
	}
	v, ok := given[name]
	if !ok && hasDef {
		var err error
		if v, err = expand(def, st.vars()); err != nil {
			return lineErr(in.Line, "ARG: %v", err)
		}
	}
	if st.cfg == nil {
		globals[name] = v // before FROM: for FROM only
		return nil
	}
	if !ok && !hasDef {
		if gv, isGlobal := globals[name]; isGlobal {
			v = gv // ARG NAME after FROM takes the global's value
		}
	}
	st.args[name] = v
	return nil
}

func (st *state) from(ctx context.Context, t Target, in Instruction, globals map[string]string, log io.Writer) error {
	text, err := expand(in.Text, globals)
	if err != nil {
		return lineErr(in.Line, "FROM: %v", err)
	}
	ws := strings.Fields(text)
	if len(ws) != 1 {
		if len(ws) == 3 && strings.EqualFold(ws[1], "AS") {
			return lineErr(in.Line, "FROM ... AS (a multi-stage build) is not supported")
		}
		return lineErr(in.Line, "FROM: want one image")
	}
	im, err := t.Image(ctx, ws[0])
	if err != nil {
		if !errdefs.IsNotFound(err) && errdefs.Code(err) != errdefs.Code(errdefs.InvalidArgument("x")) {
			return lineErr(in.Line, "FROM %s: %v", ws[0], err)
		}
		// Not a stored image's name: a registry reference.
		fmt.Fprintf(log, "pulling %s\n", ws[0])
		if im, err = t.Pull(ctx, ws[0], ""); err != nil {
			return fmt.Errorf("Dockerfile:%d: FROM %s: neither in the image store nor pulled: %w", in.Line, ws[0], err)
		}
	}
	st.image, st.digest = im.Name, im.Digest
	st.cfg = proto.Clone(im.GetConfig()).(*imagev1.ImageConfig)
	if st.cfg == nil {
		st.cfg = &imagev1.ImageConfig{}
	}
	if st.cfg.Labels == nil {
		st.cfg.Labels = map[string]string{}
	}
	return nil
}

// vars are what $NAME expands to: ARGs, then ENV over them.
func (st *state) vars() map[string]string {
	v := map[string]string{}
	for k, x := range st.args {
		v[k] = x
	}
	if st.cfg != nil {
		for _, kv := range st.cfg.Env {
			if k, x, ok := strings.Cut(kv, "="); ok {
				v[k] = x
			}
		}
	}
	return v
}

func (st *state) env(in Instruction) error {
	ps, err := pairs(in, st.vars(), true)
	if err != nil {
		return err
	}
	for _, p := range ps {
		if !validName(p[0]) {
			return lineErr(in.Line, "ENV: %q is not a variable name", errdefs.Clip(p[0], 40))
		}
		kept := st.cfg.Env[:0]
		for _, kv := range st.cfg.Env {
			if k, _, _ := strings.Cut(kv, "="); k != p[0] {
				kept = append(kept, kv)
			}
		}
		st.cfg.Env = append(kept, p[0]+"="+p[1])
	}
	return nil
}

func (st *state) label(in Instruction) error {
	ps, err := pairs(in, st.vars(), false)
	if err != nil {
		return err
	}
	for _, p := range ps {
		st.cfg.Labels[p[0]] = p[1]
	}
	return nil
}

func (st *state) workdir(in Instruction) error {
	dir, err := expand(strings.TrimSpace(in.Text), st.vars())
	if err != nil {
		return lineErr(in.Line, "WORKDIR: %v", err)
	}
	if !path.IsAbs(dir) {
		base := st.cfg.WorkingDir
		if base == "" {
			base = "/"
		}
		dir = path.Join(base, dir)
	}
	st.cfg.WorkingDir = path.Clean(dir)
	return nil
}

func (st *state) user(in Instruction) error {
	u, err := expand(strings.TrimSpace(in.Text), st.vars())
	if err != nil || u == "" || strings.ContainsAny(u, " \t") {
		return lineErr(in.Line, "USER: want one user name")
	}
	st.cfg.User = u
	return nil
}

func (st *state) command(in Instruction) error {
	args := in.JSON
	if args == nil {
		args = []string{"/bin/sh", "-c", in.Text}
	}
	if in.Cmd == "CMD" {
		st.cfg.Cmd = args
	} else {
		st.cfg.Entrypoint = args
	}
	return nil
}

// layerStep runs a RUN, COPY or ADD in a sandbox of the current image and
// commits the result, unless the cache has it.
func (st *state) layerStep(ctx context.Context, t Target, in Instruction, o Options, log io.Writer) (cached bool, err error) {
	var files []copyFile
	var dest string
	what := in.Cmd + " " + fmt.Sprint(in.Flags) + " " + in.Text + " " + fmt.Sprintf("%q", in.JSON) + " " + argsText(st.args)
	switch {
	case in.Cmd == "RUN":
		what += " user=" + in.User
	case in.Archive != "":
		sum, err := archiveSum(in)
		if err != nil {
			return false, err
		}
		what += " archive=" + sum
	default:
		if files, dest, err = st.sources(in, o.Context, st.ignore); err != nil {
			return false, err
		}
	}
	key := cacheKey(st.digest, st.cfg, what, files)
	name := o.CacheProject + "/build-cache:" + key
	if !o.NoCache {
		if im, err := t.Image(ctx, name); err == nil {
			st.image, st.digest = im.Name, im.Digest
			return true, nil
		} else if !errdefs.IsNotFound(err) {
			return false, err
		}
	}
	box, err := st.startBox(ctx, t)
	if err != nil {
		return false, fmt.Errorf("Dockerfile:%d: %w", in.Line, err)
	}
	defer box.Stop(context.WithoutCancel(ctx)) //nolint:errcheck // a build sandbox; its node removes it either way
	if in.Cmd == "RUN" {
		args := in.JSON
		if args == nil {
			args = []string{"/bin/sh", "-c", in.Text}
		}
		env := append([]string(nil), st.cfg.Env...)
		for k, v := range st.args {
			env = append(env, k+"="+v)
		}
		user := st.cfg.User
		if in.User != "" {
			user = in.User
		}
		code, err := box.Run(ctx, args, env, st.cfg.WorkingDir, user, log)
		if err != nil {
			return false, fmt.Errorf("Dockerfile:%d: RUN: %w", in.Line, err)
		}
		if code != 0 {
			return false, errdefs.FailedPrecondition("Dockerfile:%d: RUN %s: exit code %d", in.Line, errdefs.Clip(in.Text, 120), code)
		}
	} else if in.Archive != "" {
		if err := st.copyArchive(ctx, box, in, log); err != nil {
			return false, err
		}
	} else if err := st.copy(ctx, box, in, files, dest); err != nil {
		return false, err
	}
	im, err := box.Commit(ctx, name, st.cfg)
	if err != nil {
		return false, fmt.Errorf("Dockerfile:%d: commit: %w", in.Line, err)
	}
	st.image, st.digest = im.Name, im.Digest
	return false, nil
}

// commitConfig writes the config as the build ends onto the current image
// (one empty layer) under name.
func (st *state) commitConfig(ctx context.Context, t Target, name string) (*imagev1.Image, error) {
	box, err := st.startBox(ctx, t)
	if err != nil {
		return nil, err
	}
	defer box.Stop(context.WithoutCancel(ctx)) //nolint:errcheck // as in layerStep
	return box.Commit(ctx, name, st.cfg)
}

// startBox starts a sandbox of the image so far with its WORKDIR made,
// owned by the USER as BuildKit makes it, or by root where that user may
// not create it.
func (st *state) startBox(ctx context.Context, t Target) (Box, error) {
	box, err := t.Start(ctx, st.image)
	if err != nil {
		return nil, fmt.Errorf("start a sandbox of %s: %w", st.image, err)
	}
	if st.cfg.WorkingDir == "" {
		return box, nil
	}
	err = box.MakeDir(ctx, st.cfg.WorkingDir, st.cfg.User)
	if err != nil && st.cfg.User != "" && errdefs.Code(err) == errdefs.Code(errdefs.PermissionDenied("x")) {
		err = box.MakeDir(ctx, st.cfg.WorkingDir, "")
	}
	if err != nil {
		box.Stop(context.WithoutCancel(ctx)) //nolint:errcheck // the error below matters more
		return nil, fmt.Errorf("WORKDIR %s: %w", st.cfg.WorkingDir, err)
	}
	return box, nil
}

func argsText(args map[string]string) string {
	keys := make([]string, 0, len(args))
	for k := range args {
		keys = append(keys, k+"="+args[k])
	}
	sort.Strings(keys)
	return strings.Join(keys, "\x00")
}

// cacheKey names a step by what decides its result: the parent image, the
// config it runs with, the instruction and the files it copies. 40 hex
// digits (a tag holds 128 characters).
func cacheKey(parent string, cfg *imagev1.ImageConfig, what string, files []copyFile) string {
	h := sha256.New()
	cj, _ := json.Marshal(cfg)
	fmt.Fprintf(h, "%s\n%s\n%s\n", parent, cj, what)
	for _, f := range files {
		fmt.Fprintf(h, "%s %s %o %s\n", f.dest, f.sum, f.perm, f.linkTarget)
	}
	return hex.EncodeToString(h.Sum(nil))[:40]
}

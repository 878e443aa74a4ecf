// Package baseimage builds the project's own base images without a
// registry [ours]: root/busybox:latest from the host's static busybox,
// root/py:3.11 (Debian bookworm with python3, pip, git, curl, bash, sudo and
// an unprivileged user "user") and the Debian 13 images with systemd (for
// the vm backend, and root/debian-host:13, the host test's machine) with
// debootstrap. Downloaded packages are kept
// in a tarball under the cache directory, so later builds run offline.
package baseimage

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/opendsec/opendsec/internal/errdefs"
	"github.com/opendsec/opendsec/internal/image"
)

// Recipe names a base image the project knows how to build.
type Recipe struct {
	Name        string // image name it builds by default
	Description string
	build       func(ctx context.Context, o Options, root string) error
	config      ocispec.ImageConfig
	// base names the recipe whose image this one adds a layer to (built
	// first, into the same store); the image keeps base's config and adds
	// labels to it.
	base   string
	labels map[string]string
}

// Options configure a build.
type Options struct {
	// CacheDir keeps downloads (the debootstrap package tarball).
	CacheDir string
	// Mirror is the Debian mirror; empty means the one in the host's apt sources.
	Mirror   string
	Progress image.Progress
}

const defaultPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Recipes lists the known recipes by name.
var Recipes = map[string]Recipe{
	"busybox": {
		Name:        "root/busybox:latest",
		Description: "static busybox with its applets (2 MB)",
		build:       buildBusybox,
		config:      ocispec.ImageConfig{Env: []string{defaultPath}, Cmd: []string{"/bin/sh"}},
	},
	"py": {
		Name:        "root/py:3.11",
		Description: "Debian bookworm minbase + python3 3.11, pip, venv, git, curl, bash, sudo; user \"user\" (uid 1000, passwordless sudo)",
		build:       buildDebianPython,
		config:      ocispec.ImageConfig{Env: []string{defaultPath, "LANG=C.UTF-8"}, Cmd: []string{"/bin/bash"}},
	},
	"debian-systemd": {
		Name:        "root/debian-systemd:13",
		Description: "Debian 13 (trixie) minbase + systemd as init, dbus, iproute2, procps, bash, python3; user \"user\" (uid 1000, passwordless sudo): the vm backend boots its systemd",
		build:       buildDebianSystemd,
		config:      ocispec.ImageConfig{Env: []string{defaultPath, "LANG=C.UTF-8"}, Cmd: []string{"/bin/bash"}},
	},
	"debian-docker": {
		Name:        "root/debian-docker:13",
		Description: "root/debian-systemd:13's packages + Debian's docker.io (dockerd, containerd, runc): a vm sandbox that runs containers",
		build:       buildDebianDocker,
		config:      ocispec.ImageConfig{Env: []string{defaultPath, "LANG=C.UTF-8"}, Cmd: []string{"/bin/bash"}},
	},
	"debian-kernel": {
		Name:        "root/debian-kernel:13",
		Description: "root/debian-systemd:13's packages + Debian 13's own kernel (linux-image-amd64): a vm sandbox boots the image's kernel",
		build:       buildDebianKernel,
		config:      ocispec.ImageConfig{Env: []string{defaultPath, "LANG=C.UTF-8"}, Cmd: []string{"/bin/bash"}},
	},
	"debian-host": {
		Name:        "root/debian-host:13",
		Description: "root/debian-kernel:13's packages + what an OpenDsec node needs (udev, nftables, conntrack, e2fsprogs, crun, runsc): the host test's Debian 13 machine (make test-hosts, with --rootfs)",
		build:       buildDebianHost,
		config:      ocispec.ImageConfig{Env: []string{defaultPath, "LANG=C.UTF-8"}, Cmd: []string{"/bin/bash"}},
	},
	"code-interpreter": {
		Name:        "root/code-interpreter:latest",
		Description: "root/py:3.11 + Jupyter (Python, bash and JavaScript/Node.js kernels, numpy, matplotlib) and the server of E2B's Code Interpreter protocol on port 49999",
		build:       buildCodeInterpreter,
		base:        "py",
		labels:      codeInterpreterLabels,
	},
}

// Build runs recipe and stores the result as ref.
func Build(ctx context.Context, store *image.Store, recipe string, ref image.Ref, o Options) (*image.Image, error) {
	r, err := lookup(recipe)
	if err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp(filepath.Join(store.Dir(), "tmp"), "build-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(work)
	if r.base != "" {
		return buildOnBase(ctx, store, r, ref, o, work)
	}
	root := filepath.Join(work, "rootfs")
	if err := os.Mkdir(root, 0o755); err != nil {
		return nil, err
	}
	if err := r.build(ctx, o, root); err != nil {
		return nil, fmt.Errorf("build %s: %w", recipe, err)
	}
	layer, err := store.PackDir(root, false, o.Progress)
	if err != nil {
		return nil, err
	}
	return store.Commit(ref, nil, []image.Layer{layer}, r.config)
}

// BuildRoot runs recipe into root, a directory that does not exist yet or
// is empty, instead of into a store: a machine's disk is made from it (the
// host test's Debian 13 machine, scripts/test-hosts.sh, is the recipe
// debian-host). A recipe that adds a layer to another's image has no root
// of its own and is refused.
func BuildRoot(ctx context.Context, recipe, root string, o Options) error {
	r, err := lookup(recipe)
	if err != nil {
		return err
	}
	if r.base != "" {
		return errdefs.InvalidArgument("recipe %q: adds a layer to %s, so it has no root of its own: build it into a store", recipe, Recipes[r.base].Name)
	}
	root, err = filepath.Abs(root)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		return err
	}
	if len(ents) > 0 {
		return errdefs.InvalidArgument("root %s: not empty (%d entries, the first %q): give a new or empty directory", root, len(ents), ents[0].Name())
	}
	if err := r.build(ctx, o, root); err != nil {
		return fmt.Errorf("build %s into %s (remove what it left there before another try): %w", recipe, root, err)
	}
	return nil
}

// lookup returns the recipe of that name, or an error listing the known ones.
func lookup(recipe string) (Recipe, error) {
	r, ok := Recipes[recipe]
	if !ok {
		names := make([]string, 0, len(Recipes))
		for n := range Recipes {
			names = append(names, n)
		}
		sort.Strings(names)
		return Recipe{}, errdefs.InvalidArgument("recipe %q: unknown; known: %s", recipe, strings.Join(names, ", "))
	}
	return r, nil
}

func buildOnBase(ctx context.Context, store *image.Store, r Recipe, ref image.Ref, o Options, work string) (*image.Image, error) {
	baseRef, err := image.ParseRef(Recipes[r.base].Name)
	if err != nil {
		return nil, err
	}
	base, err := store.Resolve(baseRef)
	if err != nil {
		return nil, errdefs.FailedPrecondition("%s builds on %s, which is not in this store: run `dsec image build %s` into it first (%v)", r.Name, baseRef, r.base, err)
	}
	merged, upper, unmount, err := withBase(ctx, store, base, work, o)
	if err != nil {
		return nil, err
	}
	err = r.build(ctx, o, merged)
	unmount()
	if err != nil {
		return nil, fmt.Errorf("build %s: %w", r.Name, err)
	}
	layer, err := store.PackDir(upper, true, o.Progress)
	if err != nil {
		return nil, err
	}
	cfg := base.Config.Config
	cfg.Labels = map[string]string{}
	for k, v := range base.Config.Config.Labels {
		cfg.Labels[k] = v
	}
	for k, v := range r.labels {
		cfg.Labels[k] = v
	}
	return store.Commit(ref, base, []image.Layer{layer}, cfg)
}

// digestOf is a short content hash, for cache markers.
func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

func report(o Options, stage string, done, total int64) {
	if o.Progress != nil {
		o.Progress(stage, done, total)
	}
}

func buildBusybox(ctx context.Context, o Options, root string) error {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return errdefs.FailedPrecondition("busybox not found on the host: install Debian's busybox-static")
	}
	out, err := exec.CommandContext(ctx, "file", "-L", bb).Output()
	if err == nil && !strings.Contains(string(out), "statically linked") {
		return errdefs.FailedPrecondition("%s is not statically linked: install Debian's busybox-static", bb)
	}
	report(o, "assembling busybox root", 0, 0)
	for _, d := range []string{"bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "tmp", "home/user", "proc", "sys", "dev", "var/tmp", "run"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	os.Chmod(filepath.Join(root, "tmp"), 0o1777)     //nolint:errcheck // created just above
	os.Chmod(filepath.Join(root, "var/tmp"), 0o1777) //nolint:errcheck // created just above
	os.Chmod(filepath.Join(root, "root"), 0o700)     //nolint:errcheck // created just above
	data, err := os.ReadFile(bb)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(root, "bin/busybox"), data, 0o755); err != nil {
		return err
	}
	list, err := exec.CommandContext(ctx, bb, "--list-full").Output()
	if err != nil {
		return fmt.Errorf("busybox --list-full: %w", err)
	}
	sc := bufio.NewScanner(strings.NewReader(string(list)))
	for sc.Scan() {
		p := strings.TrimSpace(sc.Text())
		if p == "" || p == "bin/busybox" {
			continue
		}
		dst := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		rel, _ := filepath.Rel(filepath.Dir(dst), filepath.Join(root, "bin/busybox"))
		if err := os.Symlink(rel, dst); err != nil && !os.IsExist(err) {
			return err
		}
	}
	files := map[string]string{
		"etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
		"etc/group":    "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n",
		"etc/shadow":   "root:*:19000:0:99999:7:::\nuser:*:19000:0:99999:7:::\n",
		"etc/hostname": "sandbox\n",
		"etc/hosts":    "127.0.0.1 localhost\n::1 localhost\n",
	}
	for p, content := range files {
		mode := os.FileMode(0o644)
		if p == "etc/shadow" {
			mode = 0o600
		}
		if err := os.WriteFile(filepath.Join(root, p), []byte(content), mode); err != nil {
			return err
		}
	}
	return os.Chown(filepath.Join(root, "home/user"), 1000, 1000)
}

package baseimage

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// BuildRoot writes a recipe's root into a directory of its own: it refuses
// what it cannot build so, and a directory that already holds something.
func TestBuildRootRefusals(t *testing.T) {
	ctx := context.Background()
	err := BuildRoot(ctx, "code-interpreter", t.TempDir(), Options{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "root/py:3.11") {
		t.Fatalf("a recipe on a base: %v", err)
	}
	err = BuildRoot(ctx, "nope", t.TempDir(), Options{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "busybox, code-interpreter, debian-docker, debian-host") {
		t.Fatalf("an unknown recipe: %v", err)
	}
	full := t.TempDir()
	if err := os.WriteFile(filepath.Join(full, "keep"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	err = BuildRoot(ctx, "busybox", full, Options{})
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `"keep"`) {
		t.Fatalf("a directory with a file: %v", err)
	}
	if data, err := os.ReadFile(filepath.Join(full, "keep")); err != nil || string(data) != "x" {
		t.Fatalf("the refused directory changed: %q %v", data, err)
	}
}

// The busybox recipe needs nothing but the host's static busybox: its
// root, written into a new directory, is a shell and its applets.
func TestBuildRootWritesTheRecipesRoot(t *testing.T) {
	root := filepath.Join(t.TempDir(), "new", "root")
	if err := BuildRoot(context.Background(), "busybox", root, Options{}); err != nil {
		if errors.Is(err, errdefs.ErrFailedPrecondition) {
			t.Skipf("host lacks a static busybox: %v", err)
		}
		t.Fatal(err)
	}
	for _, p := range []string{"bin/busybox", "bin/sh", "etc/passwd"} {
		if _, err := os.Lstat(filepath.Join(root, p)); err != nil {
			t.Errorf("%s: %v", p, err)
		}
	}
}

// debian-host is the host test's machine: it must hold the vm images'
// systemd and kernel and what a node runs on, so the test's bundle finds
// crun and runsc in its download.
func TestHostPackagesExtendTheKernelImage(t *testing.T) {
	have := map[string]bool{}
	for _, p := range hostPackages {
		have[p] = true
	}
	for _, p := range append(append([]string{}, kernelPackages...), "crun", "runsc", "nftables", "udev") {
		if !have[p] {
			t.Errorf("debian-host lacks %s", p)
		}
	}
}

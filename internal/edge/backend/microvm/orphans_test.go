package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// fakeVMM runs a shell loop whose command line looks like a QEMU of box
// directory dir, as a daemonized VMM that outlived the edge would.
func fakeVMM(t *testing.T, dir string) <-chan struct{} { return fakeVMMOf(t, "/bin/sh", dir) }

// fakeVMMOf is fakeVMM running shell bin.
func fakeVMMOf(t *testing.T, bin, dir string) <-chan struct{} {
	t.Helper()
	cmd := &exec.Cmd{Path: bin, Args: []string{"qemu-system-x86_64", "-c", "while :; do sleep 0.1; done", "-drive", "file=" + filepath.Join(dir, "rw.ext4")}}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ended := make(chan struct{})
	go func() { cmd.Wait(); close(ended) }() //nolint:errcheck // reaped so that it leaves /proc
	t.Cleanup(func() { cmd.Process.Kill() })
	return ended
}

// A VMM and guest RAM of a sandbox the backend has no box of (a crash cut
// its create) are found by the sandbox's id, for its node only, and
// Destroy of that id ends the VMM and frees the RAM.
func TestOrphanVMsAreFoundAndDestroyedByID(t *testing.T) {
	// The fake VMMs run /bin/sh: the backend's "QEMU" is that file.
	b, err := New(context.Background(), backend.Config{StateDir: t.TempDir(), Log: testutil.Logger(t), Options: map[string]string{"qemu": "/bin/sh"}})
	if err != nil {
		t.Fatal(err)
	}
	node, other := sandboxid.NodeID("orphtest"), sandboxid.NodeID("othrnode")
	id, theirs, ramOnly := sandboxid.New(node), sandboxid.New(other), sandboxid.New(node)
	base := t.TempDir()
	vmm := fakeVMM(t, filepath.Join(base, "sandboxes", string(id), "vm"))
	fakeVMM(t, filepath.Join(base, "sandboxes", string(theirs), "vm"))
	// Another program by the same name and arguments is no VMM of ours.
	impostor := fakeVMMOf(t, "/bin/bash", filepath.Join(base, "sandboxes", string(id), "vm"))
	defer func() {
		select {
		case <-impostor:
			t.Error("Destroy killed a process that only looked like the VMM")
		default:
		}
	}()
	for _, i := range []sandboxid.ID{id, ramOnly} {
		if err := os.WriteFile(memFile(i), []byte("ram"), 0o600); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.Remove(memFile(i)) })
	}
	inv := b.(backend.Inventory)
	found, err := inv.Found(context.Background(), node)
	slices.Sort(found)
	want := []sandboxid.ID{id, ramOnly}
	slices.Sort(want)
	if err != nil || !slices.Equal(found, want) {
		t.Fatalf("found %v, %v; want %v (not the other node's %s)", found, err, want, theirs)
	}
	for _, i := range want {
		if err := b.Destroy(context.Background(), i); err != nil {
			t.Fatalf("destroy %s: %v", i, err)
		}
	}
	select {
	case <-vmm:
	case <-time.After(5 * time.Second):
		t.Fatal("the orphan VMM still runs after Destroy")
	}
	for _, i := range want {
		if _, err := os.Stat(memFile(i)); !os.IsNotExist(err) {
			t.Fatalf("guest RAM of %s left: %v", i, err)
		}
	}
	if found, _ := inv.Found(context.Background(), node); len(found) != 0 {
		t.Fatalf("found after destroy: %v", found)
	}
	if found, _ := inv.Found(context.Background(), other); len(found) != 1 {
		t.Fatalf("the other node's VMM: found %v, want it left alone", found)
	}
}

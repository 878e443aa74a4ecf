package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opendsec/opendsec/internal/edge/backend"
	"github.com/opendsec/opendsec/internal/sandboxid"
	"github.com/opendsec/opendsec/internal/testutil"
)

// imageTree writes a tree with a kernel of release rel, its modules as
// depmod would list them (erofs needs netfs; virtio_blk xz-compressed
// where xz is installed; virtio_pci built in), and a lib that is a link
// to usr/lib, as Debian 13's.
func imageTree(t *testing.T, rel string) string {
	t.Helper()
	tree := t.TempDir()
	mods := filepath.Join(tree, "usr/lib/modules", rel)
	for _, d := range []string{filepath.Join(tree, "boot"), filepath.Join(mods, "kernel/fs"), filepath.Join(mods, "kernel/drivers")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.Symlink("usr/lib", filepath.Join(tree, "lib"))
	os.WriteFile(filepath.Join(tree, "boot", "vmlinuz-"+rel), []byte("kernel "+rel), 0o644)
	for name, data := range map[string]string{"kernel/fs/erofs.ko": "erofs", "kernel/fs/netfs.ko": "netfs", "kernel/drivers/virtio_blk.ko": "blk"} {
		os.WriteFile(filepath.Join(mods, name), []byte(data), 0o644)
	}
	blk := "kernel/drivers/virtio_blk.ko"
	if _, err := exec.LookPath("xz"); err == nil {
		if out, err := exec.Command("xz", filepath.Join(mods, blk)).CombinedOutput(); err != nil {
			t.Fatalf("xz: %v: %s", err, out)
		}
		blk += ".xz"
	}
	os.WriteFile(filepath.Join(mods, "modules.dep"), []byte("kernel/fs/erofs.ko: kernel/fs/netfs.ko\nkernel/fs/netfs.ko:\n"+blk+":\n../../escape.ko:\n"), 0o644)
	os.WriteFile(filepath.Join(mods, "modules.builtin"), []byte("kernel/drivers/virtio/virtio_pci.ko\n"), 0o644)
	return tree
}

// An image's kernel is found with its modules; the modules the guest's
// init loads are taken with what they need, in load order, decompressed;
// those built in are skipped, and an entry outside the modules directory
// is never taken.
func TestTakeImageKernel(t *testing.T) {
	tree := imageTree(t, "6.12.10-amd64")
	os.WriteFile(filepath.Join(tree, "boot", "vmlinuz-6.12.9-amd64"), []byte("older"), 0o644)
	os.MkdirAll(filepath.Join(tree, "usr/lib/modules/6.12.9-amd64"), 0o755)
	os.WriteFile(filepath.Join(tree, "boot", "vmlinuz-7.0-no-modules"), []byte("no modules"), 0o644)
	rel := findImageKernel(tree)
	if rel != "6.12.10-amd64" {
		t.Fatalf("found %q, want the newest with modules, 6.12.10-amd64", rel)
	}
	dir := t.TempDir()
	k, err := takeImageKernel(context.Background(), tree, rel, dir, []string{"virtio", "virtio_blk", "erofs", "escape"}, []string{"virtio_net"}, []string{"virtio_pci", "virtio_blk"})
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"virtio_blk", "netfs", "erofs"}; !slices.Equal(k.Order, want) || !slices.Equal(k.OrderNet, want) {
		t.Fatalf("order %v, with a NIC %v; want %v", k.Order, k.OrderNet, want)
	}
	if data, _ := os.ReadFile(filepath.Join(k.ModulesDir, "virtio_blk.ko")); string(data) != "blk" {
		t.Fatalf("virtio_blk.ko holds %q", data)
	}
	again, err := loadBootKernel(dir)
	if err != nil || !again.Image || again.Path != filepath.Join(dir, "vmlinuz") {
		t.Fatalf("kept kernel %+v, %v", again, err)
	}
	if data, _ := os.ReadFile(again.Path); string(data) != "kernel 6.12.10-amd64" {
		t.Fatalf("the kernel copied: %q", data)
	}
	// A kernel without what the init needs is not taken.
	if _, err := takeImageKernel(context.Background(), tree, rel, t.TempDir(), []string{"virtio_blk"}, nil, []string{"ext4"}); err == nil || !strings.Contains(err.Error(), "no ext4") {
		t.Fatalf("a kernel without ext4: %v", err)
	}
}

// Nothing is read through a link: not a linked kernel, nor a modules
// directory or module reached through one (which would read the node's
// files into a guest).
func TestImageKernelFollowsNoLinks(t *testing.T) {
	if rel := findImageKernel(t.TempDir()); rel != "" {
		t.Fatalf("an empty tree has kernel %q", rel)
	}
	tree := imageTree(t, "6.12.1-amd64")
	os.Remove(filepath.Join(tree, "boot", "vmlinuz-6.12.1-amd64"))
	os.Symlink("/boot/vmlinuz", filepath.Join(tree, "boot", "vmlinuz-6.12.1-amd64"))
	if rel := findImageKernel(tree); rel != "" {
		t.Fatalf("a linked kernel was taken: %q", rel)
	}
	tree = imageTree(t, "6.12.1-amd64")
	fs := filepath.Join(tree, "usr/lib/modules/6.12.1-amd64/kernel/fs")
	os.RemoveAll(fs)
	host := t.TempDir()
	os.WriteFile(filepath.Join(host, "erofs.ko"), []byte("the node's file"), 0o644)
	os.WriteFile(filepath.Join(host, "netfs.ko"), []byte("the node's file"), 0o644)
	os.Symlink(host, fs)
	_, err := takeImageKernel(context.Background(), tree, "6.12.1-amd64", t.TempDir(), []string{"erofs"}, nil, nil)
	if err == nil || !strings.Contains(err.Error(), "no link is followed") {
		t.Fatalf("a module through a linked directory: %v", err)
	}
	tree = imageTree(t, "6.12.1-amd64")
	dep := filepath.Join(tree, "usr/lib/modules/6.12.1-amd64/modules.dep")
	os.Remove(dep)
	os.Symlink("/proc/self/status", dep)
	if _, err := takeImageKernel(context.Background(), tree, "6.12.1-amd64", t.TempDir(), nil, nil, nil); err == nil {
		t.Fatal("a linked modules.dep was read")
	}
}

func TestCompareVersions(t *testing.T) {
	in := []string{"6.12.10-amd64", "6.1.0-57-cloud-amd64", "6.12.9-amd64", "6.12.117+deb13-amd64", "6.2"}
	slices.SortFunc(in, compareVersions)
	want := []string{"6.1.0-57-cloud-amd64", "6.2", "6.12.9-amd64", "6.12.10-amd64", "6.12.117+deb13-amd64"}
	if !slices.Equal(in, want) {
		t.Fatalf("sorted %v, want %v", in, want)
	}
}

// An image's kernel taken on the node goes once no guest boots it and no
// create used it within the grace; one a running guest boots stays.
func TestPruneKernels(t *testing.T) {
	state := t.TempDir()
	b := &Backend{cfg: backend.Config{StateDir: state}, log: testutil.Logger(t), boxes: map[sandboxid.ID]*box{}, roots: map[string]*sync.Mutex{}}
	old := time.Now().Add(-time.Hour)
	for _, k := range []string{"unused", "booted", "fresh"} {
		dir := filepath.Join(state, "kernels", k)
		os.MkdirAll(dir, 0o700)
		os.WriteFile(filepath.Join(dir, "vmlinuz"), make([]byte, 8192), 0o600)
		if k != "fresh" {
			os.Chtimes(dir, old, old)
		}
	}
	bx := &box{Dir: t.TempDir()}
	bx.saveGuest(Guest{Kernel: filepath.Join(state, "kernels", "booted", "vmlinuz")})
	b.boxes["a-b"] = bx
	freed, err := b.pruneKernels(10 * time.Minute)
	if err != nil || freed < 8192 {
		t.Fatalf("freed %d, %v", freed, err)
	}
	for k, want := range map[string]bool{"unused": false, "booted": true, "fresh": true} {
		if _, err := os.Stat(filepath.Join(state, "kernels", k)); (err == nil) != want {
			t.Errorf("kernels/%s kept: %v, want %v", k, err == nil, want)
		}
	}
}

package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
)

// imageTree writes a tree with a kernel of release rel, its modules as
// depmod would list them (erofs needs netfs; virtio_blk xz-compressed),
// and a lib that is a link to usr/lib, as Debian 13's.
func imageTree(t *testing.T, rel string) string {
	t.Helper()
	tree := t.TempDir()
	mods := filepath.Join(tree, "usr/lib/modules", rel)
	for _, d := range []string{"boot", filepath.Join(mods, "kernel/fs"), filepath.Join(mods, "kernel/drivers")} {
		os.MkdirAll(filepath.Join(tree, d), 0o755)
		os.MkdirAll(d, 0o755)
	}
	os.Symlink("usr/lib", filepath.Join(tree, "lib"))
	os.WriteFile(filepath.Join(tree, "boot", "vmlinuz-"+rel), []byte("kernel "+rel), 0o644)
	for name, data := range map[string]string{"kernel/fs/erofs.ko": "erofs", "kernel/fs/netfs.ko": "netfs", "kernel/drivers/virtio_blk.ko": "blk"} {
		os.WriteFile(filepath.Join(mods, name), []byte(data), 0o644)
	}
	if _, err := exec.LookPath("xz"); err == nil {
		exec.Command("xz", filepath.Join(mods, "kernel/drivers/virtio_blk.ko")).Run()
	}
	blk := "kernel/drivers/virtio_blk.ko"
	if _, err := os.Stat(filepath.Join(mods, blk)); err != nil {
		blk += ".xz"
	}
	os.WriteFile(filepath.Join(mods, "modules.dep"), []byte("kernel/fs/erofs.ko: kernel/fs/netfs.ko\nkernel/fs/netfs.ko:\n"+blk+":\n../../escape.ko:\n"), 0o644)
	return tree
}

// An image's kernel is found with its modules; the modules the guest's
// init loads are taken with what they need, in load order, decompressed;
// those built into the kernel (absent from modules.dep) are skipped.
func TestTakeImageKernel(t *testing.T) {
	tree := imageTree(t, "6.12.1-amd64")
	os.WriteFile(filepath.Join(tree, "boot", "vmlinuz-6.1.0-old"), []byte("old, no modules"), 0o644)
	kernel, rel := findImageKernel(tree)
	if rel != "6.12.1-amd64" {
		t.Fatalf("found %q %q", kernel, rel)
	}
	dir := t.TempDir()
	k, err := takeImageKernel(context.Background(), tree, kernel, rel, dir, []string{"virtio", "virtio_blk", "erofs"}, []string{"virtio_net"})
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
	if data, _ := os.ReadFile(again.Path); string(data) != "kernel 6.12.1-amd64" {
		t.Fatalf("the kernel copied: %q", data)
	}
}

// A tree without a kernel, or whose kernel or boot directory is a link,
// has none: nothing is followed out of the image.
func TestFindImageKernelFollowsNoLinks(t *testing.T) {
	if k, _ := findImageKernel(t.TempDir()); k != "" {
		t.Fatalf("an empty tree has kernel %q", k)
	}
	tree := imageTree(t, "6.12.1-amd64")
	os.Remove(filepath.Join(tree, "boot", "vmlinuz-6.12.1-amd64"))
	os.Symlink("/boot/vmlinuz", filepath.Join(tree, "boot", "vmlinuz-6.12.1-amd64"))
	if k, _ := findImageKernel(tree); k != "" {
		t.Fatalf("a linked kernel was taken: %q", k)
	}
	tree = imageTree(t, "6.12.1-amd64")
	os.RemoveAll(filepath.Join(tree, "usr/lib/modules"))
	if k, _ := findImageKernel(tree); k != "" {
		t.Fatalf("a kernel without modules was taken: %q", k)
	}
}

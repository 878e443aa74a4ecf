package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// The guest finds its disks by ext4 label where they have no serial
// (Firecracker): the label mkfs.ext4 -L writes is read back, and a file
// that is not ext4 has none.
func TestExt4LabelOfARealImage(t *testing.T) {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("no mkfs.ext4 (Debian's e2fsprogs)")
	}
	img := filepath.Join(t.TempDir(), "disk.ext4")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(8 << 20)
	f.Close()
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", "-L", "dsec-rw", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	if got := ext4Label(img); got != "dsec-rw" {
		t.Fatalf("label %q, want dsec-rw", got)
	}
	other := filepath.Join(t.TempDir(), "zeros")
	os.WriteFile(other, make([]byte, 4096), 0o600)
	if got := ext4Label(other); got != "" {
		t.Fatalf("a file of zeros has label %q", got)
	}
	if got := ext4Label(filepath.Join(t.TempDir(), "absent")); got != "" {
		t.Fatalf("a missing device has label %q", got)
	}
}

// A root the image store shares is EROFS: the guest mounts it as such by
// its magic, and an ext4 disk stays ext4.
func TestRootFSTypeOfRealImages(t *testing.T) {
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("no mkfs.erofs (Debian's erofs-utils)")
	}
	tree := t.TempDir()
	os.WriteFile(filepath.Join(tree, "f"), []byte("x"), 0o644)
	img := filepath.Join(t.TempDir(), "root.erofs")
	if out, err := exec.Command("mkfs.erofs", img, tree).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	if got := rootFSType(img); got != "erofs" {
		t.Fatalf("an EROFS image is %q", got)
	}
	other := filepath.Join(t.TempDir(), "zeros")
	os.WriteFile(other, make([]byte, 4096), 0o600)
	if got := rootFSType(other); got != "ext4" {
		t.Fatalf("a file of zeros is %q; want the default, ext4", got)
	}
}

func TestVsockPortFromTheCommandLine(t *testing.T) {
	for cmdline, want := range map[string]string{
		"console=ttyS0 dsec.agent=vsock:1024 quiet": "1024",
		"dsec.agent=vsock:":                         "",
		"dsec.agent=vsock:12ab":                     "",
		"dsec.agent=virtio":                         "",
		"console=ttyS0":                             "",
	} {
		got, ok := vsockPort(cmdline)
		if got != want || ok != (want != "") {
			t.Errorf("%q: %q %v, want %q", cmdline, got, ok, want)
		}
	}
}

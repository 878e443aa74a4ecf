package microvm

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
)

// Disk serials the guest's init finds its disks by.
const (
	RootSerial     = "dsec-root"
	WritableSerial = "dsec-rw"
	// ModulesSerial is the kernel's modules disk (QEMU.ModulesDisk).
	ModulesSerial = "dsec-modules"
)

// BuildRootImage writes an ext4 image of the tree at dir (an image's
// merged layers) to out: the read-only root disk every sandbox of that
// image on the node shares. It is written beside out and renamed into
// place, so a reader never sees half of one.
func BuildRootImage(ctx context.Context, dir, out string) error {
	var size int64
	err := filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		size += 4096 // an inode and a block's rounding, roughly
		if d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				size += fi.Size()
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	mb := size*13/10/(1<<20) + 32
	tmp := out + ".tmp"
	os.Remove(tmp)
	if err := mkfs(ctx, tmp, mb, "-d", dir, "-L", RootSerial, "-O", "^has_journal"); err != nil {
		return err
	}
	return os.Rename(tmp, out)
}

// NewWritableDisk makes a sandbox's writable disk: a sparse ext4 file of
// sizeMB, which bounds what the sandbox can write.
func NewWritableDisk(ctx context.Context, out string, sizeMB int64) error {
	return mkfs(ctx, out, sizeMB, "-L", WritableSerial, "-E", "lazy_itable_init=1,lazy_journal_init=1")
}

func mkfs(ctx context.Context, file string, sizeMB int64, args ...string) error {
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	err = f.Truncate(sizeMB << 20)
	f.Close()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "mkfs.ext4", append(append([]string{"-q", "-F"}, args...), file)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(file)
		return fmt.Errorf("mkfs.ext4 %s: %v: %s", file, err, out)
	}
	return nil
}

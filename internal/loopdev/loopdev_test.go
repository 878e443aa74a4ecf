package loopdev

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/testutil"
)

// A read-only EROFS image mounted through a loop device (kernels before
// 6.12 mount EROFS only from a block device) shows its files, refuses
// writes, and its device goes with the unmount.
func TestMountReadOnlyThroughALoopDevice(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.erofs")
	tree, mnt := t.TempDir(), t.TempDir()
	os.WriteFile(filepath.Join(tree, "hello"), []byte("hi\n"), 0o644)
	img := filepath.Join(t.TempDir(), "img.erofs")
	if out, err := exec.Command("mkfs.erofs", img, tree).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	os.Chmod(img, 0o444)
	if err := Mount(img, mnt, "erofs", unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "hello")); err != nil || string(got) != "hi\n" {
		t.Fatalf("hello = %q, %v", got, err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "new"), nil, 0o644); err == nil {
		t.Fatal("a write to a read-only mount succeeded")
	}
	backing := func() bool {
		files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
		for _, f := range files {
			if b, _ := os.ReadFile(f); strings.TrimSpace(string(b)) == img {
				return true
			}
		}
		return false
	}
	if !backing() {
		t.Fatal("no loop device holds the image")
	}
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatal(err)
	}
	if backing() {
		t.Fatal("the loop device stayed after the unmount")
	}
}

// Many mounts at once, while as many unmounts let devices go, all get a
// device: concurrent callers are handed the same free device by the
// kernel, and all but one must try again (16 creates in flight in a
// burst of bench/density once lost 16 times in a row and failed).
func TestConcurrentMountsAllGetADevice(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireBinary(t, "mkfs.erofs")
	tree := t.TempDir()
	os.WriteFile(filepath.Join(tree, "hello"), []byte("hi\n"), 0o644)
	img := filepath.Join(t.TempDir(), "img.erofs")
	if out, err := exec.Command("mkfs.erofs", img, tree).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	// Each caller is slow between asking for a device and taking it, as
	// on a node whose cores the burst holds.
	beforeConfigure = func() { time.Sleep(time.Millisecond) }
	t.Cleanup(func() { beforeConfigure = nil })
	const workers, rounds = 32, 4
	errs := make(chan error, workers)
	for w := range workers {
		go func() {
			mnt := filepath.Join(t.TempDir(), strconv.Itoa(w))
			os.Mkdir(mnt, 0o755)
			for range rounds {
				if err := Mount(img, mnt, "erofs", unix.MS_RDONLY, ""); err != nil {
					errs <- err
					return
				}
				if err := unix.Unmount(mnt, 0); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for range workers {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

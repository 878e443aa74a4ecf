// Package loopdev mounts a file system image through a loop device that
// detaches itself when unmounted.
package loopdev

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/opendsec/opendsec/internal/errdefs"
)

// Mount attaches img to a free loop device (read-only with MS_RDONLY in
// flags) and mounts it at mnt as fstype with data.
func Mount(img, mnt, fstype string, flags uintptr, data string) error {
	readOnly := flags&unix.MS_RDONLY != 0
	mode, loFlags := os.O_RDWR, uint32(unix.LO_FLAGS_AUTOCLEAR)
	if readOnly {
		mode, loFlags = os.O_RDONLY, loFlags|unix.LO_FLAGS_READ_ONLY
	}
	file, err := os.OpenFile(img, mode, 0)
	if err != nil {
		return err
	}
	defer file.Close()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer ctl.Close()
	for attempt := 0; attempt < 16; attempt++ {
		dev, lf, err := takeFree(ctl, file, mode, loFlags)
		if errors.Is(err, unix.EBUSY) {
			// Another process took this device first.
			time.Sleep(time.Duration(attempt+1) * time.Millisecond)
			continue
		}
		if err != nil {
			return err
		}
		err = unix.Mount(dev, mnt, fstype, flags, data)
		lf.Close() // with AUTOCLEAR, the device goes away with the mount
		if err != nil {
			return fmt.Errorf("mount %s (%s) at %s: %w", dev, img, mnt, err)
		}
		return nil
	}
	return errdefs.Unavailable("no free loop device after 16 tries")
}

// taking serialises this process's takeFree calls: the kernel hands every
// caller that asks at once the same free device, and all but one then
// lose it. In a burst (16 creates in flight on a busy node, each likely
// to be preempted between asking and configuring) a caller could lose 16
// times in a row; within one process none loses now, and other processes
// are left to the retries.
var taking sync.Mutex

// beforeConfigure, if set, runs between asking for a free device and
// configuring it (tests widen the race with it).
var beforeConfigure func()

// takeFree binds file to a free loop device and returns its path and an
// open descriptor of it (the caller closes it once mounted: with
// AUTOCLEAR the device then goes with the mount). EBUSY: another process
// took the device first.
func takeFree(ctl, file *os.File, mode int, loFlags uint32) (string, *os.File, error) {
	taking.Lock()
	defer taking.Unlock()
	n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
	if err != nil {
		return "", nil, os.NewSyscallError("ioctl(LOOP_CTL_GET_FREE)", err)
	}
	dev := fmt.Sprintf("/dev/loop%d", n)
	lf, err := os.OpenFile(dev, mode, 0)
	if err != nil {
		return "", nil, err
	}
	if beforeConfigure != nil {
		beforeConfigure()
	}
	cfg := unix.LoopConfig{Fd: uint32(file.Fd()), Info: unix.LoopInfo64{Flags: loFlags}}
	if err := unix.IoctlLoopConfigure(int(lf.Fd()), &cfg); err != nil {
		lf.Close()
		if errors.Is(err, unix.EBUSY) {
			return "", nil, err
		}
		return "", nil, os.NewSyscallError("ioctl(LOOP_CONFIGURE)", err)
	}
	return dev, lf, nil
}

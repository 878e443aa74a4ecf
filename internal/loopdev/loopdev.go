// Package loopdev mounts a file system image through a loop device that
// detaches itself when unmounted.
package loopdev

import (
	"errors"
	"fmt"
	"os"

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
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return os.NewSyscallError("ioctl(LOOP_CTL_GET_FREE)", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		lf, err := os.OpenFile(dev, mode, 0)
		if err != nil {
			return err
		}
		cfg := unix.LoopConfig{Fd: uint32(file.Fd()), Info: unix.LoopInfo64{Flags: loFlags}}
		err = unix.IoctlLoopConfigure(int(lf.Fd()), &cfg)
		if errors.Is(err, unix.EBUSY) {
			lf.Close() // another process took this device first
			continue
		}
		if err != nil {
			lf.Close()
			return os.NewSyscallError("ioctl(LOOP_CONFIGURE)", err)
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

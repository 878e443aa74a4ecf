package main

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/opendsec/opendsec/internal/image"
)

// What systemd's status lines say on the console (the combined unit
// format, with show_status on under quiet): localFS is where a vm
// sandbox's systemd starts the agent (its unit runs after
// local-fs.target, before sysinit.target), booted is the end of the boot
// (Debian's default target).
const (
	reachedLocalFS = "Reached target local-fs.target"
	reachedDefault = "Reached target graphical.target"
)

// bareImageBoot boots ref as a bare QEMU full PC boots it: q35 with its
// firmware, the image's own kernel and initramfs from its /boot, its root
// file system as one ext4 disk and its systemd as init, until systemd
// reports local-fs.target and the default target reached; n times, each
// on a fresh copy of the disk. An image without a kernel of its own gives nil: booting
// the node's kernel needs its PCI modules loaded by an initramfs, which
// is the backend's own init (the probe row). Takes one-layer images (the
// base recipes'; others give nil too): a bare boot has no overlay to
// apply whiteouts with. Needs root (the image's files keep their owners).
func bareImageBoot(ctx context.Context, storeDir, ref, accel string, memoryMB int64, n int) (localFS, booted []time.Duration, err error) {
	store, err := image.OpenStore(storeDir)
	if err != nil {
		return nil, nil, err
	}
	r, err := image.ParseRef(ref)
	if err != nil {
		return nil, nil, err
	}
	im, err := store.Resolve(r)
	if err != nil {
		return nil, nil, err
	}
	if len(im.Manifest.Layers) != 1 {
		fmt.Printf("(no bare boot of %s: it has %d layers, and a bare boot takes one)\n", ref, len(im.Manifest.Layers))
		return nil, nil, nil
	}
	dir, err := os.MkdirTemp("", "dsec-bench-imageboot-")
	if err != nil {
		return nil, nil, err
	}
	defer os.RemoveAll(dir)
	root := filepath.Join(dir, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		return nil, nil, err
	}
	if out, err := exec.CommandContext(ctx, "tar", "-xpf", store.BlobPath(im.Manifest.Layers[0].Digest), "-C", root, "--numeric-owner").CombinedOutput(); err != nil {
		return nil, nil, fmt.Errorf("unpack %s: %v: %s", ref, err, out)
	}
	kernels, _ := filepath.Glob(filepath.Join(root, "boot", "vmlinuz-*"))
	initrds, _ := filepath.Glob(filepath.Join(root, "boot", "initrd.img-*"))
	if len(kernels) == 0 || len(initrds) == 0 {
		return nil, nil, nil
	}
	// The identity the backend's init writes at every boot.
	if err := os.WriteFile(filepath.Join(root, "etc/machine-id"), []byte("0123456789abcdef0123456789abcdef\n"), 0o444); err != nil {
		return nil, nil, err
	}
	if err := os.WriteFile(filepath.Join(root, "etc/hostname"), []byte("bare\n"), 0o644); err != nil {
		return nil, nil, err
	}
	disk := filepath.Join(dir, "root.ext4")
	if out, err := exec.CommandContext(ctx, "mkfs.ext4", "-q", "-F", "-d", root, disk, "4G").CombinedOutput(); err != nil {
		return nil, nil, fmt.Errorf("mkfs.ext4: %v: %s", err, out)
	}
	for i := range n {
		fs, all, err := bootToTargets(ctx, dir, disk, kernels[len(kernels)-1], initrds[len(initrds)-1], accel, memoryMB)
		if err != nil {
			return nil, nil, fmt.Errorf("bare boot %d of %s: %w", i+1, ref, err)
		}
		localFS, booted = append(localFS, fs), append(booted, all)
	}
	return localFS, booted, nil
}

// bootToTargets boots a copy of disk once and returns the times from
// QEMU's start to systemd's reaching local-fs.target and its default
// target, read from the console.
func bootToTargets(ctx context.Context, dir, disk, kernel, initrd, accel string, memoryMB int64) (localFS, booted time.Duration, err error) {
	run := filepath.Join(dir, "run.ext4")
	console := filepath.Join(dir, "console.log")
	os.Remove(console)
	if out, err := exec.CommandContext(ctx, "cp", "--sparse=always", disk, run).CombinedOutput(); err != nil {
		return 0, 0, fmt.Errorf("cp: %v: %s", err, out)
	}
	defer os.Remove(run)
	cpu := "max"
	if accel == "kvm" {
		cpu = "host"
	}
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", "-M", "q35", "-accel", accel, "-cpu", cpu,
		"-m", fmt.Sprint(memoryMB), "-smp", "1", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", kernel, "-initrd", initrd,
		"-append", // printk.devkmsg=on: else the kernel keeps 10 lines of
		// systemd's in 5 s and may drop the one waited for.
		"root=/dev/vda rw console=ttyS0 panic=-1 printk.devkmsg=on systemd.log_target=kmsg systemd.log_level=info",
		"-serial", "file:"+console, "-drive", "file="+run+",format=raw,if=virtio")
	t0 := time.Now()
	if err := cmd.Start(); err != nil {
		return 0, 0, err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		cmd.Process.Kill() //nolint:errcheck // it may have ended
		<-exited
	}()
	deadline := time.After(10 * time.Minute)
	for {
		if localFS == 0 && consoleSays(console, reachedLocalFS) {
			localFS = time.Since(t0)
		}
		if consoleSays(console, reachedDefault) {
			if localFS == 0 {
				localFS = time.Since(t0)
			}
			return localFS, time.Since(t0), nil
		}
		select {
		case err := <-exited:
			exited <- err
			return 0, 0, fmt.Errorf("QEMU ended (%v) before %q; console: %s", err, reachedDefault, lastLines(console, 5))
		case <-deadline:
			return 0, 0, fmt.Errorf("no %q within 10 minutes; console: %s", reachedDefault, lastLines(console, 5))
		case <-ctx.Done():
			return 0, 0, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func consoleSays(path, marker string) bool {
	data, _ := os.ReadFile(path)
	return strings.Contains(string(data), marker)
}

func lastLines(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return err.Error()
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > n {
			lines = lines[1:]
		}
	}
	return strings.Join(lines, " | ")
}

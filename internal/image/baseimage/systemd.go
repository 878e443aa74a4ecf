package baseimage

import (
	"context"
	"os"
	"path/filepath"
)

// The vm backend's own kind of image: Debian 13 (trixie) with systemd as
// its init, which a vm sandbox boots as PID 1 with the agent as one of its
// units (cmd/dsec-vminit). The host test's Debian 13 machine
// (scripts/test-hosts.sh) is the same image with a kernel and a node's
// packages on top (debian-host).
const systemdSuite = "trixie"

// systemdPackages are installed on top of trixie's minbase.
var systemdPackages = []string{"systemd", "systemd-sysv", "dbus", "kmod", "iproute2", "procps", "ca-certificates", "bash", "sudo", "python3"}

// dockerPackages add Debian's Docker to systemdPackages: a vm sandbox
// runs containers of its own.
var dockerPackages = append(append([]string{}, systemdPackages...), "docker.io", "docker-cli")

func buildDebianSystemd(ctx context.Context, o Options, root string) error {
	return buildSystemdImage(ctx, o, root, "systemd", systemdPackages)
}

func buildDebianDocker(ctx context.Context, o Options, root string) error {
	return buildSystemdImage(ctx, o, root, "docker", dockerPackages)
}

// kernelPackages add Debian 13's own kernel to systemdPackages: a vm
// sandbox of this image boots it (its /boot and /lib/modules) instead of
// the node's guest kernel.
var kernelPackages = append(append([]string{}, systemdPackages...), "linux-image-amd64")

func buildDebianKernel(ctx context.Context, o Options, root string) error {
	return buildSystemdImage(ctx, o, root, "kernel", kernelPackages)
}

// hostPackages add what an OpenDsec node runs on to kernelPackages: the
// host test boots this root as its machine, with the Debian kernel and
// initramfs of its /boot.
// Its download is also where that test's offline bundle takes crun and
// runsc from (the test takes them out of the disk again).
var hostPackages = append(append([]string{}, kernelPackages...), "udev", "nftables", "conntrack", "e2fsprogs", "crun", "runsc")

func buildDebianHost(ctx context.Context, o Options, root string) error {
	return buildSystemdImage(ctx, o, root, "host", hostPackages)
}

func buildSystemdImage(ctx context.Context, o Options, root, kind string, packages []string) error {
	if err := installDebian(ctx, o, root, systemdSuite, kind, packages); err != nil {
		return err
	}
	if err := finishDebian(ctx, root); err != nil {
		return err
	}
	// Its identity is the sandbox's: the guest's init writes both at boot.
	for _, p := range []string{"etc/machine-id", "etc/hostname"} {
		if err := os.WriteFile(filepath.Join(root, p), nil, 0o444); err != nil {
			return err
		}
	}
	// No console login: the agent is how a sandbox is reached.
	for _, unit := range []string{"getty.target", "serial-getty@.service", "console-getty.service"} {
		link := filepath.Join(root, "etc/systemd/system", unit)
		os.Remove(link)
		if err := os.Symlink("/dev/null", link); err != nil {
			return err
		}
	}
	return nil
}

#!/bin/sh
# Fetches the microvm backend's guest kernel from Debian's packages into
# DIR (default .cache/guest), without installing it on the host: the
# uncompressed PVH vmlinux (QEMU's microvm machine boots it directly), the
# virtio modules the guest's init loads, and every module of the kernel
# with its index (depmod) on a read-only ext4 disk, which a vm sandbox's
# guest mounts at /lib/modules/RELEASE (modprobe, Docker's bridge and
# netfilter). Idempotent; needs lz4, kmod, mkfs.ext4 and apt-get (make deps
# installs them).
#
#   scripts/guest-kernel.sh [DIR]   ->  DIR/vmlinux, DIR/modules/*.ko, DIR/release, DIR/modules.img
set -eu
dir=${1:-.cache/guest}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
mods="virtio_ring virtio virtio_mmio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_console virtio_blk overlay vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport failover net_failover virtio_net libcrc32c erofs"
if [ -s "$dir/vmlinux" ] && [ -s "$dir/release" ] && [ -s "$dir/modules.img" ] && [ "$(cat "$dir/modules.list" 2>/dev/null)" = "$mods" ]; then
	exit 0
fi
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -1)
if [ -z "$pkg" ]; then
	echo "guest-kernel: Debian's linux-image-cloud-amd64 is not known to apt (apt-get update?)" >&2
	exit 1
fi
work=$(mktemp -d)
chmod 755 "$work" # apt-get download runs as _apt
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -qq "$pkg")
dpkg-deb -x "$work"/"$pkg"_*.deb "$work/root"
release=${pkg#linux-image-}
bz=$work/root/boot/vmlinuz-$release
# The bzImage holds the kernel lz4-compressed (legacy frame, magic 02 21 4c 18).
off=$(grep -aobUP '\x02\x21\x4c\x18' "$bz" | head -1 | cut -d: -f1)
if [ -z "$off" ]; then
	echo "guest-kernel: no lz4 payload in $bz" >&2
	exit 1
fi
tail -c +"$((off + 1))" "$bz" | lz4 -dc > "$work/vmlinux" 2>/dev/null || true
if ! head -c 4 "$work/vmlinux" | grep -q ELF; then
	echo "guest-kernel: the payload of $bz is not an ELF kernel" >&2
	exit 1
fi
mkdir -p "$dir/modules"
for m in $mods; do
	f=$(find "$work/root/lib/modules/$release" -name "$m.ko*" | head -1)
	[ -n "$f" ] || continue # built into this kernel
	cp "$f" "$dir/modules/"
done
# All of the kernel's modules, indexed, on a disk of their own.
depmod -b "$work/root" "$release"
mkfs.ext4 -q -F -L dsec-modules -d "$work/root/lib/modules/$release" "$work/modules.img" \
	"$(( $(du -sm "$work/root/lib/modules/$release" | cut -f1) * 5 / 4 + 16 ))M"
mv "$work/modules.img" "$dir/modules.img"
mv "$work/vmlinux" "$dir/vmlinux"
echo "$release" > "$dir/release"
echo "$mods" > "$dir/modules.list"
echo "guest kernel $release in $dir"

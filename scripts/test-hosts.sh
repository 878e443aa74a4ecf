#!/bin/bash
# The host test (make test-hosts): a Debian 13 (trixie) virtual machine
# with systemd as PID 1 and cgroup v2 only, built from Debian's packages
# and booted under QEMU with its own kernel. Inside it, from the binaries
# just built: deploy/quickstart.sh installs OpenDsec as systemd units, the
# host suite (test/hosts, compiled here) runs against it, and
# `quickstart.sh --uninstall` must leave nothing behind.
#
#   scripts/test-hosts.sh [CACHE]    (default .cache/hostvm)
#
# The packages are kept in CACHE/debootstrap (the download of the image
# recipe debian-host) and the disk in CACHE/base.img, so a rerun is
# offline; each run boots a copy of it.
# Needs root, debootstrap, qemu-system-x86_64, mkfs.ext4; KVM is used where its probe boots, else TCG.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${1:-$repo/.cache/hostvm}
mkdir -p "$cache"
cache=$(cd "$cache" && pwd)
# The runtimes are not on the disk: the offline bundle (make bundle)
# installs them from the packages it carries, as on a machine without a
# mirror.
bundled_packages="crun runsc"
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
timeout_s=${HOST_TEST_TIMEOUT:-1800}

log() { printf '%s %s\n' "$(date +%T)" "$*"; }

# One run at a time: a second would rebuild the disk and the shared
# directory under the first.
exec 9>"$cache/lock"
flock -n 9 || { log "another host test runs in $cache (lock $cache/lock)"; exit 1; }

# 1. The machine's root: the image recipe debian-host (the vm backend's
# Debian 13 with systemd, Debian's kernel and a node's packages;
# internal/image/baseimage), written into a directory. Its packages are
# downloaded once into CACHE/debootstrap. disk_recipe names what makes
# the disk: the recipes' code and this script's own steps below.
recipes=$({
	cat "$repo"/internal/image/baseimage/{baseimage,debian,systemd,codeinterpreter}.go
	sed -n '/^if \[ ! -s "\$base"/,/^fi$/p' "$0"
} | sha256sum | cut -c1-16)
disk_recipe="5 $recipes"
base=$cache/base.img
if [ ! -s "$base" ] || [ "$(cat "$cache/base.recipe" 2>/dev/null)" != "$disk_recipe" ]; then
	log "building the Debian 13 disk (dsec image build debian-host)"
	root=$cache/root
	rm -rf "$root"
	"$repo/bin/dsec" image build debian-host --rootfs "$root" --cache-dir "$cache" --mirror "$mirror" >"$cache/debootstrap.log" 2>&1 ||
		{ tail -20 "$cache/debootstrap.log" >&2; exit 1; }
	# One download stays: this build's (a changed package list made a new
	# one). trixie.tgz and packages were this script's own, before.
	ls -t "$cache"/debootstrap/trixie-host-*.tgz | tail -n +2 | xargs -r rm -f
	rm -f "$cache/trixie.tgz" "$cache/packages"
	# 2. The test's own: the runtimes out again, an identity, a test unit
	# that runs /host/inside.sh from the shared directory and powers off.
	chroot "$root" dpkg --purge $bundled_packages >>"$cache/debootstrap.log" 2>&1 ||
		{ tail -20 "$cache/debootstrap.log" >&2; exit 1; }
	# The image leaves identity and console logins to a sandbox's init;
	# this machine has its own, and a root login on its console.
	rm -f "$root"/etc/systemd/system/{getty.target,serial-getty@.service,console-getty.service}
	od -An -tx1 -N16 /dev/urandom | tr -d ' \n' >"$root/etc/machine-id"
	echo >>"$root/etc/machine-id"
	echo dsec-host >"$root/etc/hostname"
	printf '127.0.0.1 localhost dsec-host\n' >"$root/etc/hosts"
	cat >"$root/etc/fstab" <<'EOF'
/dev/vda / ext4 defaults,errors=remount-ro 0 1
host /host 9p trans=virtio,version=9p2000.L,msize=1048576,nofail 0 0
EOF
	mkdir -p "$root/host"
	chroot "$root" passwd -d root >/dev/null
	cat >"$root/etc/systemd/system/dsec-hosttest.service" <<'EOF'
[Unit]
Description=OpenDsec host test (runs /host/inside.sh, then powers off)
After=multi-user.target
RequiresMountsFor=/host

[Service]
Type=simple
ExecStart=/bin/sh -c '/bin/bash /host/inside.sh > /host/inside.log 2>&1; echo $? > /host/inside.rc; systemctl poweroff'
StandardOutput=journal+console

[Install]
WantedBy=multi-user.target
EOF
	chroot "$root" systemctl enable dsec-hosttest.service >/dev/null 2>&1
	cp "$root"/boot/vmlinuz-* "$cache/vmlinuz"
	cp "$root"/boot/initrd.img-* "$cache/initrd.img"
	rm -f "$base.partial"
	mkfs.ext4 -q -F -L root -d "$root" "$base.partial" 16G
	mv "$base.partial" "$base"
	echo "$disk_recipe" >"$cache/base.recipe"
	rm -rf "$root"
fi

# The download debian-host's build kept: the bundle takes Debian 13's
# crun and runsc from it.
downloads=("$cache"/debootstrap/trixie-host-*.tgz)
[ ${#downloads[@]} = 1 ] && [ -e "${downloads[0]}" ] ||
	{ log "want one debian-host download in $cache/debootstrap, found: ${downloads[*]}; delete $base and run again"; exit 1; }
tarball=${downloads[0]}

# 3. What the run takes in: the offline bundle of the binaries just built
# (with a busybox image store and Debian 13's crun and runsc), the host
# suite, the installer.
share=$cache/run
rm -rf "$share" && mkdir -p "$share/bin" "$share/deploy"
for f in dsec aether dsec-vminit libdsec-compat.so; do cp -L "$repo/bin/$f" "$share/bin/"; done
cp "$repo/deploy/quickstart.sh" "$share/deploy/"
(cd "$repo" && go test -c -o "$share/hosts.test" ./test/hosts/)
# HOST_BENCH=1 (make bench-hosts) also runs bench/create in the VM.
if [ "${HOST_BENCH:-0}" = 1 ]; then (cd "$repo" && go build -o "$share/bench-create" ./bench/create); fi
if [ ! -e "$cache/images/refs/root/busybox/latest" ]; then
	"$repo/bin/dsec" image build busybox --store "$cache/images" >/dev/null
fi
BUNDLE_PACKAGES=$bundled_packages "$repo/scripts/bundle.sh" "$share/opendsec.tar.gz" --images "$cache/images" \
	--image root/busybox:latest --debs-from "$tarball" >"$cache/bundle.log" 2>&1 || { cat "$cache/bundle.log" >&2; exit 1; }
cp "$repo/test/hosts/inside.sh" "$share/inside.sh"
# Settings for inside.sh: HOST_TEST_RUN picks host tests (-test.run).
printf 'HOST_TEST_RUN=%q\nBENCH_N=%q\nHOST_TEST_QUIT=%q\n' "${HOST_TEST_RUN:-}" "${BENCH_N:-10}" "${HOST_TEST_QUIT:-}" >"$share/env"

# 4. Boot. KVM only where a probe boot works (this repository's rule:
# /dev/kvm opening proves nothing); TCG otherwise.
accel=tcg
if [ -w /dev/kvm ] && timeout 60 qemu-system-x86_64 -machine q35,accel=kvm -cpu host -m 256 -nographic -no-reboot \
	-kernel "$cache/vmlinuz" -initrd "$cache/initrd.img" -append "console=ttyS0 panic=-1 rdinit=/bin/false" -nic none 2>&1 |
	grep -q "Run /bin/false"; then
	accel=kvm
fi
# Each run boots a sparse copy of the base disk (seconds: only its
# written blocks are copied).
overlay=$cache/run.img
# A guest kernel can die under multi-threaded TCG (QEMU 7.2: an int3 Oops
# while it patches its own text on two vCPUs; seen at boot and, once in
# about ten runs, mid-test): a run whose kernel panicked before the test
# finished is run again from a fresh disk, once, and says so.
for attempt in 1 2; do
	cp --sparse=always "$base" "$overlay"
	rm -f "$share/inside.log" "$share/inside.rc"
	log "booting the VM ($accel); the run's log: $share/inside.log"
	start=$(date +%s)
	set +e
	timeout "$timeout_s" qemu-system-x86_64 -machine "q35,accel=$accel" -cpu max -smp 2 -m 6144 -nographic -no-reboot \
		-kernel "$cache/vmlinuz" -initrd "$cache/initrd.img" \
		-append "root=/dev/vda rw console=ttyS0 quiet systemd.show_status=0 panic=-1" \
		-drive "file=$overlay,if=virtio,format=raw" \
		-virtfs "local,path=$share,mount_tag=host,security_model=none,id=host" -nic none >"$cache/console.log" 2>&1
	qrc=$?
	set -e
	if [ -e "$share/inside.rc" ] || ! grep -q "Kernel panic" "$cache/console.log"; then break; fi
	[ $attempt = 2 ] || cp "$cache/console.log" "$cache/console.panic.log"
	log "the guest kernel panicked (console: $cache/console.log)$([ $attempt = 1 ] && echo '; running the test again on a fresh disk')"
done
rm -f "$overlay"
cat "$share/inside.log" 2>/dev/null || true
if [ "$qrc" = 124 ]; then
	log "the VM did not finish within ${timeout_s}s; console: $cache/console.log"
	exit 1
fi
rc=$(cat "$share/inside.rc" 2>/dev/null || echo "none")
log "host test: exit $rc in $(($(date +%s) - start))s (Debian 13, systemd, cgroup v2, $accel)"
[ "$rc" = 0 ]

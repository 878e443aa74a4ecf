#!/bin/sh
# Installs what OpenDsec needs from Debian's packages (idempotent; installs
# only what is missing). Needs root.
set -eu
pkgs="crun runc runsc criu nftables conntrack iproute2 debootstrap busybox-static file ca-certificates python3-venv procps gcc libc6-dev qemu-system-x86 lz4 kmod docker-registry skopeo umoci erofs-utils prometheus"
missing=""
for p in $pkgs; do
	dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -n "$missing" ]; then
	echo "installing:$missing"
	if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
	$SUDO apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing
fi
command -v go >/dev/null || { echo "Go is required (https://go.dev/dl); none found on PATH" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is required" >&2; exit 1; }

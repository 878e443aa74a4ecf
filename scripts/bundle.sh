#!/bin/bash
# The offline bundle (make bundle): one tarball with everything
# deploy/quickstart.sh --bundle needs on a machine without a registry or a
# Debian mirror, and a SHA-256 manifest of it.
#
#   scripts/bundle.sh OUT.tar.gz [--images STORE] [--image NAME]... [--debs-from TARBALL]
#
# What goes in (under opendsec-VERSION/):
#   bin/      dsec, aether, dsec-vminit, libdsec-compat.so (from bin/, make
#             build), runsc-net and firecracker (from .cache, where made)
#   guest/    the microvm backend's guest kernel and modules (.cache/guest)
#   images/   an image store holding the named images (default
#             root/busybox:latest and root/py:3.11, from .cache/images)
#   debs/     the Debian packages the installer needs (crun, runsc,
#             nftables, conntrack, iproute2, qemu-system-x86) with every
#             package they depend on, and debs/CODENAME, the Debian release
#             they are for. By default downloaded for this machine's
#             release (apt-get download); --debs-from takes them from a
#             debootstrap tarball instead (make test-hosts' download of
#             the debian-host recipe's packages),
#             for another release.
#   VERSION   what dsec version says
#   MANIFEST.sha256   sha256sum of every other file; the installer refuses
#             a bundle whose files do not match it before it changes anything.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
out=$1
shift
store=$repo/.cache/images images=() debs_from=""
packages=${BUNDLE_PACKAGES:-crun runsc nftables conntrack iproute2 qemu-system-x86}
while [ $# -gt 0 ]; do
	case $1 in
	--images) store=$2; shift 2 ;;
	--image) images+=("$2"); shift 2 ;;
	--debs-from) debs_from=$2; shift 2 ;;
	*) echo "bundle: unknown option $1" >&2; exit 2 ;;
	esac
done
[ ${#images[@]} -gt 0 ] || images=(root/busybox:latest root/py:3.11)
for f in dsec aether dsec-vminit; do
	[ -x "$repo/bin/$f" ] || { echo "bundle: bin/$f missing: make build first" >&2; exit 1; }
done
version=$("$repo/bin/dsec" version)
work=$(mktemp -d "${TMPDIR:-/tmp}/bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT
top=$work/opendsec-$version
mkdir -p "$top/bin" "$top/debs"
step() { printf '%s %s\n' "$(date +%T)" "$*"; }

step "binaries ($version)"
for f in dsec aether dsec-vminit libdsec-compat.so; do
	[ ! -e "$repo/bin/$f" ] || cp -L "$repo/bin/$f" "$top/bin/"
done
[ ! -x "$repo/.cache/bin/runsc-net" ] || cp -L "$repo/.cache/bin/runsc-net" "$top/bin/"
[ ! -x "$repo/.cache/firecracker/firecracker" ] || cp -L "$repo/.cache/firecracker/firecracker" "$top/bin/"
echo "$version" >"$top/VERSION"

if [ -s "$repo/.cache/guest/vmlinux" ]; then
	step "the microvm guest kernel"
	cp -a "$repo/.cache/guest" "$top/guest"
fi

step "images: ${images[*]}"
"$repo/bin/dsec" image copy --from "$store" --to "$top/images" "${images[@]}" >/dev/null
rm -rf "$top/images/tmp"

if [ -n "$debs_from" ]; then
	step "Debian packages from $debs_from: $packages and what they depend on"
	x=$work/debootstrap
	mkdir -p "$x"
	tar -xzf "$debs_from" -C "$x"
	lists=$(ls "$x"/var/lib/apt/lists/*_Packages)
	codename=$(basename "$lists" | sed -n 's/.*_dists_\([a-z]*\)_.*/\1/p')
	# The closure of the packages' Depends and Pre-Depends (the first of
	# each alternative that the tarball holds), from its Packages index.
	python3 - "$lists" "$x/var/cache/apt/archives" "$top/debs" $packages <<'EOF'
import os, re, shutil, sys
lists, archives, out, want = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
pkgs = {}
for stanza in open(lists).read().split("\n\n"):
    f = dict(re.findall(r"^([A-Za-z-]+): (.*)$", stanza, re.M))
    if "Package" in f:
        pkgs[f["Package"]] = f
have = {n.split("_")[0]: n for n in os.listdir(archives) if n.endswith(".deb")}
seen, todo = set(), list(want)
while todo:
    p = todo.pop()
    if p in seen:
        continue
    if p not in have:
        sys.exit(f"bundle: package {p} is not in the tarball")
    seen.add(p)
    deps = pkgs.get(p, {}).get("Pre-Depends", "") + "," + pkgs.get(p, {}).get("Depends", "")
    for group in filter(None, (g.strip() for g in deps.split(","))):
        names = [re.sub(r"[ (:].*", "", alt.strip()) for alt in group.split("|")]
        pick = next((n for n in names if n in have), None)
        if pick:
            todo.append(pick)
for p in sorted(seen):
    shutil.copy(os.path.join(archives, have[p]), out)
EOF
else
	codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
	step "Debian packages for $codename: $packages and what they depend on (apt-get download)"
	# shellcheck disable=SC2086 # the package list is words
	closure=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances $packages |
		grep -v '^ ' | grep -v '^<' | sort -u)
	# shellcheck disable=SC2086
	(cd "$top/debs" && apt-get -o APT::Sandbox::User=root download -q $closure >/dev/null)
fi
echo "$codename" >"$top/debs/CODENAME"

step "manifest"
(cd "$top" && find . -type f ! -name MANIFEST.sha256 -printf '%P\n' | LC_ALL=C sort | xargs -d '\n' sha256sum >MANIFEST.sha256)
mkdir -p "$(dirname "$out")"
tar -C "$work" -czf "$out.partial" "opendsec-$version"
mv "$out.partial" "$out"
step "wrote $out ($(du -h "$out" | cut -f1); $(wc -l <"$top/MANIFEST.sha256") files, $(ls "$top/debs" | grep -c '\.deb$') Debian packages for $codename)"

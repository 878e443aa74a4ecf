#!/bin/bash
# Runs inside the host test's Debian 13 VM (scripts/test-hosts.sh puts it
# in the shared directory /host): install with deploy/quickstart.sh from
# the offline bundle (the VM has no network, crun or runsc), run the host
# suite, roll out, uninstall, and check that nothing is left.
set -u
cd /host
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
rc=0
# shellcheck disable=SC1091
[ ! -f /host/env ] || . /host/env
section() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }

section "the machine"
echo "$(. /etc/os-release && echo "$PRETTY_NAME"), kernel $(uname -r), $(systemctl --version | head -1), cgroup $(stat -fc %T /sys/fs/cgroup)"

section "a check that fails changes nothing"
if ./deploy/quickstart.sh --bin /nonexistent --backends container,gvisor >/tmp/refused.log 2>&1; then
	echo "FAIL: the installer accepted --bin /nonexistent"
	rc=1
elif [ -e /usr/local/lib/opendsec ] || [ -e /etc/systemd/system/dsec-edge.service ]; then
	echo "FAIL: a refused install changed the machine"
	rc=1
else
	grep -- "- " /tmp/refused.log
fi

section "a bundle that does not match its manifest is refused before anything changes"
# tamper HOW WANT: a copy of the bundle changed by HOW (a shell command run
# in its top directory) must be refused, naming WANT, with nothing changed.
tamper() {
	rm -rf /tmp/tampered && mkdir /tmp/tampered && tar -xzf /host/opendsec.tar.gz -C /tmp/tampered
	(cd /tmp/tampered/opendsec-* && eval "$1")
	tar -C /tmp/tampered -czf /tmp/tampered.tar.gz . && rm -rf /tmp/tampered
	if ./deploy/quickstart.sh --bundle /tmp/tampered.tar.gz --backends container,gvisor >/tmp/refused.log 2>&1; then
		echo "FAIL: the installer took a bundle changed by: $1"
		rc=1
	elif [ -e /usr/local/lib/opendsec ] || [ -e /etc/systemd/system/dsec-edge.service ] || command -v crun >/dev/null; then
		echo "FAIL: a refused bundle ($1) changed the machine"
		rc=1
	elif ! grep -q "$2" /tmp/refused.log; then
		echo "FAIL: the refusal of a bundle changed by $1 does not say $2:"; cat /tmp/refused.log
		rc=1
	else
		tail -2 /tmp/refused.log
	fi
}
tamper "printf x >>bin/aether" "bin/aether: FAILED"
tamper "sed -i 's/^[0-9a-f]* \(.*bin\/aether\)$/deadbeef \1/' MANIFEST.sha256; printf x >>bin/aether" "malformed manifest line"
tamper "ln -s /etc/shadow images/shadow" "not a regular file: images/shadow"

section "install from the offline bundle (no network; crun and runsc from it)"
ip route | grep -q default && { echo "FAIL: the VM has a route out; the offline install proves nothing"; rc=1; }
if command -v crun || command -v runsc; then echo "FAIL: the VM has crun or runsc before the install"; rc=1; fi
./deploy/quickstart.sh --bundle /host/opendsec.tar.gz --backends container,gvisor || { echo "FAIL: install"; journalctl -u 'dsec-*' --no-pager | tail -60; exit 1; }
section "install again (idempotent)"
./deploy/quickstart.sh --bundle /host/opendsec.tar.gz --backends container,gvisor --no-check-run || { echo "FAIL: second install"; rc=1; }

section "host suite"
set +u
. /etc/opendsec/client.env
set -u
# What runs after a minute of the suite and after four, for a hang's diagnosis.
(for t in 60 120; do sleep $t; { date; ps -eLo pid,tid,stat,wchan:32,etime,args | grep -E '[r]unsc|[c]run|[d]sec|[a]ether' | cut -c1-200; } >>/host/ps.txt; done; [ -z "${HOST_TEST_QUIT:-}" ] || pkill -QUIT -f 'bin/dsec edge') &
DSEC_HOST_TEST=1 ./hosts.test -test.v -test.timeout 25m ${HOST_TEST_RUN:+-test.run "$HOST_TEST_RUN"} || rc=1
journalctl -u 'dsec-*' --no-pager >/host/units.journal 2>&1
[ "$rc" = 0 ] || { echo "the units' journal: units.journal in the run directory"; journalctl -u dsec-edge --no-pager | grep -v level=INFO | tail -40; }

section "rollout over the systemd units (the same build again, with its gates)"
/host/bin/dsec rollout --plan /etc/opendsec/rollout.json --binary /host/bin/dsec --agent /host/bin/aether --soak 5s || { echo "FAIL: rollout"; rc=1; }
DSEC_API_URL=http://127.0.0.1:7070 /host/bin/dsec nodes | grep -q " healthy " || { echo "FAIL: no healthy node after the rollout"; rc=1; }

if [ -x /host/bench-create ]; then
	section "bench: create to first exec against bare crun (cgroup v2, systemd host)"
	# /tmp is a 3 GiB tmpfs on Debian 13; the bench's layers want disk.
	TMPDIR=/var/tmp /host/bench-create -store /var/lib/opendsec/images -agent /host/bin/aether -n "${BENCH_N:-10}" || { echo "FAIL: bench"; rc=1; }
fi

section "uninstall"
./deploy/quickstart.sh --uninstall || { echo "FAIL: uninstall"; rc=1; }

section "nothing left"
left=0
check() { # what, command that prints leftovers
	out=$("${@:2}" 2>/dev/null)
	if [ -n "$out" ]; then
		echo "FAIL: left after uninstall: $1:"
		echo "$out" | sed 's/^/    /'
		left=1
	fi
}
check "units" sh -c "systemctl list-units --all --no-legend 'dsec-*' | grep -v dsec-hosttest"
check "unit files" sh -c "ls /etc/systemd/system/dsec-*.service | grep -v dsec-hosttest"
check "processes" pgrep -a -f '/usr/local/lib/opendsec|runsc|crun|aether'
check "mounts" grep -E '/var/lib/opendsec|/run/opendsec' /proc/self/mounts
check "cgroups" sh -c "ls -d /sys/fs/cgroup/opendsec /sys/fs/cgroup/system.slice/dsec-edge.service 2>/dev/null"
check "nftables tables" sh -c "nft list tables | grep dsec"
check "network namespaces" sh -c "ip netns list | grep dsec"
check "files" ls -d /usr/local/lib/opendsec /var/lib/opendsec /etc/opendsec /run/opendsec /run/lock/opendsec-sandboxnet.lock /usr/local/bin/dsec
[ "$left" = 0 ] || rc=1
[ "$left" = 1 ] || echo "nothing left"
section "done: exit $rc"
exit $rc

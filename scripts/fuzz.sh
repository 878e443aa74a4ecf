#!/bin/sh
# Runs every fuzzer in the tree for $1 (default 30s), $2 at a time
# (default 1; with more, each fuzzer gets one worker, and what Go does
# around a run, linking its binary and replaying its corpus, overlaps).
#
# Go's fuzzing coordinator sometimes ends a run whose time is up with
# "context deadline exceeded" and no failing input (seen in make test's
# 5 s smoke: FuzzMarkerScanner after 171943 execs, nothing found). Such a
# run is repeated once; a run that reports a failing input, or fails
# twice, fails the whole.
set -u
if [ "${1:-}" = --one ]; then # --one FUZZTIME WORKERS PKG FN: one fuzzer
	fuzztime=$2 workers=$3 pkg=$4 fn=$5
	out=$(mktemp)
	trap 'rm -f "$out"' EXIT
	parallel=
	[ "$workers" -gt 0 ] && parallel="-parallel $workers"
	for attempt in 1 2; do
		echo "== $pkg $fn" >"$out"
		# shellcheck disable=SC2086 # $parallel is empty or two words
		go test -run '^$' -fuzz "^$fn\$" -fuzztime "$fuzztime" $parallel "./$pkg" >>"$out" 2>&1
		status=$?
		cat "$out" # in one write, not interleaved with another fuzzer's
		[ "$status" = 0 ] && exit 0
		if [ "$attempt" = 1 ] && grep -q 'context deadline exceeded' "$out" && ! grep -q 'Failing input written' "$out"; then
			echo "-- $fn: the coordinator's deadline flake (no failing input); once more"
			continue
		fi
		exit 1
	done
fi
fuzztime=${1:-30s}
jobs=${2:-1}
workers=0 # Go's default: one per CPU
[ "$jobs" -gt 1 ] && workers=1
grep -rl --include='*_test.go' '^func Fuzz' . | grep -v '^./.cache/' | xargs grep -H '^func Fuzz' |
	sed -E 's#^\./(.*)/[^/]+_test.go:func (Fuzz[A-Za-z0-9]+).*#\1 \2#' |
	xargs -n 2 -P "$jobs" "$0" --one "$fuzztime" "$workers" || { echo "fuzz: a fuzzer failed (above)"; exit 1; }

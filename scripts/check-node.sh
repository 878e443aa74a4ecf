#!/bin/sh
# Checks for what the E2B JavaScript acceptance tests need.
set -eu
# E2B's JavaScript SDK (the gateway's acceptance suite) needs Node 20.18.1+
# with npm; Debian 12's nodejs is 18, too old, so Node is not installed here.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
	echo "Node.js 20.18.1 or newer with npm is required for the E2B JavaScript acceptance tests; none found on PATH" >&2
	exit 1
fi
node -e 'const [a,b,c]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&(b>18||(b===18&&c>=1)))?0:1)' || {
	echo "Node.js $(node --version) is too old for E2B's JavaScript SDK; 20.18.1 or newer is required" >&2
	exit 1
}

# OpenDsec. Two commands on a fresh machine (as root, Debian 12):
#   make quickstart   install packages, build, start `dsec up`, build images, run examples/quickstart.py
#   make test         everything CI runs
SHELL := /bin/bash
CACHE := $(CURDIR)/.cache
STATE ?= $(CURDIR)/.state
LISTEN ?= 127.0.0.1:7070
VENV := $(CACHE)/venv
E2B_VENV := $(CACHE)/venv-e2b
GOBIN_DIR := $(CACHE)/bin
BUF_VERSION := v1.75.0
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_CONNECT_VERSION := v1.21.1
# The gvisor backend's preload library (compat/gvisor): no libc of its own.
COMPAT_CC := gcc -shared -fPIC -O2 -nostdlib -Wl,--build-id=none -Wall -Werror
GO_TEST_FLAGS ?= -race -count=1
# What every binary reports (dsec version, aether --version, the daemons'
# logs, status and opendsec_build_info): an edge tells sandboxes whose agent
# is older than itself by it after an upgrade.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
VERSION_LDFLAGS := -X github.com/opendsec/opendsec/internal/version.Version=$(VERSION)
# Every package but the end-to-end suites takes about a minute. The suites
# (test/e2e/..., one package per area) drive real runtimes and VMs for
# several minutes each, so they have a timeout of their own with room for a
# busy machine. They mostly wait (a quiet run keeps a third of two cores
# busy), so three run side by side, the longest first: each draws ports of
# its own, names its nodes' sandboxes, networks and cgroups by a node id of
# its own and checks leaks of its own nodes. Beside a CPU hog of two busy
# loops on 2 cores the four took 711 s together (the longest, sandboxes,
# 685 s of its 45 min), all passing, once the deadlines that had failed
# there became hang guards (a TCG guest's agent wait, the tests' contexts).
# E2E_PARALLEL=1 runs them one at a time. The hostile suite always runs
# alone, after the others: its floods are answered or refused within a
# deadline, which a node busy with other suites cannot promise.
UNIT_TIMEOUT ?= 20m
E2E_TIMEOUT ?= 45m
E2E_PARALLEL ?= 3
E2E_LONGEST := crash sandboxes
E2E_ALONE := hostile
export PATH := $(GOBIN_DIR):$(PATH)

.PHONY: all deps build images venv e2b-sdks quickstart up down check test test-alerts test-go test-sdks test-python test-e2b test-e2b-python test-e2b-js test-hosts bench-hosts bundle check-generated generate lint bench fuzz fuzz-smoke clean

all: build

deps:
	./scripts/install-deps.sh
	./scripts/build-runsc.sh $(CACHE)/bin/runsc-net
	./scripts/guest-kernel.sh $(CACHE)/guest
	./scripts/firecracker.sh $(CACHE)/firecracker

build:
	go build -trimpath -ldflags="$(VERSION_LDFLAGS)" -o bin/dsec ./cmd/dsec
	@if [ -x $(CACHE)/bin/runsc-net ]; then ln -sf $(CACHE)/bin/runsc-net bin/runsc-net; fi
	CGO_ENABLED=0 go build -trimpath -ldflags="-s -w $(VERSION_LDFLAGS)" -o bin/aether ./cmd/aether
	CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o bin/dsec-vminit ./cmd/dsec-vminit
	$(COMPAT_CC) -o bin/libdsec-compat.so compat/gvisor/statx.c

# Base images, built offline-capably: the Debian packages are kept in
# .cache/debootstrap, the code interpreter's wheels in .cache/wheels, the
# images in .cache/images (the image store dsec up uses).
PY_IMAGE := $(CACHE)/images/refs/root/py/3.11
CI_IMAGE := $(CACHE)/images/refs/root/code-interpreter/latest
SYSTEMD_IMAGE := $(CACHE)/images/refs/root/debian-systemd/13
DOCKER_IMAGE := $(CACHE)/images/refs/root/debian-docker/13
KERNEL_IMAGE := $(CACHE)/images/refs/root/debian-kernel/13
CI_SOURCES := $(wildcard internal/image/baseimage/codeinterpreter/*)

images: build $(PY_IMAGE) $(CI_IMAGE) $(SYSTEMD_IMAGE) $(DOCKER_IMAGE) $(KERNEL_IMAGE)
	@test -e $(CACHE)/images/refs/root/busybox/latest || ./bin/dsec image build busybox --store $(CACHE)/images

$(PY_IMAGE): | build
	./bin/dsec image build py --store $(CACHE)/images --cache-dir $(CACHE)

# The vm backend's images with systemd, with Docker too, and with Debian's
# own kernel (Debian 13; about 2 min each the first time).
$(SYSTEMD_IMAGE): | build
	./bin/dsec image build debian-systemd --store $(CACHE)/images --cache-dir $(CACHE)

$(DOCKER_IMAGE): | build
	./bin/dsec image build debian-docker --store $(CACHE)/images --cache-dir $(CACHE)

$(KERNEL_IMAGE): | build
	./bin/dsec image build debian-kernel --store $(CACHE)/images --cache-dir $(CACHE)

# Rebuilt when its server or its pinned wheels change (about 25 s).
$(CI_IMAGE): $(PY_IMAGE) $(CI_SOURCES) | build
	./bin/dsec image build code-interpreter --store $(CACHE)/images --cache-dir $(CACHE)

venv:
	@test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q -e './sdk/python[test]'

# E2B's own SDKs, pinned, for the gateway's acceptance tests (npm keeps its
# download cache under .cache/npm).
e2b-sdks:
	./scripts/check-node.sh
	@test -x $(E2B_VENV)/bin/python || python3 -m venv $(E2B_VENV)
	$(E2B_VENV)/bin/pip install -q -r test/e2b/python/requirements.txt
	cd test/e2b/js && npm ci --no-audit --no-fund --cache $(CACHE)/npm --prefer-offline

# Starts dsec up in the background (log: $(STATE)/dsec.log); `make down` stops it.
up: build
	@if [ -f $(STATE)/dsec.pid ] && kill -0 $$(cat $(STATE)/dsec.pid) 2>/dev/null; then echo "dsec up already running (pid $$(cat $(STATE)/dsec.pid))"; else \
		mkdir -p $(STATE); rm -f $(STATE)/client.env.ready; \
		nohup ./bin/dsec up --state-dir $(STATE) --listen $(LISTEN) --image-store $(CACHE)/images > $(STATE)/dsec.log 2>&1 & echo $$! > $(STATE)/dsec.pid; \
		for i in $$(seq 1 100); do grep -q "opendsec is up" $(STATE)/dsec.log 2>/dev/null && break; sleep 0.1; done; \
		grep -q "opendsec is up" $(STATE)/dsec.log || { cat $(STATE)/dsec.log; exit 1; }; \
		echo "dsec up running (pid $$(cat $(STATE)/dsec.pid)); settings in $(STATE)/client.env"; fi

down:
	@if [ -f $(STATE)/dsec.pid ]; then kill $$(cat $(STATE)/dsec.pid) 2>/dev/null || true; rm -f $(STATE)/dsec.pid; echo "stopped dsec up (sandboxes keep running; the next make up re-attaches them)"; fi

# deploy/quickstart.sh is the one install path: with systemd it installs
# units, here (no systemd) it starts dsec up in the background in $(STATE),
# as `make up` does; both check a container and a microVM print 42.
quickstart: deps build images venv
	./deploy/quickstart.sh --bin bin --images $(CACHE)/images --state $(STATE) --prefix $(STATE)/opt --etc $(STATE)
	source $(STATE)/client.env && $(VENV)/bin/python examples/quickstart.py
	@echo "fork with memory on the microvm backend (examples/fork.py):"
	source $(STATE)/client.env && $(VENV)/bin/python examples/fork.py

test: deps build images venv e2b-sdks check-generated lint test-go test-sdks test-hosts test-alerts fuzz-smoke

# The alert rules, with Debian's promtool (package prometheus).
test-alerts:
	promtool check rules deploy/prometheus/alerts.yml
	cd deploy/prometheus && promtool test rules alerts_test.yml

# The inner loop's tier: build, lint and the unit tests in short mode,
# which skip every test that needs root, a runtime, a VM or the host's
# network (testutil.RequireRoot, RequireBinary). No root needed; under a
# minute with a warm build cache.
check: build lint
	go test -short -count=1 $$(go list ./... | grep -v '/test/e2e\(/\|$$\)')

# A test run fails, not skips, when a runtime or image it covers is missing
# (testutil.Missing, and the Python and JS fixtures): a green run means every
# backend was exercised. DSEC_TEST_STRICT=0 make test-go allows skips.
DSEC_TEST_STRICT ?= 1
test test-go test-sdks test-python test-e2b test-e2b-python test-e2b-js: export DSEC_TEST_STRICT := $(DSEC_TEST_STRICT)

test-go:
	go test $(GO_TEST_FLAGS) -timeout $(UNIT_TIMEOUT) $$(go list ./... | grep -v '/test/e2e\(/\|$$\)')
	go test $(GO_TEST_FLAGS) -p $(E2E_PARALLEL) -timeout $(E2E_TIMEOUT) $(E2E_LONGEST:%=./test/e2e/%) \
		$$(go list ./test/e2e/... | grep -v $(E2E_LONGEST:%=-e '/test/e2e/%$$') $(E2E_ALONE:%=-e '/test/e2e/%$$'))
	go test $(GO_TEST_FLAGS) -p 1 -timeout $(E2E_TIMEOUT) $(E2E_ALONE:%=./test/e2e/%)

# What a suite needs made first; nothing in test-sdks' sub-make (SUITE_ONLY
# on its command line; one in the environment is ignored).
suite-needs = $(if $(filter command line,$(origin SUITE_ONLY)),,$(1))

# The suites start clusters of their own: settings of a running one in the
# caller's environment (client.env sourced) must not redirect them.
test-python: $(call suite-needs,build images venv)
	env -u DSEC_API_URL -u DSEC_API_KEY DSEC_TEST_IMAGE_STORE=$(CACHE)/images $(VENV)/bin/python -m pytest -q sdk/python/tests

# E2B's Python and JavaScript SDKs, unchanged, against the gateway of a
# dsec up each suite starts.
test-e2b: test-e2b-python test-e2b-js
test-e2b-python: $(call suite-needs,build images e2b-sdks)
	env -u E2B_API_URL -u E2B_SANDBOX_URL -u E2B_API_KEY DSEC_TEST_IMAGE_STORE=$(CACHE)/images $(E2B_VENV)/bin/python -m pytest -q test/e2b/python
test-e2b-js: $(call suite-needs,build images e2b-sdks)
	cd test/e2b/js && env -u E2B_API_URL -u E2B_SANDBOX_URL -u E2B_API_KEY DSEC_TEST_IMAGE_STORE=$(CACHE)/images npm test

# The three SDK suites side by side, each with the cluster it starts (own
# state directory, ports and node): they wait on sandboxes far more than
# they compute (beside a CPU hog each took 2 to 23 % longer), so together
# they take about as long as the longest. Each suite's output is printed
# whole when it ends. The sub-make only runs the suites (SUITE_ONLY): what
# they need is made once, before.
test-sdks: build images venv e2b-sdks
	$(MAKE) --no-print-directory -j3 --output-sync=target SUITE_ONLY=1 test-python test-e2b-python test-e2b-js

# The host test: a Debian 13 VM (systemd, cgroup v2 only) built from
# Debian's packages into .cache/hostvm (about 2 minutes the first time,
# offline after), booted under QEMU; inside, deploy/quickstart.sh installs
# the binaries just built as systemd units, test/hosts runs against them,
# and --uninstall must leave nothing. About 5 minutes under TCG.
test-hosts: build
	./scripts/test-hosts.sh $(CACHE)/hostvm

# The same VM, with bench/create run inside it after the host suite.
bench-hosts: build
	HOST_BENCH=1 ./scripts/test-hosts.sh $(CACHE)/hostvm

# The offline bundle: binaries, images (BUNDLE_IMAGES), the guest kernel
# and modules, runsc-net, Firecracker and the Debian packages the
# installer needs, with a SHA-256 manifest (scripts/bundle.sh).
# deploy/quickstart.sh --bundle FILE installs from it without a network.
# make bundle BUNDLE_IMAGES="root/busybox:latest root/debian-systemd:13"
# ships the vm backend's image with systemd instead of root/py:3.11.
BUNDLE_IMAGES ?= root/busybox:latest root/py:3.11
bundle: build images
	./scripts/bundle.sh dist/opendsec-$(VERSION)-linux-amd64.tar.gz $(foreach i,$(BUNDLE_IMAGES),--image $(i))

tools:
	@test -x $(GOBIN_DIR)/buf || GOBIN=$(GOBIN_DIR) go install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)
	@test -x $(GOBIN_DIR)/protoc-gen-go || GOBIN=$(GOBIN_DIR) go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	@test -x $(GOBIN_DIR)/protoc-gen-connect-go || GOBIN=$(GOBIN_DIR) go install connectrpc.com/connect/cmd/protoc-gen-connect-go@$(PROTOC_GEN_CONNECT_VERSION)

generate: tools
	buf lint
	buf generate

# The committed generated code must match the protos.
check-generated: tools
	@rm -rf $(CACHE)/gencheck && mkdir -p $(CACHE)/gencheck
	@buf generate --template buf.gen.yaml -o $(CACHE)/gencheck
	@diff -r api/gen $(CACHE)/gencheck/api/gen >/dev/null || { echo "api/gen is stale: run make generate"; diff -r api/gen $(CACHE)/gencheck/api/gen | head -20; exit 1; }
	@echo "generated code is fresh"

lint: tools
	buf lint
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }
	go vet ./...

bench: build images
	go run ./bench/create --store $(CACHE)/images
	go run ./bench/fork --store $(CACHE)/images
	go run ./bench/e2b --store $(CACHE)/images
	go run ./bench/network --store $(CACHE)/images
	go run ./bench/quota --store $(CACHE)/images
	go run ./bench/placement
	go run ./bench/density --store $(CACHE)/images
	go run ./bench/apiservers --store $(CACHE)/images
	go run ./bench/crossfork --store $(CACHE)/images
	go run ./bench/microvm --store $(CACHE)/images

# Every fuzzer briefly, in make test: a property and the code it checks that
# disagree show within seconds (FuzzParseRef once failed in 9 s).
fuzz-smoke:
	@$(MAKE) --no-print-directory fuzz FUZZTIME=5s FUZZJOBS=2

FUZZTIME ?= 30s
FUZZJOBS ?= 1
fuzz:
	@./scripts/fuzz.sh $(FUZZTIME) $(FUZZJOBS)

clean:
	rm -rf bin dist $(CACHE)/gencheck

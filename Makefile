# crab's entry points. Everything generated lands in CRAB_HOME (default .crab/).
#
#   make deps             install system packages (hack/install-deps.sh; root, idempotent)
#   make build            build the workspace, link the shim into $(CRAB_HOME)/bin
#   make images           build the test images (cached) and import them into the
#                         private containerd, namespaces crab-test and crab-demo
#   make containerd-up    start the private containerd (hack/containerd.sh start)
#   make containerd-down  remove its containers and stop it, reaping leftovers
#                         (and the private dockerds first, which run on it)
#   make docker-up        the private containerd with the images, then two private Docker
#                         Engines on it (overlay2 and containerd image store, hack/dockerd.sh)
#                         with crab's test images loaded
#   make docker-down      remove their containers and stop them (images are kept)
#   make demo             run a container under the crab shim; leaves containerd up
#                         (DEMO_RUNTIME=io.containerd.runc.v2 runs it on the stock shim)
#   make lint             cargo fmt --check and cargo clippy -D warnings (part of make test)
#   make test             everything above, lint, then all tests (the Docker ones against the
#                         private dockerds), then test-containerd-1.7; containerd and the
#                         dockerds are always stopped after
#   make test-containerd-1.7
#                         the end-to-end lifecycle tests against containerd 1.7 (a second
#                         private containerd, Debian trixie's, unpacked under $(CRAB_HOME))
#   make bench            the benchmarks (shim, inspector, checkpoint, restore, cri, and the
#                         shim's parts alone: units) against the private containerd (stopped
#                         after); figures under $(CRAB_HOME)/bench
#   make soak             SOAK_ARGS sandboxes (default 1,000) at once under crab, a checkpoint
#                         storm (one turn end each, faster than the engine drains), removal and a
#                         leftover check; figures under $(CRAB_HOME)/bench/soak-*
#   make fuzz             fuzz every parser of untrusted bytes, FUZZ_SECONDS (60) each
#                         (hack/fuzz.sh; summary in $(CRAB_HOME)/fuzz/summary.txt);
#                         make fuzz-smoke: 5 s each (CI)
#   make critest          the Kubernetes CRI conformance suite (critest v1.30.0, binary from
#                         CRITEST, default ../shared/critest/critest) against the private
#                         containerd's CRI for CRITEST_HANDLER (crab; "runc crab" runs both and
#                         compares), every image built locally and pulled from a registry on
#                         127.0.0.1 (hack/critest.sh); JUnit and summary under $(CRAB_HOME)/critest
#   make install          the shim and crabctl into $(PREFIX)/bin (default /usr/local), the
#                         annotated default config into $(CONFDIR) (default /etc/crab; an
#                         existing config is kept), DESTDIR to stage; prints the containerd and
#                         Docker snippets (hack/install.sh; edits no other config)
#   make deb              the Debian package (cargo-deb) under target/debian/: crab_*.deb
#   make clean            stop containerd, remove $(CRAB_HOME) and cargo's target dir
#
# Tests read CRAB_HOME, CRAB_CONTAINERD_ADDRESS, CRAB_NAMESPACE and CRAB_RUNTIME
# (set CRAB_RUNTIME=io.containerd.runc.v2 to run them against the stock shim); the Docker
# tests also CRAB_DOCKER_* (hack/dockerd.sh env).
# CRAB_CONTAINERD=1.7 points every target at the containerd 1.7 instance instead of 2.x.

SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help
# Targets depend on each other's side effects (a running containerd, installed
# packages) more than on files: run them one at a time, in the order listed.
.NOTPARALLEL:

export CRAB_HOME ?= $(CURDIR)/.crab
CARGO ?= cargo
SHIM := containerd-shim-crab-v1
# k8s.io is the CRI's namespace (2.x only: 1.7 runs without the CRI plugin).
NAMESPACES := crab-test crab-demo $(if $(filter 1.7,$(CRAB_CONTAINERD)),,k8s.io)
DEMO_NAMESPACE := crab-demo
DEMO_IMAGE := localhost/crab/busybox:latest
DEMO_RUNTIME ?= io.containerd.crab.v1
BENCH_ARGS ?=

# Prefix for recipes that talk to the private containerd: exports
# CRAB_HOME, CRAB_CONTAINERD_ADDRESS and CRAB_NAMESPACE.
with_env = eval "$$(hack/containerd.sh env)";

# Runs $(1) with the private containerd up and always stops it afterwards.
# A failed stop (leaked shims or mounts) fails the target too.
define with_containerd
	trap 'rc=$$?; hack/containerd.sh stop || { [[ $$rc -ne 0 ]] || rc=1; }; exit $$rc' EXIT; \
	$(MAKE) --no-print-directory images; \
	$(with_env) $(1)
endef

# End-to-end tests also run against containerd 1.7: what containerd asks of the
# shim (task lifecycle, exec, signals, stdio incl. binary:// loggers, pause, a
# shim crash), then the global leak check. The 1.7 instance gets its own start,
# image import and stop. (--workspace, not -p: the same feature resolution as the
# main run, so its test binaries are reused instead of rebuilt.)
E2E_TESTS_CONTAINERD_17 := lifecycle exec signals stdin pause shim_crash logdriver z_host_is_clean
define test_containerd_17
	export CRAB_CONTAINERD=1.7; \
	$(call with_containerd,$(CARGO) test --workspace --release $(addprefix --test ,$(E2E_TESTS_CONTAINERD_17)))
endef

.PHONY: help deps build lint images containerd-up containerd-down docker-up docker-down demo test test-containerd-1.7 bench clean

help:
	@sed -n '3,42s/^# \{0,1\}//p' $(firstword $(MAKEFILE_LIST))

deps:
	hack/install-deps.sh

build:
	$(CARGO) build --release --workspace
	shim="$${CARGO_TARGET_DIR:-$(CURDIR)/target}/release/$(SHIM)"; \
	[[ -x $$shim ]] || { echo "make build: $$shim was not built" >&2; exit 1; }; \
	mkdir -p "$(CRAB_HOME)/bin"; \
	ln -sfn "$$shim" "$(CRAB_HOME)/bin/$(SHIM)"

images: containerd-up
	for ns in $(NAMESPACES); do hack/build-images.sh import "$$ns"; done

containerd-up:
	hack/containerd.sh start

containerd-down:
	hack/containerd.sh stop

docker-up: images
	hack/dockerd.sh start
	hack/dockerd.sh images

docker-down:
	hack/dockerd.sh stop

demo: deps build images
	@$(with_env) \
	id=crab-demo-$$$$; \
	echo; \
	echo "+ ctr -a $$CRAB_CONTAINERD_ADDRESS -n $(DEMO_NAMESPACE) run --rm --runtime $(DEMO_RUNTIME) $(DEMO_IMAGE) $$id sh -c 'echo hello from crab; uname -a'"; \
	ctr -a "$$CRAB_CONTAINERD_ADDRESS" -n $(DEMO_NAMESPACE) run --rm --runtime $(DEMO_RUNTIME) \
		$(DEMO_IMAGE) "$$id" sh -c 'echo hello from crab; uname -a'; \
	echo; \
	echo "What happened: ctr asked the private containerd ($$CRAB_CONTAINERD_ADDRESS) to run"; \
	echo "$(DEMO_IMAGE), a locally built image (no registry). For runtime io.containerd.crab.v1"; \
	echo "containerd started containerd-shim-crab-v1 (found in $$CRAB_HOME/bin), which created"; \
	echo "the container with runc, passed its output back, reported its exit, and --rm deleted it."; \
	echo; \
	hack/demo.sh; \
	echo; \
	echo "containerd is still running: 'hack/containerd.sh ctr -n $(DEMO_NAMESPACE) ...' talks to it,"; \
	echo "'make containerd-down' stops it."

# Formatting and lints are enforced: every target (tests, benchmarks, examples) of the workspace.
# The module graph's checks (layers, no cycle, file and function bounds) read only the sources:
# run with the lints so that a change that breaks them is caught before a commit, not by CI.
lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings
	$(CARGO) test --release -p crab-shim --test module_graph --quiet

# The Docker tests read CRAB_DOCKER_* (hack/dockerd.sh env); containerd's stop stops the
# dockerds first.
test: deps build lint
	@$(call with_containerd,$(MAKE) --no-print-directory docker-up; \
		eval "$$(hack/dockerd.sh env)"; $(CARGO) test --workspace --release --no-fail-fast)
	@$(test_containerd_17)

test-containerd-1.7: deps build
	@$(test_containerd_17)

# BENCHES picks some: make bench BENCHES="bench-restore".
BENCHES ?= bench-shim bench-inspector bench-checkpoint bench-restore bench-cri bench-units bench-replication
bench: build
	@$(call with_containerd,for b in $(BENCHES); do $(CARGO) run --release -p crab-integration --bin $$b -- $(BENCH_ARGS) || exit 1; done)

# make replay: real agent trajectories (../shared/trajectories next to the repo, or
# CRAB_TRAJECTORIES=path) replayed under each checkpoint policy against the private
# containerd (stopped after); prints figures, writes $(CRAB_HOME)/bench/replay-*.
# REPLAY_ARGS="--densities 1,4,8,16 --select all ..." (see `--help` of the replay binary).
REPLAY_ARGS ?=
.PHONY: replay
replay: build
	@$(call with_containerd,$(CARGO) run --release -p crab-integration --bin replay -- $(REPLAY_ARGS))

# make soak: many sandboxes at once, then a storm of checkpoints (the soak binary's --help);
# exits non-zero when a checkpoint failed or something was left behind.
# SOAK_ARGS="--sandboxes 200 --rate 20 --parallel 32 ...".
SOAK_ARGS ?=
.PHONY: soak
soak: build
	@$(call with_containerd,$(CARGO) run --release -p crab-integration --bin soak -- $(SOAK_ARGS))

# make critest: hack/critest.sh starts and stops its registry; containerd is stopped after.
.PHONY: critest
critest: deps build
	@$(call with_containerd,hack/critest.sh)

# make fuzz: needs no containerd. FUZZ_TARGETS="criu_image signature" picks some.
FUZZ_SECONDS ?= 60
.PHONY: fuzz fuzz-smoke
fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) hack/fuzz.sh

fuzz-smoke:
	FUZZ_SECONDS=5 hack/fuzz.sh

# make install: PREFIX, CONFDIR, DESTDIR as hack/install.sh reads them.
PREFIX ?= /usr/local
CONFDIR ?= /etc/crab
.PHONY: install deb
install: build
	PREFIX="$(PREFIX)" CONFDIR="$(CONFDIR)" DESTDIR="$(DESTDIR)" hack/install.sh

# cargo-deb comes with make deps (hack/install-deps.sh).
deb: build
	$(CARGO) deb -p crab-shim --no-build --no-strip

clean:
	hack/containerd.sh stop
	rm -rf "$(CRAB_HOME)"
	$(CARGO) clean

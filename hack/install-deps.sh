#!/usr/bin/env bash
# Installs everything crab needs on a Debian (bookworm or newer) host, by package
# name only. Idempotent: a second run changes nothing and takes seconds.
#
# Sources: the base system stays on its own suite. trixie and sid are added at a
# low pin priority (100) so that nothing is upgraded implicitly; the packages we
# want are then named with their release (`pkg/trixie`). Never `-t trixie`: that
# raises the whole suite and upgrades half the base system.
set -euo pipefail

[[ $EUID -eq 0 ]] || { echo "install-deps: must run as root" >&2; exit 1; }

export DEBIAN_FRONTEND=noninteractive

SOURCES=/etc/apt/sources.list.d/crab-debian-extra.sources
PREFS=/etc/apt/preferences.d/crab-debian-extra

# Installed in four steps, each by name and release:
#  1. trixie's C library (the sid packages below need libc >= 2.38; bookworm has
#     no criu at all), iptables (CRIU locks the network with it) and the image
#     tools. Moving libc to trixie makes apt drop the
#     bookworm -dev packages pinned to the old libc (libc6-dev, build-essential),
#     so step 4 puts back what Rust and the BPF build need to link and compile.
#  2. containerd 2.x, runc 1.3 and CRIU 4.2 from sid (they need nothing else once
#     trixie's libc is in). CRIU must be 4.2+: 4.1 reads socket options that Linux
#     6.16+ refuses on TCP/UDP sockets, so it cannot dump any process holding one
#     (criu issue 2718). python3-pycriu is CRIU's own image decoder (crit), matching
#     that CRIU: shim/tests/root_criu_vs_crit.rs reads mutated images with it and crab.
#  3. Docker Engine from trixie (docker.io, docker-cli; the Docker tests run a private
#     dockerd on the private containerd, hack/dockerd.sh), after step 2 so that its
#     containerd dependency is met by the 2.x already there.
#  4. libc6-dev from trixie plus the BPF toolchain (and gcc for the static pause
#     binary of the CRI sandbox image) from the base suite. clang-19
#     from trixie would drag in gcc-14 and a new libssl and remove curl/openssh;
#     bookworm's clang-19 + libbpf 1.1 + bpftool 7.1 compile CO-RE programs fine.
#     python3-venv: the mini-swe-agent test makes a venv (integration/harnesses).
TRIXIE_PKGS=(
  libc6 libc-bin base-files libhogweed6t64 libnettle8t64 libp11-kit0 libgnutls30t64
  iptables umoci skopeo mmdebstrap docker-registry containernetworking-plugins
)
SID_PKGS=(containerd runc criu libcompel1 python3-pycriu)
DOCKER_PKGS=(docker.io docker-cli)
TRIXIE_DEV_PKGS=(libc6-dev libdpkg-perl dpkg-dev)
BASE_PKGS=(
  ca-certificates curl jq iproute2 busybox-static zstd tar pkg-config protobuf-compiler
  clang-19 llvm-19 libbpf-dev bpftool gcc binutils python3-venv
)

have_all() {
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || return 1
  done
}

want_versions_ok() {
  command -v containerd >/dev/null && containerd --version | grep -qE ' v?2\.' &&
    command -v runc >/dev/null && runc --version | grep -qE 'runc version 1\.(3|4|5)' &&
    command -v criu >/dev/null && criu --version | grep -qE 'Version: (4\.([2-9]|[1-9][0-9])|[5-9]\.)'
}

if have_all "${BASE_PKGS[@]}" "${TRIXIE_PKGS[@]}" "${TRIXIE_DEV_PKGS[@]}" "${SID_PKGS[@]}" "${DOCKER_PKGS[@]}" && want_versions_ok; then
  echo "install-deps: everything already installed"
else
  if [[ ! -f $SOURCES ]]; then
    cat >"$SOURCES" <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  fi
  cat >"$PREFS" <<'PIN'
Package: *
Pin: release n=trixie
Pin-Priority: 100

Package: *
Pin: release n=sid
Pin-Priority: 50
PIN
  apt-get update -qq
  apt_install() { apt-get install -y -qq --no-install-recommends "$@"; }
  with_release() { local r=$1 p; shift; for p in "$@"; do printf '%s/%s\n' "$p" "$r"; done; }
  mapfile -t trixie_args < <(with_release trixie "${TRIXIE_PKGS[@]}")
  apt_install "${trixie_args[@]}"
  mapfile -t sid_args < <(with_release sid "${SID_PKGS[@]}")
  apt_install "${sid_args[@]}"
  mapfile -t docker_args < <(with_release trixie "${DOCKER_PKGS[@]}")
  apt_install "${docker_args[@]}"
  mapfile -t dev_args < <(with_release trixie "${TRIXIE_DEV_PKGS[@]}")
  apt_install "${dev_args[@]}" "${BASE_PKGS[@]}"
fi

# The Debian package enables a system containerd service; crab never uses it
# (tests run a private one), and on hosts without systemd nothing starts anyway.
if command -v systemctl >/dev/null && systemctl is-active -q containerd 2>/dev/null; then
  echo "install-deps: note: a system containerd is running; crab leaves it alone"
fi
# Likewise docker.io's docker service: the tests run their own dockerd (hack/dockerd.sh).
if command -v systemctl >/dev/null && systemctl is-active -q docker 2>/dev/null; then
  echo "install-deps: note: a system Docker is running; crab leaves it alone"
fi

# make lint (part of make test) needs rustfmt and clippy with the Rust toolchain; with
# rustup they are components (a no-op when present), otherwise they must come with it.
if command -v rustup >/dev/null; then
  for c in rustfmt clippy; do
    rustup component list --installed 2>/dev/null | grep -q "^$c" || rustup component add "$c"
  done
fi

# make deb (and its test, integration/tests/install.rs) packages with cargo-deb, from
# crates.io into cargo's bin directory (~/.cargo/bin), pinned; a no-op when that version is there.
CARGO_DEB_VERSION=3.8.0
if ! cargo deb --version 2>/dev/null | grep -q "$CARGO_DEB_VERSION"; then
  cargo install --locked --version "$CARGO_DEB_VERSION" cargo-deb
fi

# bpffs and tracefs may be absent at boot; the inspector needs both.
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
mountpoint -q /sys/kernel/tracing || mount -t tracefs tracefs /sys/kernel/tracing

echo "install-deps: containerd $(containerd --version | awk '{print $3}'), $(runc --version | head -1), criu $(criu --version | awk '/Version/{print $2}')"

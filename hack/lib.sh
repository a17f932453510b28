# Shared helpers for the hack/ scripts. Source it; besides defining functions
# and the CRAB_* path variables below it only creates CRAB_HOME (so that the
# path can be made absolute).
#
# Every path here derives from CRAB_HOME (default: <repo>/.crab) so that two
# checkouts, or a checkout and a system containerd, never share state.

CRAB_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
CRAB_HOME=${CRAB_HOME:-$CRAB_REPO/.crab}
mkdir -p "$CRAB_HOME"
CRAB_HOME=$(cd "$CRAB_HOME" && pwd -P)
export CRAB_HOME

# Which containerd: CRAB_CONTAINERD unset or 2 is the system's 2.x (hack/install-deps.sh);
# 1.7 is Debian trixie's 1.7 (it cannot be installed next to 2.x), unpacked under
# CRAB_HOME by `hack/containerd.sh start`. Each runs as an independent private
# instance with its own config, root, state, log and socket, so both can run at
# once: 2.x directly under CRAB_HOME (as it always was), 1.7 under
# CRAB_HOME/containerd-1.7-run.
CRAB_CONTAINERD_FLAVOR=${CRAB_CONTAINERD:-2}
CRAB_CONTAINERD17_TREE=$CRAB_HOME/containerd-1.7
CRAB_CONTAINERD17_HOME=$CRAB_HOME/containerd-1.7-run
case $CRAB_CONTAINERD_FLAVOR in
  2)
    CRAB_CONTAINERD_HOME=$CRAB_HOME
    CRAB_CONTAINERD_BIN=containerd
    CRAB_CTR_BIN=ctr
    ;;
  1.7)
    CRAB_CONTAINERD_HOME=$CRAB_CONTAINERD17_HOME
    CRAB_CONTAINERD_BIN=$CRAB_CONTAINERD17_TREE/usr/bin/containerd
    CRAB_CTR_BIN=$CRAB_CONTAINERD17_TREE/usr/bin/ctr
    ;;
  *)
    printf '%s: error: CRAB_CONTAINERD=%s: expected 2 (the default) or 1.7\n' "${CRAB_LOG_PREFIX:-crab}" "$CRAB_CONTAINERD_FLAVOR" >&2
    exit 1
    ;;
esac

CRAB_CONTAINERD_DIR=$CRAB_CONTAINERD_HOME/containerd
CRAB_CONTAINERD_ROOT=$CRAB_CONTAINERD_DIR/root
CRAB_CONTAINERD_CONFIG=$CRAB_CONTAINERD_DIR/config.toml
CRAB_CONTAINERD_LOG=$CRAB_CONTAINERD_DIR/containerd.log
CRAB_RUN_DIR=$CRAB_CONTAINERD_HOME/run
CRAB_CONTAINERD_STATE=$CRAB_RUN_DIR/state
CRAB_CONTAINERD_PIDFILE=$CRAB_RUN_DIR/containerd.pid
# containerd's registry hosts directory (<host>/hosts.toml), read on every CRI pull.
CRAB_REGISTRY_HOSTS_DIR=$CRAB_CONTAINERD_DIR/certs.d
CRAB_IMAGES_DIR=$CRAB_HOME/images
CRAB_BIN_DIR=$CRAB_HOME/bin

# Namespaces the private containerd serves for tests and the demo.
CRAB_NAMESPACES=(crab-test crab-demo)

CRAB_BUSYBOX_IMAGE=localhost/crab/busybox:latest
CRAB_AGENT_IMAGE=localhost/crab/agent:latest
# The CRI plugin's sandbox image (hack/containerd.sh), built locally by hack/build-images.sh.
CRAB_PAUSE_IMAGE=localhost/crab/pause:3.10

# The host's Debian mirror (deb822 or one-line sources), so that the Debian-based
# images (hack/build-images.sh, hack/critest-images.sh) are fetched from wherever
# this machine is known to reach.
crab_debian_mirror() {
  if [[ -n ${CRAB_DEBIAN_MIRROR:-} ]]; then
    echo "$CRAB_DEBIAN_MIRROR"
    return
  fi
  local uri
  uri=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
    grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n1 | tr -d ' ') || true
  echo "${uri:-http://deb.debian.org/debian}"
}

log() { printf '%s: %s\n' "${CRAB_LOG_PREFIX:-crab}" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The socket path. A unix socket path must fit in sun_path (108 bytes incl. the
# NUL), and containerd derives longer ones from it (the ".ttrpc" socket), so a
# deep CRAB_HOME falls back to a short directory under /run named after a hash
# of the instance's home (CRAB_HOME for 2.x): stable across calls, distinct per
# checkout and per instance.
crab_socket_dir() {
  local dir=$CRAB_RUN_DIR longest=$CRAB_RUN_DIR/containerd.sock.ttrpc
  if (( ${#longest} >= 104 )); then
    dir=/run/crab-$(printf '%s' "$CRAB_CONTAINERD_HOME" | sha256sum | cut -c1-12)
  fi
  printf '%s\n' "$dir"
}
CRAB_SOCKET_DIR=$(crab_socket_dir)
CRAB_CONTAINERD_ADDRESS=$CRAB_SOCKET_DIR/containerd.sock

crab_ctr() { "$CRAB_CTR_BIN" --address "$CRAB_CONTAINERD_ADDRESS" "$@"; }

# True when the private containerd answers on its socket.
crab_containerd_answers() {
  [[ -S $CRAB_CONTAINERD_ADDRESS ]] &&
    timeout 5 "$CRAB_CTR_BIN" --address "$CRAB_CONTAINERD_ADDRESS" version >/dev/null 2>&1
}

# Mount points at or below each given directory, deepest first, so they can be
# unmounted in order. mountinfo escapes space, tab, newline and backslash as
# octal; printf %b turns them back.
crab_mounts_under() {
  local dir m
  for dir in "$@"; do
    [[ -n $dir ]] || continue
    while read -r m; do
      m=$(printf '%b' "$m")
      [[ $m == "$dir" || $m == "$dir"/* ]] && printf '%s\n' "$m"
    done < <(awk '{print $5}' /proc/self/mountinfo)
  done | awk '{print length($0) "\t" $0}' | sort -rn | cut -f2- | uniq
}

#!/usr/bin/env bash
# A private containerd for crab's tests and demo: its own config, root, state,
# socket and log under CRAB_HOME. It never talks to, stops or cleans up after a
# system containerd. Two flavors (CRAB_CONTAINERD, below) run as independent
# instances, so both can be up at once.
#
#   hack/containerd.sh start    start it (no-op if already running), wait for the socket
#   hack/containerd.sh stop     stop the private dockerds on it (hack/dockerd.sh), kill and
#                               delete all tasks and containers, stop it, then reap
#                               leftover shims and mounts (no-op if stopped)
#   hack/containerd.sh status   exit 0 if it answers, 1 otherwise
#   hack/containerd.sh env      print `export CRAB_...=` lines for tests (eval them; with 1.7
#                               also PATH, so that the tests' `ctr` is 1.7's; with the CRI,
#                               CRAB_CRI_CONFIG: the config file of its crab handlers)
#   hack/containerd.sh ctr ARGS run ctr against the private socket (with the flavor's own ctr)
#                               (namespace: CONTAINERD_NAMESPACE, else CRAB_NAMESPACE, else crab-test)
#
# Environment:
#   CRAB_HOME                   state directory (default <repo>/.crab)
#   CRAB_CONTAINERD=2|1.7       which containerd (default 2):
#                               2    the system's containerd 2.x; state in CRAB_HOME/{containerd,run}
#                               1.7  Debian trixie's containerd 1.7, downloaded (apt-get download)
#                                    and unpacked into CRAB_HOME/containerd-1.7 on first start
#                                    (the .deb is cached in CRAB_HOME/cache); state in
#                                    CRAB_HOME/containerd-1.7-run/{containerd,run}
#   CRAB_CONTAINERD_CRI=0|1     the CRI plugin (2.x: on by default; 1.7: off, and cannot be
#                               switched on). With it: runtime handlers `crab` (runc's
#                               runtime type, runtime_path a wrapper setting CRAB_CONFIG),
#                               `crab-v1` (crab's own runtime type, ConfigPath) and `runc`,
#                               a CNI bridge (CRAB_HOME/cni), and the sandbox image
#                               localhost/crab/pause:3.10 (hack/build-images.sh import k8s.io)
#   CRAB_CRI_CONFIG             crab config file of the CRI handlers `crab` and `crab-v1` (default: one
#                               written on start, store under CRAB_HOME/cri-store)
#   CRAB_CONTAINERD_LOG_LEVEL   containerd log level (default info)
#
# containerd runs with PATH=$CRAB_HOME/bin:$PATH so that
# `ctr run --runtime io.containerd.crab.v1` finds containerd-shim-crab-v1 there
# (1.7: PATH=$CRAB_HOME/bin:<1.7 tree>/usr/bin:$PATH, so that io.containerd.runc.v2
# is 1.7's own runc shim).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CRAB_LOG_PREFIX=containerd.sh

# containerd places every shim's socket here whatever its own state dir is,
# named by a hash of (containerd address, namespace, id); see shim_socket().
SHIM_SOCKET_DIR=/run/containerd/s

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
}

toml_str() { printf "'%s'" "$1"; }

# In 2.x the CRI is several plugins, but only io.containerd.grpc.v1.cri (the
# service kubelet talks to) has to go. The others only hold config and idle:
# io.containerd.cri.v1.{images,runtime}, and the pod-sandbox controller, which
# io.containerd.grpc.v1.sandbox-controllers needs; disabling them too makes
# both fail to load (and loads the pod-sandbox controller before transfer).
# (In 1.7 the CRI is that one plugin.)
CRI_PLUGINS=(io.containerd.grpc.v1.cri)
cri_enabled() {
  local default=1
  [[ $CRAB_CONTAINERD_FLAVOR != 1.7 ]] || default=0
  [[ ${CRAB_CONTAINERD_CRI:-$default} == 1 ]]
}
CRAB_CNI_CONF_DIR=$CRAB_CONTAINERD_HOME/cni/net.d

disabled_plugins() {
  local plugins=()
  cri_enabled || plugins+=("${CRI_PLUGINS[@]}")
  local IFS=,
  local quoted=()
  local p
  for p in "${plugins[@]}"; do quoted+=("$(toml_str "$p")"); done
  printf '[%s]' "${quoted[*]}"
}

# CRI settings. Handlers: `crab` (this shim, with the crab config of CRAB_HOME)
# next to the stock `runc`, so tests run the same pod on both. This host also
# needs: runc cannot lower oom_score_adj (CAP_SYS_RESOURCE is withheld); CNI
# config and pod netns files of our own, not the host's; and the locally built
# pause image (hack/build-images.sh), as nothing can be pulled.
cri_plugin_config() {
  cri_enabled || return 0
  cat <<EOF
  [plugins.'io.containerd.cri.v1.images']
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = $(toml_str "$CRAB_PAUSE_IMAGE")
    # Per-registry hosts.toml (mirrors); hack/critest.sh points upstream names at a local registry.
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = $(toml_str "$CRAB_REGISTRY_HOSTS_DIR")
  [plugins.'io.containerd.cri.v1.runtime']
    restrict_oom_score_adj = true
    # Pod network namespaces under our state dir, not the host's /run/netns.
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['/usr/lib/cni', '/opt/cni/bin']
      conf_dir = $(toml_str "$CRAB_CNI_CONF_DIR")
      max_conf_num = 1
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
      # crab as the README recommends for Kubernetes: runc's runtime type, crab's shim as the
      # binary (a wrapper that names its config: runc's options cannot), so that the CRI treats
      # it as runc (features, user namespaces, recursive read-only mounts).
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.crab]
        runtime_type = 'io.containerd.runc.v2'
        runtime_path = $(toml_str "$(cri_crab_shim)")
        # crab's annotations of a pod (io.crab/probe-commands, policy, turn boundary) reach
        # its containers' specs.
        pod_annotations = ['io.crab/*']
        container_annotations = ['io.crab/*']
      # crab under its own runtime type, config in its options: what ctr, nerdctl and Docker use.
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.crab-v1]
        runtime_type = 'io.containerd.crab.v1'
        pod_annotations = ['io.crab/*']
        container_annotations = ['io.crab/*']
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.crab-v1.options]
          ConfigPath = $(toml_str "$(cri_crab_config)")
EOF
}

# The CRI handler `crab`'s runtime_path: a wrapper that sets CRAB_CONFIG and runs the shim.
cri_crab_shim() { printf '%s\n' "$CRAB_CONTAINERD_DIR/cri-shim/containerd-shim-crab-v1"; }
write_cri_crab_shim() {
  cri_enabled || return 0
  local shim
  shim=$(cri_crab_shim)
  mkdir -p "$(dirname "$shim")"
  cat >"$shim.tmp" <<EOF
#!/bin/sh
# Generated by hack/containerd.sh: the CRI handler \`crab\` (runc's runtime type) with its config.
CRAB_CONFIG=$(printf '%q' "$(cri_crab_config)") exec $(printf '%q' "$CRAB_HOME/bin/containerd-shim-crab-v1") "\$@"
EOF
  chmod 0755 "$shim.tmp"
  mv "$shim.tmp" "$shim"
}

# The crab config of the CRI handler: CRAB_CRI_CONFIG if set, else one written
# on start that keeps the checkpoint store under the instance's home.
cri_crab_config() { printf '%s\n' "${CRAB_CRI_CONFIG:-$CRAB_CONTAINERD_DIR/cri-crab.toml}"; }
write_cri_crab_config() {
  cri_enabled || return 0
  if [[ -n ${CRAB_CRI_CONFIG:-} ]]; then
    [[ -f $CRAB_CRI_CONFIG ]] || die "CRAB_CRI_CONFIG=$CRAB_CRI_CONFIG: no such file"
    return 0
  fi
  local cfg
  cfg=$(cri_crab_config)
  cat >"$cfg.tmp" <<EOF
# Generated by hack/containerd.sh for the CRI handler \`crab\`; edits are
# overwritten on start (set CRAB_CRI_CONFIG to use a file of your own).
[store]
state_dir = $(toml_str "$CRAB_CONTAINERD_HOME/cri-store")
[engine]
# The CRI handlers' checkpoint engine: its own, not the host's default (/run/crab/engine).
root = $(toml_str "$CRAB_CONTAINERD_HOME/cri-engine")
EOF
  mv "$cfg.tmp" "$cfg"
}

# The pod network: one bridge with host-local addresses, named and numbered
# after the instance's home so that two private instances on a host do not
# collide.
cni_bridge_name() { printf 'crab%s' "$(printf '%s' "$CRAB_CONTAINERD_HOME" | sha256sum | cut -c1-8)"; }
cni_subnet() {
  local h
  h=$(printf '%s' "$CRAB_CONTAINERD_HOME" | sha256sum | cut -c1-4)
  printf '10.%d.%d.0/24' $((200 + 0x${h:0:2} % 50)) $((0x${h:2:2}))
}

write_cni_config() {
  cri_enabled || return 0
  mkdir -p "$CRAB_CNI_CONF_DIR"
  local tmp=$CRAB_CNI_CONF_DIR/.10-crab.conflist.tmp
  # ipMasq off: pods need no way out (nothing is reachable from here anyway),
  # and it would add iptables rules to the host. Loopback is containerd's own.
  # portmap: the CRI's port mappings (a pod's hostPort, critest's port-mapping test)
  # as DNAT rules on the host, made for the pods that ask for one and removed with them.
  cat >"$tmp" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "crab",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$(cni_bridge_name)",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{ "subnet": "$(cni_subnet)" }]],
        "routes": [{ "dst": "0.0.0.0/0" }],
        "dataDir": "$CRAB_CONTAINERD_HOME/cni/ipam"
      }
    },
    {
      "type": "portmap",
      "capabilities": { "portMappings": true }
    }
  ]
}
EOF
  mv "$tmp" "$CRAB_CNI_CONF_DIR/10-crab.conflist"
}

remove_cni_bridge() {
  cri_enabled || return 0
  local br
  br=$(cni_bridge_name)
  ! ip link show "$br" >/dev/null 2>&1 || ip link del "$br" || log "warning: could not delete bridge $br"
}

# 1.7 reads config version 2; 2.x reads 3 (and would migrate 2, logging about it).
config_version() {
  case $CRAB_CONTAINERD_FLAVOR in
    1.7) echo 2 ;;
    *) echo 3 ;;
  esac
}

write_config() {
  mkdir -p "$CRAB_CONTAINERD_DIR"
  local tmp=$CRAB_CONTAINERD_CONFIG.tmp
  cat >"$tmp" <<EOF
# Generated by hack/containerd.sh; edits are overwritten on start.
version = $(config_version)
root = $(toml_str "$CRAB_CONTAINERD_ROOT")
state = $(toml_str "$CRAB_CONTAINERD_STATE")
disabled_plugins = $(disabled_plugins)

[grpc]
  address = $(toml_str "$CRAB_CONTAINERD_ADDRESS")

[ttrpc]
  address = $(toml_str "$CRAB_CONTAINERD_ADDRESS.ttrpc")

[debug]
  level = $(toml_str "${CRAB_CONTAINERD_LOG_LEVEL:-info}")

[plugins]
  # Defaults point at host-wide paths a system containerd also uses.
  [plugins."io.containerd.internal.v1.opt"]
    path = $(toml_str "$CRAB_CONTAINERD_DIR/opt")
  [plugins."io.containerd.nri.v1.nri"]
    disable = true
$(cri_plugin_config)
EOF
  mv "$tmp" "$CRAB_CONTAINERD_CONFIG"
}

# PID of our containerd, if it is alive and really is ours.
containerd_pid() {
  local pid
  [[ -f $CRAB_CONTAINERD_PIDFILE ]] || return 1
  pid=$(<"$CRAB_CONTAINERD_PIDFILE")
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "--config $CRAB_CONTAINERD_CONFIG" || return 1
  printf '%s\n' "$pid"
}

# containerd 1.7 conflicts with the installed 2.x package, so trixie's .deb is
# fetched by name and unpacked, not installed. The tree is replaced atomically
# and marked complete last, so an interrupted run is redone.
CONTAINERD17_PKG=containerd/trixie
CONTAINERD17_CACHE=$CRAB_HOME/cache/containerd-1.7
ensure_containerd17() {
  local done_mark=$CRAB_CONTAINERD17_TREE/.unpacked-from
  [[ -f $done_mark && -x $CRAB_CONTAINERD_BIN && -x $CRAB_CTR_BIN ]] && return 0
  mkdir -p "$CONTAINERD17_CACHE"
  local deb
  deb=$(find "$CONTAINERD17_CACHE" -maxdepth 1 -name 'containerd_1.7.*.deb' | sort | tail -n1)
  if [[ -z $deb ]]; then
    log "downloading $CONTAINERD17_PKG into $CONTAINERD17_CACHE"
    # Sandbox user root: _apt cannot write into CRAB_HOME, and apt says so loudly.
    local get=(apt-get download -q -o APT::Sandbox::User=root "$CONTAINERD17_PKG")
    if ! (cd "$CONTAINERD17_CACHE" && "${get[@]}" >/dev/null); then
      log "retrying after apt-get update"
      apt-get update -qq || die "apt-get update failed"
      (cd "$CONTAINERD17_CACHE" && "${get[@]}" >/dev/null) ||
        die "cannot download $CONTAINERD17_PKG; 'make deps' configures the trixie apt source"
    fi
    deb=$(find "$CONTAINERD17_CACHE" -maxdepth 1 -name 'containerd_1.7.*.deb' | sort | tail -n1)
    [[ -n $deb ]] || die "apt-get download $CONTAINERD17_PKG did not produce containerd_1.7.*.deb in $CONTAINERD17_CACHE"
  fi
  local tmp=$CRAB_CONTAINERD17_TREE.tmp version
  rm -rf "$tmp"
  dpkg -x "$deb" "$tmp" || die "cannot unpack $deb"
  version=$("$tmp/usr/bin/containerd" --version 2>/dev/null | awk '{print $3}') || true
  [[ $version == 1.7.* || $version == v1.7.* ]] ||
    die "$deb holds containerd '${version:-?}', not 1.7"
  basename "$deb" >"$tmp/.unpacked-from"
  rm -rf "$CRAB_CONTAINERD17_TREE"
  mv "$tmp" "$CRAB_CONTAINERD17_TREE"
  log "containerd $version unpacked into $CRAB_CONTAINERD17_TREE"
}

# The containerd binary of the selected flavor, ready to run.
check_containerd_binary() {
  case $CRAB_CONTAINERD_FLAVOR in
    1.7)
      ! cri_enabled || die "CRAB_CONTAINERD_CRI=1 is supported with containerd 2.x only"
      ensure_containerd17
      ;;
    *)
      command -v containerd >/dev/null || die "containerd not found; run 'make deps'"
      containerd --version | awk '{print $3}' | grep -qE '^v?2\.' ||
        die "$(command -v containerd) is not containerd 2.x ($(containerd --version)); run 'make deps'"
      ;;
  esac
}

# What containerd runs with: crab's shim first; for 1.7 its own runc shim
# (containerd-shim-runc-v2) before the system's 2.x one, which speaks another
# version of the shim protocol.
containerd_path() {
  case $CRAB_CONTAINERD_FLAVOR in
    1.7) echo "$CRAB_BIN_DIR:$CRAB_CONTAINERD17_TREE/usr/bin:$PATH" ;;
    *) echo "$CRAB_BIN_DIR:$PATH" ;;
  esac
}

# What an interrupted test run (a killed `make test`, a host restarted under it) leaves for
# the next one to trip over: empty cgroups of test containers (runc names them
# <hierarchy>/<namespace>/<id>, test ids start with "it-") and the test suite's FIFO dirs.
# rmdir(2) refuses a cgroup that still has a process or a child, so a live container's
# cgroup survives this; it runs only while no containerd of this instance runs.
remove_test_leftovers() {
  local ns root d
  for ns in "${CRAB_NAMESPACES[@]}" "${CRAB_NAMESPACE:-crab-test}"; do
    for root in /sys/fs/cgroup /sys/fs/cgroup/*; do
      [[ -d $root/$ns ]] || continue
      for d in "$root/$ns"/it-*/; do
        [[ -d $d ]] || continue
        # Children first; a cgroup with processes stays.
        if find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || [[ ! -d $d ]]; then
          log "removed the empty cgroup ${d%/} an earlier run left"
        fi
      done
    done
  done
  for d in "$CRAB_HOME/tmp/integration-fifo"/it-*/; do
    [[ -d $d ]] || continue
    rm -rf "$d" && log "removed the FIFO dir ${d%/} an earlier run left"
  done
}

cmd_start() {
  if crab_containerd_answers; then
    log "already running (socket $CRAB_CONTAINERD_ADDRESS)"
    return 0
  fi
  if containerd_pid >/dev/null; then
    die "containerd (pid $(containerd_pid)) is running but does not answer on $CRAB_CONTAINERD_ADDRESS; run '$0 stop' first"
  fi
  check_containerd_binary
  remove_test_leftovers
  mkdir -p "$CRAB_CONTAINERD_ROOT" "$CRAB_CONTAINERD_STATE" "$CRAB_SOCKET_DIR" "$CRAB_BIN_DIR"
  [[ $CRAB_SOCKET_DIR == "$CRAB_RUN_DIR" ]] ||
    log "CRAB_HOME path is too long for a unix socket; using $CRAB_CONTAINERD_ADDRESS"
  rm -f "$CRAB_CONTAINERD_ADDRESS" "$CRAB_CONTAINERD_ADDRESS.ttrpc"
  write_config
  write_cni_config
  write_cri_crab_config
  write_cri_crab_shim
  printf '\n==== %s hack/containerd.sh start\n' "$(date -Is)" >>"$CRAB_CONTAINERD_LOG"
  # setsid: the daemon must outlive the make/shell that started it and not get
  # its terminal's signals.
  PATH=$(containerd_path) setsid "$CRAB_CONTAINERD_BIN" --config "$CRAB_CONTAINERD_CONFIG" \
    </dev/null >>"$CRAB_CONTAINERD_LOG" 2>&1 &
  local pid=$!
  echo "$pid" >"$CRAB_CONTAINERD_PIDFILE"
  local i
  for ((i = 0; i < 300; i++)); do
    if crab_containerd_answers; then
      log "started containerd $CRAB_CONTAINERD_FLAVOR (pid $pid, socket $CRAB_CONTAINERD_ADDRESS, log $CRAB_CONTAINERD_LOG)"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  log "containerd did not come up; last log lines:"
  tail -n 30 "$CRAB_CONTAINERD_LOG" >&2
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$CRAB_CONTAINERD_PIDFILE"
  exit 1
}

# Kill and delete every task and container in every namespace, so that runc
# state, cgroups and rootfs mounts are released the normal way.
remove_all_containers() {
  local ns id
  for ns in $(crab_ctr namespaces ls -q); do
    for id in $(crab_ctr -n "$ns" tasks ls -q); do
      crab_ctr -n "$ns" tasks kill -a -s KILL "$id" >/dev/null 2>&1 || true
    done
    for id in $(crab_ctr -n "$ns" tasks ls -q); do
      crab_ctr -n "$ns" tasks rm -f "$id" >/dev/null 2>&1 ||
        log "warning: could not delete task $ns/$id"
    done
    for id in $(crab_ctr -n "$ns" containers ls -q); do
      crab_ctr -n "$ns" containers rm "$id" >/dev/null 2>&1 ||
        log "warning: could not delete container $ns/$id"
    done
  done
}

stop_containerd() {
  local pid i
  pid=$(containerd_pid) || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    log "containerd (pid $pid) ignored SIGTERM for 10s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  fi
}

# Shims started by our containerd: their argv carries `-address <our socket>`.
# Prints "pid namespace id" per shim.
our_shims() {
  local d args
  for d in /proc/[0-9]*; do
    args=$(tr '\0' '\n' 2>/dev/null <"$d/cmdline") || continue
    [[ $args == containerd-shim* || $args == */containerd-shim* ]] || continue
    awk -v want="$CRAB_CONTAINERD_ADDRESS" -v pid="${d#/proc/}" '
      prev == "-address" { addr = $0 }
      prev == "-namespace" { ns = $0 }
      prev == "-id" { id = $0 }
      { prev = $0 }
      END { if (addr == want) print pid, ns, id }' <<<"$args"
  done
}

# All descendants of a pid, deepest first (/proc/PID/task/*/children needs
# CONFIG_PROC_CHILDREN, which these kernels lack).
descendants() {
  ps -e -o pid=,ppid= | awk -v root="$1" '
    { parent[$1] = $2; pids[NR] = $1 }
    END {
      for (i = 1; i <= NR; i++) {
        depth = 0
        for (p = parent[pids[i]]; p != "" && p != 0; p = parent[p]) {
          depth++
          if (p == root) { print depth, pids[i]; break }
        }
      }
    }' | sort -rn | cut -d' ' -f2
}

# containerd's pkg/shim SocketAddress: sha256 of "<address>/<namespace>/<id>".
shim_socket() {
  printf '%s/%s' "$SHIM_SOCKET_DIR" "$(printf '%s/%s/%s' "$CRAB_CONTAINERD_ADDRESS" "$1" "$2" | sha256sum | cut -d' ' -f1)"
}

reap_shims() {
  local pid ns id p
  while read -r pid ns id; do
    [[ -n $pid ]] || continue
    log "killing leftover shim $pid ($ns/$id) and its processes"
    for p in $(descendants "$pid") "$pid"; do kill -KILL "$p" 2>/dev/null || true; done
    if [[ -d /run/containerd/runc/$ns/$id ]]; then
      runc --root "/run/containerd/runc/$ns" delete --force "$id" >/dev/null 2>&1 || true
    fi
    rm -f "$(shim_socket "$ns" "$id")" "$(shim_socket "$ns" "$id/debug")"
  done < <(our_shims)
}

# Mounts under this instance's home and socket dir, deepest first. The 2.x
# instance's home is CRAB_HOME, which also holds the 1.7 instance's: those
# mounts belong to the other containerd.
own_mounts() {
  local other=
  [[ $CRAB_CONTAINERD_HOME != "$CRAB_HOME" ]] || other=$CRAB_CONTAINERD17_HOME
  crab_mounts_under "$CRAB_CONTAINERD_HOME" "$CRAB_SOCKET_DIR" |
    awk -v other="$other" 'other == "" || ($0 != other && index($0, other "/") != 1)'
}

unmount_leftovers() {
  local m
  while read -r m; do
    [[ -n $m ]] || continue
    log "unmounting leftover $m"
    umount "$m" 2>/dev/null || umount -l "$m" || log "warning: could not unmount $m"
  done < <(own_mounts)
}

cmd_stop() {
  # The private dockerds (hack/dockerd.sh) run on the 2.x instance: they go first, the
  # normal way, before their containers are removed under them.
  local docker_rc=0
  if [[ $CRAB_CONTAINERD_FLAVOR == 2 ]]; then
    "$CRAB_REPO/hack/dockerd.sh" stop || docker_rc=1
  fi
  if crab_containerd_answers; then
    remove_all_containers
  fi
  stop_containerd
  rm -f "$CRAB_CONTAINERD_PIDFILE"
  reap_shims
  unmount_leftovers
  remove_cni_bridge
  rm -f "$CRAB_CONTAINERD_ADDRESS" "$CRAB_CONTAINERD_ADDRESS.ttrpc"
  [[ $CRAB_SOCKET_DIR == "$CRAB_RUN_DIR" ]] || rmdir "$CRAB_SOCKET_DIR" 2>/dev/null || true
  if [[ -n $(our_shims) || -n $(own_mounts) ]]; then
    die "stopped, but shims or mounts remain (see above)"
  fi
  [[ $docker_rc -eq 0 ]] || die "stopped, but a private dockerd did not stop cleanly (see above)"
  log "stopped"
}

cmd_status() {
  if crab_containerd_answers; then
    echo "running: pid $(containerd_pid || echo '?'), socket $CRAB_CONTAINERD_ADDRESS"
  else
    echo "not running"
    return 1
  fi
}

cmd_env() {
  printf 'export CRAB_HOME=%q\n' "$CRAB_HOME"
  printf 'export CRAB_CONTAINERD=%q\n' "$CRAB_CONTAINERD_FLAVOR"
  printf 'export CRAB_CONTAINERD_ADDRESS=%q\n' "$CRAB_CONTAINERD_ADDRESS"
  # Tests run `ctr` from PATH: with 1.7, that must be 1.7's.
  [[ $CRAB_CONTAINERD_FLAVOR != 1.7 ]] ||
    printf 'export PATH=%q:"$PATH"\n' "$CRAB_CONTAINERD17_TREE/usr/bin"
  printf 'export CRAB_NAMESPACE=%q\n' "${CRAB_NAMESPACE:-crab-test}"
  # The crab config of the CRI handlers: what crabctl needs (as CRAB_CONFIG) for the pods of
  # handler `crab`, whose runc-type options cannot name it.
  ! cri_enabled || printf 'export CRAB_CRI_CONFIG=%q\n' "$(cri_crab_config)"
}

cmd_ctr() {
  CONTAINERD_NAMESPACE=${CONTAINERD_NAMESPACE:-${CRAB_NAMESPACE:-crab-test}} \
    exec "$CRAB_CTR_BIN" --address "$CRAB_CONTAINERD_ADDRESS" "$@"
}

case ${1:-} in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  ctr) shift; cmd_ctr "$@" ;;
  *) usage ;;
esac

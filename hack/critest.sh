#!/usr/bin/env bash
# Runs the Kubernetes CRI conformance suite (critest, cri-tools v1.30.0) against the private
# containerd's CRI (hack/containerd.sh) for one or more runtime handlers, offline.
#
#   hack/critest.sh                        (what `make critest` runs)
#
# Before the run: the images critest uses are built (hack/critest-images.sh, cached) and
# pushed under their upstream names to a registry on 127.0.0.1 (Debian's docker-registry,
# data kept in $CRAB_HOME/critest/registry/ for the current build of the images), and containerd's registry hosts directory
# (hack/containerd.sh) gets a hosts.toml for registry.k8s.io and gcr.io that sends pulls
# there and nowhere else. Everything this script starts (the registry; containerd when it
# was not running) is stopped and the hosts.toml files removed when it ends, also on failure,
# and so are the host-wide iptables chains of the CNI portmap plugin (the port-mapping tests)
# when this run made them.
#
# Per handler, under $CRAB_HOME/critest/<handler>/: junit.xml (ginkgo's JUnit report),
# critest.log (its output), summary.txt (one line: passed/failed/skipped, from the JUnit,
# and the wall time), failed.txt (each failed test with its message), passed.txt and
# skipped.txt (test names). With more than
# one handler, a comparison table (also $CRAB_HOME/critest/comparison.txt) and the tests
# runc passed that another handler did not. Each handler starts from the same state: the
# critest images are removed from containerd first, so every run pulls them.
#
# Exits non-zero when any test failed, when critest itself failed, and, when `runc` ran
# too, when another handler passed fewer tests than runc.
#
# Skipped on purpose (for every handler):
#   "public image with digest should be pulled and removed": it pulls upstream's
#   test-image-digest by one exact manifest digest, which no locally built image can have;
#   offline it can never pass.
# critest itself skips its 5 benchmarks (they run with -benchmark instead of the conformance
# tests), so a full run reports 6 skipped.
#
# Only one critest may run on a host at a time (the networking tests use host ports
# 12000-12003): a second run waits for the first (lock /run/lock/crab-critest.lock).
#
# Environment:
#   CRITEST           the critest binary (default <repo>/../shared/critest/critest); cri-tools
#                     v1.30.0 `make critest`, see ../shared/critest/README.md
#   CRITEST_HANDLER   the CRI runtime handlers to test, space-separated, in order (default
#                     crab; `runc crab` runs both and compares; hack/containerd.sh
#                     configures `crab` and `runc`)
#   CRITEST_ARGS      more critest arguments, e.g. -ginkgo.focus='PodSandbox'
#   CRAB_HOME         state directory (default <repo>/.crab)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CRAB_LOG_PREFIX=critest

CRITEST_VERSION=1.30.0
CRITEST_SKIP='public image with digest should be pulled and removed'
CRITEST_DIR=$CRAB_HOME/critest
LOCK=/run/lock/crab-critest.lock
HOSTS=(registry.k8s.io gcr.io)
SHIM=containerd-shim-crab-v1

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
  exit 2
}
case ${1:-} in
  '') ;;
  *) usage ;;
esac

CRITEST=${CRITEST:-$CRAB_REPO/../shared/critest/critest}
[[ -x $CRITEST ]] || die "no critest binary at $CRITEST: set CRITEST to cri-tools v$CRITEST_VERSION's critest (its README: ../shared/critest/README.md next to the repo; or build it from cri-tools v$CRITEST_VERSION with 'make critest')"
version=$("$CRITEST" -version 2>&1 | awk '/critest version/ {print $3}') || true
[[ $version == "$CRITEST_VERSION" ]] ||
  log "warning: $CRITEST is critest '${version:-?}'; the images and the skip list are for v$CRITEST_VERSION"

read -r -a handlers <<<"${CRITEST_HANDLER:-crab}"
((${#handlers[@]} > 0)) || die "CRITEST_HANDLER is empty: name one or more handlers (crab, runc)"
for h in "${handlers[@]}"; do
  [[ $h =~ ^[A-Za-z0-9._-]+$ ]] || die "CRITEST_HANDLER: '$h' is not a handler name"
done
read -r -a extra_args <<<"${CRITEST_ARGS:-}"

[[ $EUID -eq 0 ]] || die "must run as root (containerd, images)"
[[ $CRAB_CONTAINERD_FLAVOR == 2 && ${CRAB_CONTAINERD_CRI:-1} == 1 ]] ||
  die "critest needs the CRI: containerd 2.x with CRAB_CONTAINERD_CRI=1 (the default)"
for cmd in docker-registry skopeo python3 flock iptables; do
  command -v "$cmd" >/dev/null || die "$cmd not found; run 'make deps'"
done

mkdir -p "$CRITEST_DIR" "$(dirname "$LOCK")"
exec 9>"$LOCK"
if ! flock -n 9; then
  log "another critest run holds $LOCK (host ports 12000-12003); waiting for it"
  flock 9
fi

# The CNI portmap plugin (hack/containerd.sh's pod network) makes host-wide chains for the
# port-mapping tests on first use and leaves them; when this run made them and they are idle
# again, they go with it.
PORTMAP_CHAINS=(CNI-HOSTPORT-DNAT CNI-HOSTPORT-MASQ CNI-HOSTPORT-SETMARK)
portmap_chains_existed=1
iptables -t nat -S CNI-HOSTPORT-DNAT >/dev/null 2>&1 || portmap_chains_existed=0
remove_portmap_chains() {
  local c
  ((portmap_chains_existed == 0)) || return 0
  iptables -t nat -S CNI-HOSTPORT-DNAT >/dev/null 2>&1 || return 0
  if [[ -n $(iptables -t nat -S CNI-HOSTPORT-DNAT | grep -v '^-N') ]]; then
    log "warning: CNI-HOSTPORT-DNAT still has rules (a pod with host ports is left); keeping the portmap chains"
    return 0
  fi
  iptables -t nat -D PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT 2>/dev/null || true
  iptables -t nat -D OUTPUT -m addrtype --dst-type LOCAL -j CNI-HOSTPORT-DNAT 2>/dev/null || true
  iptables -t nat -D POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" \
    -j CNI-HOSTPORT-MASQ 2>/dev/null || true
  for c in "${PORTMAP_CHAINS[@]}"; do
    iptables -t nat -F "$c" 2>/dev/null || true
    iptables -t nat -X "$c" 2>/dev/null || log "warning: could not remove iptables chain nat/$c"
  done
}

registry_pid=
critest_pid=
started_containerd=0
written_hosts=()
cleanup() {
  local rc=$? f
  if [[ -n $critest_pid ]]; then
    log "stopping critest (pid $critest_pid)"
    kill "$critest_pid" 2>/dev/null || true
    wait "$critest_pid" 2>/dev/null || true
  fi
  for f in "${written_hosts[@]}"; do
    rm -f "$f"
    rmdir "$(dirname "$f")" 2>/dev/null || true
  done
  if [[ -n $registry_pid ]]; then
    kill "$registry_pid" 2>/dev/null || true
    wait "$registry_pid" 2>/dev/null || true
  fi
  if ((started_containerd)); then
    "$CRAB_REPO/hack/containerd.sh" stop || { [[ $rc -ne 0 ]] || rc=1; }
  fi
  remove_portmap_chains
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ! crab_containerd_answers; then
  "$CRAB_REPO/hack/containerd.sh" start
  started_containerd=1
fi
grep -qF "$CRAB_REGISTRY_HOSTS_DIR" "$CRAB_CONTAINERD_CONFIG" ||
  die "the running containerd was started without the registry hosts directory: run 'hack/containerd.sh stop' and retry"
for h in "${handlers[@]}"; do
  [[ $h != crab || -x $CRAB_BIN_DIR/$SHIM ]] || die "no $CRAB_BIN_DIR/$SHIM: run 'make build'"
done
"$CRAB_REPO/hack/build-images.sh" import k8s.io pause

# The registry, on a free port of 127.0.0.1, its storage kept for one build of the images
# ($1: the layout's directory name) and dropped with it.
start_registry() {
  local storage=$CRITEST_DIR/registry/$1 port config=$CRITEST_DIR/registry.yml i
  mkdir -p "$storage"
  find "$CRITEST_DIR/registry" -mindepth 1 -maxdepth 1 ! -name "$1" -exec rm -rf {} +
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  REGISTRY=127.0.0.1:$port
  cat >"$config" <<EOF
# Written by hack/critest.sh for one run.
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $storage
http:
  addr: $REGISTRY
EOF
  docker-registry serve "$config" >>"$CRITEST_DIR/registry.log" 2>&1 &
  registry_pid=$!
  for ((i = 0; i < 100; i++)); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
      log "registry on $REGISTRY (pid $registry_pid, log $CRITEST_DIR/registry.log)"
      return
    fi
    kill -0 "$registry_pid" 2>/dev/null || break
    sleep 0.1
  done
  tail -n 20 "$CRITEST_DIR/registry.log" >&2 || true
  die "docker-registry did not listen on $REGISTRY"
}

# hosts.toml per upstream registry: pulls and resolves go to the local registry only.
write_hosts() {
  local host dir f
  for host in "${HOSTS[@]}"; do
    dir=$CRAB_REGISTRY_HOSTS_DIR/$host
    f=$dir/hosts.toml
    mkdir -p "$dir"
    written_hosts+=("$f")
    cat >"$f.tmp" <<EOF
# Written by hack/critest.sh for one run and removed after it: $host's images come from
# the local registry (hack/critest-images.sh push), never from $host.
server = "http://$REGISTRY"

[host."http://$REGISTRY"]
  capabilities = ["pull", "resolve"]
EOF
    mv "$f.tmp" "$f"
  done
}

# Removes critest's images from the CRI's namespace, so that a run pulls them afresh.
remove_images() {
  local refs
  mapfile -t refs < <("$CRAB_REPO/hack/critest-images.sh" refs | awk '{print $2}')
  crab_ctr -n k8s.io images rm "${refs[@]}" >/dev/null 2>&1 || true
}

# Prints "passed failed skipped" from a JUnit report ($1); writes the failed tests with
# their messages to $2, the names of the passed tests to $3 and of the skipped ones to $4.
# Suite-level nodes (BeforeSuite, ...) count when they fail, never as passed or skipped tests.
junit_counts() {
  python3 - "$@" <<'EOF'
import sys
import xml.etree.ElementTree as ET

report, failed_out, passed_out, skipped_out = sys.argv[1:5]
passed, failed, skipped = [], [], []
for case in ET.parse(report).getroot().iter("testcase"):
    name = case.get("name", "")
    status = case.get("status", "")
    problem = case.find("failure")
    if problem is None:
        problem = case.find("error")
    suite_node = not name.startswith("[It]")
    if problem is not None or status in ("failed", "panicked", "interrupted", "aborted", "timedout"):
        message = (problem.get("message") if problem is not None else None) or status
        failed.append(f"{name}\n    {message.strip()}")
    elif case.find("skipped") is not None or status in ("skipped", "pending"):
        if not suite_node:
            skipped.append(name)
    elif not suite_node:
        passed.append(name)
for path, lines in ((failed_out, failed), (passed_out, sorted(passed)), (skipped_out, sorted(skipped))):
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
print(len(passed), len(failed), len(skipped))
EOF
}

declare -A PASSED FAILED SKIPPED WALL
rc=0
run_handler() {
  local h=$1 out=$CRITEST_DIR/$1 start wall crit_rc=0 passed failed skipped
  rm -rf "$out"
  mkdir -p "$out"
  remove_images
  log "$h: running critest (output in $out/critest.log)"
  start=$SECONDS
  # In the background, so that a signal to this script ends the run at once (the trap
  # stops critest) instead of after it.
  "$CRITEST" -runtime-endpoint "unix://$CRAB_CONTAINERD_ADDRESS" \
    -image-endpoint "unix://$CRAB_CONTAINERD_ADDRESS" -runtime-handler "$h" \
    -ginkgo.skip "$CRITEST_SKIP" -ginkgo.junit-report "$out/junit.xml" -ginkgo.no-color \
    "${extra_args[@]}" > >(tee "$out/critest.log") 2>&1 &
  critest_pid=$!
  wait "$critest_pid" || crit_rc=$?
  critest_pid=
  wall=$((SECONDS - start))
  [[ -s $out/junit.xml ]] || die "$h: critest wrote no JUnit report (exit $crit_rc); see $out/critest.log"
  read -r passed failed skipped < <(junit_counts "$out/junit.xml" "$out/failed.txt" "$out/passed.txt" \
    "$out/skipped.txt")
  if ((crit_rc != 0 && failed == 0)); then
    echo "critest exited $crit_rc with no failed test in its report; see $out/critest.log" >>"$out/failed.txt"
    failed=1
  fi
  printf '%s: %d passed, %d failed, %d skipped in %dm%02ds (critest v%s, containerd %s)\n' \
    "$h" "$passed" "$failed" "$skipped" $((wall / 60)) $((wall % 60)) "${version:-?}" \
    "$(containerd --version | awk '{print $3}')" >"$out/summary.txt"
  PASSED[$h]=$passed FAILED[$h]=$failed SKIPPED[$h]=$skipped WALL[$h]=$wall
  log "$(cat "$out/summary.txt")"
  if ((failed > 0)); then
    log "$h: failed tests:"
    sed 's/^/  /' "$out/failed.txt" >&2
    rc=1
  fi
}

layout=$("$CRAB_REPO/hack/critest-images.sh" build)
start_registry "$(basename "$layout")"
"$CRAB_REPO/hack/critest-images.sh" push "$REGISTRY"
write_hosts
for h in "${handlers[@]}"; do run_handler "$h"; done

if ((${#handlers[@]} > 1)); then
  {
    printf '%-10s %7s %7s %8s %9s\n' handler passed failed skipped wall
    for h in "${handlers[@]}"; do
      printf '%-10s %7d %7d %8d %6dm%02ds\n' "$h" "${PASSED[$h]}" "${FAILED[$h]}" "${SKIPPED[$h]}" \
        $((WALL[$h] / 60)) $((WALL[$h] % 60))
    done
    if [[ -n ${PASSED[runc]:-} ]]; then
      for h in "${handlers[@]}"; do
        [[ $h != runc ]] || continue
        missing=$(comm -23 "$CRITEST_DIR/runc/passed.txt" "$CRITEST_DIR/$h/passed.txt")
        if [[ -n $missing ]]; then
          printf '\npassed under runc, not under %s:\n' "$h"
          while IFS= read -r name; do
            how=failed
            ! grep -qxF -- "$name" "$CRITEST_DIR/$h/skipped.txt" || how=skipped
            printf '  %-8s %s\n' "$how" "$name"
          done <<<"$missing"
        fi
      done
    fi
  } >"$CRITEST_DIR/comparison.txt"
  echo
  cat "$CRITEST_DIR/comparison.txt"
  if [[ -n ${PASSED[runc]:-} ]]; then
    for h in "${handlers[@]}"; do
      if ((PASSED[$h] < PASSED[runc])); then
        log "$h passed ${PASSED[$h]} tests, runc ${PASSED[runc]}: $h must pass every test runc passes"
        rc=1
      fi
    done
  fi
fi
exit "$rc"

#!/usr/bin/env bash
# The main demo: an agent sandbox under crab, three turns, and what crab decided for each.
# Expects the private containerd (hack/containerd.sh start) with the test images imported,
# and crabctl built (make build).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
eval "$("$CRAB_REPO"/hack/containerd.sh env)"
NS=crab-demo
ID=crab-agent-demo-$$
CRABCTL=${CARGO_TARGET_DIR:-$CRAB_REPO/target}/release/crabctl
CONFIG=$CRAB_HOME/demo-crab.toml
cat >"$CONFIG" <<TOML
[store]
state_dir = "$CRAB_HOME/demo-state"
TOML
ctr() { command ctr -a "$CRAB_CONTAINERD_ADDRESS" -n "$NS" "$@"; }
crabctl() { "$CRABCTL" --address "$CRAB_CONTAINERD_ADDRESS" --namespace "$NS" --config "$CONFIG" "$@"; }
cleanup() { ctr task kill -s KILL "$ID" >/dev/null 2>&1 || true; sleep 0.3; ctr task rm "$ID" >/dev/null 2>&1 || true; ctr container rm "$ID" >/dev/null 2>&1 || true; }
trap cleanup EXIT

say() { printf '\n\033[1m%s\033[0m\n' "$*"; }
turn() {
  local n=$1 cmd=$2
  say "turn $n: $cmd"
  ctr task exec --exec-id "t$n" --cwd /app "$ID" bash -c "$cmd" || true
  crabctl turn-end "$ID" --turn "turn-$n" >/dev/null
}

say "An agent sandbox (Debian, python3, git) under io.containerd.crab.v1"
ctr run -d --runtime io.containerd.crab.v1 --runtime-config-path "$CONFIG" \
  localhost/crab/agent:latest "$ID" sleep infinity >/dev/null
turn 1 "ls /etc | head -3; python3 -c 'print(6*7)'"
turn 2 "echo 'print(\"hi\")' > /app/main.py && python3 /app/main.py"
turn 3 "nohup python3 -m http.server 8000 --bind 127.0.0.1 >/dev/null 2>&1 & sleep 1"
sleep 2   # checkpoints run in the background while the agent thinks
say "What each turn left behind (crabctl turns $ID)"
crabctl turns "$ID"
say "The checkpoints taken (crabctl checkpoints $ID)"
crabctl checkpoints "$ID"
say "Why turn 2 was a filesystem checkpoint (crabctl show $ID turn-2, abridged)"
crabctl show "$ID" turn-2 | grep -E '"(kind|changed|scanned)"|/app/' | head -8

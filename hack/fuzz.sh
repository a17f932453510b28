#!/usr/bin/env bash
# Fuzzes every parser of untrusted bytes (the cargo-fuzz targets of shim/fuzz) for a bounded
# time each: one build, then each target in turn. Fails on any crash, overflow, leak, OOM or
# hang, leaving the input under $CRAB_HOME/fuzz/artifacts/<target>/.
#
#   FUZZ_SECONDS=60      per target (make fuzz; make fuzz-smoke uses 5)
#   FUZZ_TARGETS="..."   a subset (default: all, as `cargo fuzz list` gives them)
#   FUZZ_MAX_LEN=65536   the largest input libFuzzer makes
#   FUZZ_RSS_MB=2048     memory limit per target (and per single allocation)
#   FUZZ_SANITIZER=address  or none (faster, catches panics only)
#
# Corpora grow under $CRAB_HOME/fuzz/corpus/<target> (seeded from shim/fuzz/seeds/<target>),
# logs go to $CRAB_HOME/fuzz/logs/, the executions per target to $CRAB_HOME/fuzz/summary.txt.
# cargo-fuzz needs nightly flags: on stable they are allowed by RUSTC_BOOTSTRAP=1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

FUZZ_SECONDS=${FUZZ_SECONDS:-60}
FUZZ_MAX_LEN=${FUZZ_MAX_LEN:-65536}
FUZZ_RSS_MB=${FUZZ_RSS_MB:-2048}
FUZZ_SANITIZER=${FUZZ_SANITIZER:-address}
# The newest cargo-fuzz that builds on the stable toolchain here (1.95).
CARGO_FUZZ_VERSION=0.13.2
export RUSTC_BOOTSTRAP=1
# libfuzzer-sys compiles libFuzzer (C++): take Debian's clang++-NN when there is no c++.
if [[ -z ${CXX:-} ]] && ! command -v c++ >/dev/null; then
  for cxx in clang++ clang++-{25..14} g++; do
    command -v "$cxx" >/dev/null && { export CXX=$cxx; break; }
  done
fi

log() { printf 'fuzz: %s\n' "$*" >&2; }

if ! cargo fuzz --version >/dev/null 2>&1; then
  log "installing cargo-fuzz $CARGO_FUZZ_VERSION"
  cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi

cd "$CRAB_REPO/shim"
out=$CRAB_HOME/fuzz
mkdir -p "$out/logs"
targets=${FUZZ_TARGETS:-$(cargo fuzz list)}
triple=$(rustc -vV | sed -n 's/^host: //p')

# One build of every target (debug assertions on: integer overflow is a finding too); the
# runs below use the binaries, so nothing is rebuilt between targets.
log "building the targets (sanitizer: $FUZZ_SANITIZER)"
start=$SECONDS
cargo fuzz build --debug-assertions --sanitizer "$FUZZ_SANITIZER"
log "built in $((SECONDS - start)) s"
bin_dir=$CRAB_REPO/shim/fuzz/target/$triple/release

summary=$out/summary.txt
{
  printf '# %s, %s s per target, -max_len=%s, -rss_limit_mb=%s, sanitizer %s\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$FUZZ_SECONDS" "$FUZZ_MAX_LEN" "$FUZZ_RSS_MB" "$FUZZ_SANITIZER"
  printf '%-18s %12s %8s %8s %s\n' target executions exec/s corpus result
} >"$summary"
failed=()
for t in $targets; do
  corpus=$out/corpus/$t
  artifacts=$out/artifacts/$t
  logf=$out/logs/$t.log
  mkdir -p "$corpus" "$artifacts"
  seeds=()
  [[ -d $CRAB_REPO/shim/fuzz/seeds/$t ]] && seeds=("$CRAB_REPO/shim/fuzz/seeds/$t")
  log "$t: ${FUZZ_SECONDS} s"
  rc=0
  "$bin_dir/$t" "$corpus" "${seeds[@]}" \
    -max_total_time="$FUZZ_SECONDS" -max_len="$FUZZ_MAX_LEN" \
    -rss_limit_mb="$FUZZ_RSS_MB" -malloc_limit_mb="$FUZZ_RSS_MB" -timeout=10 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 >"$logf" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logf" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$logf" | tail -1)
  units=$(sed -n 's/^#[0-9]*[[:space:]]*DONE .*corp: \([0-9]*\).*/\1/p' "$logf" | tail -1)
  result=ok
  if [[ $rc -ne 0 ]]; then
    result="FAILED (exit $rc; $(ls "$artifacts" | head -3 | tr '\n' ' ')log $logf)"
    failed+=("$t")
    grep -m5 -E 'panicked|ERROR: libFuzzer|SUMMARY' "$logf" >&2 || true
  fi
  printf '%-18s %12s %8s %8s %s\n' "$t" "${execs:-?}" "${rate:-?}" "${units:-?}" "$result" \
    | tee -a "$summary" >&2
done

log "summary: $summary"
if [[ ${#failed[@]} -gt 0 ]]; then
  log "FAILED: ${failed[*]} (inputs under $out/artifacts/, reproduce with" \
    "RUSTC_BOOTSTRAP=1 cargo fuzz run <target> <input> in shim/)"
  exit 1
fi

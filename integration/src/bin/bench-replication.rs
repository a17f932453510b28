//! Off-node replication under load (issue 27): real agent trajectories replayed by N sandboxes
//! at once (default 16) under crab's policy twice, with `[replication]` off and on (a registry
//! on 127.0.0.1, Debian's `docker-registry`); prints the replication lag (a checkpoint durable
//! to pushed, and a turn end to pushed: the age of the recovery point a node's loss leaves)
//! p50/p95, the bytes pushed per turn against the bytes the checkpoints themselves added to
//! the stores (deduplication), and the delay exposed to the agent with replication on against
//! off (from the mean `Tasks.Exec`+`Start` time of its actions: the next action waits for the
//! last turn's checkpoint, never for a push). One off/on pair is noisier than the effect on a
//! small host, so the rounds run in `--pairs` interleaved pairs (off-on, on-off, ...: a drift
//! of the host over the run weighs on both sides alike) and the exposed delay is reported per
//! pair and over all of them. Each "on" round pushes to a repository of its own (nothing
//! deduplicated against an earlier round). Asserts nothing.
//!
//! `CRAB_BENCH_REGISTRY=apart` runs the registry as if on another host: at SCHED_IDLE and with
//! its storage in /dev/shm. On one host it otherwise competes with the sandboxes for the CPUs
//! and for the disk (each checkpoint's `syncfs` also flushes what the registry wrote); the
//! difference between the two runs is its share of the exposed delay.
//!
//! `make bench BENCHES=bench-replication` (BENCH_ARGS="--density 16 --max-turns 20 --pairs 3"), or with
//! the private containerd up: `cargo run --release -p crab-integration --bin bench-replication`.
//! Output: `$CRAB_HOME/bench/replication-<unix time>.{json,md}` (and `replication-latest.*`).

use std::path::PathBuf;

use crab_integration::bench::{parse_counts, Bench, Host};
use crab_integration::registry::Registry;
use crab_integration::replay::{run_round, trajectory, Options, Policy, Round, RoundRecord};
use serde_json::json;

const BENCH: Bench = Bench::new("bench-replication");
const USAGE: &str = "usage: bench-replication [--density N] [--max-turns N] [--pairs N]
  --density N    sandboxes at once, each replaying a real trajectory (default 16)
  --max-turns N  turns of each trajectory (default 20)
  --pairs N      interleaved off/on pairs of rounds (default 3)
trajectories: $CRAB_TRAJECTORIES, else ../shared/trajectories next to the repo";

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

/// Mean `Tasks.Exec`+`Start` time of every action of the round, in ms.
fn mean_exec_ms(r: &RoundRecord) -> f64 {
    let v: Vec<f64> = r
        .sandboxes
        .iter()
        .flat_map(|s| s.turns.iter().map(|t| t.exec_start_ms))
        .filter(|x| x.is_finite())
        .collect();
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn turns(r: &RoundRecord) -> usize {
    r.sandboxes.iter().map(|s| s.turns.len()).sum()
}

fn errors(r: &RoundRecord) -> usize {
    r.sandboxes.iter().map(|s| s.errors.len()).sum()
}

/// The delay replication exposed to the agent in one pair: the change of the mean action
/// start, over every action of the "on" round, as a share of the "off" round's replay time.
fn exposed_share(off: &RoundRecord, on: &RoundRecord) -> f64 {
    let replay_off: f64 = off.sandboxes.iter().map(|s| s.replay_s).sum();
    (mean_exec_ms(on) - mean_exec_ms(off)) * turns(on) as f64 / 1e3 / replay_off.max(1e-9)
}

/// What the "on" rounds' replicators recorded, summed.
#[derive(Default)]
struct Pushed {
    lags: Vec<f64>,
    turn_lags: Vec<f64>,
    sent: u64,
    skipped: u64,
    pushes: u64,
    failures: u64,
    unreplicated: usize,
}

impl Pushed {
    fn add(&mut self, on: &RoundRecord) {
        let floats = |v: &serde_json::Value| -> Vec<f64> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_f64())
                .collect()
        };
        for s in &on.sandboxes {
            match &s.replication {
                Some(st) => {
                    self.lags.extend(floats(&st["lags_ms"]));
                    self.turn_lags.extend(floats(&st["turn_lags_ms"]));
                    self.sent += st["bytes_sent"].as_u64().unwrap_or(0);
                    self.skipped += st["bytes_skipped"].as_u64().unwrap_or(0);
                    self.pushes += st["pushes"].as_u64().unwrap_or(0);
                    self.failures += st["failures"].as_u64().unwrap_or(0);
                }
                None => self.unreplicated += 1,
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let (mut density, mut max_turns, mut pairs) = (16usize, 20usize, 3usize);
    parse_counts(
        BENCH.name,
        USAGE,
        &mut [
            ("--density", &mut density),
            ("--max-turns", &mut max_turns),
            ("--pairs", &mut pairs),
        ],
    );
    let path = std::env::var_os("CRAB_TRAJECTORIES")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/trajectories")
        });
    let all = trajectory::load(&path)
        .unwrap_or_else(|e| BENCH.die(format!("{e} (set CRAB_TRAJECTORIES)")));
    let selection: Vec<String> = trajectory::DEFAULT_SELECTION
        .iter()
        .map(|s| s.to_string())
        .collect();
    let selected = trajectory::select(&all, &selection).unwrap_or_else(|e| BENCH.die(e));
    let env = BENCH.crab_env("replication");
    let host = Host::now();
    let idle = std::env::var("CRAB_BENCH_REGISTRY").is_ok_and(|v| v == "apart");
    let registry = Registry::start_apart(idle);
    let round = Round {
        policy: Policy::Crab,
        density,
        oracle: false,
    };
    let opts = |config: String| Options {
        think_scale: 0.05,
        cmd_timeout: std::time::Duration::from_secs(30),
        max_turns: Some(max_turns),
        sandbox_config: config,
        prelude: None,
    };
    let mut rounds: Vec<(RoundRecord, RoundRecord)> = Vec::new();
    let mut pushed = Pushed::default();
    // Per "on" round: the registry's CPU seconds and the round's wall seconds (the registry
    // shares this host's CPUs with the sandboxes; off the node it would not).
    let mut registry_cpu: Vec<(f64, f64)> = Vec::new();
    for pair in 0..pairs {
        let mut off = None;
        let mut on = None;
        // off-on, then on-off, ...
        for replicate in [pair % 2 == 1, pair % 2 == 0] {
            match replicate {
                false => {
                    BENCH.progress(format!(
                        "pair {}/{pairs}: replication off, {density} sandboxes",
                        pair + 1
                    ));
                    off = Some(run_round(round, &selected, &opts(String::new())).await);
                }
                true => {
                    BENCH.progress(format!(
                        "pair {}/{pairs}: replication on ({}), {density} sandboxes",
                        pair + 1,
                        registry.addr
                    ));
                    let config = format!(
                        "replication.registry = \"{}/crab/bench-{pair}\"\n\
                         replication.insecure = true\n",
                        registry.addr
                    );
                    let (cpu, wall) = (registry.cpu_seconds(), std::time::Instant::now());
                    on = Some(run_round(round, &selected, &opts(config)).await);
                    registry_cpu.push((registry.cpu_seconds() - cpu, wall.elapsed().as_secs_f64()));
                }
            }
        }
        let (off, on) = (off.expect("ran"), on.expect("ran"));
        pushed.add(&on);
        BENCH.progress(format!(
            "pair {}: exposed delay on vs off {:+.2}%",
            pair + 1,
            exposed_share(&off, &on) * 100.0
        ));
        rounds.push((off, on));
    }
    let own: u64 = rounds
        .iter()
        .flat_map(|(_, on)| &on.sandboxes)
        .map(|s| s.store_bytes.values().sum::<u64>())
        .sum();
    let turns_on = rounds.iter().map(|(_, on)| turns(on)).sum::<usize>().max(1);
    let mut lags = pushed.lags.clone();
    let mut turn_lags = pushed.turn_lags.clone();
    let (p50, p95) = (percentile(&mut lags, 0.5), percentile(&mut lags, 0.95));
    let (t50, t95) = (
        percentile(&mut turn_lags, 0.5),
        percentile(&mut turn_lags, 0.95),
    );
    let shares: Vec<f64> = rounds
        .iter()
        .map(|(off, on)| exposed_share(off, on))
        .collect();
    let mut sorted = shares.clone();
    let median = percentile(&mut sorted, 0.5);
    let mean_share = shares.iter().sum::<f64>() / shares.len().max(1) as f64;
    let mean_of = |f: fn(&(RoundRecord, RoundRecord)) -> f64| {
        rounds.iter().map(f).sum::<f64>() / rounds.len().max(1) as f64
    };
    let exec_off = mean_of(|(off, _)| mean_exec_ms(off));
    let exec_on = mean_of(|(_, on)| mean_exec_ms(on));
    let per_pair = shares
        .iter()
        .map(|s| format!("{:+.2}%", s * 100.0))
        .collect::<Vec<_>>()
        .join(", ");
    let (reg_cpu, reg_wall) = registry_cpu
        .iter()
        .fold((0.0, 0.0), |(c, w), (dc, dw)| (c + dc, w + dw));
    let reg_share = reg_cpu / (reg_wall * host.cpus as f64).max(1e-9);
    let errors_off: usize = rounds.iter().map(|(off, _)| errors(off)).sum();
    let errors_on: usize = rounds.iter().map(|(_, on)| errors(on)).sum();
    let md = format!(
        "# bench-replication\n\n\
         {} CPUs, kernel {}, load {}; {density} sandboxes at once, {} trajectories, at most \
         {max_turns} turns each, crab's policy; registry on 127.0.0.1; {pairs} interleaved \
         off/on pairs of rounds{}\n\n\
         | figure | value |\n|---|---|\n\
         | replication lag p50 / p95, turn end to pushed | {t50:.0} / {t95:.0} ms ({} pushes) |\n\
         | replication lag p50 / p95, durable to pushed | {p50:.0} / {p95:.0} ms |\n\
         | bytes pushed per turn | {:.0} |\n\
         | bytes the checkpoints added to the stores per turn | {:.0} |\n\
         | bytes not sent again (already in the registry) | {} |\n\
         | failed push attempts | {} |\n\
         | sandboxes never replicated | {} |\n\
         | mean action start, replication off / on | {exec_off:.1} / {exec_on:.1} ms |\n\
         | exposed delay on vs off, share of the replay time: per pair | {per_pair} |\n\
         | exposed delay on vs off: median / mean of the pairs | {:+.2}% / {:+.2}% |\n\
         | the registry's CPU during the \"on\" rounds (on this host) | {reg_cpu:.1} s, {:.1}% of the host's CPUs |\n\
         | errors (off / on) | {errors_off} / {errors_on} |\n",
        host.cpus,
        host.kernel,
        host.loadavg,
        selected.len(),
        match idle {
            true => {
                " (the registry apart: at SCHED_IDLE, its storage in /dev/shm, standing in for \
                 one on another host)"
            }
            false => "",
        },
        pushed.pushes,
        pushed.sent as f64 / turns_on as f64,
        own as f64 / turns_on as f64,
        pushed.skipped,
        pushed.failures,
        pushed.unreplicated,
        median * 100.0,
        mean_share * 100.0,
        reg_share * 100.0,
    );
    let json = json!({
        "host": host.json(),
        "density": density,
        "max_turns": max_turns,
        "pairs": pairs,
        "lag_ms": {"p50": p50, "p95": p95, "all": lags},
        "turn_lag_ms": {"p50": t50, "p95": t95, "all": turn_lags},
        "bytes_sent": pushed.sent,
        "bytes_skipped": pushed.skipped,
        "store_bytes": own,
        "turns": turns_on,
        "pushes": pushed.pushes,
        "failures": pushed.failures,
        "unreplicated": pushed.unreplicated,
        "exec_start_ms": {"off": exec_off, "on": exec_on},
        "exposed_share": {"per_pair": shares, "median": median, "mean": mean_share},
        "registry_idle": idle,
        "registry_cpu_s": reg_cpu,
        "registry_cpu_share": reg_share,
        "errors": {"off": errors_off, "on": errors_on},
    });
    drop(registry);
    BENCH.finish(
        &env.crab_home.join("bench"),
        "replication",
        host.unix_time,
        &json,
        &md,
    );
}

//! Off-node replication under load (issue 27): real agent trajectories replayed by N sandboxes
//! at once (default 16) under crab's policy twice, with `[replication]` off and on (a registry
//! on 127.0.0.1, Debian's `docker-registry`); prints the replication lag (a checkpoint durable
//! to pushed) p50/p95, the bytes pushed per turn against the bytes the checkpoints themselves
//! added to the stores (deduplication), and the delay exposed to the agent with replication on
//! against off (from the mean `Tasks.Exec`+`Start` time of its actions: the next action waits
//! for the last turn's checkpoint, never for a push). Asserts nothing.
//!
//! `make bench BENCHES=bench-replication` (BENCH_ARGS="--density 16 --max-turns 20"), or with
//! the private containerd up: `cargo run --release -p crab-integration --bin bench-replication`.
//! Output: `$CRAB_HOME/bench/replication-<unix time>.{json,md}` (and `replication-latest.*`).

use std::path::PathBuf;

use crab_integration::bench::{parse_counts, Bench, Host};
use crab_integration::registry::Registry;
use crab_integration::replay::{run_round, trajectory, Options, Policy, Round, RoundRecord};
use serde_json::json;

const BENCH: Bench = Bench::new("bench-replication");
const USAGE: &str = "usage: bench-replication [--density N] [--max-turns N]
  --density N    sandboxes at once, each replaying a real trajectory (default 16)
  --max-turns N  turns of each trajectory (default 20)
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

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let (mut density, mut max_turns) = (16usize, 20usize);
    parse_counts(
        BENCH.name,
        USAGE,
        &mut [("--density", &mut density), ("--max-turns", &mut max_turns)],
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
    let registry = Registry::start();
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
    };
    BENCH.progress(format!("replication off: {density} sandboxes"));
    let off = run_round(round, &selected, &opts(String::new())).await;
    BENCH.progress(format!(
        "replication on ({}): {density} sandboxes",
        registry.addr
    ));
    let on = run_round(
        round,
        &selected,
        &opts(format!(
            "replication.registry = \"{}/crab/bench\"\nreplication.insecure = true\n",
            registry.addr
        )),
    )
    .await;
    let mut lags: Vec<f64> = Vec::new();
    let (mut sent, mut skipped, mut pushes, mut failures, mut unreplicated) = (0u64, 0, 0, 0, 0);
    for s in &on.sandboxes {
        match &s.replication {
            Some(st) => {
                lags.extend(
                    st["lags_ms"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|v| v.as_f64()),
                );
                sent += st["bytes_sent"].as_u64().unwrap_or(0);
                skipped += st["bytes_skipped"].as_u64().unwrap_or(0);
                pushes += st["pushes"].as_u64().unwrap_or(0);
                failures += st["failures"].as_u64().unwrap_or(0);
            }
            None => unreplicated += 1,
        }
    }
    let own: u64 = on
        .sandboxes
        .iter()
        .map(|s| s.store_bytes.values().sum::<u64>())
        .sum();
    let turns_on = turns(&on).max(1);
    let (p50, p95) = (percentile(&mut lags, 0.5), percentile(&mut lags, 0.95));
    let (exec_off, exec_on) = (mean_exec_ms(&off), mean_exec_ms(&on));
    let replay_off: f64 = off.sandboxes.iter().map(|s| s.replay_s).sum();
    let exposed_share = (exec_on - exec_off) * turns_on as f64 / 1e3 / replay_off.max(1e-9);
    let md = format!(
        "# bench-replication\n\n\
         {} CPUs, kernel {}, load {}; {density} sandboxes at once, {} trajectories, at most \
         {max_turns} turns each, crab's policy; registry on 127.0.0.1\n\n\
         | figure | value |\n|---|---|\n\
         | replication lag p50 / p95 (durable to pushed) | {p50:.0} / {p95:.0} ms ({} pushes) |\n\
         | bytes pushed per turn | {:.0} |\n\
         | bytes the checkpoints added to the stores per turn | {:.0} |\n\
         | bytes not sent again (already in the registry) | {skipped} |\n\
         | failed push attempts | {failures} |\n\
         | sandboxes never replicated | {unreplicated} |\n\
         | mean action start, replication off / on | {exec_off:.1} / {exec_on:.1} ms |\n\
         | exposed delay on vs off, share of the replay time | {:+.2}% |\n\
         | errors (off / on) | {} / {} |\n",
        host.cpus,
        host.kernel,
        host.loadavg,
        selected.len(),
        lags.len().max(pushes as usize),
        sent as f64 / turns_on as f64,
        own as f64 / turns_on as f64,
        exposed_share * 100.0,
        errors(&off),
        errors(&on),
    );
    let json = json!({
        "host": host.json(),
        "density": density,
        "max_turns": max_turns,
        "lag_ms": {"p50": p50, "p95": p95, "all": lags},
        "bytes_sent": sent,
        "bytes_skipped": skipped,
        "store_bytes": own,
        "turns": turns_on,
        "pushes": pushes,
        "failures": failures,
        "unreplicated": unreplicated,
        "exec_start_ms": {"off": exec_off, "on": exec_on},
        "exposed_share": exposed_share,
        "errors": {"off": errors(&off), "on": errors(&on)},
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

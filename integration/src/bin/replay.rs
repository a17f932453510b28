//! Trajectory replayer (issue 6): real mini-swe-agent trajectories replayed through containerd
//! and the crab shim under each checkpoint policy, at several densities; prints figures and
//! the inspector's accuracy, asserts nothing. How a replay runs: `crab_integration::replay`.
//!
//! `make replay` (REPLAY_ARGS="...") or, with the private containerd up and the images
//! imported (`make build containerd-up images`, then `eval "$(hack/containerd.sh env)"`):
//! `cargo run --release -p crab-integration --bin replay -- [options]`
//!
//! Output: tables on stdout; `$CRAB_HOME/bench/replay-<unix time>.{json,md}` and
//! `replay-latest.{json,md}` (the JSON has every turn of every sandbox).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crab_integration::bench::{Bench, Host};

const BENCH: Bench = Bench::new("replay");

use crab_integration::replay::recovery::{self, RecoveryOptions, RecoveryPolicy};
use crab_integration::replay::{
    self, density, report, trajectory, Options, Policy, Round, RoundRecord,
};
use crab_integration::sandbox::AGENT_IMAGE;
use crab_integration::Harness;
use serde_json::json;

const USAGE: &str = "usage: replay [options]
  --trajectories PATH   a trajectories .jsonl, or a directory with *mini-swe-agent*.jsonl
                        (default: $CRAB_TRAJECTORIES, else ../shared/trajectories next to the repo)
  --select A,B,...      trials to replay: full names, parts of names, or `all`
                        (default: a representative set of 4, see replay::trajectory)
  --densities 1,4,...   sandboxes at once (default 1,4; the issue's set is 1,4,8,16); the
                        accuracy pass runs the largest at once
  --policies a,b,...    of none, fs-every-turn, full-every-turn, crab (default: all; none is
                        the baseline of the relative figures and is always run)
  --think-scale X       recorded think time multiplier (default 0.05)
  --timeout S           command timeout in seconds (default 30, as the agent's harness)
  --max-turns N         replay at most N turns of each trajectory
  --no-oracle           skip the inspector-accuracy pass
  --sandbox-config TOML more crab config for every sandbox (root-level dotted keys, e.g.
                        'restore.lazy_pages_min_mib = 1': every process restore lazy)
  --prelude CMD         run CMD in every sandbox before its trajectory (the first turn covers
                        it), e.g. 'nohup python3 -m http.server 8000 >/dev/null 2>&1 &': an
                        idle server beside the agent's commands
  --no-idle-memory      skip the idle shim memory pass (N idle sandboxes under crab, then under
                        containerd's runc shim, N = the largest density)
  --project N,...       project crab's measured costs to N sandboxes (default 64,256,1000)
  --accuracy-only       only the inspector-accuracy pass (no policy rounds)
  --recovery            recovery correctness instead (see replay::recovery): per trajectory two
                        fault-free runs, then per policy (chat-only, fs-every-turn,
                        full-every-turn, crab; --policies picks) crashes after K turns spread
                        over it, recovery, the rest, and the state digest compared; default
                        selection: replay::recovery::DEFAULT_SELECTION
  --crash-turns K       crash points per trajectory and policy (default 3)
  --jobs N              recovery: sandboxes at once (default 4)";

/// `v` as a positive integer, or exit naming `flag`.
fn positive(flag: &str, v: &str) -> usize {
    v.parse()
        .ok()
        .filter(|n| *n > 0)
        .unwrap_or_else(|| BENCH.die(format!("{flag}: {v:?} is not a positive integer")))
}

struct Args {
    trajectories: PathBuf,
    select: Vec<String>,
    densities: Vec<usize>,
    policies: Vec<Policy>,
    opts: Options,
    oracle: bool,
    rounds: bool,
    recovery: bool,
    select_given: bool,
    policies_given: Option<Vec<String>>,
    crash_turns: usize,
    jobs: usize,
    idle_memory: bool,
    project: Vec<usize>,
}

fn args() -> Args {
    let default_path = std::env::var_os("CRAB_TRAJECTORIES")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/trajectories")
        });
    let mut a = Args {
        trajectories: default_path,
        select: trajectory::DEFAULT_SELECTION
            .iter()
            .map(|s| s.to_string())
            .collect(),
        densities: vec![1, 4],
        policies: Policy::ALL.to_vec(),
        opts: Options {
            think_scale: 0.05,
            cmd_timeout: Duration::from_secs(30),
            max_turns: None,
            sandbox_config: String::new(),
            prelude: None,
        },
        oracle: true,
        rounds: true,
        recovery: false,
        select_given: false,
        policies_given: None,
        crash_turns: recovery::DEFAULT_CRASH_TURNS,
        jobs: 4,
        idle_memory: true,
        project: vec![64, 256, 1000],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| BENCH.die(format!("{flag} needs a value")))
        };
        let list = |v: String| -> Vec<String> {
            v.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        };
        match flag.as_str() {
            "--trajectories" => a.trajectories = PathBuf::from(value()),
            "--select" => {
                a.select = list(value());
                a.select_given = true;
            }
            "--densities" => {
                a.densities = list(value())
                    .iter()
                    .map(|d| positive("--densities", d))
                    .collect()
            }
            "--policies" => a.policies_given = Some(list(value())),
            "--recovery" => a.recovery = true,
            "--crash-turns" => a.crash_turns = positive("--crash-turns", &value()),
            "--jobs" => a.jobs = positive("--jobs", &value()),
            "--think-scale" => {
                let v = value();
                a.opts.think_scale = v
                    .parse()
                    .ok()
                    .filter(|x: &f64| x.is_finite() && *x >= 0.0)
                    .unwrap_or_else(|| BENCH.die(format!("--think-scale: {v:?}")))
            }
            "--timeout" => {
                let v = value();
                a.opts.cmd_timeout = Duration::from_secs_f64(
                    v.parse()
                        .ok()
                        .filter(|x: &f64| *x > 0.0)
                        .unwrap_or_else(|| BENCH.die(format!("--timeout: {v:?}"))),
                )
            }
            "--max-turns" => {
                let v = value();
                a.opts.max_turns = Some(
                    v.parse()
                        .ok()
                        .filter(|n| *n > 0)
                        .unwrap_or_else(|| BENCH.die(format!("--max-turns: {v:?}"))),
                )
            }
            "--no-oracle" => a.oracle = false,
            "--sandbox-config" => a.opts.sandbox_config = value(),
            "--prelude" => a.opts.prelude = Some(value()),
            "--no-idle-memory" => a.idle_memory = false,
            "--project" => {
                a.project = list(value())
                    .iter()
                    .map(|d| positive("--project", d))
                    .collect()
            }
            "--accuracy-only" => a.rounds = false,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => BENCH.die(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if a.recovery && !a.select_given {
        a.select = recovery::DEFAULT_SELECTION
            .iter()
            .map(|s| s.to_string())
            .collect();
    }
    if let (Some(list), false) = (&a.policies_given, a.recovery) {
        a.policies = list
            .iter()
            .map(|p| {
                Policy::from_name(p)
                    .unwrap_or_else(|| BENCH.die(format!("--policies: unknown policy {p:?}")))
            })
            .collect();
    }
    if a.select.is_empty() || a.densities.is_empty() || !(a.rounds || a.oracle) {
        BENCH.die("nothing to replay");
    }
    // The relative figures need the baseline, first.
    a.policies.retain(|p| *p != Policy::None);
    a.policies.sort();
    a.policies.dedup();
    a.policies.insert(0, Policy::None);
    a
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let a = args();
    let mut all = trajectory::load(&a.trajectories)
        .unwrap_or_else(|e| BENCH.die(format!("{e} (set --trajectories or CRAB_TRAJECTORIES)")));
    if a.recovery {
        all.insert(0, recovery::synthetic());
    }
    let selected = trajectory::select(&all, &a.select).unwrap_or_else(|e| BENCH.die(e));
    let env = BENCH.crab_env("turns and checkpoints");
    let h = Harness::connect_env(env)
        .await
        .unwrap_or_else(|e| BENCH.die(e));
    for t in &selected {
        let turns = t.turns.len().min(a.opts.max_turns.unwrap_or(usize::MAX));
        eprintln!("replay: {} ({turns} turns)", t.trial);
    }
    if a.recovery {
        return recovery_main(&a, &h, &selected).await;
    }
    let load_before = crab_integration::bench::loadavg();
    let started = Instant::now();
    let mut rounds = Vec::new();
    let mut figures = Vec::new();
    for &density in a.densities.iter().filter(|_| a.rounds) {
        let mut baseline = None;
        for &policy in &a.policies {
            let round = Round {
                policy,
                density,
                oracle: false,
            };
            eprintln!("replay: round {} N={density} ...", policy.name());
            let r = replay::run_round(round, &selected, &a.opts).await;
            let f = report::figures(&r, baseline.as_ref());
            eprintln!(
                "replay: round {} N={density}: {} turns in {:.1} s, {} sandboxes failed",
                policy.name(),
                f.turns,
                r.wall_s,
                f.failed_sandboxes
            );
            if policy == Policy::None {
                baseline = Some(r.clone());
            }
            figures.push(f);
            rounds.push(r);
        }
    }
    let accuracy = if a.oracle {
        // As many at once as the largest density (every turn is judged the same way; the
        // pass's timings are not used).
        let density = selected
            .len()
            .min(a.densities.iter().copied().max().unwrap_or(1));
        eprintln!("replay: accuracy pass (crab, {density} sandboxes at once) ...");
        let round = Round {
            policy: Policy::Crab,
            density,
            oracle: true,
        };
        let r = replay::run_round(round, &selected, &a.opts).await;
        let acc = report::accuracy(&r);
        rounds.push(r);
        Some(acc)
    } else {
        None
    };
    let max_density = a.densities.iter().copied().max().unwrap_or(1);
    let idle = if a.idle_memory && a.rounds {
        eprintln!(
            "replay: idle shim memory ({max_density} sandboxes under crab, then under runc) ..."
        );
        let root = density::round_engine_root(&h.env, "idle");
        let r = density::idle_shims(max_density, &root).await;
        let _ = std::fs::remove_dir_all(&root);
        match r {
            Ok(m) => Some(m),
            Err(e) => {
                eprintln!("replay: idle shim memory: {e}");
                None
            }
        }
    } else {
        None
    };
    let projections: Vec<Projected> = a
        .densities
        .iter()
        .filter_map(|&d| projection(&a, &selected, &rounds, &figures, idle.as_ref(), d))
        .collect();
    let total = started.elapsed();
    let failures: Vec<String> = rounds
        .iter()
        .flat_map(|r| {
            r.sandboxes.iter().flat_map(move |s| {
                s.errors
                    .iter()
                    .map(move |e| format!("{} N={} {}: {e}", r.policy.name(), r.density, s.trial))
            })
        })
        .collect();

    let host = Host::now();
    let now = host.unix_time;
    let kernel = &host.kernel;
    let cpus = host.cpus;
    let load_after = &host.loadavg;
    let mut md = format!(
        "# Trajectory replay\n\nkernel {kernel}, {cpus} CPUs, unix time {now}, total {:.0} s, loadavg before {load_before} / after \
         {load_after}. Image {AGENT_IMAGE} through the private containerd and the crab shim. Think time x{}, command timeout \
         {:?}{}. Trajectories ({}): {}.\n\n",
        total.as_secs_f64(),
        a.opts.think_scale,
        a.opts.cmd_timeout,
        a.opts.max_turns.map(|m| format!(", at most {m} turns each")).unwrap_or_default(),
        selected.len(),
        selected.iter().map(|t| t.trial.as_str()).collect::<Vec<_>>().join(", ")
    );
    md.push_str(&report::markdown(&figures, accuracy.as_ref()));
    if let Some((crab, runc)) = &idle {
        let m = |s: &density::ShimMemory| match (&s.pss_kib_per_shim, &s.rss_kib_per_shim) {
            (Some(p), Some(r)) => format!(
                "{:.1} / {:.1} MiB ({} shims)",
                p.mean / 1024.0,
                r.mean / 1024.0,
                s.max_shims
            ),
            _ => "not measured".into(),
        };
        md.push_str(&format!(
            "\n## Idle shim memory, {max_density} sandboxes\n\nPer sandbox, PSS / RSS (kernel's smaps_rollup, mean of \
             samples over 3 s once all run): crab {}; containerd's runc shim {}.\n",
            m(crab),
            m(runc)
        ));
    }
    for p in &projections {
        md.push_str(&p.markdown());
    }
    if !failures.is_empty() {
        md.push_str(&format!("\n\n## Errors ({})\n\n", failures.len()));
        for f in failures.iter().take(30) {
            md.push_str(&format!("- {f}\n"));
        }
    }
    let result = json!({
        "benchmark": "replay",
        "unix_time": now,
        "total_s": total.as_secs_f64(),
        "host": {"kernel": kernel, "cpus": cpus, "loadavg_before": load_before, "loadavg_after": load_after},
        "image": AGENT_IMAGE,
        "options": {"think_scale": a.opts.think_scale, "cmd_timeout_s": a.opts.cmd_timeout.as_secs_f64(),
                    "max_turns": a.opts.max_turns, "densities": a.densities,
                    "policies": a.policies.iter().map(|p| p.name()).collect::<Vec<_>>(), "oracle": a.oracle},
        "trajectories": selected.iter().map(|t| json!({"trial": t.trial, "turns": t.turns.len()})).collect::<Vec<_>>(),
        "figures": figures,
        "accuracy": accuracy,
        "idle_shims": idle.as_ref().map(|(crab, runc)| json!({"crab": crab, "runc": runc})),
        "projections": projections,
        "errors": failures,
        "rounds": rounds,
    });
    BENCH.finish(&h.env.bench_dir(), "replay", now, &result, &md);
}

/// `--recovery`: recovery correctness (see `replay::recovery`).
async fn recovery_main(a: &Args, h: &Harness, selected: &[trajectory::Trajectory]) {
    let policies = match &a.policies_given {
        Some(list) => list
            .iter()
            .filter(|p| *p != "none")
            .map(|p| {
                RecoveryPolicy::from_name(p).unwrap_or_else(|| {
                    BENCH.die(format!("--policies: unknown recovery policy {p:?}"))
                })
            })
            .collect(),
        None => RecoveryPolicy::ALL.to_vec(),
    };
    let ro = RecoveryOptions {
        crash_turns: a.crash_turns,
        jobs: a.jobs,
        policies,
    };
    let load_before = crab_integration::bench::loadavg();
    let r = recovery::run(selected, &a.opts, &ro).await;
    let host = Host::now();
    let now = host.unix_time;
    let kernel = &host.kernel;
    let load_after = &host.loadavg;
    let mut md = format!(
        "# Recovery correctness\n\nkernel {kernel}, unix time {now}, total {:.0} s, {} sandboxes at once, loadavg before \
         {load_before} / after {load_after}. Image {AGENT_IMAGE}. Think time x{}, command timeout {:?}{}, {} crash points \
         per trajectory and policy. Trajectories ({}): {}.\n\n",
        r.wall_s,
        ro.jobs,
        a.opts.think_scale,
        a.opts.cmd_timeout,
        a.opts.max_turns.map(|m| format!(", at most {m} turns each")).unwrap_or_default(),
        ro.crash_turns,
        selected.len(),
        selected.iter().map(|t| t.trial.as_str()).collect::<Vec<_>>().join(", ")
    );
    md.push_str(&recovery::markdown(&r));
    let result = json!({
        "benchmark": "recovery",
        "unix_time": now,
        "host": {"kernel": kernel, "loadavg_before": load_before, "loadavg_after": load_after},
        "image": AGENT_IMAGE,
        "options": {"think_scale": a.opts.think_scale, "cmd_timeout_s": a.opts.cmd_timeout.as_secs_f64(),
                    "max_turns": a.opts.max_turns, "crash_turns": ro.crash_turns, "jobs": ro.jobs,
                    "policies": ro.policies.iter().map(|p| p.name()).collect::<Vec<_>>()},
        "trajectories": selected.iter().map(|t| json!({"trial": t.trial, "turns": t.turns.len()})).collect::<Vec<_>>(),
        "report": r,
    });
    BENCH.finish(&h.env.bench_dir(), "recovery", now, &result, &md);
}

/// The projection of crab's costs at the largest density to more sandboxes.
#[derive(serde::Serialize)]
struct Projected {
    density: usize,
    costs: density::Costs,
    rows: Vec<density::Projection>,
}

impl Projected {
    fn markdown(&self) -> String {
        let c = &self.costs;
        let mut md = format!(
            "\n## Projection (M/M/c model of the engine's slots, costs measured at N={})\n\n\
             A sandbox ends a turn every {:.1} s at the recorded think times (mean think plus the measured command time); \
             {:.2} checkpoint jobs per turn; a job holds its slot {:.0} ms on average and writes {:.2} MB; crab's shim \
             takes {:.1} MiB (PSS) per sandbox. `wait` is the mean wait for a slot (Erlang C); `of a turn` is that wait \
             over the turn interval, the most a turn could be held (a wait only shows when it outlasts the agent's next \
             think).\n\n| sandboxes | slots | jobs/s | utilisation | P(wait) | wait ms | of a turn | writes MB/s | shim memory GiB |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            self.density,
            c.turn_interval_s,
            c.jobs_per_turn,
            c.job_s * 1e3,
            c.bytes_per_job / 1e6,
            c.shim_pss_kib / 1024.0
        );
        for p in &self.rows {
            md.push_str(&format!(
                "| {} | {} | {:.2} | {:.2} | {:.3} | {:.1} | {:.3}% | {:.2} | {:.2} |\n",
                p.sandboxes,
                p.slots,
                p.jobs_per_s,
                p.utilisation,
                p.p_wait,
                p.mean_wait_ms,
                p.wait_share_of_turn * 100.0,
                p.write_mb_s,
                p.shim_memory_gib
            ));
        }
        md
    }
}

/// crab's costs from its round at `density`, projected to `--project` sandboxes with the
/// default slot count and a few more. Each density's own: a job's time on a busy host includes
/// the CPU it waited for, so the smallest density's is closest to a host sized for its load.
fn projection(
    a: &Args,
    selected: &[trajectory::Trajectory],
    rounds: &[RoundRecord],
    figures: &[report::Figures],
    idle: Option<&(density::ShimMemory, density::ShimMemory)>,
    density: usize,
) -> Option<Projected> {
    let r = rounds
        .iter()
        .find(|r| r.policy == Policy::Crab && !r.oracle && r.density == density)?;
    let f = figures
        .iter()
        .find(|f| f.policy == Policy::Crab && f.density == r.density)?;
    let engine = r.engine.as_ref()?;
    let turns: Vec<&trajectory::Turn> = selected
        .iter()
        .flat_map(|t| t.turns.iter().take(a.opts.max_turns.unwrap_or(usize::MAX)))
        .collect();
    let think_s =
        turns.iter().map(|t| t.think.as_secs_f64()).sum::<f64>() / turns.len().max(1) as f64;
    let run_s = f.commands_s / f.turns.max(1) as f64;
    let shim_pss_kib = idle
        .and_then(|(crab, _)| crab.pss_kib_per_shim)
        .or(f.shim_pss_kib)
        .map(|s| s.mean)
        .unwrap_or(f64::NAN);
    let costs = density::Costs {
        turn_interval_s: think_s + run_s,
        jobs_per_turn: engine.jobs as f64 / f.turns.max(1) as f64,
        job_s: if engine.run_ms_mean.is_finite() {
            engine.run_ms_mean / 1e3
        } else {
            0.0
        },
        bytes_per_job: if engine.jobs == 0 {
            0.0
        } else {
            engine.bytes as f64 / engine.jobs as f64
        },
        shim_pss_kib,
    };
    let default_slots = crab_runtime_config::Config::default().engine.max_jobs;
    let mut rows = Vec::new();
    for &n in &a.project {
        for slots in [default_slots, 8, 32] {
            rows.push(density::project(&costs, n, slots));
        }
    }
    Some(Projected {
        density: r.density,
        costs,
        rows,
    })
}

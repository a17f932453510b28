//! Shim overhead benchmark: crab vs the stock runc shim, through containerd's gRPC API (no ctr
//! process spawn in the measured path).
//!
//! Per runtime and iteration (runtimes interleaved, their order alternating each iteration):
//!   run    Tasks.Create -> Start -> Wait of a container running `true` (shim start included)
//!   delete Tasks.Delete of that exited task (shim teardown)
//!   exec   Exec -> Start -> Wait -> DeleteProcess of `true` in a running container
//!
//! Prints min/p50/p95 per runtime and the crab/runc ratio, and writes
//! `$CRAB_HOME/bench/shim-<unix time>.{json,md}` (plus `shim-latest.{json,md}`).
//!
//! Environment: CRAB_BENCH_ITERATIONS (default 20), CRAB_BENCH_RUNTIMES (comma-separated,
//! default `io.containerd.crab.v1,io.containerd.runc.v2`), plus the usual CRAB_* variables.
//! `--iterations N` overrides the iteration count.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crab_integration::bench::stats::{ms, Summary};
use crab_integration::bench::{Bench, Host};

use crab_integration::harness::STEP_TIMEOUT;
use crab_integration::{CleanupGuard, Harness, ProcessSpec};
use serde_json::json;

const METRICS: [&str; 3] = ["run", "delete", "exec"];
const CRAB: &str = "io.containerd.crab.v1";
const RUNC: &str = "io.containerd.runc.v2";

type Samples = BTreeMap<&'static str, Vec<Duration>>;

const BENCH: Bench = Bench::new("bench-shim");

fn iterations() -> usize {
    let mut args = std::env::args().skip(1);
    let mut n = std::env::var("CRAB_BENCH_ITERATIONS").ok();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--iterations" | "-n" => n = args.next(),
            "-h" | "--help" => {
                eprintln!("usage: bench-shim [--iterations N]   (env: CRAB_BENCH_ITERATIONS, CRAB_BENCH_RUNTIMES)");
                std::process::exit(0);
            }
            other => BENCH.die(format!("unknown argument {other:?} (see --help)")),
        }
    }
    match n {
        None => 20,
        Some(s) => s.parse().ok().filter(|n| *n > 0).unwrap_or_else(|| {
            BENCH.die(format!("iterations must be a positive integer, got {s:?}"))
        }),
    }
}

/// One create->start->exit of `true`, then its delete.
async fn run_once(h: &Harness, id: &str) -> crab_integration::Result<(Duration, Duration)> {
    h.create_container(id, &ProcessSpec::new(&["true"])).await?;
    let t0 = Instant::now();
    h.create_task(id, None).await?;
    h.start(id, "").await?;
    let status = h.wait(id, "", STEP_TIMEOUT).await?;
    let run = t0.elapsed();
    let t1 = Instant::now();
    h.delete_task(id).await?;
    let delete = t1.elapsed();
    h.delete_container(id).await?;
    if status != 0 {
        return Err(crab_integration::Error::Protocol(format!(
            "`true` exited {status}"
        )));
    }
    Ok((run, delete))
}

/// One exec round-trip of `true` in the running container `id`.
async fn exec_once(h: &Harness, id: &str, exec_id: &str) -> crab_integration::Result<Duration> {
    let io = h.stdio(id, exec_id, Default::default())?;
    let t0 = Instant::now();
    h.exec(id, exec_id, &ProcessSpec::new(&["true"]), &io)
        .await?;
    h.start(id, exec_id).await?;
    let status = h.wait(id, exec_id, STEP_TIMEOUT).await?;
    h.delete_process(id, exec_id).await?;
    let d = t0.elapsed();
    if status != 0 {
        return Err(crab_integration::Error::Protocol(format!(
            "exec `true` exited {status}"
        )));
    }
    Ok(d)
}

fn short(runtime: &str) -> String {
    runtime
        .trim_start_matches("io.containerd.")
        .replace('.', "-")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n = iterations();
    let runtimes: Vec<String> = std::env::var("CRAB_BENCH_RUNTIMES")
        .ok()
        .filter(|s| !s.is_empty())
        .map(|s| s.split(',').map(|r| r.trim().to_string()).collect())
        .unwrap_or_else(|| vec![CRAB.into(), RUNC.into()]);
    let base = Harness::connect().await.unwrap_or_else(|e| BENCH.die(e));
    // measure() owns the cleanup guard, so its containers are gone by the time we exit.
    match measure(&base, &runtimes, n).await {
        Ok(samples) => report(n, &runtimes, &samples, &base),
        Err(e) => BENCH.die(e),
    }
}

async fn measure(base: &Harness, runtimes: &[String], n: usize) -> Result<Vec<Samples>, String> {
    let pid = std::process::id();
    let harnesses: Vec<Harness> = runtimes.iter().map(|r| base.with_runtime(r)).collect();

    // One long-lived container per runtime for the exec round-trips.
    let sleepers: Vec<String> = runtimes
        .iter()
        .map(|r| format!("bench-{}-exec-{pid}", short(r)))
        .collect();
    let mut guard: CleanupGuard =
        base.guard(&sleepers.iter().map(String::as_str).collect::<Vec<_>>());
    for (h, id) in harnesses.iter().zip(&sleepers) {
        h.start_detached(id, &ProcessSpec::new(&["sleep", "100000"]))
            .await
            .map_err(|e| {
                format!(
                    "runtime {} cannot start a container: {e}\n(for the crab runtime: `make build` \
                     links the shim into $CRAB_HOME/bin)\n{}",
                    h.runtime(),
                    h.log_excerpt(id)
                )
            })?;
    }

    let mut samples: Vec<Samples> = runtimes.iter().map(|_| Samples::new()).collect();
    eprintln!(
        "bench-shim: {n} iterations (+1 warm-up) x {} runtimes",
        runtimes.len()
    );
    for iter in 0..=n {
        let mut order: Vec<usize> = (0..runtimes.len()).collect();
        if iter % 2 == 1 {
            order.reverse();
        }
        for r in order {
            let h = &harnesses[r];
            let id = format!("bench-{}-{pid}-{iter}", short(&runtimes[r]));
            guard.add(&id);
            let (run, delete) = run_once(h, &id)
                .await
                .map_err(|e| format!("{}: run {id}: {e}\n{}", runtimes[r], h.log_excerpt(&id)))?;
            let exec = exec_once(h, &sleepers[r], &format!("x{iter}"))
                .await
                .map_err(|e| format!("{}: exec in {}: {e}", runtimes[r], sleepers[r]))?;
            if iter == 0 {
                continue; // warm-up
            }
            let s = &mut samples[r];
            s.entry("run").or_default().push(run);
            s.entry("delete").or_default().push(delete);
            s.entry("exec").or_default().push(exec);
        }
    }
    for (h, id) in harnesses.iter().zip(&sleepers) {
        if let Err(e) = h.kill_and_remove(id).await {
            eprintln!("bench-shim: removing {id}: {e}");
        }
    }
    Ok(samples)
}

fn report(n: usize, runtimes: &[String], samples: &[Samples], h: &Harness) {
    let host = Host::now();
    let now = host.unix_time;
    let kernel = &host.kernel;
    let cpus = host.cpus;

    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Shim benchmark\n\n{n} iterations per runtime (after 1 warm-up), runtimes interleaved; \
         kernel {kernel}, {cpus} CPUs, unix time {now}.\n\n\
         - run: Tasks.Create -> Start -> Wait of `true`\n\
         - delete: Tasks.Delete of the exited task\n\
         - exec: Exec -> Start -> Wait -> DeleteProcess of `true` in a running container\n\n\
         | metric | runtime | min ms | p50 ms | p95 ms | mean ms |\n|---|---|---:|---:|---:|---:|"
    );
    let mut by_runtime = serde_json::Map::new();
    let mut table: BTreeMap<(&str, &str), Summary> = BTreeMap::new();
    for metric in METRICS {
        for (r, rt) in runtimes.iter().enumerate() {
            let s = Summary::of_durations(&samples[r][metric]);
            let _ = writeln!(
                md,
                "| {metric} | {rt} | {:.2} | {:.2} | {:.2} | {:.2} |",
                s.min, s.p50, s.p95, s.mean
            );
            let entry = by_runtime.entry(rt.clone()).or_insert_with(|| json!({}));
            entry[metric] = json!({
                "min_ms": s.min, "p50_ms": s.p50, "p95_ms": s.p95, "mean_ms": s.mean,
                "samples_ms": samples[r][metric].iter().copied().map(ms).collect::<Vec<_>>(),
            });
            table.insert((metric, rt.as_str()), s);
        }
    }
    let mut ratios = serde_json::Map::new();
    if runtimes.iter().any(|r| r == CRAB) && runtimes.iter().any(|r| r == RUNC) {
        let _ = writeln!(
            md,
            "\n| metric | crab/runc min | crab/runc p50 | crab/runc p95 |\n|---|---:|---:|---:|"
        );
        for metric in METRICS {
            let (c, r) = (&table[&(metric, CRAB)], &table[&(metric, RUNC)]);
            let (min, p50, p95) = (c.min / r.min, c.p50 / r.p50, c.p95 / r.p95);
            let _ = writeln!(md, "| {metric} | {min:.2} | {p50:.2} | {p95:.2} |");
            ratios.insert(metric.into(), json!({"min": min, "p50": p50, "p95": p95}));
        }
    }
    let result = json!({
        "benchmark": "shim",
        "unix_time": now,
        "iterations": n,
        "warmup_iterations": 1,
        "host": {"kernel": kernel, "cpus": cpus},
        "containerd_address": h.env.address,
        "image": h.env.image,
        "runtimes": by_runtime,
        "ratio_crab_over_runc": ratios,
    });

    BENCH.finish(&h.env.bench_dir(), "shim", now, &result, &md);
}

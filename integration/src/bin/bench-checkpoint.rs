//! Checkpoint benchmark (issue 4): prints figures, asserts nothing.
//!
//! Everything goes through the private containerd and the crab shim, with agent sandboxes
//! (`localhost/crab/agent:latest`, `sleep infinity` as init, turns run as `bash -c` execs in
//! /app, a turn ends with `Tasks.Update` carrying the `io.crab/turn-end` annotation; the shim
//! checkpoints in the background and publishes `<state_dir>/<ns>/<id>/checkpoints/<seq>.json`).
//!
//! 1. fs checkpoint latency and freeze time versus changed bytes: each turn writes 1 KB /
//!    100 KB / 1 MB / 10 MB / 100 MB of random bytes to one file (sizes interleaved per round).
//!    Per turn: the manifest's `timings` {freeze_ms, capture_ms, total_ms}, the time from the
//!    turn-end `Tasks.Update` returning until the manifest is published (polled every ms), and
//!    the layer blob's size.
//! 2. proc checkpoint latency versus resident size, once per dump driver (`[checkpoint]
//!    process_dump`: `criu`, crab driving CRIU's RPC, and `runc`, `runc checkpoint`): a python3
//!    process holding a random bytearray of 10 / 50 / 100 / 500 MB (started with nohup in a
//!    turn), then turns that poke
//!    it through a FIFO (it flips a byte: memory changed, so a proc turn) — `total_ms`, the
//!    publish delay, and the image's `bytes_stored` / `bytes_logical`; and where the time goes:
//!    the phases the shim records in the manifest's `timings.process` (trap check, the dump and
//!    CRIU's own part of it with its freezing/frozen/memdump/memwrite figures, image
//!    verification, page dedup, sync).
//! 3. Page deduplication: a 100 MB holder, then 10 turns that each write one byte in 1% of its
//!    pages (a different 1% each turn): per checkpoint `bytes_stored` (after dedup) versus
//!    `bytes_logical` (the image as CRIU wrote it, i.e. what storing without dedup costs), and
//!    the ratio to the first, full image.
//!
//! Output: a table on stdout; `$CRAB_HOME/bench/checkpoint-<unix time>.{json,md}` and
//! `checkpoint-latest.{json,md}`.
//!
//! `cargo run --release -p crab-integration --bin bench-checkpoint [-- --fs-turns N
//! --proc-turns N --dedup-turns N]` with the private containerd up and the images imported
//! (`make build containerd-up images`, then `eval "$(hack/containerd.sh env)"`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crab_integration::bench::sandbox::{
    holder_script, kinds_str, poke, AgentSandbox, Fill, Published, Res,
};
use crab_integration::bench::stats::Summary;
use crab_integration::bench::{Bench, Host};
use crab_integration::env::DEFAULT_RUNTIME;
use crab_integration::{CleanupGuard, Harness};
use serde_json::{json, Value};

const BENCH: Bench = Bench::new("bench-checkpoint");

const AGENT_IMAGE: &str = "localhost/crab/agent:latest";
const T: Duration = Duration::from_secs(180);

const FS_SIZES: [(&str, usize); 5] = [
    ("1 KB", 1 << 10),
    ("100 KB", 100 << 10),
    ("1 MB", 1 << 20),
    ("10 MB", 10 << 20),
    ("100 MB", 100 << 20),
];
const PROC_MBS: [usize; 4] = [10, 50, 100, 500];
/// How process images are dumped (`[checkpoint] process_dump`): both, side by side.
/// `criu-netns` is `criu` with `[checkpoint] network_namespace = "always"`: the container's
/// network namespace dumped though it cannot have changed (the baseline of leaving it out).
const DRIVERS: [&str; 3] = ["criu", "criu-netns", "runc"];
const DEDUP_MB: usize = 100;

struct Opts {
    fs_turns: usize,
    proc_turns: usize,
    dedup_turns: usize,
}

fn opts() -> Opts {
    let (mut fs_turns, mut proc_turns, mut dedup_turns) = (5, 3, 10);
    crab_integration::bench::parse_counts(
        "bench-checkpoint",
        "[--fs-turns N (5)] [--proc-turns N (3)] [--dedup-turns N (10)]",
        &mut [
            ("--fs-turns", &mut fs_turns),
            ("--proc-turns", &mut proc_turns),
            ("--dedup-turns", &mut dedup_turns),
        ],
    );
    Opts {
        fs_turns,
        proc_turns,
        dedup_turns,
    }
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn mib(b: f64) -> f64 {
    b / 1048576.0
}

#[derive(Default)]
struct Series {
    total_ms: Vec<f64>,
    freeze_ms: Vec<f64>,
    capture_ms: Vec<f64>,
    publish_ms: Vec<f64>,
    layer_bytes: Vec<f64>,
    stored: Vec<f64>,
    logical: Vec<f64>,
    kinds: HashMap<String, usize>,
    /// The process image's phases (`timings.process`), by name, in [`PHASES`] order.
    phases: Vec<Vec<f64>>,
    drivers: HashMap<String, usize>,
}

/// The phases of a process checkpoint the shim records in `timings.process`, with the report's
/// column names. `around CRIU` (dump minus CRIU's own run) and `rest` (total minus the
/// phases: the job around the process image) are derived.
const PHASES: [(&str, &str); 12] = [
    ("freeze_ms", "freeze"),
    ("check_ms", "trap check"),
    ("dump_ms", "dump"),
    ("criu_ms", "CRIU own"),
    ("freezing_ms", "freezing"),
    ("frozen_ms", "frozen"),
    ("memdump_ms", "memdump"),
    ("memwrite_ms", "memwrite"),
    ("thaw_ms", "thaw"),
    ("verify_ms", "verify"),
    ("dedup_ms", "dedup"),
    ("sync_ms", "sync"),
];

impl Series {
    fn add(&mut self, t: &Published) {
        let m = &t.manifest;
        self.total_ms.push(f(&m["timings"]["total_ms"]));
        self.freeze_ms.push(f(&m["timings"]["freeze_ms"]));
        self.capture_ms.push(f(&m["timings"]["capture_ms"]));
        self.publish_ms.push(t.publish_ms);
        if let Some(l) = m["fs_layers"].as_array().and_then(|l| l.last()) {
            self.layer_bytes.push(f(&l["size"]));
        }
        self.stored.push(f(&m["process"]["bytes_stored"]));
        self.logical.push(f(&m["process"]["bytes_logical"]));
        *self
            .kinds
            .entry(m["kind"].as_str().unwrap_or("?").to_string())
            .or_default() += 1;
        let p = &m["timings"]["process"];
        if p.is_object() {
            self.phases.resize(PHASES.len(), Vec::new());
            for (i, (key, _)) in PHASES.iter().enumerate() {
                self.phases[i].push(f(&p[key]));
            }
            *self
                .drivers
                .entry(p["driver"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
        }
    }

    /// The p50 of phase `key` (NaN when not recorded).
    fn phase_p50(&self, key: &str) -> f64 {
        PHASES
            .iter()
            .position(|(k, _)| *k == key)
            .and_then(|i| self.phases.get(i))
            .map_or(f64::NAN, |v| Summary::of(v).p50)
    }

    /// Per checkpoint: dump minus CRIU's own run, and total minus the phases.
    fn derived(&self) -> (Vec<f64>, Vec<f64>) {
        let at = |key: &str| {
            PHASES
                .iter()
                .position(|(k, _)| *k == key)
                .and_then(|i| self.phases.get(i))
        };
        let (Some(dump), Some(criu)) = (at("dump_ms"), at("criu_ms")) else {
            return (Vec::new(), Vec::new());
        };
        let around = dump.iter().zip(criu).map(|(d, c)| d - c).collect();
        let summed = [
            "freeze_ms",
            "check_ms",
            "dump_ms",
            "thaw_ms",
            "verify_ms",
            "dedup_ms",
            "sync_ms",
        ];
        let rest = (0..self.total_ms.len())
            .map(|n| {
                let phases: f64 = summed
                    .iter()
                    .filter_map(|k| at(k).and_then(|v| v.get(n)))
                    .sum();
                self.total_ms[n] - phases
            })
            .collect();
        (around, rest)
    }

    fn json(&self) -> Value {
        json!({
            "total_ms": Summary::json(&self.total_ms),
            "freeze_ms": Summary::json(&self.freeze_ms),
            "capture_ms": Summary::json(&self.capture_ms),
            "publish_after_update_ms": Summary::json(&self.publish_ms),
            "layer_bytes": self.layer_bytes,
            "process_bytes_stored": self.stored,
            "process_bytes_logical": self.logical,
            "kinds": self.kinds,
            "process_phases_ms": self.phases_json(),
        })
    }

    fn phases_json(&self) -> Value {
        if self.phases.is_empty() {
            return Value::Null;
        }
        let mut out = serde_json::Map::new();
        for ((key, _), v) in PHASES.iter().zip(&self.phases) {
            out.insert((*key).into(), Summary::json(v));
        }
        let (around, rest) = self.derived();
        out.insert("around_criu_ms".into(), Summary::json(&around));
        out.insert("rest_of_job_ms".into(), Summary::json(&rest));
        out.insert("drivers".into(), json!(self.drivers));
        Value::Object(out)
    }
}

// ---------------------------------------------------------------------------------------------
// 1. fs checkpoints

async fn bench_fs(
    base: &Harness,
    pid: u32,
    o: &Opts,
    guard: &mut CleanupGuard,
) -> Res<Vec<Series>> {
    let id = format!("bench-checkpoint-{pid}-fs");
    guard.add(&id);
    let mut sb = AgentSandbox::start(base, DEFAULT_RUNTIME, id, T).await?;
    let res = async {
        BENCH.progress(format!(
            "1/3 fs: {} turns per size (+1 warm-up), sizes interleaved",
            o.fs_turns
        ));
        // Warm-up: the store's first checkpoint, caches, the random source.
        sb.run("head -c 1024 /dev/urandom > /app/warm.bin").await?;
        sb.end_turn_checkpointed().await?;
        let mut out: Vec<Series> = FS_SIZES.iter().map(|_| Series::default()).collect();
        for _ in 0..o.fs_turns {
            for (i, (_, bytes)) in FS_SIZES.iter().enumerate() {
                sb.run(&format!(
                    "head -c {bytes} /dev/urandom > /app/changed-{bytes}.bin"
                ))
                .await?;
                out[i].add(&sb.end_turn_checkpointed().await?);
            }
        }
        Ok::<_, String>(out)
    }
    .await;
    sb.remove(&BENCH).await;
    res
}

// ---------------------------------------------------------------------------------------------
// 2./3. proc checkpoints

async fn bench_proc(
    base: &Harness,
    pid: u32,
    o: &Opts,
    guard: &mut CleanupGuard,
) -> Res<Vec<(usize, &'static str, Series, Published)>> {
    let mut out = Vec::new();
    for mb in PROC_MBS {
        for driver in DRIVERS {
            out.push(proc_one(base, pid, o, guard, mb, driver).await?);
        }
    }
    Ok(out)
}

async fn proc_one(
    base: &Harness,
    pid: u32,
    o: &Opts,
    guard: &mut CleanupGuard,
    mb: usize,
    driver: &'static str,
) -> Res<(usize, &'static str, Series, Published)> {
    {
        BENCH.progress(format!(
            "2/3 proc: {mb} MB holder, dumped by {driver}, {} poke turns after its start turn",
            o.proc_turns
        ));
        let id = format!("bench-checkpoint-{pid}-proc{mb}-{driver}");
        guard.add(&id);
        let config = match driver {
            "criu-netns" => {
                "[checkpoint]\nprocess_dump = \"criu\"\nnetwork_namespace = \"always\"\n"
                    .to_string()
            }
            d => format!("[checkpoint]\nprocess_dump = \"{d}\"\n"),
        };
        let mut sb = AgentSandbox::start_with(base, DEFAULT_RUNTIME, id, T, &config).await?;
        let res = async {
            sb.run(&holder_script(mb, Fill::Random)).await?;
            let first = sb.end_turn_checkpointed().await?;
            let mut s = Series::default();
            for _ in 0..o.proc_turns {
                sb.run(&poke("b[0] ^= 1")).await?;
                s.add(&sb.end_turn_checkpointed().await?);
            }
            Ok::<_, String>((mb, driver, s, first))
        }
        .await;
        sb.remove(&BENCH).await;
        res
    }
}

struct Dedup {
    first: Published,
    turns: Vec<Published>,
}

async fn bench_dedup(base: &Harness, pid: u32, o: &Opts, guard: &mut CleanupGuard) -> Res<Dedup> {
    BENCH.progress(format!(
        "3/3 dedup: {DEDUP_MB} MB holder, {} turns changing 1% of its pages",
        o.dedup_turns
    ));
    let id = format!("bench-checkpoint-{pid}-dedup");
    guard.add(&id);
    let mut sb = AgentSandbox::start(base, DEFAULT_RUNTIME, id, T).await?;
    let res = async {
        sb.run(&holder_script(DEDUP_MB, Fill::Random)).await?;
        let first = sb.end_turn_checkpointed().await?;
        let mut turns = Vec::new();
        for t in 0..o.dedup_turns {
            // One byte in every 100th page, a different page of each hundred per turn: 1%.
            let code = format!(
                "for i in range({} * 4096, len(b), 100 * 4096): b[i] ^= 1",
                t % 100
            );
            sb.run(&poke(&code)).await?;
            turns.push(sb.end_turn_checkpointed().await?);
        }
        Ok::<_, String>(Dedup { first, turns })
    }
    .await;
    sb.remove(&BENCH).await;
    res
}

// ---------------------------------------------------------------------------------------------
// Report

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = opts();
    let env = BENCH.crab_env("checkpoints");
    let base = Harness::connect_env(env)
        .await
        .unwrap_or_else(|e| BENCH.die(e));
    let pid = std::process::id();
    let load_before = crab_integration::bench::loadavg();
    let started = Instant::now();
    let mut guard = base.guard(&[]);
    let res = async {
        let fs = bench_fs(&base, pid, &o, &mut guard).await?;
        let proc = bench_proc(&base, pid, &o, &mut guard).await?;
        let dedup = bench_dedup(&base, pid, &o, &mut guard).await?;
        Ok::<_, String>((fs, proc, dedup))
    }
    .await;
    // Before any exit: die() does not run destructors.
    drop(guard);
    BENCH.remove_state_dirs(&base.env.crab_home.join("state"), pid);
    let (fs, proc, dedup) = res.unwrap_or_else(|e| BENCH.die(e));
    report(
        &base,
        &o,
        &fs,
        &proc,
        &dedup,
        started.elapsed(),
        &load_before,
    );
}

fn report(
    h: &Harness,
    o: &Opts,
    fs: &[Series],
    proc: &[(usize, &str, Series, Published)],
    dedup: &Dedup,
    total: Duration,
    load_before: &str,
) {
    let host = Host::now();
    let (now, kernel, cpus, load_after) = (host.unix_time, &host.kernel, host.cpus, &host.loadavg);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Checkpoint benchmark\n\nkernel {kernel}, {cpus} CPUs, unix time {now}, total {:.0} s, loadavg before \
         {load_before} / after {load_after}. Image {AGENT_IMAGE}, runtime io.containerd.crab.v1 through the private \
         containerd. Figures only: the aims are the issue's, not checked here. `total` = the manifest's \
         `timings.total_ms` (the shim's checkpoint job); `publish` = from the turn-end `Tasks.Update` returning \
         until the manifest file appeared (polled every 1 ms).\n",
        total.as_secs_f64()
    );

    // 1.
    let _ = writeln!(
        md,
        "## 1. fs checkpoint versus changed bytes ({} turns per size after 1 warm-up; random bytes to one file per turn)\n\n\
         | changed | total p50 ms | total max ms | freeze p50 ms | freeze max ms | capture p50 ms | publish p50 ms | layer p50 KiB | aim (total p50) | kinds |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
        o.fs_turns
    );
    let mut fs_json = serde_json::Map::new();
    for ((name, bytes), s) in FS_SIZES.iter().zip(fs) {
        let (t, fr, c, p, l) = (
            Summary::of(&s.total_ms),
            Summary::of(&s.freeze_ms),
            Summary::of(&s.capture_ms),
            Summary::of(&s.publish_ms),
            Summary::of(&s.layer_bytes),
        );
        let aim = if *bytes < 1 << 20 { "<= 10 ms" } else { "-" };
        let _ = writeln!(
            md,
            "| {name} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} | {:.1} | {:.0} | {aim} | {} |",
            t.p50,
            t.max,
            fr.p50,
            fr.max,
            c.p50,
            p.p50,
            l.p50 / 1024.0,
            kinds_str(&s.kinds)
        );
        let mut v = s.json();
        v["changed_bytes"] = json!(bytes);
        v["aim"] = json!(aim);
        fs_json.insert((*name).into(), v);
    }

    // 2.
    let _ = writeln!(
        md,
        "\n## 2. proc checkpoint versus resident size ({} turns per size poking the holder, after its start turn)\n\n\
         `driver`: how the process image was dumped (`[checkpoint] process_dump`): `criu` (crab drives CRIU's \
         RPC, the default, leaving out the network namespace that cannot have changed), `criu-netns` (the same \
         with `network_namespace = \"always\"`: the namespace dumped, the baseline) or `runc` (`runc checkpoint`).\n\n\
         | held | driver | total p50 ms | total max ms | publish p50 ms | image logical MiB | stored p50 MiB | start turn total ms | start turn stored MiB | aim (total p50) | kinds |\n\
         |---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        o.proc_turns
    );
    let mut proc_json = serde_json::Map::new();
    for (mb, driver, s, first) in proc {
        let (t, p, lg, st) = (
            Summary::of(&s.total_ms),
            Summary::of(&s.publish_ms),
            Summary::of(&s.logical),
            Summary::of(&s.stored),
        );
        let aim = match *mb {
            10 => "<= 80 ms",
            50 => "<= 150 ms",
            500 => "<= 600 ms",
            _ => "-",
        };
        let _ = writeln!(
            md,
            "| {mb} MB | {driver} | {:.0} | {:.0} | {:.0} | {:.1} | {:.2} | {:.0} | {:.1} | {aim} | {} |",
            t.p50,
            t.max,
            p.p50,
            mib(lg.p50),
            mib(st.p50),
            f(&first.manifest["timings"]["total_ms"]),
            mib(f(&first.manifest["process"]["bytes_stored"])),
            kinds_str(&s.kinds)
        );
        let mut v = s.json();
        v["held_mb"] = json!(mb);
        v["driver"] = json!(driver);
        v["aim"] = json!(aim);
        v["start_turn"] =
            json!({"manifest": first.manifest, "publish_after_update_ms": first.publish_ms});
        proc_json.insert(format!("{mb}MB-{driver}"), v);
    }
    let _ = writeln!(
        md,
        "\n### Where a proc checkpoint's time goes (p50 ms of the poke turns)\n\n\
         `dump` is what the shim waited for (`runc checkpoint`, or CRIU directly); `CRIU own` is CRIU's run by \
         its log; `around CRIU` = dump - CRIU own (runc's start-up and its CRIU version check, CRIU's start-up). \
         `freezing`/`frozen`/`memdump`/`memwrite` are CRIU's `stats-dump` (inside `CRIU own`; the container is \
         frozen for `frozen`). `freeze`/`thaw`: crab freezing the container before CRIU and thawing it after. \
         `dedup` hashes the pages and writes new chunks and recipes; `sync` makes image and chunks durable; \
         `rest` = total - (freeze + trap check + dump + thaw + verify + dedup + sync): the job around the \
         process image.\n\n\
         | held | driver | total | {} | around CRIU | rest |\n|---:|---|---:|{}---:|---:|",
        PHASES.map(|(_, name)| name).join(" | "),
        "---:|".repeat(PHASES.len())
    );
    for (mb, driver, s, _) in proc {
        let (around, rest) = s.derived();
        let cols: Vec<String> = PHASES
            .iter()
            .map(|(k, _)| format!("{:.1}", s.phase_p50(k)))
            .collect();
        let _ = writeln!(
            md,
            "| {mb} MB | {driver} ({}) | {:.1} | {} | {:.1} | {:.1} |",
            kinds_str(&s.drivers),
            Summary::of(&s.total_ms).p50,
            cols.join(" | "),
            Summary::of(&around).p50,
            Summary::of(&rest).p50
        );
    }

    // 3.
    let full = f(&dedup.first.manifest["process"]["bytes_logical"]);
    let _ = writeln!(
        md,
        "\n## 3. Bytes stored with and without page dedup ({DEDUP_MB} MB holder; checkpoint 0 = its start turn, \
         then {} turns each changing 1% of its pages)\n\n\
         `without dedup` = `bytes_logical` (the image as CRIU wrote it); `with dedup` = `bytes_stored` (its files \
         after dedup plus new chunks and index). Full image = checkpoint 0's `bytes_logical` = {:.1} MiB.\n\n\
         | checkpoint | kind | without dedup MiB | with dedup MiB | stored / logical | stored / full image | total ms | aim |\n\
         |---:|---|---:|---:|---:|---:|---:|---|",
        o.dedup_turns,
        mib(full)
    );
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    for (i, t) in std::iter::once(&dedup.first)
        .chain(&dedup.turns)
        .enumerate()
    {
        let m = &t.manifest;
        let (lg, st) = (
            f(&m["process"]["bytes_logical"]),
            f(&m["process"]["bytes_stored"]),
        );
        let aim = if i == 0 { "-" } else { "<= 5%" };
        if i > 0 {
            ratios.push(st / full * 100.0);
        }
        let _ = writeln!(
            md,
            "| {i} | {} | {:.2} | {:.3} | {:.2}% | {:.2}% | {:.0} | {aim} |",
            m["kind"].as_str().unwrap_or("?"),
            mib(lg),
            mib(st),
            st / lg * 100.0,
            st / full * 100.0,
            f(&m["timings"]["total_ms"])
        );
        rows.push(
            json!({"checkpoint": i, "kind": m["kind"], "bytes_logical": lg, "bytes_stored": st,
            "stored_over_logical": st / lg, "stored_over_full_image": st / full,
            "total_ms": m["timings"]["total_ms"], "publish_after_update_ms": t.publish_ms}),
        );
    }
    let r = Summary::of(&ratios);
    let sum_stored: f64 = dedup
        .turns
        .iter()
        .map(|t| f(&t.manifest["process"]["bytes_stored"]))
        .sum();
    let sum_logical: f64 = dedup
        .turns
        .iter()
        .map(|t| f(&t.manifest["process"]["bytes_logical"]))
        .sum();
    let _ = writeln!(
        md,
        "\nRepeated checkpoints 1-{}: stored / full image p50 {:.2}% (max {:.2}%); together {:.1} MiB with dedup \
         versus {:.1} MiB without ({:.1}x less).",
        dedup.turns.len(),
        r.p50,
        r.max,
        mib(sum_stored),
        mib(sum_logical),
        sum_logical / sum_stored
    );
    let _ = writeln!(
        md,
        "\nAims (issues 4 and 15): fs checkpoint p50 <= 10 ms for edits under 1 MB; proc checkpoint p50 <= 80 / 150 / \
         600 ms at 10 / 50 / 500 MB; \
         repeated proc checkpoints store <= 5% of a full image each. (Published CRAB figures for scale: fs-only \
         20-100 ms, process 700-1,000 ms.)"
    );

    let result = json!({
        "benchmark": "checkpoint",
        "unix_time": now,
        "total_s": total.as_secs_f64(),
        "host": {"kernel": kernel, "cpus": cpus, "loadavg_before": load_before, "loadavg_after": load_after},
        "containerd_address": h.env.address,
        "image": AGENT_IMAGE,
        "options": {"fs_turns": o.fs_turns, "proc_turns": o.proc_turns, "dedup_turns": o.dedup_turns},
        "fs": fs_json,
        "proc": proc_json,
        "dedup": {"held_mb": DEDUP_MB, "changed_per_turn": 0.01, "full_image_bytes": full, "checkpoints": rows,
                  "repeated_stored_over_full_pct": Summary::json(&ratios),
                  "repeated_total_bytes_stored": sum_stored, "repeated_total_bytes_logical": sum_logical},
        "aims": {"fs_total_p50_ms_under_1mb": 10.0, "proc_total_p50_ms_at_10mb": 80.0, "proc_total_p50_ms_at_50mb": 150.0,
                 "proc_total_p50_ms_at_500mb": 600.0, "repeated_proc_stored_pct_of_full": 5.0},
    });

    BENCH.finish(&h.env.bench_dir(), "checkpoint", now, &result, &md);
}

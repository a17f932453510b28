//! Figures from replayed rounds: per policy and density, and the inspector's accuracy.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{json, Value};

use super::oracle::Verdict;
use super::{Policy, RoundRecord};
use crate::bench::stats::Summary;

/// The figures of one (policy, density) round.
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub policy: Policy,
    pub density: usize,
    pub sandboxes: usize,
    pub failed_sandboxes: usize,
    pub turns: usize,
    pub timeouts: usize,
    /// Published checkpoints by kind (fs, proc, full, failed).
    pub checkpoints: BTreeMap<String, usize>,
    /// Turns that no checkpoint covers (coalesced turns share one and are covered).
    pub skipped_turns: usize,
    /// crab's answers by kind (the inspector's, whatever the policy took).
    pub decisions: BTreeMap<String, usize>,
    /// Store bytes by top-level entry, summed over the sandboxes.
    pub store_bytes: BTreeMap<String, u64>,
    pub decision_ms: Summary,
    pub turn_end_ms: Summary,
    pub checkpoint_job_ms: Summary,
    pub exec_start_ms: Summary,
    /// Mean exec start minus the `none` round's at the same density (ms per turn).
    pub exposed_ms_per_turn: Option<f64>,
    /// The delay exposed over all turns, as a share of the `none` round's replay time (the
    /// fault-free wall time the sandboxes spent).
    pub exposed_share: Option<f64>,
    /// Checkpoint jobs' waits for an engine slot, in ms (the round's own engine).
    pub queue_wait_ms: Option<Summary>,
    pub engine_jobs: Option<u64>,
    /// The crab shims' memory per shim (one per sandbox) while the round ran, KiB.
    pub shim_pss_kib: Option<Summary>,
    pub shim_rss_kib: Option<Summary>,
    pub drain_ms: Summary,
    /// Sum over sandboxes of the time from the first think to the last turn end.
    pub replay_s: f64,
    pub replay_vs_none: Option<f64>,
    /// Sum of the commands' run times: the same commands, but their run time varies with
    /// load (and with what they find), more than checkpoints change it.
    pub commands_s: f64,
    /// `replay_s - commands_s` over the `none` round's: think time plus what the runtime
    /// added (exec starts, turn ends, output collection).
    pub harness_vs_none: Option<f64>,
    pub wall_s: f64,
    pub wall_vs_none: Option<f64>,
}

impl Figures {
    pub fn skipped_share(&self) -> f64 {
        self.skipped_turns as f64 / self.turns.max(1) as f64
    }

    pub fn total_bytes(&self) -> u64 {
        self.store_bytes.values().sum()
    }
}

pub fn figures(r: &RoundRecord, baseline: Option<&RoundRecord>) -> Figures {
    let turns = || r.sandboxes.iter().flat_map(|s| &s.turns);
    let samples = |f: &dyn Fn(&super::TurnRecord) -> Option<f64>| -> Vec<f64> {
        turns().filter_map(f).collect()
    };
    let mut checkpoints = BTreeMap::new();
    let mut skipped_turns = 0;
    let mut store_bytes = BTreeMap::new();
    let mut job_ms = Vec::new();
    for s in &r.sandboxes {
        let mut covered = BTreeSet::new();
        for m in &s.manifests {
            *checkpoints
                .entry(m["kind"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
            covered.extend(
                m["turn_id"]
                    .as_str()
                    .unwrap_or("")
                    .split(',')
                    .map(str::to_string),
            );
            if let Some(t) = m["timings"]["total_ms"].as_f64() {
                job_ms.push(t);
            }
        }
        if r.policy.checkpoints() {
            skipped_turns += (0..s.turns.len())
                .filter(|n| !covered.contains(&format!("t{n}")))
                .count();
        } else {
            skipped_turns += s.turns.len();
        }
        for (k, v) in &s.store_bytes {
            *store_bytes.entry(k.clone()).or_default() += v;
        }
    }
    let mut decisions = BTreeMap::new();
    for t in turns() {
        if let Some(d) = &t.decision {
            *decisions.entry(d.clone()).or_default() += 1;
        }
    }
    let exec_start = samples(&|t| Some(t.exec_start_ms));
    let exec_start_ms = Summary::of(&exec_start);
    let replay_s: f64 = r
        .sandboxes
        .iter()
        .map(|s| s.replay_s)
        .filter(|x| x.is_finite())
        .sum();
    let commands = |r: &RoundRecord| -> f64 {
        r.sandboxes
            .iter()
            .flat_map(|s| &s.turns)
            .map(|t| t.run_ms / 1e3)
            .sum()
    };
    let commands_s = commands(r);
    let (mut exposed, mut replay_vs_none, mut wall_vs_none, mut harness_vs_none) =
        (None, None, None, None);
    let mut exposed_share = None;
    if let Some(b) = baseline.filter(|b| b.density == r.density) {
        let base_exec = Summary::of(
            &b.sandboxes
                .iter()
                .flat_map(|s| &s.turns)
                .map(|t| t.exec_start_ms)
                .collect::<Vec<_>>(),
        );
        exposed = Some(exec_start_ms.mean - base_exec.mean).filter(|x| x.is_finite());
        let base_replay: f64 = b
            .sandboxes
            .iter()
            .map(|s| s.replay_s)
            .filter(|x| x.is_finite())
            .sum();
        replay_vs_none = Some(replay_s / base_replay).filter(|x| x.is_finite());
        let turns = turns().count() as f64;
        exposed_share = exposed
            .map(|e| e * turns / 1e3 / base_replay)
            .filter(|x| x.is_finite());
        harness_vs_none =
            Some((replay_s - commands_s) / (base_replay - commands(b))).filter(|x| x.is_finite());
        wall_vs_none = Some(r.wall_s / b.wall_s).filter(|x| x.is_finite());
    }
    Figures {
        policy: r.policy,
        density: r.density,
        sandboxes: r.sandboxes.len(),
        failed_sandboxes: r.sandboxes.iter().filter(|s| !s.errors.is_empty()).count(),
        turns: turns().count(),
        timeouts: turns().filter(|t| t.timed_out).count(),
        checkpoints,
        skipped_turns,
        decisions,
        store_bytes,
        decision_ms: Summary::of(&samples(&|t| t.decision_ms)),
        turn_end_ms: Summary::of(&samples(&|t| t.turn_end_ms)),
        checkpoint_job_ms: Summary::of(&job_ms),
        exec_start_ms,
        exposed_ms_per_turn: exposed,
        exposed_share,
        queue_wait_ms: r.engine.as_ref().map(|e| e.wait_ms),
        engine_jobs: r.engine.as_ref().map(|e| e.jobs),
        shim_pss_kib: r.shims.as_ref().and_then(|s| s.pss_kib_per_shim),
        shim_rss_kib: r.shims.as_ref().and_then(|s| s.rss_kib_per_shim),
        drain_ms: Summary::of(&r.sandboxes.iter().map(|s| s.drain_ms).collect::<Vec<_>>()),
        replay_s,
        replay_vs_none,
        commands_s,
        harness_vs_none,
        wall_s: r.wall_s,
        wall_vs_none,
    }
}

/// Verdict counts of one dimension (files or processes).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Confusion {
    pub true_positive: usize,
    pub true_negative: usize,
    pub false_positive: usize,
    pub false_negative: usize,
    pub ambiguous: usize,
}

impl Confusion {
    fn add(&mut self, v: Verdict) {
        match v {
            Verdict::TruePositive => self.true_positive += 1,
            Verdict::TrueNegative => self.true_negative += 1,
            Verdict::FalsePositive => self.false_positive += 1,
            Verdict::FalseNegative => self.false_negative += 1,
            Verdict::Ambiguous => self.ambiguous += 1,
        }
    }
}

/// The inspector's accuracy over the oracle pass.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Accuracy {
    pub turns: usize,
    pub fs: Confusion,
    pub proc: Confusion,
    /// Turns with a false negative in either dimension (must be 0).
    pub false_negative_turns: usize,
    /// Turns whose kind was too big (a false positive in a dimension, none negative).
    pub false_positive_turns: usize,
    /// Changed paths missing from crab's lists, and listed paths that did not change.
    pub paths_missed: usize,
    pub paths_extra: usize,
    /// The turns to look at: every false negative, and the false positives.
    pub details: Vec<Value>,
}

pub fn accuracy(r: &RoundRecord) -> Accuracy {
    let mut a = Accuracy::default();
    for s in &r.sandboxes {
        for (n, t) in s.turns.iter().enumerate() {
            let Some(j) = &t.judgement else { continue };
            a.turns += 1;
            a.fs.add(j.fs);
            a.proc.add(j.proc);
            a.paths_missed += j.fs_missed.len();
            a.paths_extra += j.fs_extra.len();
            let fneg = j.fs == Verdict::FalseNegative || j.proc == Verdict::FalseNegative;
            let fpos =
                !fneg && (j.fs == Verdict::FalsePositive || j.proc == Verdict::FalsePositive);
            a.false_negative_turns += fneg as usize;
            a.false_positive_turns += fpos as usize;
            if fneg || fpos {
                let short = |v: &[std::path::PathBuf]| -> Vec<String> {
                    v.iter().take(10).map(|p| p.display().to_string()).collect()
                };
                a.details.push(json!({
                    "trial": s.trial, "turn": n, "recorded_index": t.index,
                    "verdict": if fneg { "false negative" } else { "false positive" },
                    "crab": t.summary, "fs": j.fs, "proc": j.proc,
                    "fs_changed": short(&j.fs_changed), "fs_missed": short(&j.fs_missed), "fs_extra": short(&j.fs_extra),
                    "proc_changed": j.proc_changed, "proc_unstable": j.proc_unstable,
                }));
            }
        }
    }
    a
}

/// Bytes for people: KiB below a MiB, MiB below a GiB.
fn bytes(b: u64) -> String {
    match b {
        b if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        b if b < 1 << 30 => format!("{:.1} MiB", b as f64 / 1048576.0),
        b => format!("{:.2} GiB", b as f64 / 1073741824.0),
    }
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "-".into())
}

fn pair(s: &Summary, digits: usize) -> String {
    if s.n == 0 {
        return "-".into();
    }
    format!("{:.digits$} / {:.digits$}", s.p50, s.p95)
}

/// The tables (markdown) for all rounds.
pub fn markdown(figs: &[Figures], acc: Option<&Accuracy>) -> String {
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## Policies\n\n\
         `ckpts` = published checkpoints fs/proc/full/failed; `skipped` = turns no checkpoint covers; `written` = the \
         sandboxes' stores at the end (layers + process images + manifests and answers); `decision` = crab's turn-end \
         answer (`elapsed_us` of the stored answer); `turn end` = the `Tasks.Update` call; `job` = the checkpoint job \
         (manifest `timings.total_ms`); `exec start` = `Tasks.Exec` to `Tasks.Start` returned (it waits for the \
         previous checkpoint); `exposed` = its mean minus `none`'s at the same N; `replay` = sum over sandboxes of first \
         think to last turn end, of which `commands` ran the commands; `vs none` = replay / `none`'s, and without the \
         commands' run time (which varies with load more than checkpoints change it). p50 / p95 in ms. chat-only \
         keeps no OS state: at run time it costs what `none` costs.\n\n\
         | policy | N | sandboxes | turns | timeouts | ckpts fs/proc/full/failed | skipped | written | decision ms | turn end ms | job ms | exec start ms | exposed ms/turn | replay s | commands s | vs none | vs none excl. commands |\n\
         |---|---:|---:|---:|---:|---|---:|---:|---|---|---|---|---:|---:|---:|---:|---:|"
    );
    for f in figs {
        let k = |n: &str| f.checkpoints.get(n).copied().unwrap_or(0);
        let failed = if f.failed_sandboxes > 0 {
            format!(" ({} failed)", f.failed_sandboxes)
        } else {
            String::new()
        };
        let _ = writeln!(
            md,
            "| {} | {} | {}{failed} | {} | {} | {} | {:.0}% | {} | {} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} |",
            f.policy.name(),
            f.density,
            f.sandboxes,
            f.turns,
            f.timeouts,
            if f.policy.checkpoints() { format!("{}/{}/{}/{}", k("fs"), k("proc"), k("full"), k("failed")) } else { "-".into() },
            f.skipped_share() * 100.0,
            bytes(f.total_bytes()),
            pair(&f.decision_ms, 2),
            pair(&f.turn_end_ms, 1),
            pair(&f.checkpoint_job_ms, 0),
            pair(&f.exec_start_ms, 1),
            opt(f.exposed_ms_per_turn, 1),
            f.replay_s,
            f.commands_s,
            opt(f.replay_vs_none, 3),
            opt(f.harness_vs_none, 3),
        );
    }
    let _ = writeln!(
        md,
        "\nDensity: `exposed` = the delay exposed over all turns as a share of `none`'s replay time (the fault-free \
         time); `decision` = crab's turn-end answer p50 / p95 / p99; `queue wait` = checkpoint jobs' wait for an engine \
         slot (the round's own engine) p50 / p95 / p99; `shim` = crab shim memory per sandbox while the round ran, \
         PSS (shared pages split among the shims) / RSS, mean of the samples.\n\n\
         | policy | N | exposed | decision ms | jobs | queue wait ms | shim PSS / RSS MiB |\n|---|---:|---:|---|---:|---|---|"
    );
    for f in figs {
        let three = |s: &Summary, digits: usize| {
            if s.n == 0 {
                "-".to_string()
            } else {
                format!(
                    "{:.digits$} / {:.digits$} / {:.digits$}",
                    s.p50, s.p95, s.p99
                )
            }
        };
        let mem = match (&f.shim_pss_kib, &f.shim_rss_kib) {
            (Some(p), Some(r)) => format!("{:.1} / {:.1}", p.mean / 1024.0, r.mean / 1024.0),
            _ => "-".into(),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {mem} |",
            f.policy.name(),
            f.density,
            f.exposed_share
                .map(|x| format!("{:.2}%", x * 100.0))
                .unwrap_or_else(|| "-".into()),
            three(&f.decision_ms, 2),
            f.engine_jobs
                .map(|j| j.to_string())
                .unwrap_or_else(|| "-".into()),
            f.queue_wait_ms
                .as_ref()
                .map(|s| three(s, 1))
                .unwrap_or_else(|| "-".into()),
        );
    }
    let _ = writeln!(md, "\ncrab's decisions (the inspector's answers, whatever the policy took), and where the bytes went:\n");
    let _ = writeln!(md, "| policy | N | none | fs | proc | full | layers | process images | metadata | drain p50 ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for f in figs.iter().filter(|f| f.policy.checkpoints()) {
        let d = |n: &str| f.decisions.get(n).copied().unwrap_or(0);
        let b = |names: &[&str]| -> u64 {
            names
                .iter()
                .map(|n| f.store_bytes.get(*n).copied().unwrap_or(0))
                .sum()
        };
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            f.policy.name(),
            f.density,
            d("none"),
            d("fs"),
            d("proc"),
            d("full"),
            bytes(b(&["blobs"])),
            bytes(b(&["proc", "chunks"])),
            bytes(f.total_bytes() - b(&["blobs", "proc", "chunks"])),
            opt(Some(f.drain_ms.p50).filter(|x| x.is_finite()), 0),
        );
    }
    if let Some(a) = acc {
        let c = |c: &Confusion| {
            format!(
                "{} | {} | {} | {} | {}",
                c.true_positive, c.true_negative, c.false_positive, c.false_negative, c.ambiguous
            )
        };
        let _ = writeln!(
            md,
            "\n## Inspector accuracy ({} turns, crab's policy, against the host-side oracle)\n\n\
             Per dimension: did the turn need it (oracle) and did crab say so. Ambiguous = what changed also moved across a \
             turn end (a background writer, or a process woken by crab's own freeze), so the truth at crab's instant is \
             unknown. A kind that was right but whose file list misses a changed path counts as a false negative.\n\n\
             | dimension | true pos | true neg | false pos | false neg | ambiguous |\n|---|---:|---:|---:|---:|---:|\n\
             | files | {} |\n| processes | {} |\n\n\
             False-negative turns: **{}** (must be 0); false-positive turns: {}; changed paths missing from crab's lists: {}; \
             listed paths that did not change: {}.",
            a.turns,
            c(&a.fs),
            c(&a.proc),
            a.false_negative_turns,
            a.false_positive_turns,
            a.paths_missed,
            a.paths_extra
        );
        for d in a.details.iter().take(20) {
            let _ = writeln!(
                md,
                "- {}: {} turn {} (recorded {}): crab {}; oracle fs changed {} proc {}",
                d["verdict"].as_str().unwrap_or(""),
                d["trial"].as_str().unwrap_or(""),
                d["turn"],
                d["recorded_index"],
                d["crab"].as_str().unwrap_or("-"),
                d["fs_changed"],
                d["proc_changed"]
            );
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::super::{SandboxRecord, TurnRecord};
    use super::*;

    fn turn(exec_ms: f64, decision: Option<&str>) -> TurnRecord {
        TurnRecord {
            index: 0,
            recorded_status: "ok".into(),
            think_ms: 0.0,
            exec_start_ms: exec_ms,
            run_ms: 1.0,
            timed_out: false,
            exit_status: Some(0),
            output_bytes: 0,
            turn_end_ms: decision.map(|_| 2.0),
            decision: decision.map(str::to_string),
            decision_ms: decision.map(|_| 0.5),
            summary: None,
            judgement: None,
            oracle_errors: Vec::new(),
        }
    }

    fn round(policy: Policy, exec_ms: f64, manifests: Vec<Value>, replay_s: f64) -> RoundRecord {
        let d = policy.checkpoints().then_some("none");
        RoundRecord {
            policy,
            density: 4,
            oracle: false,
            wall_s: replay_s,
            sandboxes: vec![SandboxRecord {
                trial: "x".into(),
                slot: 0,
                id: "id".into(),
                turns: vec![
                    turn(exec_ms, d),
                    turn(exec_ms, d),
                    turn(exec_ms, d),
                    turn(exec_ms, d),
                ],
                replay_s,
                drain_ms: 3.0,
                manifests,
                store_bytes: BTreeMap::from([("blobs".into(), 1000), ("checkpoints".into(), 24)]),
                replication: None,
                errors: Vec::new(),
            }],
            shims: None,
            engine: None,
            engine_error: None,
        }
    }

    #[test]
    fn skipped_exposed_and_relative_time() {
        let none = round(Policy::None, 10.0, Vec::new(), 2.0);
        let m = vec![
            json!({"kind": "fs", "turn_id": "t0", "timings": {"total_ms": 9.0}}),
            json!({"kind": "proc", "turn_id": "t2,t3", "timings": {"total_ms": 300.0}}),
        ];
        let crab = round(Policy::Crab, 14.0, m, 3.0);
        let f = figures(&crab, Some(&none));
        assert_eq!(
            (f.turns, f.skipped_turns),
            (4, 1),
            "t1 is not covered; t2 and t3 share one checkpoint"
        );
        assert_eq!(f.checkpoints["proc"], 1);
        assert_eq!(f.exposed_ms_per_turn, Some(4.0));
        // 4 turns exposed 4 ms each over `none`'s 2 s of replay.
        assert_eq!(f.exposed_share, Some(4.0 * 4.0 / 1e3 / 2.0));
        assert_eq!(f.replay_vs_none, Some(1.5));
        assert_eq!(
            (f.commands_s, f.harness_vs_none),
            (0.004, Some((3.0 - 0.004) / (2.0 - 0.004)))
        );
        assert_eq!(f.total_bytes(), 1024);
        assert_eq!(f.checkpoint_job_ms.n, 2);
        let n = figures(&none, Some(&none));
        assert_eq!(
            (n.skipped_turns, n.exposed_ms_per_turn, n.decision_ms.n),
            (4, Some(0.0), 0)
        );
        // A baseline at another density is not a baseline.
        let mut other = none.clone();
        other.density = 1;
        assert_eq!(figures(&crab, Some(&other)).exposed_ms_per_turn, None);
        let md = markdown(&[n, f], None);
        assert!(
            md.contains("| crab | 4 | 1 | 4 | 0 | 1/1/0/0 | 25% |"),
            "{md}"
        );
    }

    #[test]
    fn accuracy_counts_turns() {
        use super::super::oracle::Judgement;
        let j = |fs, proc| Judgement {
            fs,
            proc,
            fs_changed: Vec::new(),
            fs_unstable: Vec::new(),
            fs_missed: Vec::new(),
            fs_extra: Vec::new(),
            proc_changed: Vec::new(),
            proc_unstable: Vec::new(),
        };
        let mut r = round(Policy::Crab, 1.0, Vec::new(), 1.0);
        let verdicts = [
            (Verdict::TruePositive, Verdict::TrueNegative),
            (Verdict::FalsePositive, Verdict::TrueNegative),
            (Verdict::TrueNegative, Verdict::FalseNegative),
            (Verdict::Ambiguous, Verdict::TrueNegative),
        ];
        for (t, (fs, proc)) in r.sandboxes[0].turns.iter_mut().zip(verdicts) {
            t.judgement = Some(j(fs, proc));
        }
        let a = accuracy(&r);
        assert_eq!(
            (a.turns, a.false_negative_turns, a.false_positive_turns),
            (4, 1, 1)
        );
        assert_eq!(
            (a.fs.true_positive, a.fs.ambiguous, a.proc.false_negative),
            (1, 1, 1)
        );
        assert_eq!(a.details.len(), 2);
    }
}

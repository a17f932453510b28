//! The trajectory replayer (issue 6): real agent runs replayed through containerd and the crab
//! shim, the way the agent ran them, under each checkpoint policy and at several densities.
//!
//! Each trajectory gets its own agent sandbox (`localhost/crab/agent:latest`, init `sleep
//! infinity`, like mini-swe-agent's own container). Each turn: the recorded think time
//! (scaled), then the command as a fresh `bash -c` exec in /app with the recorded harness's
//! 30 s timeout (on timeout the exec's process is killed; its children, like anything it left
//! in the background, live on), then a turn end (`Tasks.Update` with `io.crab/turn-end`,
//! under every policy that checkpoints). `N` sandboxes run at once; a round replays the
//! selected trajectories (repeated to fill `N` sandboxes when there are fewer) under one
//! policy, and every policy replays the same selection at the same density.
//!
//! Measured per turn: the time from `Tasks.Exec` to `Tasks.Start` returning (the shim holds an
//! exec start until the previous turn's checkpoint is durable, so its excess over the `none`
//! policy's is the delay checkpoints expose to the agent), the command's run time, the
//! turn-end call and crab's decision time (the stored answer's `elapsed_us`). Per sandbox,
//! once its last checkpoint is durable: the published manifests and the bytes in its store.
//!
//! Inspector accuracy ([`oracle`]) is measured in a separate pass (crab's policy, all
//! selected trajectories at once): there each turn end is bracketed by host snapshots of the
//! container's files and processes, and the next turn waits until the checkpoint is durable
//! (so crab's own freeze is not mistaken for the agent's doing). Its timings are not used.

pub mod density;
pub mod oracle;
pub mod recovery;
pub mod report;
pub mod trajectory;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use containerd_client::services::v1::snapshots::{
    snapshots_client::SnapshotsClient, MountsRequest,
};
use crab_runtime_config::CheckpointPolicy;
use serde::Serialize;
use serde_json::Value;

use crate::harness::SNAPSHOTTER;
use crate::sandbox::{Sandbox, SandboxOptions, TURN_END};
use crate::{Error, ProcessSpec, StdioOptions};

use self::oracle::{CrabAnswer, Judgement, Observer, Snapshot};
use self::trajectory::Trajectory;

/// What the replayer compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// No checkpoints (`[checkpoint] enabled = false`): the baseline. Chat-only recovery
    /// (a fresh container) costs the same at run time.
    None,
    FsEveryTurn,
    FullEveryTurn,
    /// crab's own (`policy = "minimal"`).
    Crab,
}

impl Policy {
    pub const ALL: [Policy; 4] = [
        Policy::None,
        Policy::FsEveryTurn,
        Policy::FullEveryTurn,
        Policy::Crab,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::FsEveryTurn => "fs-every-turn",
            Policy::FullEveryTurn => "full-every-turn",
            Policy::Crab => "crab",
        }
    }

    pub fn from_name(s: &str) -> Option<Policy> {
        match s {
            "minimal" => Some(Policy::Crab),
            _ => Policy::ALL.into_iter().find(|p| p.name() == s),
        }
    }

    /// The sandbox's crab config (root-level dotted keys, see [`SandboxOptions::config`]).
    pub fn config(self) -> String {
        let policy = match self {
            Policy::None => return "checkpoint.enabled = false\n".into(),
            Policy::FsEveryTurn => CheckpointPolicy::FsEveryTurn,
            Policy::FullEveryTurn => CheckpointPolicy::FullEveryTurn,
            Policy::Crab => CheckpointPolicy::Minimal,
        };
        format!("checkpoint.policy = \"{}\"\n", policy.name())
    }

    pub fn checkpoints(self) -> bool {
        self != Policy::None
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub think_scale: f64,
    pub cmd_timeout: Duration,
    /// Replay at most this many turns of each trajectory.
    pub max_turns: Option<usize>,
    /// More crab config for every sandbox (root-level dotted keys, see
    /// [`SandboxOptions::config`]), e.g. `restore.lazy_pages_min_mib = 1`.
    pub sandbox_config: String,
    /// A command run in every sandbox before its trajectory (no turn end of its own: the
    /// first turn covers it), e.g. a background server an agent would have started.
    pub prelude: Option<String>,
}

/// One round: every selected trajectory under one policy, `density` sandboxes at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    pub policy: Policy,
    pub density: usize,
    /// The accuracy pass: snapshots around each turn end, durable checkpoints before the next.
    pub oracle: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct TurnRecord {
    pub index: u64,
    pub recorded_status: String,
    /// How long the replayer slept for the agent's (scaled) think time.
    pub think_ms: f64,
    /// From `Tasks.Exec` to `Tasks.Start` returning.
    pub exec_start_ms: f64,
    /// From `Tasks.Start` returning to the exit (or the kill, on timeout).
    pub run_ms: f64,
    pub timed_out: bool,
    pub exit_status: Option<u32>,
    pub output_bytes: usize,
    /// The turn-end `Tasks.Update` as the harness saw it.
    pub turn_end_ms: Option<f64>,
    /// crab's decision (the stored answer's kind and `elapsed_us`).
    pub decision: Option<String>,
    pub decision_ms: Option<f64>,
    pub summary: Option<String>,
    pub judgement: Option<Judgement>,
    pub oracle_errors: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SandboxRecord {
    pub trial: String,
    pub slot: usize,
    pub id: String,
    pub turns: Vec<TurnRecord>,
    /// From the first think time to the last turn end returning.
    pub replay_s: f64,
    /// After the last turn end, until its checkpoint was durable (an exec start waits for it).
    pub drain_ms: f64,
    /// Checkpoints the turn ends published (origin manifests left out), oldest first.
    pub manifests: Vec<Value>,
    /// Bytes in the sandbox's store by top-level entry (checkpoints, blobs, proc, chunks,
    /// turns), files counted once per inode.
    pub store_bytes: BTreeMap<String, u64>,
    /// With `[replication]`: the sandbox's replicator status (`replication.json`) at its end.
    pub replication: Option<Value>,
    pub errors: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RoundRecord {
    pub policy: Policy,
    pub density: usize,
    pub oracle: bool,
    pub wall_s: f64,
    pub sandboxes: Vec<SandboxRecord>,
    /// The crab shims' memory while the round ran.
    pub shims: Option<density::ShimMemory>,
    /// The round's own engine root's figures (checkpoint jobs' waits for a slot); `None`
    /// without checkpoints.
    pub engine: Option<density::EngineFigures>,
    pub engine_error: Option<String>,
}

/// Replays `trajectories` in one round. Sandbox failures are recorded, not fatal.
pub async fn run_round(round: Round, trajectories: &[Trajectory], opts: &Options) -> RoundRecord {
    let n = round.density.max(1);
    let jobs: VecDeque<(usize, Trajectory)> = (0..trajectories.len().max(n))
        .map(|i| (i, trajectories[i % trajectories.len()].clone()))
        .collect();
    let jobs = Arc::new(Mutex::new(jobs));
    let env = crate::env::TestEnv::from_env();
    // The round's own engine: its stats are this round's jobs only.
    let engine_root = density::round_engine_root(
        &env,
        &format!(
            "{}-n{n}{}",
            round.policy.name(),
            if round.oracle { "o" } else { "" }
        ),
    );
    let sampler = density::Sampler::start(env.clone(), density::CRAB_SHIM, Duration::from_secs(1));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..n {
        let (jobs, opts, engine_root) = (jobs.clone(), opts.clone(), engine_root.clone());
        workers.push(tokio::spawn(async move {
            let mut out = Vec::new();
            loop {
                let Some((slot, t)) = jobs.lock().unwrap().pop_front() else {
                    break;
                };
                let name = format!(
                    "replay-{}-n{n}{}-{slot}",
                    round.policy.name(),
                    if round.oracle { "o" } else { "" }
                );
                let trial = t.trial.clone();
                let rec = tokio::spawn(replay_sandbox(
                    name.clone(),
                    round,
                    t,
                    opts.clone(),
                    engine_root.clone(),
                ))
                .await
                .unwrap_or_else(|e| SandboxRecord {
                    trial,
                    slot,
                    id: name,
                    turns: Vec::new(),
                    replay_s: f64::NAN,
                    drain_ms: f64::NAN,
                    manifests: Vec::new(),
                    store_bytes: BTreeMap::new(),
                    replication: None,
                    errors: vec![format!("the sandbox's replay panicked: {e}")],
                });
                eprintln!(
                    "replay: {} N={n}{}: {} done, {} turns in {:.1} s{}",
                    round.policy.name(),
                    if round.oracle { " (accuracy)" } else { "" },
                    rec.trial,
                    rec.turns.len(),
                    rec.replay_s,
                    rec.errors
                        .first()
                        .map(|e| format!(", ERROR: {e}"))
                        .unwrap_or_default()
                );
                out.push(SandboxRecord { slot, ..rec });
            }
            out
        }));
    }
    let mut sandboxes = Vec::new();
    for w in workers {
        sandboxes.extend(w.await.unwrap_or_default());
    }
    sandboxes.sort_by_key(|s| s.slot);
    let wall_s = started.elapsed().as_secs_f64();
    let shims = Some(sampler.finish().await);
    let (engine, engine_error) = match round.policy.checkpoints() {
        false => (None, None),
        true => match density::EngineFigures::read(&engine_root) {
            Ok(f) => (Some(f), None),
            Err(e) => (None, Some(e)),
        },
    };
    let _ = std::fs::remove_dir_all(&engine_root);
    RoundRecord {
        policy: round.policy,
        density: n,
        oracle: round.oracle,
        wall_s,
        sandboxes,
        shims,
        engine,
        engine_error,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn replay_sandbox(
    name: String,
    round: Round,
    t: Trajectory,
    opts: Options,
    engine_root: std::path::PathBuf,
) -> SandboxRecord {
    let config = format!(
        "{}engine.root = \"{}\"\n{}\n",
        round.policy.config(),
        engine_root.display(),
        opts.sandbox_config
    );
    let (mut sb, guard) = Sandbox::start(
        &name,
        SandboxOptions {
            config: &config,
            ..Default::default()
        },
    )
    .await;
    let mut rec = SandboxRecord {
        trial: t.trial.clone(),
        slot: 0,
        id: sb.id.clone(),
        turns: Vec::new(),
        replay_s: f64::NAN,
        drain_ms: f64::NAN,
        manifests: Vec::new(),
        store_bytes: BTreeMap::new(),
        replication: None,
        errors: Vec::new(),
    };
    if let Err(e) = replay_turns(&mut sb, round, &t, &opts, &mut rec).await {
        rec.errors.push(e);
    }
    if round.policy.checkpoints() {
        // The last turn's checkpoint: an exec start waits until it is durable.
        let t0 = Instant::now();
        match exec(&sb, "drain", "true", Duration::from_secs(120)).await {
            Ok(_) => rec.drain_ms = ms(t0.elapsed()),
            Err(e) => rec
                .errors
                .push(format!("waiting for the last checkpoint: {e}")),
        }
        rec.manifests = sb
            .manifests()
            .into_iter()
            .filter(|m| matches!(m["kind"].as_str(), Some("fs" | "proc" | "full" | "failed")))
            .collect();
        rec.store_bytes = store_bytes(&sb.store());
        if opts.sandbox_config.contains("replication.registry") {
            rec.replication = replication_status(&sb.store()).await;
        }
    }
    if let Err(e) = sb.h.kill_and_remove(&sb.id).await {
        rec.errors.push(format!("removing the sandbox: {e}"));
    }
    let leaks = sb.h.leaks(&sb.id).await;
    if !leaks.is_empty() {
        rec.errors
            .push(format!("left behind: {}", leaks.join("; ")));
    }
    let _ = std::fs::remove_dir_all(&sb.state_dir);
    drop(guard);
    rec
}

async fn replay_turns(
    sb: &mut Sandbox,
    round: Round,
    t: &Trajectory,
    opts: &Options,
    rec: &mut SandboxRecord,
) -> Result<(), String> {
    let mut oracle = match round.oracle {
        true => Some(OracleRun::start(sb).await?),
        false => None,
    };
    if let Some(cmd) = &opts.prelude {
        let x = exec(sb, "prelude", cmd, opts.cmd_timeout)
            .await
            .map_err(|e| format!("prelude (`{}`): {e}", first_line(cmd)))?;
        if x.status != Some(0) {
            return Err(format!(
                "prelude (`{}`) exited with {:?}",
                first_line(cmd),
                x.status
            ));
        }
    }
    let started = Instant::now();
    let mut ready_at = Instant::now();
    let turns = t.turns.iter().take(opts.max_turns.unwrap_or(usize::MAX));
    for (n, turn) in turns.enumerate() {
        let wake = ready_at + turn.think.mul_f64(opts.think_scale);
        let slept = wake.saturating_duration_since(Instant::now());
        tokio::time::sleep_until(wake.into()).await;
        let x = exec(sb, &format!("t{n}"), &turn.cmd, opts.cmd_timeout)
            .await
            .map_err(|e| format!("turn {} (`{}`): {e}", turn.index, first_line(&turn.cmd)))?;
        let mut r = TurnRecord {
            index: turn.index,
            recorded_status: turn.recorded_status.clone(),
            think_ms: ms(slept),
            exec_start_ms: x.start_ms,
            run_ms: x.run_ms,
            timed_out: x.timed_out,
            exit_status: x.status,
            output_bytes: x.output_bytes,
            turn_end_ms: None,
            decision: None,
            decision_ms: None,
            summary: None,
            judgement: None,
            oracle_errors: Vec::new(),
        };
        let before = match &oracle {
            Some(o) => Some(o.snapshot().await),
            None => None,
        };
        if round.policy.checkpoints() {
            let turn_id = format!("t{n}");
            let t0 = Instant::now();
            let annotations = HashMap::from([(TURN_END.to_string(), turn_id.clone())]);
            sb.h.update(&sb.id, None, annotations)
                .await
                .map_err(|e| format!("turn end {turn_id}: {e}"))?;
            r.turn_end_ms = Some(ms(t0.elapsed()));
            let answer = last_answer(&sb.store())?;
            if answer["turn_id"] != turn_id.as_str() {
                return Err(format!(
                    "turn end {turn_id}: the newest stored answer is {}'s",
                    answer["turn_id"]
                ));
            }
            r.decision = answer["kind"].as_str().map(str::to_string);
            r.decision_ms = answer["elapsed_us"].as_f64().map(|us| us / 1e3);
            if let (Some(o), Some(before)) = (&mut oracle, before) {
                let (j, errors) = o.judge(sb, &turn_id, before, &answer).await?;
                r.judgement = Some(j);
                r.oracle_errors = errors;
                r.summary = Some(summary(&answer));
            }
        }
        // The agent thinks once the turn end returned (and, in the accuracy pass, once the
        // oracle has its snapshots).
        ready_at = Instant::now();
        rec.turns.push(r);
    }
    rec.replay_s = started.elapsed().as_secs_f64();
    Ok(())
}

/// The accuracy pass's state for one sandbox.
struct OracleRun {
    observer: Arc<Mutex<Observer>>,
    /// The snapshots before and after the previous turn end (at first, the base, twice).
    prev: (Arc<Snapshot>, Arc<Snapshot>),
    /// Whether crab's checkpoint job ran across the previous turn end (see [`oracle::judge`]).
    prev_froze: bool,
}

impl OracleRun {
    async fn start(sb: &Sandbox) -> Result<OracleRun, String> {
        let mounts = SnapshotsClient::new(sb.h.channel())
            .mounts(sb.h.request(MountsRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: sb.id.clone(),
            }))
            .await
            .map_err(|e| format!("Snapshots.Mounts {}: {e}", sb.id))?
            .into_inner()
            .mounts;
        let (upperdir, lowerdirs) = mounts
            .iter()
            .find(|m| m.r#type == "overlay")
            .and_then(|m| oracle::overlay_dirs(&m.options))
            .ok_or_else(|| {
                format!(
                    "{}: the rootfs is not an overlay with an upperdir: {mounts:?}",
                    sb.id
                )
            })?;
        let (_, pid) = sb.h.status(&sb.id, "").await.map_err(|e| e.to_string())?;
        let cgroup = oracle::cgroup2_dir(pid)
            .map_err(|e| format!("the cgroup of {} (pid {pid}): {e}", sb.id))?;
        let observer = Observer::new(oracle::Target {
            upperdir,
            lowerdirs,
            cgroup,
        });
        let mut run = OracleRun {
            observer: Arc::new(Mutex::new(observer)),
            prev: Default::default(),
            prev_froze: false,
        };
        // The base: crab's first mark is taken at Start, before any exec, once the init no
        // longer runs `runc init` (`runc start` returns when it released the init, which then
        // execs the container's program on its own schedule). Taken earlier, the oracle would
        // count that exec as the first turn's change (seen on a loaded host: 77 turns).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let mut args = cmdline.split(|b| *b == 0);
            let runc_init =
                args.next().is_some_and(|a| a.ends_with(b"runc")) && args.next() == Some(b"init");
            // Empty while the exec replaces the image.
            if (!cmdline.is_empty() && !runc_init) || Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Then until the program has settled (a dynamic loader's start-up is still memory
        // being written): crab's base mark comes later than this anyway.
        let dir = run.observer.lock().unwrap().cgroup().to_path_buf();
        let settled = tokio::task::spawn_blocking(move || {
            oracle::settle(&dir, Duration::from_millis(50), Duration::from_secs(5))
        });
        let _ = settled.await;
        let base = Arc::new(run.snapshot().await);
        run.prev = (base.clone(), base);
        Ok(run)
    }

    async fn snapshot(&self) -> Snapshot {
        let o = self.observer.clone();
        tokio::task::spawn_blocking(move || o.lock().unwrap().snapshot())
            .await
            .expect("the snapshot thread does not panic")
    }

    /// Judges crab's answer for the turn that ended just after `before` was taken: waits until
    /// the turn's checkpoint (if any) is durable, takes the snapshot after the turn end.
    async fn judge(
        &mut self,
        sb: &Sandbox,
        turn_id: &str,
        before: Snapshot,
        answer: &Value,
    ) -> Result<(Judgement, Vec<String>), String> {
        let froze = [self.prev_froze, answer["kind"] != "none"];
        if froze[1] {
            wait_published(sb, turn_id).await?;
            // The freeze woke every process; crab re-marks the idle ones once they have run
            // and gone back to sleep (bounded): so does the snapshot after the turn end, or
            // a wake that lands late on a busy host shows as the next turn's change.
            let dir = self.observer.lock().unwrap().cgroup().to_path_buf();
            let settled = tokio::task::spawn_blocking(move || {
                oracle::settle(&dir, Duration::from_millis(50), Duration::from_secs(5))
            });
            let _ = settled.await;
        }
        let (before, after) = (Arc::new(before), Arc::new(self.snapshot().await));
        let errors = before.errors.iter().chain(&after.errors).cloned().collect();
        let crab = CrabAnswer::from_json(answer);
        let (o, (pb, pa)) = (self.observer.clone(), self.prev.clone());
        let (b, a) = (before.clone(), after.clone());
        let j = tokio::task::spawn_blocking(move || {
            let resolved = o.lock().unwrap().resolve([&pb, &pa, &b, &a]);
            oracle::judge(&resolved, &crab, froze)
        })
        .await
        .map_err(|e| e.to_string())?;
        self.prev = (before, after);
        self.prev_froze = froze[1];
        Ok((j, errors))
    }
}

fn first_line(s: &str) -> &str {
    let l = s.lines().next().unwrap_or("");
    &l[..l.char_indices().nth(80).map(|(i, _)| i).unwrap_or(l.len())]
}

/// The answer's explanation, short: what crab saw.
fn summary(a: &Value) -> String {
    let n = |k: &str| a["fs"][k].as_array().map(Vec::len).unwrap_or(0);
    let names = |k: &str| -> Vec<String> {
        a["procs"][k]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["cmdline"].as_str().map(str::to_string))
            .collect()
    };
    format!(
        "{}: fs +{} ~{} -{}; procs started {:?} ended {:?}; memory changed in {}; holds changed {}",
        a["kind"].as_str().unwrap_or("?"),
        n("added"),
        n("modified"),
        n("deleted"),
        names("started"),
        names("ended"),
        a["procs"]["memory"]
            .as_array()
            .map(|m| m
                .iter()
                .filter(|m| m["changed_pages"].as_u64().unwrap_or(0)
                    + m["added_pages"].as_u64().unwrap_or(0)
                    + m["removed_pages"].as_u64().unwrap_or(0)
                    > 0)
                .count())
            .unwrap_or(0),
        a["procs"]["held_changed"]
            .as_array()
            .map(Vec::len)
            .unwrap_or(0),
    )
}

struct Exec {
    start_ms: f64,
    run_ms: f64,
    timed_out: bool,
    status: Option<u32>,
    output_bytes: usize,
}

/// Runs `cmd` as `bash -c` in /app; on timeout its process gets SIGKILL (what it started lives
/// on, as under the agent's harness).
async fn exec(sb: &Sandbox, exec_id: &str, cmd: &str, timeout: Duration) -> crate::Result<Exec> {
    let mut io = sb.h.stdio(&sb.id, exec_id, StdioOptions::default())?;
    let spec = ProcessSpec::new(&["bash", "-c", cmd]).cwd("/app");
    let t0 = Instant::now();
    sb.h.exec(&sb.id, exec_id, &spec, &io).await?;
    sb.h.start(&sb.id, exec_id).await?;
    let start_ms = ms(t0.elapsed());
    let t1 = Instant::now();
    let (status, timed_out) = match sb.h.wait(&sb.id, exec_id, timeout).await {
        Ok(s) => (Some(s), false),
        Err(Error::Timeout { .. }) => {
            sb.h.kill(&sb.id, exec_id, libc::SIGKILL, false).await?;
            (
                sb.h.wait(&sb.id, exec_id, Duration::from_secs(60))
                    .await
                    .ok(),
                true,
            )
        }
        Err(e) => return Err(e),
    };
    let run_ms = ms(t1.elapsed());
    // The shim closes the FIFOs once the exit is in (after a bounded drain of what the
    // process's children may still hold open).
    let output_bytes = tokio::task::block_in_place(|| {
        let out = io
            .stdout(Duration::from_secs(30))
            .map(|o| o.len())
            .unwrap_or(0);
        out + io
            .stderr_string(Duration::from_secs(30))
            .map(|e| e.len())
            .unwrap_or(0)
    });
    sb.h.delete_process(&sb.id, exec_id).await?;
    Ok(Exec {
        start_ms,
        run_ms,
        timed_out,
        status,
        output_bytes,
    })
}

/// The newest stored turn answer.
fn last_answer(store: &Path) -> Result<Value, String> {
    let dir = store.join("turns");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "json")
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    let last = files
        .last()
        .ok_or_else(|| format!("no answer in {}", dir.display()))?;
    let text = std::fs::read(last).map_err(|e| format!("{}: {e}", last.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", last.display()))
}

/// Waits until a manifest covering `turn_id` is published.
async fn wait_published(sb: &Sandbox, turn_id: &str) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if sb.manifests().iter().any(|m| {
            m["turn_id"]
                .as_str()
                .is_some_and(|t| t.split(',').any(|t| t == turn_id))
        }) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no checkpoint of turn {turn_id} published in 180 s"
            ));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Bytes under `store`, by top-level entry, each inode once.
/// With `[replication]`: once the replicator pushed the store's newest durable checkpoint
/// (waited for up to 60 s), its status; `None` without replication.
async fn replication_status(store: &Path) -> Option<Value> {
    let read = || -> Option<Value> {
        serde_json::from_slice(&std::fs::read(store.join("replication.json")).ok()?).ok()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let st = read();
        let newest = std::fs::read_dir(store.join("checkpoints"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_suffix(".json")?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        match &st {
            Some(v) if v["pushed_seq"].as_u64() == newest => return st,
            None if Instant::now() > deadline => return None,
            _ if Instant::now() > deadline => return st,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

fn store_bytes(store: &Path) -> BTreeMap<String, u64> {
    use std::os::unix::fs::MetadataExt;
    fn walk(p: &Path, seen: &mut HashSet<(u64, u64)>) -> u64 {
        let Ok(meta) = std::fs::symlink_metadata(p) else {
            return 0;
        };
        if meta.is_dir() {
            return std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| walk(&e.path(), seen))
                .sum();
        }
        if seen.insert((meta.dev(), meta.ino())) {
            meta.len()
        } else {
            0
        }
    }
    let mut seen = HashSet::new();
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(store).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        *out.entry(name).or_default() += walk(&e.path(), &mut seen);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_and_their_config() {
        for p in Policy::ALL {
            assert_eq!(Policy::from_name(p.name()), Some(p));
            // What the sandbox gets must be valid crab config with the intended effect.
            let c = crab_runtime_config::Config::from_toml_str(&p.config(), Path::new("replay"))
                .unwrap();
            assert_eq!(c.checkpoint.enabled, p.checkpoints(), "{p:?}");
        }
        assert_eq!(Policy::from_name("minimal"), Some(Policy::Crab));
        assert_eq!(Policy::from_name("chat-only"), None);
        let c = |p: Policy| {
            crab_runtime_config::Config::from_toml_str(&p.config(), Path::new("replay"))
                .unwrap()
                .checkpoint
                .policy
        };
        assert_eq!(c(Policy::Crab), CheckpointPolicy::Minimal);
        assert_eq!(c(Policy::FsEveryTurn), CheckpointPolicy::FsEveryTurn);
        assert_eq!(c(Policy::FullEveryTurn), CheckpointPolicy::FullEveryTurn);
    }

    #[test]
    fn store_bytes_count_each_inode_once() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("blobs/sha256")).unwrap();
        std::fs::write(t.path().join("blobs/sha256/a"), [0u8; 100]).unwrap();
        std::fs::create_dir_all(t.path().join("proc/000001")).unwrap();
        std::fs::write(t.path().join("proc/000001/pages.img"), [0u8; 10]).unwrap();
        std::fs::hard_link(
            t.path().join("proc/000001/pages.img"),
            t.path().join("proc/000001/again.img"),
        )
        .unwrap();
        let b = store_bytes(t.path());
        assert_eq!(b["blobs"], 100);
        assert_eq!(b["proc"], 10);
    }
}

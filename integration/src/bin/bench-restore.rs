//! Restore benchmark (issue 5): prints figures, asserts nothing.
//!
//! Everything goes through the private containerd and the crab shim, with agent sandboxes
//! ([`crab_integration::sandbox::Sandbox`]: `localhost/crab/agent:latest`, `sleep infinity` as
//! init, turns as `bash -c` execs, turn ends through `Tasks.Update`, each turn waited for until
//! its checkpoint is durable).
//!
//! 0. Baseline: a plain start of the agent image under crab and under io.containerd.runc.v2,
//!    both as `ctr run -d` (wall time of the command) and through the API (Snapshots.Prepare +
//!    Containers.Create, Tasks.Create, Tasks.Start).
//! 1. Restore of fs-only chains of 1 / 10 / 50 layers: one sandbox gets 50 fs turns (a small
//!    edit each); `crabctl export --turn` of turns 1, 10 and 50; then starts of a new container
//!    from each image: `ctr run -d` with the image's snapshots removed first (`cold`: containerd
//!    unpacks the checkpoint's layers), `ctr run -d` again (`warm`: unpacked), and the API path
//!    on the unpacked image (request until Tasks.Start returned = the task runs).
//! 2. Restore of a 50 MB process: a python3 holding a 50 MB bytearray of random bytes (started
//!    in a turn, alive in the background: a proc checkpoint), exported, started the same three
//!    ways; the shim's own part is read from its log: `container X restored from ... in D`
//!    (runc restore + CRIU), then until its `inspector: watching cgroup` line (setting up
//!    checkpoints; the process image is imported into the new container's store in the
//!    background), then until Tasks.Start returned (the inspector's base mark also runs in the
//!    background). Each restored container is checked to hold the process again. The shim's
//!    kernel check at CRIU's gate (`kernel check passed in D ms`) is read from the same log,
//!    and (sections 1 and 2) what Create's question to the engine cost (`rootfs layers asked
//!    of the engine in D ms`). `BENCH_RESTORE_ONLY=2` runs this section alone.
//! 3. Rollback, end to end (`crabctl rollback C --to T`, wall time; crabctl's own figure too):
//!    each repetition runs a turn that writes a file and then rolls back to before it; fs-only
//!    (turn 10 of the 50-turn sandbox) and with the 50 MB process. The same checkpoint is also
//!    exported on its own after each rollback: the share of the export in a rollback.
//!    (With the process, `--recreate`: the process restore is what is measured; fs-only goes
//!    in place when it can.) Then (3b) a rollback of a 1 MB delta (half of a 1 MB file
//!    rewritten, a 512 KiB file and a directory created since the checkpoint), in place and
//!    recreated (`--recreate`) alternately in the same run: crabctl's wall time and own total,
//!    and in place the shim's freeze and apply. `BENCH_RESTORE_ONLY=3b` runs this section alone.
//! 4. Fork: for N = 1, 8, 32, in each round: N plain API starts of the agent image at once
//!    under crab (the reference), `crabctl fork C --at T --count N -o json` of the fs checkpoint,
//!    and of the process checkpoint (after one untimed warm-up fork of each); the forks are
//!    removed after each. Per fork, crabctl's figures (its own time: Containers.Create,
//!    Tasks.Create, Tasks.Start) and the shim's `restored in`; the last fork of the first round
//!    is checked to hold the process again. Ratios: fork N wall / N plain starts (p50s), and
//!    fork N wall / N against one start of the same checkpoint image (a plain start plus a
//!    restore, sections 1 and 2). Each fork's store is looked at: one that already holds
//!    checkpoints continues a removed fork's lineage. `BENCH_RESTORE_ONLY=4` runs this section
//!    alone (without sections 1-2, the ratios against one start of the image are left out).
//!
//!    4b, forks that merge their memory: for N = 8 and 32, `crabctl fork --merge-memory` of
//!    the process checkpoint, then the host's ksmd run at 5,000 pages every 20 ms (the host's
//!    own settings are put back afterwards): the forks' summed PSS right after the start and
//!    once merged, against one restored sandbox's (a single fork alone), how long merging took
//!    and ksmd's CPU time (issue 29's aim: at most 2x one). `BENCH_RESTORE_ONLY=4b` runs this
//!    section alone.
//!
//! 5. Lazy restore: for 50, 128 and 512 MB held by a python3 (random bytes; `BENCH_LAZY_SIZES`
//!    picks others), the process checkpoint is exported and started through the API, eagerly
//!    (`[restore] lazy_pages_min_mib = 0`), lazily (`= 1`) and with the default configuration
//!    in turn in the same run: until Tasks.Start returned (the processes run), the shim's
//!    `restored in`, whether `pgrep -f` finds the holder by its command line right after the
//!    start, until a first exec has made the holder touch every page (the worst case for lazy
//!    pages: each missing page is a fault the daemon serves), and, lazy only, until the shim
//!    logged that every page had arrived; then the default configuration's 512 MB start over
//!    its 50 MB start (issue 29's aim: within 1.5x). `BENCH_RESTORE_ONLY=5` runs this section
//!    alone.
//! 6. Verification of a large image (50 and 200 MB held by a python3; `BENCH_VERIFY_SIZES`):
//!    API starts with the restore cache off (each a first restore), the page files' digests
//!    checked before the restore (`[restore] verify_during_restore = false`) and while CRIU
//!    restores (`true`, the default) alternately: until Tasks.Start returned, and what
//!    verification cost the critical path (the shim's `verified in`, plus CRIU's wait at the
//!    post-restore gate). `BENCH_RESTORE_ONLY=6` runs this section alone.
//!
//! Aims (the issues'; printed next to the figures, not checked): fs-only rollback p50 <= 20 ms;
//! restore with a 50 MB process p50 <= 300 ms; forking N <= 1.2x N plain starts at once, and no
//! slower per sandbox than a plain start plus a restore.
//!
//! Output: a table on stdout; `$CRAB_HOME/bench/restore-<unix time>.{json,md}` and
//! `restore-latest.{json,md}`, written after each section too (a run that stops keeps what it
//! measured: the report then says where it stopped). Cleanup comes last, in dependency order
//! (containers, then the unpacked snapshots of the run's checkpoint images, children first,
//! then the images); what it cannot remove is reported with the figures, not fatal to them.
//! `CRAB_BENCH_RESTORE_CACHE=off` runs the sandboxes without the restore cache (for a before /
//! after of the cache in the same build).
//!
//! `cargo run --release -p crab-integration --bin bench-restore [-- --reps N --rollback-reps N
//! --fork-reps N]` with the private containerd up and the images imported (`make build images
//! containerd-up`, then `eval "$(hack/containerd.sh env)"`); crabctl is taken from
//! target/release. For the steps inside crabctl and the shim (runc create/restore, Diff.Apply,
//! the inspector's base mark), start that containerd with `CRAB_CONTAINERD_LOG_LEVEL=debug`:
//! shims then log at debug level too, with timestamps, into its log.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crab_integration::bench::stats::{ms, Summary as Stats};
use crab_integration::bench::Host;

use containerd_client::services::v1::snapshots::{
    snapshots_client::SnapshotsClient, ListSnapshotsRequest, RemoveSnapshotRequest,
};
use containerd_client::services::v1::{
    containers_client::ContainersClient, content_client::ContentClient,
    images_client::ImagesClient, GetImageRequest, ListContainersRequest, ListImagesRequest,
    ReadContentRequest,
};
use crab_integration::api::crab_runtime_options;
use crab_integration::env::{TestEnv, DEFAULT_RUNTIME, RUNC_RUNTIME};
use crab_integration::harness::{chain_id, SNAPSHOTTER};
use crab_integration::sandbox::{Sandbox, SandboxOptions, AGENT_IMAGE};
use crab_integration::spec::container_spec;
use crab_integration::{CleanupGuard, Harness, ProcessSpec};
use serde_json::{json, Value};

const BENCH: crab_integration::bench::Bench = crab_integration::bench::Bench::new("bench-restore");
const T: Duration = Duration::from_secs(180);
const CHAINS: [usize; 3] = [1, 10, 50];
const FORKS: [usize; 3] = [1, 8, 32];
const HELD_MB: usize = 50;
/// Section 5's sizes, MB held.
const LAZY_SIZES: [usize; 3] = [50, 128, 512];
/// Section 6's image sizes (MB held by the process).
const VERIFY_SIZES: [usize; 2] = [50, 200];
/// The issue's aim for what signature verification and checks cost a restore.
const AIM_VERIFY_MS: f64 = 5.0;
const ROLLBACK_CHAIN: usize = 10;

const AIM_ROLLBACK_FS_MS: f64 = 20.0;
const AIM_RESTORE_PROC_MS: f64 = 300.0;
/// Forking N: at most this times the wall time of N plain starts at once (issue 15).
const AIM_FORK_OVER_PLAIN: f64 = 1.2;

type Res<T> = Result<T, String>;

struct Opts {
    reps: usize,
    rollback_reps: usize,
    fork_reps: usize,
}

fn opts() -> Opts {
    let (mut reps, mut rollback_reps, mut fork_reps) = (5, 10, 5);
    crab_integration::bench::parse_counts(
        "bench-restore",
        "[--reps N (5): starts per image and way] [--rollback-reps N (10)] [--fork-reps N (5)]",
        &mut [
            ("--reps", &mut reps),
            ("--rollback-reps", &mut rollback_reps),
            ("--fork-reps", &mut fork_reps),
        ],
    );
    Opts {
        reps,
        rollback_reps,
        fork_reps,
    }
}

/// One row of the report: a named series of milliseconds.
struct Row {
    section: &'static str,
    what: String,
    samples: Vec<f64>,
    aim: Option<f64>,
    note: String,
}

#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    /// Things seen on the way, printed after the table.
    notes: Vec<String>,
    extra: serde_json::Map<String, Value>,
    /// The error that stopped the run (the figures before it are kept).
    failed: Option<String>,
    /// What the cleanup could not remove.
    cleanup: Vec<String>,
}

impl Report {
    fn row(
        &mut self,
        section: &'static str,
        what: impl Into<String>,
        samples: Vec<f64>,
        aim: Option<f64>,
        note: impl Into<String>,
    ) {
        self.rows.push(Row {
            section,
            what: what.into(),
            samples,
            aim,
            note: note.into(),
        });
    }

    fn p50(&self, what: &str) -> f64 {
        self.rows
            .iter()
            .find(|r| r.what == what)
            .map(|r| Stats::of(&r.samples).p50)
            .unwrap_or(f64::NAN)
    }
}

fn p50_of(v: &[f64]) -> f64 {
    Stats::of(v).p50
}

// ---------------------------------------------------------------------------------------------
// containerd, ctr and crabctl

/// One start through the API, in steps.
#[derive(Default, Clone)]
struct ApiStart {
    /// Lease, Snapshots.Prepare and Containers.Create (what `ctr run` does before the task).
    container_ms: f64,
    task_create_ms: f64,
    task_start_ms: f64,
    total_ms: f64,
    /// Unix time Tasks.Start returned (to compare with the shim's log lines).
    started_at: f64,
}

/// The shim's log lines about one restore.
#[derive(Clone, Copy)]
struct ShimLog {
    /// Its `restored ... in D` figure: runc restore (CRIU) and the init's stdio.
    restore_ms: f64,
    /// Its `checkpoint image of ID verified in D ms` figure: the description and signature,
    /// the CRIU files' digests (hashing time only: the files are read to be copied anyway) and
    /// the least-privilege check.
    verify_ms: f64,
    /// With the page files verified while CRIU restored (`[restore] verify_during_restore`):
    /// how long hashing them took, and how long CRIU waited for the verdict at its post-restore
    /// gate (what of the hashing stayed on the critical path). NaN where not logged.
    pages_ms: f64,
    gate_wait_ms: f64,
    /// Its `kernel check passed in D ms` figure: what CRIU restored read from the kernel and
    /// compared with the spec while CRIU held the tree at pre-resume (on the critical path).
    kernel_check_ms: f64,
    /// Unix times of that line and of the inspector's start after it.
    restored_at: f64,
    inspector_at: Option<f64>,
}

impl ShimLog {
    /// From the restore's end until checkpointing of the container began.
    fn setup_ms(&self) -> f64 {
        self.inspector_at
            .map_or(f64::NAN, |t| (t - self.restored_at) * 1e3)
    }
}

#[derive(Default)]
struct StartSeries {
    ctr_cold: Vec<f64>,
    ctr_warm: Vec<f64>,
    api: Vec<ApiStart>,
    /// The shim's log figure for runc restore (process images only), per way.
    shim_cold: Vec<f64>,
    shim_warm: Vec<f64>,
    shim_api: Vec<f64>,
    /// Restore's end until checkpointing began (all ways), see [`ShimLog::setup_ms`].
    setup: Vec<f64>,
    /// The shim's verification of the image (all ways), see [`ShimLog::verify_ms`].
    verify: Vec<f64>,
    /// The kernel check at CRIU's gate (all ways), see [`ShimLog::kernel_check_ms`].
    kernel_check: Vec<f64>,
    /// Create's question to the engine: which layers it unpacked the rootfs from (all ways,
    /// fs and process images), see [`Bench::layers_ms`].
    layers: Vec<f64>,
    /// API starts: checkpointing began until Tasks.Start returned (the inspector's base mark).
    api_tail: Vec<f64>,
    /// Snapshots removed before each cold start.
    removed: Vec<usize>,
    /// Layers (index in the image) whose snapshot was not there to remove.
    absent: Vec<Vec<usize>>,
    /// Resident KiB of the holder as seen inside restored containers (process images only).
    held_kib: Vec<f64>,
}

impl StartSeries {
    fn api_col(&self, f: impl Fn(&ApiStart) -> f64) -> Vec<f64> {
        self.api.iter().map(f).collect()
    }

    fn json(&self) -> Value {
        json!({
            "ctr_run_cold_ms": Stats::json(&self.ctr_cold),
            "ctr_run_warm_ms": Stats::json(&self.ctr_warm),
            "api_total_ms": Stats::json(&self.api_col(|a| a.total_ms)),
            "api_container_create_ms": Stats::json(&self.api_col(|a| a.container_ms)),
            "api_task_create_ms": Stats::json(&self.api_col(|a| a.task_create_ms)),
            "api_task_start_ms": Stats::json(&self.api_col(|a| a.task_start_ms)),
            "shim_after_restore_until_checkpointing_ms": Stats::json(&self.setup),
            "shim_image_verification_ms": Stats::json(&self.verify),
            "shim_kernel_check_ms": Stats::json(&self.kernel_check),
            "shim_rootfs_layers_query_ms": Stats::json(&self.layers),
            "api_checkpointing_began_until_start_returned_ms": Stats::json(&self.api_tail),
            "shim_restore_log_ms": {"cold": Stats::json(&self.shim_cold), "warm": Stats::json(&self.shim_warm), "api": Stats::json(&self.shim_api)},
            "snapshots_removed_before_cold": self.removed,
            "layers_not_unpacked_before_cold": self.absent,
            "held_kib_after_restore": self.held_kib,
        })
    }
}

struct Bench {
    base: Harness,
    o: Opts,
    pid: u32,
    /// crab config of containers this run starts itself (`ctr run`, API).
    cfg_path: PathBuf,
    cfg_body: String,
    /// Their crab state.
    state_dir: PathBuf,
    guard: CleanupGuard,
    /// Image records this run wrote.
    images: Vec<String>,
    /// Sandboxes whose checkpoint images crabctl wrote (`crab.local/checkpoint/<ns>/<id>:<seq>`).
    sandboxes: Vec<String>,
    n: usize,
    log: PathBuf,
    /// The process checkpoint's manifest, for the results.
    extra_manifest: Option<Value>,
    /// Manifests in each fork's store right after it started.
    fork_store_manifests: Vec<usize>,
    /// The ids of the forks started.
    forks: Vec<String>,
    /// Resident KiB of the holder in a fork of the process checkpoint (first round of each N).
    fork_held_kib: Vec<f64>,
    /// The results' file name stamp (the run's start).
    stamp: u64,
}

impl Bench {
    fn id(&mut self, what: &str) -> String {
        self.n += 1;
        let id = format!("bench-restore-{}-{what}-{}", self.pid, self.n);
        self.guard.add(&id);
        id
    }

    fn log_len(&self) -> u64 {
        std::fs::metadata(&self.log).map(|m| m.len()).unwrap_or(0)
    }

    /// The shim's `container ID restored from ... in D` figure logged after byte `from` of
    /// containerd's log (the shim's log reaches it asynchronously: waits up to 2 s).
    async fn shim_restore_ms(&self, from: u64, id: &str) -> Option<f64> {
        self.shim_log(from, id).await.map(|l| l.restore_ms)
    }

    /// The shim's `create ID: rootfs layers asked of the engine in D ms` figure logged after
    /// byte `from` of containerd's log (waits up to 2 s for it to arrive).
    async fn layers_ms(&self, from: u64, id: &str) -> Option<f64> {
        let needle = format!("create {id}: rootfs layers asked of the engine in ");
        for _ in 0..40 {
            if let Ok(text) = std::fs::read(&self.log) {
                let text = String::from_utf8_lossy(&text[(from as usize).min(text.len())..]);
                if let Some(ms) = text.lines().find_map(|l| {
                    let rest = &l[l.find(&needle)? + needle.len()..];
                    rest.split_whitespace().next()?.parse::<f64>().ok()
                }) {
                    return Some(ms);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// What the shim logged about restoring `id` after byte `from` of containerd's log: the
    /// `restored ... in D` line, and the next `inspector: watching cgroup` line, which the
    /// shim logs once it has set up checkpointing of the restored container (for a new
    /// container that includes importing the process image into its store). Only meaningful
    /// while no other container starts: the inspector line names no container.
    async fn shim_log(&self, from: u64, id: &str) -> Option<ShimLog> {
        let needle = format!("container {id} restored from ");
        let mut found = None;
        for _ in 0..40 {
            if let Ok(text) = std::fs::read(&self.log) {
                let text =
                    String::from_utf8_lossy(&text[(from as usize).min(text.len())..]).into_owned();
                let lines: Vec<&str> = text.lines().collect();
                if let Some(at) = lines.iter().rposition(|l| l.contains(&needle)) {
                    let line = lines[at];
                    let after = &line[line.find(&needle).unwrap() + needle.len()..];
                    let restore_ms = after
                        .rsplit_once(" in ")
                        .and_then(|(_, d)| parse_duration_ms(d.split_whitespace().next()?))?;
                    let restored_at = log_time(line).unwrap_or(f64::NAN);
                    let inspector_at = lines[at + 1..]
                        .iter()
                        .find(|l| l.contains("inspector: watching cgroup"))
                        .and_then(|l| log_time(l));
                    // The figure after `prefix` on the last line before the restore's.
                    let figure_before = |prefix: String| {
                        lines[..at]
                            .iter()
                            .rev()
                            .find_map(|l| {
                                let rest = &l[l.find(&prefix)? + prefix.len()..];
                                rest.split_whitespace().next()?.parse::<f64>().ok()
                            })
                            .unwrap_or(f64::NAN)
                    };
                    let verify_ms = figure_before(format!("checkpoint image of {id} verified in "));
                    let kernel_check_ms =
                        figure_before(format!("container {id}: kernel check passed in "));
                    let pages = format!("checkpoint image of {id}: its page files (");
                    let (pages_ms, gate_wait_ms) = lines
                        .iter()
                        .find_map(|l| {
                            let rest = &l[l.find(&pages)? + pages.len()..];
                            let took = rest
                                .split_once(" verified in ")?
                                .1
                                .split_whitespace()
                                .next()?
                                .parse::<f64>()
                                .ok()?;
                            let waited = match rest.split_once("CRIU waited ") {
                                Some((_, w)) => w.split_whitespace().next()?.parse().ok()?,
                                None => 0.0,
                            };
                            Some((took, waited))
                        })
                        .unwrap_or((f64::NAN, f64::NAN));
                    found = Some(ShimLog {
                        restore_ms,
                        verify_ms,
                        pages_ms,
                        gate_wait_ms,
                        kernel_check_ms,
                        restored_at,
                        inspector_at,
                    });
                    if inspector_at.is_some() {
                        return found;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        found
    }

    /// `ctr run -d` of `image` as `id` under `runtime`; its wall time (ctr returns once the task
    /// was started).
    fn ctr_run(&self, runtime: &str, image: &str, id: &str) -> Res<f64> {
        let mut args = vec!["run", "-d", "--runtime", runtime];
        let cfg = self.cfg_path.to_string_lossy().into_owned();
        if runtime == DEFAULT_RUNTIME {
            args.extend(["--runtime-config-path", cfg.as_str()]);
        }
        args.extend([image, id, "sleep", "infinity"]);
        let ctr = self.base.ctr();
        let t0 = Instant::now();
        let out = tokio::task::block_in_place(|| ctr.run_with(&args, None, T))
            .map_err(|e| e.to_string())?;
        let took = ms(t0.elapsed());
        if !out.status.success() {
            return Err(format!(
                "ctr {}: {}{}\n{}",
                args.join(" "),
                out.stdout,
                out.stderr,
                self.base.log_excerpt(id)
            ));
        }
        Ok(took)
    }

    async fn api_start(&self, h: &Harness, id: &str) -> Res<ApiStart> {
        api_start(h, id, &self.cfg_body).await
    }

    async fn remove(&self, id: &str) -> Res<()> {
        self.base
            .kill_and_remove(id)
            .await
            .map(|_| ())
            .map_err(|e| format!("removing {id}: {e}"))
    }

    /// A harness whose image is `image` (its chain id and config resolved).
    async fn harness_for(&self, image: &str, runtime: &str) -> Res<Harness> {
        let env = TestEnv {
            image: image.into(),
            runtime: runtime.into(),
            ..self.base.env.clone()
        };
        Harness::connect_env(env).await.map_err(|e| e.to_string())
    }

    /// crabctl against this containerd and namespace: (wall ms, stdout, stderr); fails unless it
    /// exits 0.
    fn crabctl(&self, args: &[&str]) -> Res<(f64, String, String)> {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
        let mut cmd = std::process::Command::new(&bin);
        cmd.arg("--address")
            .arg(&self.base.env.address)
            .args(["--namespace", &self.base.env.namespace])
            .args(args);
        let t0 = Instant::now();
        let out = tokio::task::block_in_place(|| cmd.output())
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        let took = ms(t0.elapsed());
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        if !out.status.success() {
            return Err(format!(
                "crabctl {}: {stdout}{stderr}\n{}",
                args.join(" "),
                self.base.log_excerpt(args.get(1).copied().unwrap_or(""))
            ));
        }
        Ok((took, stdout, stderr))
    }

    async fn read_blob(&self, digest: &str) -> Res<Vec<u8>> {
        let mut stream = ContentClient::new(self.base.channel())
            .read(self.base.request(ReadContentRequest {
                digest: digest.into(),
                offset: 0,
                size: 0,
            }))
            .await
            .map_err(|s| format!("Content.Read {digest}: {}", s.message()))?
            .into_inner();
        let mut data = Vec::new();
        while let Some(chunk) = stream
            .message()
            .await
            .map_err(|s| format!("Content.Read {digest}: {}", s.message()))?
        {
            data.extend_from_slice(&chunk.data);
        }
        Ok(data)
    }

    /// An image's config (crabctl writes plain manifests, no index).
    async fn image_config(&self, name: &str) -> Res<Value> {
        let target = ImagesClient::new(self.base.channel())
            .get(self.base.request(GetImageRequest { name: name.into() }))
            .await
            .map_err(|s| format!("Images.Get {name}: {}", s.message()))?
            .into_inner()
            .image
            .and_then(|i| i.target)
            .ok_or_else(|| format!("image {name} has no target"))?;
        let parse = |b: Vec<u8>, what: &str| {
            serde_json::from_slice::<Value>(&b).map_err(|e| format!("{name}: {what}: {e}"))
        };
        let manifest = parse(self.read_blob(&target.digest).await?, "manifest")?;
        let config = manifest["config"]["digest"]
            .as_str()
            .ok_or_else(|| format!("{name}: manifest without config"))?;
        parse(self.read_blob(config).await?, "config")
    }

    /// Removes the unpacked snapshots of `image`'s layers above its base image (top first), so
    /// the next start unpacks them again. Returns how many there were.
    async fn remove_unpacked(&self, image: &str) -> Res<(usize, Vec<usize>)> {
        let config = self.image_config(image).await?;
        let diff_ids: Vec<String> = config["rootfs"]["diff_ids"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|d| d.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        let base: usize = config["config"]["Labels"]["io.crab.checkpoint.base-layers"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{image}: no io.crab.checkpoint.base-layers label"))?;
        let (mut removed, mut absent) = (0, Vec::new());
        for i in (base..diff_ids.len()).rev() {
            let chain = chain_id(&diff_ids[..=i]).expect("non-empty");
            match self.remove_snapshot_tree(&chain).await {
                Ok(true) => removed += 1,
                Ok(false) => absent.push(i),
                Err(e) => return Err(format!("{image}: layer {i}: {e}")),
            }
        }
        Ok((removed, absent))
    }

    /// Removes snapshot `key`, after the snapshots above it that no container uses (what an
    /// interrupted unpack leaves, or the unpacked layers of another checkpoint image that
    /// shares these), deepest first: containerd refuses to remove a snapshot with children.
    /// Returns whether `key` was there.
    async fn remove_snapshot_tree(&self, key: &str) -> Res<bool> {
        let mut tree = vec![key.to_string()];
        let mut i = 0;
        while i < tree.len() && tree.len() < 10_000 {
            let children = self.snapshot_children(&tree[i]).await;
            tree.extend(children);
            i += 1;
        }
        if tree.len() > 1 {
            let in_use: Vec<String> = ContainersClient::new(self.base.channel())
                .list(self.base.request(ListContainersRequest::default()))
                .await
                .map_err(|s| format!("Containers.List: {}", s.message()))?
                .into_inner()
                .containers
                .into_iter()
                .map(|c| c.snapshot_key)
                .collect();
            if let Some(used) = tree[1..].iter().find(|k| in_use.contains(k)) {
                return Err(format!(
                    "snapshot {key} cannot go: {used} above it is a container's rootfs (snapshots above: {:?})",
                    &tree[1..]
                ));
            }
        }
        let mut there = false;
        for (n, k) in tree.iter().enumerate().rev() {
            let r = SnapshotsClient::new(self.base.channel())
                .remove(self.base.request(RemoveSnapshotRequest {
                    snapshotter: SNAPSHOTTER.into(),
                    key: k.clone(),
                }))
                .await;
            match r {
                Ok(_) => there |= n == 0,
                Err(s) if s.code() == tonic::Code::NotFound => {}
                Err(s) => {
                    let children = self.snapshot_children(k).await;
                    return Err(format!(
                        "removing snapshot {k}: {} (children: {children:?})",
                        s.message()
                    ));
                }
            }
        }
        Ok(there)
    }

    /// The snapshots whose parent is `key` (for error messages).
    /// (All snapshots are listed and matched here: a `parent==` filter with a digest in it
    /// matched nothing, which hid the children that made removals fail.)
    async fn snapshot_children(&self, key: &str) -> Vec<String> {
        let mut out = Vec::new();
        let r = SnapshotsClient::new(self.base.channel())
            .list(self.base.request(ListSnapshotsRequest {
                snapshotter: SNAPSHOTTER.into(),
                filters: vec![],
            }))
            .await;
        if let Ok(mut stream) = r.map(|r| r.into_inner()) {
            while let Ok(Some(m)) = stream.message().await {
                out.extend(
                    m.info
                        .into_iter()
                        .filter(|i| i.parent == key)
                        .map(|i| i.name),
                );
            }
        }
        out
    }
}

/// A container of `h`'s image through the API, `sleep infinity` in the spec every sandbox
/// of this run has (so a process image restores into the mounts it was dumped from).
async fn api_start(h: &Harness, id: &str, cfg_body: &str) -> Res<ApiStart> {
    let process = ProcessSpec::new(&["sleep", "infinity"]).to_oci(&h.image.env, &h.image.cwd);
    let spec = container_spec(id, &h.env.namespace, process);
    let options =
        (h.env.runtime == DEFAULT_RUNTIME).then(|| crab_runtime_options(None, Some(cfg_body)));
    let what =
        |step: &str, e: &dyn std::fmt::Display| format!("{step} {id}: {e}\n{}", h.log_excerpt(id));
    let t0 = Instant::now();
    h.create_container_with_spec_and_options(id, &spec, options)
        .await
        .map_err(|e| what("create container", &e))?;
    let t1 = Instant::now();
    h.create_task(id, None)
        .await
        .map_err(|e| what("create task", &e))?;
    let t2 = Instant::now();
    h.start(id, "").await.map_err(|e| what("start", &e))?;
    let t3 = Instant::now();
    Ok(ApiStart {
        container_ms: ms(t1 - t0),
        task_create_ms: ms(t2 - t1),
        task_start_ms: ms(t3 - t2),
        total_ms: ms(t3 - t0),
        started_at: unix_now(),
    })
}

/// The unix time of a containerd log line (`time="2026-11-29T13:18:09.343991922Z"`, UTC).
fn log_time(line: &str) -> Option<f64> {
    let t = line.split("time=\"").nth(1)?.split('"').next()?;
    let at = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()?;
    Some(at.unix_timestamp_nanos() as f64 / 1e9)
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(f64::NAN)
}

/// Rust's `Debug` of a `Duration` ("152.288865ms", "1.2s", "830µs") in milliseconds.
fn parse_duration_ms(s: &str) -> Option<f64> {
    for (unit, f) in [
        ("ms", 1.0),
        ("µs", 1e-3),
        ("us", 1e-3),
        ("ns", 1e-6),
        ("s", 1e3),
    ] {
        if let Some(n) = s.strip_suffix(unit) {
            return n.parse::<f64>().ok().map(|v| v * f);
        }
    }
    None
}

/// crabctl's own figure: the number before " ms" after the last " in ".
fn crabctl_ms(text: &str) -> f64 {
    text.lines()
        .filter_map(|l| {
            let (_, rest) = l.rsplit_once(" in ")?;
            rest.split_once(" ms")?.0.trim().parse::<f64>().ok()
        })
        .next_back()
        .unwrap_or(f64::NAN)
}

// ---------------------------------------------------------------------------------------------
// Sandboxes

/// Starts a python3 holding `HELD_MB` MB of random bytes in the background and waits until it
/// has them (it says so on a pipe: no file of the sandbox changes, so the turn is a proc turn).
fn holder_script() -> String {
    format!(
        r#"exec 3< <(exec -a crab-holder python3 -u -c '
import os, time
b = bytearray({HELD_MB} << 20)
for i in range(0, len(b), 1 << 20):
    b[i:i + (1 << 20)] = os.urandom(1 << 20)
print("ready", flush=True)
fd = os.open("/dev/null", os.O_WRONLY)
os.dup2(fd, 1)
os.close(fd)
while True:
    time.sleep(3600)
' </dev/null 2>/dev/null)
read -r line <&3
[ "$line" = ready ] || {{ echo "holder said: $line" >&2; exit 1; }}"#
    )
}

/// Resident KiB of the holder in a container (0: not there).
const HELD_KIB: &str = "pid=$(pgrep -f '^crab-holder' | head -n1); [ -n \"$pid\" ] && ps -o rss= -p \"$pid\" || echo 0";

/// The sandbox's turn that just ended, with its checkpoint durable: (seq, turn id, manifest).
async fn end_turn(s: &mut Sandbox) -> Res<(u64, String, Value)> {
    s.end_turn().await;
    s.sync().await;
    let turn = format!("t{}", s.turn);
    let m = s
        .manifests()
        .into_iter()
        .rev()
        .find(|m| m["turn_id"] == turn.as_str())
        .ok_or_else(|| format!("{}: no checkpoint for turn {turn}", s.id))?;
    let seq = m["seq"]
        .as_u64()
        .ok_or_else(|| format!("{}: manifest without seq: {m}", s.id))?;
    Ok((seq, turn, m))
}

/// A handle on another container of the run, for running commands in it.
fn sandbox_for(h: &Harness, id: &str) -> Sandbox {
    Sandbox {
        h: h.clone(),
        id: id.to_string(),
        state_dir: PathBuf::new(),
        turn: 0,
    }
}

async fn held_kib(h: &Harness, id: &str) -> f64 {
    let mut s = sandbox_for(h, id);
    s.turn = 1000;
    s.run(HELD_KIB).await.stdout.trim().parse().unwrap_or(0.0)
}

// ---------------------------------------------------------------------------------------------
// 0. Baseline

async fn baseline(b: &mut Bench, r: &mut Report) -> Res<()> {
    BENCH.progress(format!(
        "0/4 baseline: plain starts of {AGENT_IMAGE}, {} each",
        b.o.reps
    ));
    let mut j = serde_json::Map::new();
    for (name, runtime) in [("crab", DEFAULT_RUNTIME), ("runc", RUNC_RUNTIME)] {
        let h = b.harness_for(AGENT_IMAGE, runtime).await?;
        let (mut ctr, mut api) = (Vec::new(), Vec::<ApiStart>::new());
        for _ in 0..b.o.reps {
            let id = b.id(&format!("base-{name}"));
            ctr.push(b.ctr_run(runtime, AGENT_IMAGE, &id)?);
            b.remove(&id).await?;
            let id = b.id(&format!("base-{name}"));
            api.push(b.api_start(&h, &id).await?);
            b.remove(&id).await?;
        }
        let col = |f: fn(&ApiStart) -> f64| api.iter().map(f).collect::<Vec<_>>();
        r.row(
            "0 baseline",
            format!("ctr run -d, base image, {runtime}"),
            ctr.clone(),
            None,
            "",
        );
        r.row(
            "0 baseline",
            format!("API create+start, base image, {runtime}"),
            col(|a| a.total_ms),
            None,
            format!(
                "container {:.0} / task create {:.0} / start {:.0}",
                p50_of(&col(|a| a.container_ms)),
                p50_of(&col(|a| a.task_create_ms)),
                p50_of(&col(|a| a.task_start_ms))
            ),
        );
        j.insert(
            name.into(),
            json!({"runtime": runtime, "ctr_run_ms": Stats::json(&ctr), "api_total_ms": Stats::json(&col(|a| a.total_ms)),
                   "api_container_create_ms": Stats::json(&col(|a| a.container_ms)),
                   "api_task_create_ms": Stats::json(&col(|a| a.task_create_ms)), "api_task_start_ms": Stats::json(&col(|a| a.task_start_ms))}),
        );
    }
    r.extra.insert("baseline".into(), Value::Object(j));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 1./2. Restore = start from a checkpoint image

/// `reps` x (cold `ctr run`, warm `ctr run`, API start) of checkpoint image `image`.
async fn restore_series(
    b: &mut Bench,
    image: &str,
    what: &str,
    with_process: bool,
) -> Res<StartSeries> {
    let h = b.harness_for(image, DEFAULT_RUNTIME).await?;
    let mut s = StartSeries::default();
    for rep in 0..b.o.reps {
        let (removed, absent) = b.remove_unpacked(image).await?;
        s.removed.push(removed);
        s.absent.push(absent);
        for cold in [true, false] {
            let id = b.id(what);
            let from = b.log_len();
            let took = b.ctr_run(DEFAULT_RUNTIME, image, &id)?;
            s.layers.extend(b.layers_ms(from, &id).await);
            let log = if with_process {
                b.shim_log(from, &id).await
            } else {
                None
            };
            let shim = log.map(|l| l.restore_ms);
            s.setup.extend(log.map(|l| l.setup_ms()));
            s.verify.extend(log.map(|l| l.verify_ms));
            s.kernel_check.extend(log.map(|l| l.kernel_check_ms));
            if with_process && rep == 0 {
                s.held_kib.push(held_kib(&h, &id).await);
            }
            let (series, shim_series) = if cold {
                (&mut s.ctr_cold, &mut s.shim_cold)
            } else {
                (&mut s.ctr_warm, &mut s.shim_warm)
            };
            series.push(took);
            shim_series.push(shim.unwrap_or(f64::NAN));
            b.remove(&id).await?;
        }
        let id = b.id(what);
        let from = b.log_len();
        let api = b.api_start(&h, &id).await?;
        s.layers.extend(b.layers_ms(from, &id).await);
        if with_process {
            let log = b.shim_log(from, &id).await;
            s.shim_api.push(log.map_or(f64::NAN, |l| l.restore_ms));
            s.setup.extend(log.map(|l| l.setup_ms()));
            s.verify.extend(log.map(|l| l.verify_ms));
            s.kernel_check.extend(log.map(|l| l.kernel_check_ms));
            s.api_tail.extend(
                log.and_then(|l| l.inspector_at)
                    .map(|t| (api.started_at - t) * 1e3),
            );
            if rep == 0 {
                s.held_kib.push(held_kib(&h, &id).await);
            }
        }
        s.api.push(api);
        b.remove(&id).await?;
    }
    // The next image's cold starts must not find layers this one shares with it unpacked.
    b.remove_unpacked(image).await?;
    Ok(s)
}

/// Exports checkpoint `seq` of `s` as `image` once, then twice more over it (what rollback and
/// fork pay each time: the content is there already); the wall times.
fn export_series(b: &mut Bench, s: &Sandbox, seq: u64, image: &str) -> Res<(Vec<f64>, String)> {
    let mut times = Vec::new();
    let mut summary = String::new();
    for _ in 0..3 {
        let (took, out, _) = b.crabctl(&["export", &s.id, "--turn", &seq.to_string(), image])?;
        times.push(took);
        summary = out.trim().to_string();
    }
    if !b.images.iter().any(|i| i == image) {
        b.images.push(image.to_string());
    }
    Ok((times, summary))
}

fn restore_rows(
    r: &mut Report,
    section: &'static str,
    label: &str,
    s: &StartSeries,
    aim: Option<f64>,
    export: &[f64],
) {
    let api_note = format!(
        "container {:.0} / task create {:.0} / start {:.0}",
        p50_of(&s.api_col(|a| a.container_ms)),
        p50_of(&s.api_col(|a| a.task_create_ms)),
        p50_of(&s.api_col(|a| a.task_start_ms))
    );
    // Layers above the base image: a cold start unpacks them all.
    let removed = s.removed.first().copied().unwrap_or(0) + s.absent.first().map_or(0, Vec::len);
    r.row(
        section,
        format!("{label}: ctr run -d, cold (unpack)"),
        s.ctr_cold.clone(),
        aim,
        format!("unpacks {removed} layers"),
    );
    r.row(
        section,
        format!("{label}: ctr run -d, warm"),
        s.ctr_warm.clone(),
        aim,
        "",
    );
    r.row(
        section,
        format!("{label}: API create+start, warm"),
        s.api_col(|a| a.total_ms),
        aim,
        api_note,
    );
    r.row(
        section,
        format!("{label}: shim, rootfs layers asked of the engine"),
        s.layers.clone(),
        None,
        "part of Create, all three ways: containerd's Containers.Get, Snapshots.Mounts and Stat up to the image's top layer",
    );
    if s.shim_api.iter().any(|x| !x.is_nan()) || s.shim_warm.iter().any(|x| !x.is_nan()) {
        let mut all = s.shim_cold.clone();
        all.extend(&s.shim_warm);
        all.extend(&s.shim_api);
        r.row(
            section,
            format!("{label}: shim log 'restored in' (runc restore)"),
            all,
            None,
            "all three ways",
        );
        r.row(
            section,
            format!("{label}: shim, image verification (signature, digests, privileges)"),
            s.verify.clone(),
            Some(5.0),
            "part of Create: one read of the CRIU files while copying them out",
        );
        r.row(
            section,
            format!("{label}: shim, kernel check at CRIU's gate"),
            s.kernel_check.clone(),
            Some(5.0),
            "critical path: every restored thread read from /proc and the task iterator, compared with the spec",
        );
        r.row(
            section,
            format!("{label}: shim, restored until checkpointing began"),
            s.setup.clone(),
            None,
            "store and inspector set-up; the process image is imported in the background (log times)",
        );
        r.row(
            section,
            format!("{label}: API, checkpointing began until Start returned"),
            s.api_tail.clone(),
            None,
            "the base mark runs in the background (log time vs client clock)",
        );
    }
    r.row(
        section,
        format!("{label}: crabctl export"),
        export.to_vec(),
        None,
        format!(
            "first {:.0} ms, then over existing content",
            export.first().copied().unwrap_or(f64::NAN)
        ),
    );
}

/// Sandbox config that signs its exports with the key the bench's own containers trust (the
/// default key of the bench's state_dir): images from the sandboxes restore under
/// `cfg_body`, as on one host.
/// With `CRAB_BENCH_RESTORE_CACHE=off` the sandboxes (and so their forks and rollbacks) run
/// without the restore cache (`[restore] cache_mib = 0`): each restore verifies and copies the
/// CRIU image itself, and each store deduplicates its own copy, as before the cache.
fn signing_config(b: &Bench) -> String {
    let mut c = format!(
        "restore.signing_key = \"{}\"\n",
        b.state_dir.join("keys/checkpoint-signing.key").display()
    );
    if !restore_cache_on() {
        c.push_str("restore.cache_mib = 0\n");
    }
    c
}

fn restore_cache_on() -> bool {
    std::env::var("CRAB_BENCH_RESTORE_CACHE").as_deref() != Ok("off")
}

struct FsSandbox {
    s: Sandbox,
    /// chain length -> (seq, turn id)
    at: HashMap<usize, (u64, String)>,
}

async fn fs_sandbox(b: &mut Bench) -> Res<(FsSandbox, CleanupGuard)> {
    let max = *CHAINS.iter().max().expect("chains");
    BENCH.progress(format!("1/4 fs chains: a sandbox with {max} fs turns"));
    let config = signing_config(b);
    let (mut s, guard) = Sandbox::start(
        "bench-restore-fs",
        SandboxOptions {
            config: &config,
            ..Default::default()
        },
    )
    .await;
    b.sandboxes.push(s.id.clone());
    let mut at = HashMap::new();
    for i in 1..=max {
        s.run(&format!(
            "echo 'turn {i}' >> /app/notes.txt && echo {i} > /app/file-{}.txt",
            i % 7
        ))
        .await;
        let (seq, turn, m) = end_turn(&mut s).await?;
        let layers = m["fs_layers"].as_array().map_or(0, Vec::len);
        if m["kind"] != "fs" || layers != i {
            return Err(format!(
                "{}: turn {i} gave a {} checkpoint with {layers} fs layers, expected fs with {i}",
                s.id, m["kind"]
            ));
        }
        if CHAINS.contains(&i) {
            at.insert(i, (seq, turn));
        }
    }
    Ok((FsSandbox { s, at }, guard))
}

async fn bench_chains(b: &mut Bench, r: &mut Report, fs: &FsSandbox) -> Res<()> {
    let mut j = serde_json::Map::new();
    for n in CHAINS {
        let (seq, turn) = fs.at[&n].clone();
        let image = format!("localhost/crab-bench/restore-{}:fs{n}", b.pid);
        BENCH.progress(format!(
            "1/4 fs chain of {n}: export, {} x (cold ctr run, warm ctr run, API start)",
            b.o.reps
        ));
        let (export, summary) = export_series(b, &fs.s, seq, &image)?;
        let s = restore_series(b, &image, &format!("fs{n}"), false).await?;
        restore_rows(
            r,
            "1 restore fs-only",
            &format!("{n} layers"),
            &s,
            None,
            &export,
        );
        let mut v = s.json();
        v["layers"] = json!(n);
        v["turn"] = json!(turn);
        v["export_ms"] = Stats::json(&export);
        v["export_summary"] = json!(summary);
        j.insert(format!("{n}_layers"), v);
    }
    r.extra.insert("restore_fs".into(), Value::Object(j));
    Ok(())
}

struct ProcSandbox {
    s: Sandbox,
    proc_turn: (u64, String),
}

async fn proc_sandbox(b: &mut Bench) -> Res<(ProcSandbox, CleanupGuard)> {
    BENCH.progress(format!(
        "2/4 process: a sandbox with a {HELD_MB} MB python3"
    ));
    let config = signing_config(b);
    let (mut s, guard) = Sandbox::start(
        "bench-restore-proc",
        SandboxOptions {
            config: &config,
            ..Default::default()
        },
    )
    .await;
    b.sandboxes.push(s.id.clone());
    s.run("echo 'a file of the sandbox' > /app/a.txt").await;
    end_turn(&mut s).await?;
    s.run(&holder_script()).await;
    let (seq, turn, m) = end_turn(&mut s).await?;
    if m["process"].is_null() {
        return Err(format!(
            "{}: the holder's turn gave a {} checkpoint without a process image: {m}",
            s.id, m["kind"]
        ));
    }
    b.extra_manifest = Some(m);
    Ok((
        ProcSandbox {
            s,
            proc_turn: (seq, turn),
        },
        guard,
    ))
}

async fn bench_proc_restore(b: &mut Bench, r: &mut Report, p: &ProcSandbox) -> Res<()> {
    let image = format!("localhost/crab-bench/restore-{}:proc{HELD_MB}", b.pid);
    BENCH.progress(format!(
        "2/4 process: export, {} x (cold ctr run, warm ctr run, API start)",
        b.o.reps
    ));
    let (export, summary) = export_series(b, &p.s, p.proc_turn.0, &image)?;
    let s = restore_series(b, &image, "proc", true).await?;
    restore_rows(
        r,
        "2 restore 50 MB process",
        &format!("{HELD_MB} MB process"),
        &s,
        Some(AIM_RESTORE_PROC_MS),
        &export,
    );
    let mut v = s.json();
    v["turn"] = json!(p.proc_turn.1);
    v["export_ms"] = Stats::json(&export);
    v["export_summary"] = json!(summary);
    v["checkpoint"] = b.extra_manifest.take().unwrap_or(Value::Null);
    r.extra.insert("restore_proc".into(), v);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. Lazy restore

/// A python3 holding `mb` MB of random bytes; on SIGUSR1 it reads one byte of every page and
/// then creates /tmp/touched.
fn lazy_holder_script(mb: usize) -> String {
    format!(
        r#"exec 3< <(exec -a crab-lazy-holder python3 -u -c '
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGUSR1}})
b = bytearray({mb} << 20)
for i in range(0, len(b), 1 << 20):
    b[i:i + (1 << 20)] = os.urandom(1 << 20)
print("ready", flush=True)
fd = os.open("/dev/null", os.O_WRONLY)
os.dup2(fd, 1)
os.close(fd)
while True:
    signal.sigwait({{signal.SIGUSR1}})
    n = sum(b[::4096])
    with open("/tmp/touched.tmp", "w") as f:
        f.write(str(n))
    os.rename("/tmp/touched.tmp", "/tmp/touched")
' </dev/null 2>/dev/null)
read -r line <&3
[ "$line" = ready ] || {{ echo "holder said: $line" >&2; exit 1; }}"#
    )
}

/// Makes the holder touch every page and waits until it has.
/// The holder is found by its name (comm), not by `pkill -f`: while a lazy restore's pages
/// are arriving, a process's command line (on its stack, among the last pages to arrive) reads
/// as empty from /proc.
const TOUCH_ALL: &str = "rm -f /tmp/touched; pkill -USR1 -x python3; \
    for i in $(seq 6000); do [ -e /tmp/touched ] && exit 0; sleep 0.005; done; exit 1";

/// The shim's `every page of its lazy restore arrived D after the restore` for `id`, in ms.
async fn pages_arrived_ms(b: &Bench, from: u64, id: &str) -> Option<f64> {
    let needle = format!("container {id}: every page of its lazy restore arrived ");
    for _ in 0..100 {
        if let Ok(text) = std::fs::read(&b.log) {
            let text =
                String::from_utf8_lossy(&text[(from as usize).min(text.len())..]).into_owned();
            if let Some(l) = text.lines().find(|l| l.contains(&needle)) {
                let rest = &l[l.find(&needle)? + needle.len()..];
                return parse_duration_ms(rest.split_whitespace().next()?);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

async fn bench_lazy(b: &mut Bench, r: &mut Report) -> Res<()> {
    let mut j = serde_json::Map::new();
    // The default configuration's API start p50 per size: the issue's aim is 512 MB within
    // 1.5x of 50 MB.
    let mut default_start: std::collections::BTreeMap<usize, f64> = Default::default();
    let sizes: Vec<usize> = match std::env::var("BENCH_LAZY_SIZES") {
        Ok(v) => v.split(',').filter_map(|s| s.trim().parse().ok()).collect(),
        Err(_) => LAZY_SIZES.to_vec(),
    };
    for mb in sizes {
        BENCH.progress(format!(
            "5 lazy restore: a sandbox with a {mb} MB python3, then {} x (eager, lazy) API starts",
            b.o.reps
        ));
        let config = signing_config(b);
        let (mut s, guard) = Sandbox::start(
            "bench-restore-lazy",
            SandboxOptions {
                config: &config,
                ..Default::default()
            },
        )
        .await;
        b.sandboxes.push(s.id.clone());
        s.run(&lazy_holder_script(mb)).await;
        let (seq, _, m) = end_turn(&mut s).await?;
        if m["process"].is_null() {
            return Err(format!("{}: no process image in {m}", s.id));
        }
        let image = format!("localhost/crab-bench/restore-{}:lazy{mb}", b.pid);
        export_series(b, &s, seq, &image)?;
        // One untimed `ctr run` unpacks the image (the API path starts from its snapshots).
        let id = b.id(&format!("lazy{mb}-unpack"));
        b.ctr_run(DEFAULT_RUNTIME, &image, &id)?;
        b.remove(&id).await?;
        let h = b.harness_for(&image, DEFAULT_RUNTIME).await?;
        let mut start: HashMap<&str, Vec<f64>> = HashMap::new();
        let mut shim: HashMap<&str, Vec<f64>> = HashMap::new();
        let mut touched: HashMap<&str, Vec<f64>> = HashMap::new();
        let mut arrived = Vec::new();
        let mut found: HashMap<&str, (u32, u32)> = HashMap::new();
        for _ in 0..b.o.reps {
            for (mode, min) in [("eager", Some(0)), ("lazy", Some(1)), ("default", None)] {
                let id = b.id(&format!("lazy{mb}-{mode}"));
                let cfg = match min {
                    Some(min) => format!("{}[restore]\nlazy_pages_min_mib = {min}\n", b.cfg_body),
                    None => b.cfg_body.clone(),
                };
                let from = b.log_len();
                let t0 = Instant::now();
                let api = api_start(&h, &id, &cfg).await?;
                let mut c = sandbox_for(&h, &id);
                c.turn = 1000;
                // Right after the start: does `pgrep -f` see the holder by its command line?
                let seen = c.run("pgrep -fc '[c]rab-lazy-holder' || true").await.stdout;
                let f = found.entry(mode).or_default();
                f.0 += u32::from(seen.trim() == "1");
                f.1 += 1;
                c.run(TOUCH_ALL).await;
                touched.entry(mode).or_default().push(ms(t0.elapsed()));
                start.entry(mode).or_default().push(api.total_ms);
                let log = b.shim_log(from, &id).await;
                shim.entry(mode)
                    .or_default()
                    .push(log.map_or(f64::NAN, |l| l.restore_ms));
                if mode == "lazy" {
                    arrived.push(pages_arrived_ms(b, from, &id).await.unwrap_or(f64::NAN));
                }
                b.remove(&id).await?;
            }
        }
        let section = "5 lazy restore";
        for mode in ["eager", "lazy", "default"] {
            r.row(
                section,
                format!("{mb} MB, {mode}: API create+start"),
                start[mode].clone(),
                None,
                "",
            );
            r.row(
                section,
                format!("{mb} MB, {mode}: shim restore (runc restore)"),
                shim[mode].clone(),
                None,
                "",
            );
            r.row(
                section,
                format!("{mb} MB, {mode}: start + touch every page"),
                touched[mode].clone(),
                None,
                "",
            );
        }
        r.row(
            section,
            format!("{mb} MB, lazy: every page arrived (after restore)"),
            arrived.clone(),
            None,
            "",
        );
        for (mode, (seen, of)) in &found {
            println!("  {mb} MB, {mode}: pgrep -f found the holder right after the start {seen} of {of} times");
        }
        let ratio =
            |m: &HashMap<&str, Vec<f64>>| Stats::of(&m["lazy"]).p50 / Stats::of(&m["eager"]).p50;
        let mode_json = |mode: &str| {
            json!({
                "api_start_ms": Stats::json(&start[mode]),
                "shim_restore_ms": Stats::json(&shim[mode]),
                "touch_all_ms": Stats::json(&touched[mode]),
                "pgrep_f_found": found[mode].0,
                "starts": found[mode].1,
            })
        };
        let mut lazy = mode_json("lazy");
        lazy["all_pages_arrived_ms"] = Stats::json(&arrived);
        default_start.insert(mb, Stats::of(&start["default"]).p50);
        j.insert(
            format!("{mb}mb"),
            json!({
                "eager": mode_json("eager"),
                "lazy": lazy,
                "default": mode_json("default"),
                "lazy_over_eager_p50": {"api_start": ratio(&start), "touch_all": ratio(&touched)},
            }),
        );
        b.remove(&s.id).await?;
        drop(guard);
    }
    if let (Some(small), Some(large)) = (default_start.get(&50), default_start.get(&512)) {
        let x = large / small;
        println!(
            "  default config: API start of 512 MB {large:.0} ms against 50 MB {small:.0} ms p50: \
             {x:.2}x (aim: within 1.5x)"
        );
        j.insert("default_512_over_50_p50".into(), json!(x));
    }
    r.extra.insert("lazy_restore".into(), Value::Object(j));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 6. Verifying a large image: before the restore, or while CRIU restores

/// For each size: a python3 holding that many MB, exported; then API starts of the image, the
/// restore cache off (each start is a first restore: the image is copied and verified), with
/// `[restore] verify_during_restore` true and false alternately: until Tasks.Start returned,
/// the shim's verification before the restore (`verified in`), and with it on, the page files'
/// hashing and CRIU's wait at its post-restore gate. What verification costs the critical path:
/// `verified in` (before) against `verified in` + the gate's wait (during).
async fn bench_verify(b: &mut Bench, r: &mut Report) -> Res<()> {
    let mut j = serde_json::Map::new();
    let sizes: Vec<usize> = match std::env::var("BENCH_VERIFY_SIZES") {
        Ok(v) => v.split(',').filter_map(|s| s.trim().parse().ok()).collect(),
        Err(_) => VERIFY_SIZES.to_vec(),
    };
    for mb in sizes {
        BENCH.progress(format!(
            "6 verification: a sandbox with a {mb} MB python3, then {} x (before, during) API starts",
            b.o.reps
        ));
        let config = signing_config(b);
        let (mut s, guard) = Sandbox::start(
            "bench-restore-verify",
            SandboxOptions {
                config: &config,
                ..Default::default()
            },
        )
        .await;
        b.sandboxes.push(s.id.clone());
        s.run(&lazy_holder_script(mb)).await;
        let (seq, _, m) = end_turn(&mut s).await?;
        if m["process"].is_null() {
            return Err(format!("{}: no process image in {m}", s.id));
        }
        let image = format!("localhost/crab-bench/restore-{}:verify{mb}", b.pid);
        export_series(b, &s, seq, &image)?;
        let id = b.id(&format!("verify{mb}-unpack"));
        b.ctr_run(DEFAULT_RUNTIME, &image, &id)?;
        b.remove(&id).await?;
        let h = b.harness_for(&image, DEFAULT_RUNTIME).await?;
        let mut start: HashMap<&str, Vec<f64>> = HashMap::new();
        let mut critical: HashMap<&str, Vec<f64>> = HashMap::new();
        let (mut hashing, mut waited) = (Vec::new(), Vec::new());
        for _ in 0..b.o.reps {
            for (mode, during) in [("before", false), ("during", true)] {
                let id = b.id(&format!("verify{mb}-{mode}"));
                let cfg = format!(
                    "{}[restore]\ncache_mib = 0\nverify_during_restore = {during}\n",
                    b.cfg_body
                );
                let from = b.log_len();
                let api = api_start(&h, &id, &cfg).await?;
                start.entry(mode).or_default().push(api.total_ms);
                let log = b.shim_log(from, &id).await;
                let (v, p, w) = log.map_or((f64::NAN, f64::NAN, f64::NAN), |l| {
                    (l.verify_ms, l.pages_ms, l.gate_wait_ms)
                });
                critical
                    .entry(mode)
                    .or_default()
                    .push(if during { v + w } else { v });
                if during {
                    hashing.push(p);
                    waited.push(w);
                }
                b.remove(&id).await?;
            }
        }
        let section = "6 verification";
        for mode in ["before", "during"] {
            r.row(
                section,
                format!("{mb} MB, {mode}: API create+start"),
                start[mode].clone(),
                None,
                "",
            );
            r.row(
                section,
                format!("{mb} MB, {mode}: verification on the critical path"),
                critical[mode].clone(),
                Some(AIM_VERIFY_MS),
                if mode == "during" {
                    "checks before the restore + CRIU's wait at the gate"
                } else {
                    "every digest before the restore"
                },
            );
        }
        r.row(
            section,
            format!("{mb} MB, during: page files hashed alongside CRIU"),
            hashing.clone(),
            None,
            "",
        );
        r.row(
            section,
            format!("{mb} MB, during: CRIU waited at the gate"),
            waited.clone(),
            None,
            "",
        );
        let ratio =
            |m: &HashMap<&str, Vec<f64>>| Stats::of(&m["during"]).p50 / Stats::of(&m["before"]).p50;
        j.insert(
            format!("{mb}mb"),
            json!({
                "before": {"api_start_ms": Stats::json(&start["before"]), "critical_ms": Stats::json(&critical["before"])},
                "during": {"api_start_ms": Stats::json(&start["during"]), "critical_ms": Stats::json(&critical["during"]), "pages_hashed_ms": Stats::json(&hashing), "gate_wait_ms": Stats::json(&waited)},
                "during_over_before_p50": {"api_start": ratio(&start), "critical": ratio(&critical)},
            }),
        );
        b.remove(&s.id).await?;
        drop(guard);
    }
    r.extra.insert("verification".into(), Value::Object(j));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3. Rollback

/// Each repetition: a turn writes /app/undo-me.txt, then `crabctl rollback --to turn` (timed),
/// then a check that the file is gone (and the holder back, with a process).
async fn rollback_series(
    b: &mut Bench,
    s: &mut Sandbox,
    turn: &str,
    with_process: bool,
) -> Res<Value> {
    let (mut wall, mut own, mut shim, mut held) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut setup, mut export) = (Vec::new(), Vec::new());
    // What the export inside each rollback costs: the same checkpoint exported on its own.
    let scratch = format!("localhost/crab-bench/restore-{}:rollback-export", b.pid);
    b.images.push(scratch.clone());
    for rep in 0..b.o.rollback_reps {
        s.run(&format!("echo {rep} > /app/undo-me.txt")).await;
        end_turn(s).await?;
        let from = b.log_len();
        // With the process: a restore of it is what is measured (in place would keep it).
        let mut args = vec!["rollback", &s.id, "--to", turn];
        if with_process {
            args.push("--recreate");
        }
        let (took, out, _) = b.crabctl(&args)?;
        wall.push(took);
        own.push(crabctl_ms(&out));
        if with_process {
            let log = b.shim_log(from, &s.id).await;
            shim.push(log.map_or(f64::NAN, |l| l.restore_ms));
            setup.push(log.map_or(f64::NAN, |l| l.setup_ms()));
        }
        export.push(b.crabctl(&["export", &s.id, "--turn", turn, &scratch])?.0);
        let check = s
            .run("test -e /app/undo-me.txt && echo present || echo gone")
            .await
            .stdout;
        if check.trim() != "gone" {
            return Err(format!(
                "{}: after rollback to {turn} /app/undo-me.txt is still there",
                s.id
            ));
        }
        if with_process {
            held.push(
                s.run(HELD_KIB)
                    .await
                    .stdout
                    .trim()
                    .parse::<f64>()
                    .unwrap_or(0.0),
            );
        }
    }
    Ok(
        json!({"turn": turn, "wall_ms": wall, "crabctl_ms": own, "shim_restore_log_ms": shim,
               "shim_after_restore_until_checkpointing_ms": setup, "export_alone_ms": export,
               "held_kib_after": held}),
    )
}

async fn bench_rollback(
    b: &mut Bench,
    r: &mut Report,
    fs: &mut FsSandbox,
    p: &mut ProcSandbox,
) -> Res<()> {
    BENCH.progress(format!(
        "3/4 rollback: {} x fs-only, {} x with the process",
        b.o.rollback_reps, b.o.rollback_reps
    ));
    let turn = fs.at[&ROLLBACK_CHAIN].1.clone();
    let v_fs = rollback_series(b, &mut fs.s, &turn, false).await?;
    let turn = p.proc_turn.1.clone();
    let v_proc = rollback_series(b, &mut p.s, &turn, true).await?;
    let nums = |v: &Value, k: &str| -> Vec<f64> {
        v[k].as_array()
            .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN)).collect())
            .unwrap_or_default()
    };
    for (label, v, aim) in [
        ("fs-only", &v_fs, Some(AIM_ROLLBACK_FS_MS)),
        ("50 MB process", &v_proc, None),
    ] {
        let wall = nums(v, "wall_ms");
        let first = wall.first().copied().unwrap_or(f64::NAN);
        r.row(
            "3 rollback",
            format!("rollback {label}: crabctl wall"),
            wall,
            aim,
            format!("first {first:.0} ms"),
        );
        r.row(
            "3 rollback",
            format!("rollback {label}: crabctl export of that checkpoint alone"),
            nums(v, "export_alone_ms"),
            None,
            "what the export inside each rollback costs",
        );
    }
    r.row(
        "3 rollback",
        "rollback 50 MB process: shim log 'restored in'",
        nums(&v_proc, "shim_restore_log_ms"),
        None,
        "",
    );
    r.row(
        "3 rollback",
        "rollback 50 MB process: shim, restored until checkpointing began",
        nums(&v_proc, "shim_after_restore_until_checkpointing_ms"),
        None,
        "own store: the process image is referenced, not imported",
    );
    r.extra.insert(
        "rollback".into(),
        json!({"fs": v_fs, "proc": v_proc, "fs_chain": ROLLBACK_CHAIN}),
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 3b. Rollback of a 1 MB delta: in place against recreating, in the same run

/// The delta each repetition makes after the checkpoint: half of a 1 MB file of the checkpoint
/// rewritten, a new 512 KiB file, a new directory.
const DELTA_1MB: &str = "head -c 524288 /dev/urandom | dd of=/app/base.bin conv=notrunc status=none && head -c 524288 /dev/urandom > /app/delta.bin && mkdir -p /app/newdir && echo x > /app/newdir/f";
/// What the files must be after the rollback.
const DELTA_CHECK: &str =
    "sha256sum /app/base.bin | cut -c1-64; ls /app/delta.bin /app/newdir 2>/dev/null | wc -l";

/// A sandbox whose checkpoint holds a 1 MB file; each repetition makes [`DELTA_1MB`], ends the
/// turn (durable), then `crabctl rollback --to` the checkpoint, in place and with `--recreate`
/// alternately (wall time of crabctl, and its own figures), checking the files each time.
async fn bench_in_place(b: &mut Bench, r: &mut Report) -> Res<()> {
    BENCH.progress(format!(
        "3b rollback of a 1 MB delta: {} x in place, {} x recreated",
        b.o.rollback_reps, b.o.rollback_reps
    ));
    let config = signing_config(b);
    let (mut s, guard) = Sandbox::start(
        "bench-restore-inplace",
        SandboxOptions {
            config: &config,
            ..Default::default()
        },
    )
    .await;
    b.sandboxes.push(s.id.clone());
    let res = async {
        s.run("head -c 1048576 /dev/urandom > /app/base.bin").await;
        let (_, turn, _) = end_turn(&mut s).await?;
        let want = s.run(DELTA_CHECK).await.stdout;
        let (mut wall, mut own, mut frozen, mut apply) = (vec![], vec![], vec![], vec![]);
        let (mut resolve, mut asked) = (vec![], vec![]);
        let (mut r_wall, mut r_own) = (vec![], vec![]);
        let mut refused = Vec::new();
        for _ in 0..b.o.rollback_reps {
            for recreate in [false, true] {
                s.run(DELTA_1MB).await;
                end_turn(&mut s).await?;
                let mut args = vec!["rollback", &s.id, "--to", &turn, "-o", "json"];
                if recreate {
                    args.push("--recreate");
                }
                let (took, out, _) = b.crabctl(&args)?;
                let v: Value = serde_json::from_str(out.trim())
                    .map_err(|e| format!("crabctl rollback -o json: {e}: {out}"))?;
                let got = s.run(DELTA_CHECK).await.stdout;
                if got != want {
                    return Err(format!(
                        "{}: after rollback to {turn} ({}) the files are {got:?}, not {want:?}",
                        s.id, v["way"]
                    ));
                }
                let total = v["total_ms"].as_f64().unwrap_or(f64::NAN);
                match (recreate, v["way"].as_str()) {
                    (true, _) => {
                        r_wall.push(took);
                        r_own.push(total);
                    }
                    (false, Some("in_place")) => {
                        wall.push(took);
                        own.push(total);
                        frozen.push(v["freeze_ms"].as_f64().unwrap_or(f64::NAN));
                        resolve.push(v["checkpoint_ms"].as_f64().unwrap_or(f64::NAN));
                        asked.push(v["start_ms"].as_f64().unwrap_or(f64::NAN));
                        apply.push(v["apply_ms"].as_f64().unwrap_or(f64::NAN));
                    }
                    (false, _) => refused.push(v["not_in_place"].to_string()),
                }
            }
        }
        if !refused.is_empty() {
            return Err(format!(
                "{}: {} rollbacks were not done in place: {}",
                s.id,
                refused.len(),
                refused.join("; ")
            ));
        }
        r.row(
            "3b rollback 1 MB delta",
            "in place: crabctl wall",
            wall.clone(),
            Some(AIM_ROLLBACK_FS_MS),
            "files reset through the container's view, processes kept",
        );
        r.row(
            "3b rollback 1 MB delta",
            "in place: crabctl's own total",
            own.clone(),
            Some(AIM_ROLLBACK_FS_MS),
            "without crabctl's process start and connection",
        );
        r.row(
            "3b rollback 1 MB delta",
            "in place: crabctl finding the checkpoint",
            resolve.clone(),
            None,
            "the store's manifests read, the task's pid asked",
        );
        r.row(
            "3b rollback 1 MB delta",
            "in place: the shim's request (Tasks.Update)",
            asked.clone(),
            None,
            "through containerd: wait for durability, reset, record",
        );
        r.row(
            "3b rollback 1 MB delta",
            "in place: container frozen (shim)",
            frozen.clone(),
            None,
            "of which the files are reset (apply)",
        );
        r.row(
            "3b rollback 1 MB delta",
            "in place: files reset (shim)",
            apply.clone(),
            None,
            "",
        );
        r.row(
            "3b rollback 1 MB delta",
            "recreated: crabctl wall",
            r_wall.clone(),
            None,
            "export, kill and delete, create and start",
        );
        r.row(
            "3b rollback 1 MB delta",
            "recreated: crabctl's own total",
            r_own.clone(),
            None,
            "",
        );
        r.extra.insert(
            "rollback_1mb_delta".into(),
            json!({"turn": turn, "in_place": {"wall_ms": wall, "crabctl_ms": own,
                   "frozen_ms": frozen, "apply_ms": apply, "resolve_ms": resolve,
                   "request_ms": asked},
                   "recreated": {"wall_ms": r_wall, "crabctl_ms": r_own}}),
        );
        Ok(())
    }
    .await;
    let _ = s.h.kill_and_remove(&s.id).await;
    let _ = std::fs::remove_dir_all(&s.state_dir);
    drop(guard);
    res
}

// ---------------------------------------------------------------------------------------------
// 4. Fork

/// One `crabctl fork --count N -o json`.
#[derive(Default)]
struct ForkRun {
    /// The command, spawn to exit.
    wall_ms: f64,
    /// crabctl's own figures: all of it, and starting the forks (concurrently).
    total_ms: f64,
    start_ms: f64,
    /// Each fork's own time (Containers.Create + Tasks.Create + Tasks.Start) and its steps.
    sandbox_ms: Vec<f64>,
    task_create_ms: Vec<f64>,
    task_start_ms: Vec<f64>,
    /// The shim's `restored ... in D` of each fork (process checkpoints).
    shim_restore_ms: Vec<f64>,
}

fn nums(v: &Value, k: &str) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(|f| f[k].as_f64()).collect())
        .unwrap_or_default()
}

/// Removes containers `ids` concurrently (kill, wait, delete task and record and snapshot).
async fn remove_all(b: &Bench, ids: &[String]) -> Res<()> {
    let mut set = tokio::task::JoinSet::new();
    for id in ids {
        let (h, id) = (b.base.clone(), id.clone());
        set.spawn(async move {
            h.kill_and_remove(&id)
                .await
                .map(|_| ())
                .map_err(|e| format!("removing {id}: {e}"))
        });
    }
    let mut failed = None;
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => failed = Some(e),
            Err(e) => failed = Some(e.to_string()),
        }
    }
    failed.map_or(Ok(()), Err)
}

/// `n` plain API starts of the agent image at once under crab: the wall time until all ran.
async fn plain_starts(b: &mut Bench, h: &Harness, n: usize) -> Res<f64> {
    let ids: Vec<String> = (0..n).map(|_| b.id("plain")).collect();
    let t0 = Instant::now();
    let tasks: Vec<_> = ids
        .iter()
        .map(|id| {
            let (h, id, cfg) = (h.clone(), id.clone(), b.cfg_body.clone());
            tokio::spawn(async move { api_start(&h, &id, &cfg).await })
        })
        .collect();
    let mut failed = None;
    for t in tasks {
        match t.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => failed = Some(e),
            Err(e) => failed = Some(e.to_string()),
        }
    }
    let wall = ms(t0.elapsed());
    let removed = remove_all(b, &ids).await;
    if let Some(e) = failed {
        return Err(e);
    }
    removed?;
    Ok(wall)
}

async fn fork_once(
    b: &mut Bench,
    s: &Sandbox,
    turn: &str,
    n: usize,
    with_process: bool,
    check_held: bool,
) -> Res<ForkRun> {
    let from = b.log_len();
    let (wall, out, err) = b.crabctl(&[
        "fork",
        &s.id,
        "--at",
        turn,
        "--count",
        &n.to_string(),
        "-o",
        "json",
    ])?;
    let report: Value = serde_json::from_str(&out)
        .map_err(|e| format!("crabctl fork -o json printed no JSON ({e}): {out}{err}"))?;
    let ids: Vec<String> = report["forks"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| f["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    for id in &ids {
        b.guard.add(id);
        b.forks.push(id.clone());
    }
    if ids.len() != n {
        return Err(format!(
            "crabctl fork --count {n} reported {} forks: {out}{err}",
            ids.len()
        ));
    }
    // A fork's store starts with its `restored` origin manifest; more means the id was used
    // before (crabctl numbers forks after the highest existing one, and a removed container
    // keeps its store) and the new fork continues that old lineage.
    for id in &ids {
        let dir = s
            .state_dir
            .join(&s.h.env.namespace)
            .join(id)
            .join("checkpoints");
        let manifests = std::fs::read_dir(&dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        let n = e.file_name().to_string_lossy().into_owned();
                        n.ends_with(".json") && !n.starts_with('.')
                    })
                    .count()
            })
            .unwrap_or(0);
        b.fork_store_manifests.push(manifests);
    }
    let mut run = ForkRun {
        wall_ms: wall,
        total_ms: report["total_ms"].as_f64().unwrap_or(f64::NAN),
        start_ms: report["start_ms"].as_f64().unwrap_or(f64::NAN),
        sandbox_ms: nums(&report["forks"], "total_ms"),
        task_create_ms: nums(&report["forks"], "task_create_ms"),
        task_start_ms: nums(&report["forks"], "task_start_ms"),
        shim_restore_ms: Vec::new(),
    };
    if with_process {
        for id in &ids {
            if let Some(x) = b.shim_restore_ms(from, id).await {
                run.shim_restore_ms.push(x);
            }
        }
        // The last fork started holds the process again.
        if check_held {
            let last = ids.last().expect("n >= 1");
            let kib = held_kib(&s.h, last).await;
            b.fork_held_kib.push(kib);
            if kib < (HELD_MB as f64) * 1024.0 * 0.9 {
                let _ = remove_all(b, &ids).await;
                return Err(format!(
                    "fork {last} of {}: the {HELD_MB} MB holder is not back ({kib} KiB resident)",
                    s.id
                ));
            }
        }
    }
    remove_all(b, &ids).await?;
    Ok(run)
}

/// Per count: the forks of the fs checkpoint and of the process checkpoint, and as many plain
/// starts at once, interleaved in each round (so each fork figure has its reference measured
/// under the same load).
async fn fork_rounds(
    b: &mut Bench,
    fs: &FsSandbox,
    p: &ProcSandbox,
) -> Res<(
    HashMap<usize, Vec<f64>>,
    HashMap<(bool, usize), Vec<ForkRun>>,
    Vec<f64>,
)> {
    let h = b.harness_for(AGENT_IMAGE, DEFAULT_RUNTIME).await?;
    let fs_turn = fs.at[&ROLLBACK_CHAIN].1.clone();
    let proc_turn = p.proc_turn.1.clone();
    // Untimed: the first fork exports and unpacks the checkpoint; later ones find it unpacked.
    let mut warmup = Vec::new();
    for (s, turn, with_process) in [(&fs.s, &fs_turn, false), (&p.s, &proc_turn, true)] {
        warmup.push(fork_once(b, s, turn, 1, with_process, true).await?.wall_ms);
    }
    let mut plain: HashMap<usize, Vec<f64>> = HashMap::new();
    let mut forks: HashMap<(bool, usize), Vec<ForkRun>> = HashMap::new();
    for round in 0..b.o.fork_reps {
        for n in FORKS {
            BENCH.progress(format!(
                "4/4 fork: round {}/{}, N = {n}: plain starts, fork fs, fork process",
                round + 1,
                b.o.fork_reps
            ));
            plain
                .entry(n)
                .or_default()
                .push(plain_starts(b, &h, n).await?);
            for (s, turn, with_process) in [(&fs.s, &fs_turn, false), (&p.s, &proc_turn, true)] {
                let run = fork_once(b, s, turn, n, with_process, round == 0).await?;
                forks.entry((with_process, n)).or_default().push(run);
            }
        }
    }
    Ok((plain, forks, warmup))
}

async fn bench_fork(b: &mut Bench, r: &mut Report, fs: &FsSandbox, p: &ProcSandbox) -> Res<()> {
    BENCH.progress(format!(
        "4/4 fork: N = {FORKS:?}, {} rounds: N plain starts at once, N forks of the fs \
         checkpoint, N forks of the process checkpoint",
        b.o.fork_reps
    ));
    let (plain, forks, warmup) = fork_rounds(b, fs, p).await?;
    let mut j = serde_json::Map::new();
    let mut aims = serde_json::Map::new();
    for n in FORKS {
        r.row(
            "4 fork",
            format!("{n} plain API starts at once, {DEFAULT_RUNTIME}"),
            plain[&n].clone(),
            None,
            "reference for fork N, interleaved with the forks",
        );
    }
    for (with_process, label, single) in [
        (
            false,
            "fs-only",
            format!("{ROLLBACK_CHAIN} layers: API create+start, warm"),
        ),
        (
            true,
            "50 MB process",
            format!("{HELD_MB} MB process: API create+start, warm"),
        ),
    ] {
        let mut per_n = serde_json::Map::new();
        // A plain start plus a restore: the single start of this checkpoint's image (1./2.).
        let one = r.p50(&single);
        for n in FORKS {
            let runs = &forks[&(with_process, n)];
            let col = |f: fn(&ForkRun) -> f64| runs.iter().map(f).collect::<Vec<_>>();
            let flat = |f: fn(&ForkRun) -> &Vec<f64>| {
                runs.iter()
                    .flat_map(|x| f(x).iter().copied())
                    .collect::<Vec<_>>()
            };
            let wall = col(|x| x.wall_ms);
            let sandbox = flat(|x| &x.sandbox_ms);
            let shim = flat(|x| &x.shim_restore_ms);
            r.row(
                "4 fork",
                format!("fork {label} N={n}: crabctl wall"),
                wall.clone(),
                None,
                format!(
                    "crabctl's own p50 {:.0} ms, of which starting {:.0} ms",
                    p50_of(&col(|x| x.total_ms)),
                    p50_of(&col(|x| x.start_ms))
                ),
            );
            r.row(
                "4 fork",
                format!("fork {label} N={n}: each sandbox's own time"),
                sandbox.clone(),
                None,
                format!(
                    "Containers.Create + Tasks.Create (p50 {:.0}) + Tasks.Start (p50 {:.0}), all forks of all rounds",
                    p50_of(&flat(|x| &x.task_create_ms)),
                    p50_of(&flat(|x| &x.task_start_ms))
                ),
            );
            if with_process {
                r.row(
                    "4 fork",
                    format!("fork {label} N={n}: shim 'restored in' (runc restore)"),
                    shim.clone(),
                    None,
                    "all forks of all rounds",
                );
            }
            let over_plain = p50_of(&wall) / p50_of(&plain[&n]);
            let amortized = p50_of(&wall) / n as f64;
            per_n.insert(
                n.to_string(),
                json!({"wall_ms": Stats::json(&wall), "crabctl_total_ms": Stats::json(&col(|x| x.total_ms)),
                       "crabctl_start_ms": Stats::json(&col(|x| x.start_ms)),
                       "sandbox_ms": Stats::json(&sandbox),
                       "task_create_ms": Stats::json(&flat(|x| &x.task_create_ms)),
                       "task_start_ms": Stats::json(&flat(|x| &x.task_start_ms)),
                       "shim_restore_ms": Stats::json(&shim),
                       "plain_starts_ms": Stats::json(&plain[&n]),
                       "wall_over_plain_p50": over_plain,
                       "wall_per_sandbox_ms": amortized,
                       "single_start_of_the_image_p50_ms": one}),
            );
            aims.insert(
                format!("{label} N={n}"),
                json!({"wall_over_plain": over_plain, "aim_wall_over_plain": AIM_FORK_OVER_PLAIN,
                       "wall_per_sandbox_ms": amortized, "aim_per_sandbox_ms": one}),
            );
        }
        j.insert(
            if with_process { "proc" } else { "fs" }.into(),
            Value::Object(per_n),
        );
    }
    let reused = b.fork_store_manifests.iter().filter(|n| **n > 1).count();
    if reused > 0 {
        r.notes.push(format!(
            "{reused} of {} forks started on a store that already had checkpoints (up to {} manifests): \
             fork ids are reused once earlier forks are removed, and a removed container's store stays",
            b.fork_store_manifests.len(),
            b.fork_store_manifests.iter().max().unwrap_or(&0)
        ));
    }
    r.extra
        .insert("fork_store_manifests".into(), json!(b.fork_store_manifests));
    j.insert("warmup_ms".into(), json!(warmup));
    j.insert("held_kib_in_a_fork".into(), json!(b.fork_held_kib));
    j.insert("aims".into(), Value::Object(aims));
    r.extra.insert("fork".into(), Value::Object(j));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 4b. Forks that merge their memory

/// The fork counts of section 4b.
const MERGE_FORKS: [usize; 2] = [8, 32];
/// ksmd's pace in section 4b: pages per wake-up, milliseconds between wake-ups.
const MERGE_KSM_PACE: (u64, u64) = (5000, 20);
/// Issue 29's aim: the summed PSS of N idle forks at most this many times one restored
/// sandbox's.
const AIM_MERGED_PSS_RATIO: f64 = 2.0;

/// Host pids of `init` and its descendants.
fn process_tree(init: u32) -> Vec<u32> {
    let mut parent_of = HashMap::new();
    for pid in std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
    {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if let Some(ppid) = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
        {
            parent_of.insert(pid, ppid);
        }
    }
    let mut tree = vec![init];
    let mut grew = true;
    while grew {
        grew = false;
        for (pid, ppid) in &parent_of {
            if tree.contains(ppid) && !tree.contains(pid) {
                tree.push(*pid);
                grew = true;
            }
        }
    }
    tree
}

/// The summed PSS (`smaps_rollup`) of the processes under the inits `inits`, in KiB.
fn trees_pss_kib(inits: &[u32]) -> u64 {
    inits
        .iter()
        .flat_map(|i| process_tree(*i))
        .filter_map(|pid| {
            let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
            text.lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .sum()
}

/// ksmd's CPU time so far (utime + stime, clock ticks as seconds at 100 Hz), `None` without
/// a ksmd thread.
fn ksmd_cpu_s() -> Option<f64> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
        if comm.trim() != "ksmd" {
            return None;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
        let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
        Some(ticks / 100.0)
    })
}

/// `crabctl fork` of the process checkpoint, `extra` flags added; the forks' (id, init pid).
fn fork_ids_pids(
    b: &mut Bench,
    p: &ProcSandbox,
    n: usize,
    extra: &[&str],
) -> Res<Vec<(String, u32)>> {
    let count = n.to_string();
    let mut args = vec![
        "fork",
        p.s.id.as_str(),
        "--at",
        p.proc_turn.1.as_str(),
        "--count",
        count.as_str(),
        "-o",
        "json",
    ];
    args.extend(extra);
    let (_, out, err) = b.crabctl(&args)?;
    let report: Value = serde_json::from_str(&out)
        .map_err(|e| format!("crabctl fork -o json printed no JSON ({e}): {out}{err}"))?;
    let forks: Vec<(String, u32)> = report["forks"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|f| Some((f["id"].as_str()?.to_string(), f["pid"].as_u64()? as u32)))
                .collect()
        })
        .unwrap_or_default();
    for (id, _) in &forks {
        b.guard.add(id);
        b.forks.push(id.clone());
    }
    if forks.len() != n {
        return Err(format!("crabctl fork --count {n}: {out}{err}"));
    }
    Ok(forks)
}

/// 4b: N forks of the process checkpoint with `--merge-memory` while the host's ksmd runs at
/// [`MERGE_KSM_PACE`]: their summed PSS right after the start (every page copied by CRIU) and
/// once ksmd has merged them (polled every 250 ms until it is within the aim or has not
/// fallen for 5 s, at most 180 s), against one restored sandbox's (a single fork, not merged,
/// alone on the host), with how long merging took and ksmd's CPU time for it.
async fn bench_merge(b: &mut Bench, r: &mut Report, p: &ProcSandbox) -> Res<()> {
    BENCH.progress(format!(
        "4b fork --merge-memory: N = {MERGE_FORKS:?}, ksmd at {} pages / {} ms",
        MERGE_KSM_PACE.0, MERGE_KSM_PACE.1
    ));
    // Untimed warm-up (export and unpack), then one restored sandbox alone.
    let warm = fork_ids_pids(b, p, 1, &[])?;
    let ids: Vec<String> = warm.iter().map(|f| f.0.clone()).collect();
    remove_all(b, &ids).await?;
    let single = fork_ids_pids(b, p, 1, &[])?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let one_kib = trees_pss_kib(&[single[0].1]);
    let ids: Vec<String> = single.iter().map(|f| f.0.clone()).collect();
    remove_all(b, &ids).await?;
    let mut j = serde_json::Map::new();
    j.insert("one_sandbox_pss_kib".into(), json!(one_kib));
    j.insert(
        "ksm_pace".into(),
        json!({"pages_to_scan": MERGE_KSM_PACE.0, "sleep_millisecs": MERGE_KSM_PACE.1}),
    );
    for n in MERGE_FORKS {
        // The same fork without the flag first: what marking costs the start.
        let t0 = Instant::now();
        let unmarked = fork_ids_pids(b, p, n, &[])?;
        let unmarked_ms = ms(t0.elapsed());
        let ids: Vec<String> = unmarked.iter().map(|f| f.0.clone()).collect();
        remove_all(b, &ids).await?;
        let t0 = Instant::now();
        let forks = fork_ids_pids(b, p, n, &["--merge-memory"])?;
        let fork_ms = ms(t0.elapsed());
        let inits: Vec<u32> = forks.iter().map(|f| f.1).collect();
        let before = trees_pss_kib(&inits);
        let cpu0 = ksmd_cpu_s();
        let pace = crab_integration::ksm::KsmPace::set(MERGE_KSM_PACE.0, MERGE_KSM_PACE.1)?;
        let started = Instant::now();
        let (mut best, mut best_at) = (before, Instant::now());
        let mut now_kib = before;
        while started.elapsed() < Duration::from_secs(180) {
            tokio::time::sleep(Duration::from_millis(250)).await;
            now_kib = trees_pss_kib(&inits);
            if now_kib < best {
                (best, best_at) = (now_kib, Instant::now());
            }
            if (now_kib as f64) <= AIM_MERGED_PSS_RATIO * one_kib as f64
                || best_at.elapsed() > Duration::from_secs(5)
            {
                break;
            }
        }
        let merge_s = started.elapsed().as_secs_f64();
        let cpu = ksmd_cpu_s().zip(cpu0).map(|(a, b)| a - b);
        drop(pace);
        let ratio = now_kib as f64 / one_kib as f64;
        r.notes.push(format!(
            "4b fork --merge-memory N={n}: summed PSS {:.0} MiB right after the start ({:.1}x one \
             restored sandbox's {:.1} MiB), {:.0} MiB after ksmd merged for {merge_s:.1} s \
             ({ratio:.2}x; aim <= {AIM_MERGED_PSS_RATIO}x: {}), ksmd CPU {}; fork wall {fork_ms:.0} ms \
             ({unmarked_ms:.0} ms without --merge-memory just before)",
            before as f64 / 1024.0,
            before as f64 / one_kib as f64,
            one_kib as f64 / 1024.0,
            now_kib as f64 / 1024.0,
            if ratio <= AIM_MERGED_PSS_RATIO { "met" } else { "missed" },
            cpu.map_or("unknown".to_string(), |c| format!("{c:.1} s")),
        ));
        j.insert(
            n.to_string(),
            json!({"fork_wall_ms": fork_ms, "fork_wall_ms_unmarked": unmarked_ms,
                   "summed_pss_kib_at_start": before,
                   "summed_pss_kib_merged": now_kib, "merged_over_one": ratio,
                   "aim_merged_over_one": AIM_MERGED_PSS_RATIO, "merge_s": merge_s,
                   "ksmd_cpu_s": cpu}),
        );
        let ids: Vec<String> = forks.iter().map(|f| f.0.clone()).collect();
        remove_all(b, &ids).await?;
    }
    r.extra.insert("fork_merge_memory".into(), Value::Object(j));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Report

/// Which code was measured: the checkout's commit (others may have uncommitted edits in it)
/// and when the shim and crabctl binaries were built.
fn build_info() -> Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let head = std::process::Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let built = |name: &str| {
        std::fs::metadata(root.join("target/release").join(name))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map(|d| d.as_secs())
    };
    json!({"git_head": head, "shim_built_unix": built("containerd-shim-crab-v1"), "crabctl_built_unix": built("crabctl")})
}

fn verdict(p50: f64, aim: f64) -> &'static str {
    if p50.is_nan() || aim.is_nan() {
        "-"
    } else if p50 <= aim {
        "met"
    } else {
        "missed"
    }
}

/// The report of what was measured so far, as (JSON, Markdown); `state` says whether the run is
/// still going (a partial report, rewritten after each section), complete, or was stopped.
fn render(
    b: &Bench,
    r: &Report,
    total: Duration,
    load_before: &str,
    state: &str,
) -> (Value, String) {
    let host = Host::now();
    let (now, kernel, cpus, load_after) = (host.unix_time, &host.kernel, host.cpus, &host.loadavg);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Restore benchmark\n\nRun: **{state}**, restore cache {}. kernel {kernel}, {cpus} CPUs, unix time {now}, total {:.0} s, loadavg before {load_before} / \
         after {load_after}. Image {AGENT_IMAGE} through the private containerd; starts of checkpoint images under \
         io.containerd.crab.v1. Milliseconds; nearest-rank percentiles (with few samples p95 = max). Figures only: the \
         aims are the issue's, not checked here. `cold` = the checkpoint's layers were not unpacked (their snapshots \
         removed first); `warm` = unpacked; `API` = Snapshots.Prepare + Containers.Create, Tasks.Create, Tasks.Start \
         until it returned (the task runs); `crabctl wall` = the command from spawn to exit.\n",
        if restore_cache_on() { "on" } else { "off (CRAB_BENCH_RESTORE_CACHE=off)" },
        total.as_secs_f64()
    );
    let _ = writeln!(md, "| section | measurement | n | p50 | p95 | min | max | aim (p50) | notes |\n|---|---|---:|---:|---:|---:|---:|---|---|");
    let mut rows_json = Vec::new();
    for row in &r.rows {
        let s = Stats::of(&row.samples);
        let aim = row
            .aim
            .map(|a| format!("<= {a:.0} ms: {}", verdict(s.p50, a)))
            .unwrap_or_else(|| "-".into());
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {aim} | {} |",
            row.section, row.what, s.n, s.p50, s.p95, s.min, s.max, row.note
        );
        rows_json.push(json!({"section": row.section, "measurement": row.what, "ms": Stats::json(&row.samples), "aim_p50_ms": row.aim, "note": row.note}));
    }

    // Ratios that make the figures comparable.
    let base_crab = r.p50(&format!("API create+start, base image, {DEFAULT_RUNTIME}"));
    let base_runc = r.p50(&format!("API create+start, base image, {RUNC_RUNTIME}"));
    let ctr_crab = r.p50(&format!("ctr run -d, base image, {DEFAULT_RUNTIME}"));
    let _ = writeln!(md, "\n## Ratios\n");
    let _ = writeln!(
        md,
        "- plain start, crab / runc (API p50): {:.2}",
        base_crab / base_runc
    );
    for n in CHAINS {
        let api = r.p50(&format!("{n} layers: API create+start, warm"));
        let cold = r.p50(&format!("{n} layers: ctr run -d, cold (unpack)"));
        let _ = writeln!(
            md,
            "- fs chain of {n}: warm API start / plain crab start {:.2}; cold ctr run / plain crab ctr run {:.2}",
            api / base_crab,
            cold / ctr_crab
        );
    }
    let proc = r.p50(&format!("{HELD_MB} MB process: API create+start, warm"));
    let _ = writeln!(
        md,
        "- {HELD_MB} MB process: warm API start / plain crab start {:.2}",
        proc / base_crab
    );
    let one = r.p50(&format!("1 plain API starts at once, {DEFAULT_RUNTIME}"));
    for n in FORKS.iter().filter(|n| **n > 1) {
        let many = r.p50(&format!("{n} plain API starts at once, {DEFAULT_RUNTIME}"));
        let _ = writeln!(
            md,
            "- reference: {n} plain starts at once / 1 (p50) {:.2}",
            many / one
        );
    }
    if let Some(aims) = r.extra.get("fork").and_then(|f| f["aims"].as_object()) {
        for (what, a) in aims {
            let x = a["wall_over_plain"].as_f64().unwrap_or(f64::NAN);
            let per = a["wall_per_sandbox_ms"].as_f64().unwrap_or(f64::NAN);
            let single = a["aim_per_sandbox_ms"].as_f64().unwrap_or(f64::NAN);
            let _ = writeln!(
                md,
                "- fork {what}: wall / as many plain starts at once (p50s) {x:.2} (aim <= {AIM_FORK_OVER_PLAIN}: {}); \
                 wall / N {per:.0} ms per sandbox vs {single:.0} ms for one start of the image (a plain start plus a restore: {})",
                verdict(x, AIM_FORK_OVER_PLAIN),
                verdict(per, single)
            );
        }
    }
    let _ = writeln!(
        md,
        "\nAims (issues 5 and 15): fs-only rollback p50 <= {AIM_ROLLBACK_FS_MS:.0} ms; restore with a {HELD_MB} MB process p50 <= \
         {AIM_RESTORE_PROC_MS:.0} ms; forking N <= {AIM_FORK_OVER_PLAIN}x the time of N plain starts at once, and no slower \
         per sandbox than a plain start plus a restore (one API start of the same checkpoint image). (For scale: published \
         CRAB restore < 1 s; Morph < 250 ms; E2B resume ~1 s.)"
    );
    if !r.notes.is_empty() {
        let _ = writeln!(md, "\n## Seen on the way\n");
        for n in &r.notes {
            let _ = writeln!(md, "- {n}");
        }
    }
    if let Some(e) = &r.failed {
        let _ = writeln!(
            md,
            "\n## Stopped\n\n{e}\n\nThe figures above were measured before."
        );
    }
    if !r.cleanup.is_empty() {
        let _ = writeln!(md, "\n## Cleanup left\n");
        for n in &r.cleanup {
            let _ = writeln!(md, "- {n}");
        }
    }

    let mut result = json!({
        "benchmark": "restore",
        "state": state,
        "unix_time": now,
        "total_s": total.as_secs_f64(),
        "host": {"kernel": kernel, "cpus": cpus, "loadavg_before": load_before, "loadavg_after": load_after},
        "containerd_address": b.base.env.address,
        "build": build_info(),
        "image": AGENT_IMAGE,
        "options": {"reps": b.o.reps, "rollback_reps": b.o.rollback_reps, "fork_reps": b.o.fork_reps, "restore_cache": restore_cache_on()},
        "rows": rows_json,
        "notes": r.notes,
        "failed": r.failed,
        "cleanup_errors": r.cleanup,
        "aims": {"rollback_fs_p50_ms": AIM_ROLLBACK_FS_MS, "restore_proc_50mb_p50_ms": AIM_RESTORE_PROC_MS, "fork_over_plain_starts": AIM_FORK_OVER_PLAIN},
    });
    for (k, v) in &r.extra {
        result[k] = v.clone();
    }
    (result, md)
}

/// Writes the report of what was measured so far (the same files the final report replaces):
/// a run stopped later, or killed, keeps these figures.
fn save_partial(b: &Bench, r: &Report, started: Instant, load_before: &str) {
    let (json, md) = render(b, r, started.elapsed(), load_before, "partial: running");
    if let Err(e) = crab_integration::bench::write_results(
        &b.base.env.bench_dir(),
        "restore",
        b.stamp,
        &json,
        &md,
    ) {
        BENCH.progress(format!("cannot write the partial results: {e}"));
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let o = opts();
    let env = BENCH.crab_env("checkpoint images");
    let crabctl = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
    if !crabctl.is_file() {
        BENCH.die(format!(
            "{} is missing: cargo build --release (make build)",
            crabctl.display()
        ));
    }
    let base = Harness::connect_env(env)
        .await
        .unwrap_or_else(|e| BENCH.die(e));
    let pid = std::process::id();
    let state_dir = base
        .env
        .crab_home
        .join("state")
        .join(format!("bench-restore-{pid}"));
    let cfg_body = format!("[store]\nstate_dir = \"{}\"\n", state_dir.display());
    let cfg_path = base
        .env
        .crab_home
        .join("state")
        .join(format!("bench-restore-{pid}.toml"));
    std::fs::create_dir_all(&state_dir)
        .unwrap_or_else(|e| BENCH.die(format!("{}: {e}", state_dir.display())));
    std::fs::write(&cfg_path, &cfg_body)
        .unwrap_or_else(|e| BENCH.die(format!("{}: {e}", cfg_path.display())));
    let log = base.env.containerd_log();
    let guard = base.guard(&[]);
    let mut b = Bench {
        base,
        o,
        pid,
        stamp: Host::now().unix_time,
        cfg_path,
        cfg_body,
        state_dir,
        guard,
        images: Vec::new(),
        sandboxes: Vec::new(),
        n: 0,
        log,
        extra_manifest: None,
        fork_store_manifests: Vec::new(),
        forks: Vec::new(),
        fork_held_kib: Vec::new(),
    };
    let mut r = Report::default();
    let load_before = crab_integration::bench::loadavg();
    let started = Instant::now();
    let mut guards = Vec::new();
    let res = async {
        // Section 3b alone (the in-place rollback figures), for quick runs.
        match std::env::var("BENCH_RESTORE_ONLY").as_deref() {
            Ok("3b") => return bench_in_place(&mut b, &mut r).await,
            Ok("5") => return bench_lazy(&mut b, &mut r).await,
            Ok("6") => return bench_verify(&mut b, &mut r).await,
            Ok("2") => {
                let (p, g) = proc_sandbox(&mut b).await?;
                guards.push(g);
                return bench_proc_restore(&mut b, &mut r, &p).await;
            }
            Ok("4") => {
                let (fs, g) = fs_sandbox(&mut b).await?;
                guards.push(g);
                let (p, g) = proc_sandbox(&mut b).await?;
                guards.push(g);
                return bench_fork(&mut b, &mut r, &fs, &p).await;
            }
            Ok("4b") => {
                let (p, g) = proc_sandbox(&mut b).await?;
                guards.push(g);
                return bench_merge(&mut b, &mut r, &p).await;
            }
            _ => {}
        }
        baseline(&mut b, &mut r).await?;
        save_partial(&b, &r, started, &load_before);
        let (mut fs, g) = fs_sandbox(&mut b).await?;
        guards.push(g);
        bench_chains(&mut b, &mut r, &fs).await?;
        save_partial(&b, &r, started, &load_before);
        let (mut p, g) = proc_sandbox(&mut b).await?;
        guards.push(g);
        bench_proc_restore(&mut b, &mut r, &p).await?;
        save_partial(&b, &r, started, &load_before);
        bench_rollback(&mut b, &mut r, &mut fs, &mut p).await?;
        bench_in_place(&mut b, &mut r).await?;
        save_partial(&b, &r, started, &load_before);
        bench_fork(&mut b, &mut r, &fs, &p).await?;
        save_partial(&b, &r, started, &load_before);
        bench_merge(&mut b, &mut r, &p).await?;
        save_partial(&b, &r, started, &load_before);
        bench_lazy(&mut b, &mut r).await?;
        save_partial(&b, &r, started, &load_before);
        bench_verify(&mut b, &mut r).await?;
        Ok::<_, String>(())
    }
    .await;
    let total = started.elapsed();
    if let Err(e) = res {
        BENCH.progress(format!("stopped: {e}"));
        r.failed = Some(e);
    }
    save_partial(&b, &r, started, &load_before);
    BENCH.progress("cleaning up: containers, then snapshots (children first), then images");
    r.cleanup = cleanup(&b).await;
    // What the sandboxes' guards would remove is gone already; before any exit (die() runs no
    // destructors).
    drop(guards);
    let state = match (&r.failed, r.cleanup.is_empty()) {
        (Some(_), _) => "stopped by an error",
        (None, true) => "complete",
        (None, false) => "complete (cleanup left something, see the end)",
    };
    let (json, md) = render(&b, &r, total, &load_before, state);
    BENCH.finish(&b.base.env.bench_dir(), "restore", b.stamp, &json, &md);
    cleanup_files(&b);
    for e in &r.cleanup {
        BENCH.progress(format!("cleanup: {e}"));
    }
    if let Some(e) = r.failed.take() {
        drop(b.guard);
        BENCH.die(e);
    }
}

/// Removes what the run made, in dependency order: its containers (sandboxes, forks, starts),
/// then the unpacked snapshots of its checkpoint images (each snapshot's leftover children
/// before it), then the image records. Returns what could not be removed: reported with the
/// figures, never losing them.
async fn cleanup(b: &Bench) -> Vec<String> {
    let mut errors = Vec::new();
    let ours = |id: &str| {
        id.starts_with(&format!("bench-restore-{}-", b.pid))
            || b.sandboxes.iter().any(|s| id.starts_with(s.as_str()))
    };
    // 1. Containers.
    let listed = ContainersClient::new(b.base.channel())
        .list(b.base.request(ListContainersRequest::default()))
        .await;
    match listed {
        Ok(l) => {
            let ids: Vec<String> = l
                .into_inner()
                .containers
                .into_iter()
                .map(|c| c.id)
                .filter(|id| ours(id))
                .collect();
            if let Err(e) = remove_all(b, &ids).await {
                errors.push(format!("containers: {e}"));
            }
        }
        Err(s) => errors.push(format!("Containers.List: {}", s.message())),
    }
    for s in &b.sandboxes {
        let _ = std::fs::remove_dir_all(b.base.env.crab_home.join("state").join(s));
    }
    // 2. Snapshots, children first; 3. images.
    let mut names = b.images.clone();
    if let Ok(l) = ImagesClient::new(b.base.channel())
        .list(b.base.request(ListImagesRequest { filters: vec![] }))
        .await
    {
        for i in l.into_inner().images {
            let internal = b.sandboxes.iter().any(|s| {
                i.name.starts_with(&format!(
                    "crab.local/checkpoint/{}/{s}:",
                    b.base.env.namespace
                ))
            });
            if internal && !names.contains(&i.name) {
                names.push(i.name);
            }
        }
    }
    // Snapshots containerd would not remove yet ("with child" while the child is being
    // collected): checked again once the images are gone, and reported only if they stay.
    let mut refused: Vec<(String, String)> = Vec::new();
    for name in &names {
        match b.remove_unpacked(name).await {
            Ok(_) => {}
            Err(e) if e.contains("not found") || e.contains("NotFound") => {}
            Err(e) => refused.push((name.clone(), e)),
        }
    }
    for name in &names {
        let deleted = ImagesClient::new(b.base.channel())
            .delete(
                b.base
                    .request(containerd_client::services::v1::DeleteImageRequest {
                        name: name.clone(),
                        sync: false,
                        target: None,
                    }),
            )
            .await;
        match deleted {
            Ok(_) => {}
            Err(s) if s.code() == tonic::Code::NotFound => {}
            Err(s) => errors.push(format!("image {name}: {}", s.message())),
        }
    }
    for (name, e) in refused {
        // The snapshot the error names, as `removing snapshot <key>: ...`.
        let key = e
            .split("removing snapshot ")
            .nth(1)
            .and_then(|r| r.split(':').take(2).collect::<Vec<_>>().join(":").into())
            .unwrap_or_default();
        let mut gone = false;
        for _ in 0..100 {
            let stat = SnapshotsClient::new(b.base.channel())
                .stat(b.base.request(
                    containerd_client::services::v1::snapshots::StatSnapshotRequest {
                        snapshotter: SNAPSHOTTER.into(),
                        key: key.clone(),
                    },
                ))
                .await;
            if matches!(&stat, Err(s) if s.code() == tonic::Code::NotFound) {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !gone {
            errors.push(format!(
                "snapshots of {name}: {e}; still there 10 s after the images were deleted"
            ));
        }
    }
    errors
}

fn cleanup_files(b: &Bench) {
    let _ = std::fs::remove_dir_all(&b.state_dir);
    let _ = std::fs::remove_file(&b.cfg_path);
    for s in &b.sandboxes {
        let _ = std::fs::remove_dir_all(b.base.env.crab_home.join("state").join(s));
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn log_times_are_read_in_utc_to_the_nanosecond() {
        let line = r#"time="2026-12-03T06:39:53.931792054Z" level=info msg="container restored""#;
        let t = super::log_time(line).unwrap();
        assert!((t - 1_796_279_993.931_792).abs() < 1e-5, "{t}");
        assert_eq!(super::log_time("no time here"), None);
        assert_eq!(super::log_time(r#"time="yesterday""#), None);
    }
}

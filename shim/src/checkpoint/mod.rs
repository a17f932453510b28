//! Checkpoints: the smallest sufficient one at each turn end, off the agent's critical path.
//!
//! - [`store`]: the per-sandbox store (manifests `C_i = (P_j, F_k)`, blobs, atomic publish,
//!   retention); [`layer`]: fs diff layers (OCI tar+zstd, container frozen only while read);
//! - [`process`]: process images with CRIU via runc (the trap check, image verification);
//!   [`pages`]: their page data, content-addressed so unchanged pages are stored once;
//! - [`restore`]: a container started from a checkpoint image (the reserved directory in its
//!   rootfs) and the origin manifests that begin each container's lineage; before anything
//!   of such an image runs, [`provenance`] checks who signed it and [`privilege`] (reading
//!   the CRIU image with [`criu_image`]) that it asks for no more than the spec grants;
//! - [`Coordinator`] (here): a turn's answer becomes a background job; the next action on the
//!   container waits until that job is durable (bounded), and turn ends that arrive while a
//!   job runs are coalesced into the next job.
//!
//! An exec still running at a turn end (DESIGN.md §3, the trap): its main process is a child of
//! the shim, outside the tree `runc checkpoint` dumps, and CRIU can only dump one tree (whose
//! root must be the pid namespace's init). So a job that takes a process image first waits for
//! such processes to end, bounded by the action wait bound, then inspects the container again
//! and takes the checkpoint of the state at that moment (the turn's answer plus what the execs
//! did after the turn end). An exec still running at the bound, or when the next action is a
//! kill (which would otherwise wait for the very process it ends), makes the turn `failed`
//! with the exec named, and the next turn takes a full checkpoint. The turn end itself still
//! returns at once.
//!
//! Deadlines (host engine, `[engine]`): a job that gets no slot within `wait_timeout_ms` is
//! recorded `failed` with the slots' holders named; a job that holds its slot longer than
//! `job_timeout_ms` is aborted ([`deadline`]: `runc checkpoint` and CRIU killed, the container
//! thawed) and recorded `failed`. An aborted fs capture cannot be interrupted on its blocking
//! thread: it finishes in the background, its output is discarded, and the sandbox's next job
//! waits for it (outside the engine) so that two captures never overlap.

mod capture;
pub mod criu_image;
pub mod deadline;
pub mod layer;
pub mod pages;
pub mod policy;
pub mod privilege;
pub mod process;
pub mod provenance;
pub mod restore;
pub mod store;
mod tar;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use tokio::sync::watch;

use self::{
    layer::FsDiffPaths,
    store::{CheckpointKind, Manifest, ProcessImage, Store, Timings},
};
use crate::{
    error::{Error, Result},
    inspector::{procs, Answer, Inspection, Kind},
    runc::Runc,
};

/// How often a job waiting for running execs looks again.
const EXEC_POLL: Duration = Duration::from_millis(20);
/// How long an aborted job gets to end on its own once what it started was killed.
const ABORT_GRACE: Duration = Duration::from_secs(1);

/// What a job needs to know about its container.
#[derive(Clone)]
pub struct JobTarget {
    pub container_id: String,
    pub runc: Runc,
    pub init_pid: u32,
    pub cgroup2_dir: PathBuf,
    pub upperdir: Option<PathBuf>,
    /// Which xattr prefix is overlay state on the rootfs mount.
    pub overlay_xattrs: crate::inspector::fs::OverlayXattrs,
    /// What one checkpoint may cost (`[limits]`).
    pub limits: crab_runtime_config::LimitsConfig,
    /// Container paths under tracked volumes: their contents are not in the upperdir.
    pub volumes: Vec<PathBuf>,
    /// Which checkpoint a turn end takes ([`policy`]).
    pub policy: policy::CheckpointPolicy,
    /// Where its jobs wait for their turn among the host's ([`crate::engine`]).
    pub engine: Arc<crate::engine::Admission>,
}

/// The work one job does: the union of the turns it covers.
#[derive(Debug, Clone, Default)]
struct Work {
    turn_ids: Vec<String>,
    fs: bool,
    proc: bool,
    added: Vec<PathBuf>,
    modified: Vec<PathBuf>,
    deleted: Vec<PathBuf>,
    explanation: Vec<String>,
    /// A turn whose file changes are not known (the upperdir could not be scanned, e.g. it is
    /// over a `[limits]` bound): its paths are not in `added`/`modified`/`deleted`, so the job
    /// must capture the whole upperdir (a new chain) or fail, never store a partial layer.
    fs_unknown: bool,
}

impl Work {
    fn add(&mut self, turn_id: &str, a: &Answer) {
        self.turn_ids.push(turn_id.to_string());
        let (fs, proc) = match a.kind {
            Kind::None => (false, false),
            Kind::Fs => (true, false),
            Kind::Proc => (false, true),
            Kind::Full => (true, true),
        };
        self.fs |= fs;
        self.proc |= proc;
        self.added.extend(a.fs.added.iter().cloned());
        self.modified.extend(a.fs.modified.iter().cloned());
        self.deleted.extend(a.fs.deleted.iter().cloned());
        self.fs_unknown |= a.fs.unobserved;
        self.explanation.push(a.summary());
    }

    /// Takes in a later job's work (turn ends that arrived while this one waited).
    fn absorb(&mut self, later: Work) {
        self.turn_ids.extend(later.turn_ids);
        self.fs |= later.fs;
        self.proc |= later.proc;
        self.added.extend(later.added);
        self.modified.extend(later.modified);
        self.deleted.extend(later.deleted);
        self.explanation.extend(later.explanation);
        self.fs_unknown |= later.fs_unknown;
    }

    fn kind(&self) -> CheckpointKind {
        match (self.fs, self.proc) {
            (true, true) => CheckpointKind::Full,
            (true, false) => CheckpointKind::Fs,
            _ => CheckpointKind::Proc,
        }
    }
}

#[derive(Default)]
struct State {
    running: bool,
    pending: Option<Work>,
    /// The last job failed: the next one takes everything (a new fs chain and a process image).
    force_full: bool,
    /// Turn ids whose checkpoint is not durable yet (for errors and logs).
    in_flight: Vec<String>,
    /// The newest inspector answer (seq) given to [`Coordinator::submit`], whatever its kind.
    submitted_seq: u64,
    /// The actions waiting in [`Coordinator::wait_durable`] now, by name.
    waiting_actions: Vec<String>,
    /// The execs whose main process ran at the latest turn end: pid -> exec id.
    running_execs: HashMap<u32, String>,
}

/// The container's inspection, shared with the coordinator so a job can refresh the mark of
/// the processes its freeze woke.
pub type SharedInspection = Arc<tokio::sync::Mutex<Option<Inspection>>>;

pub struct Coordinator {
    store: Arc<Store>,
    target: JobTarget,
    inspection: SharedInspection,
    state: Mutex<State>,
    /// Bumped each time the coordinator becomes idle (no job running or pending).
    idle: watch::Sender<u64>,
    /// False while the origin manifest is being recorded in the background
    /// ([`Coordinator::record_origin`]): jobs wait for it, as their lineage begins there.
    origin_recorded: watch::Sender<bool>,
    keep_last: Option<u32>,
    keep_every: Option<u32>,
    wait_bound: Duration,
    /// Set when the running job passed its deadline: it starts nothing more and publishes
    /// nothing.
    aborted: AtomicBool,
    /// Held by an fs capture's blocking thread while it runs (also after its job was aborted).
    capture: Arc<tokio::sync::Mutex<()>>,
}

impl Coordinator {
    pub fn new(
        store: Store,
        target: JobTarget,
        inspection: SharedInspection,
        keep_last: Option<u32>,
        keep_every: Option<u32>,
        wait_bound: Duration,
    ) -> Arc<Coordinator> {
        Arc::new(Coordinator {
            store: Arc::new(store),
            target,
            inspection,
            state: Mutex::new(State::default()),
            idle: watch::channel(0).0,
            origin_recorded: watch::channel(true).0,
            keep_last,
            keep_every,
            wait_bound,
            aborted: AtomicBool::new(false),
            capture: Arc::new(tokio::sync::Mutex::new(())),
        })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Records the origin manifest that `make` builds (a restored container's, which imports
    /// the process image it was restored from: a copy and deduplication of up to hundreds of
    /// MB) in the background. Actions need not wait for it (they cannot change the image it
    /// reads); checkpoint jobs do, as their lineage begins there. If it fails, the next
    /// checkpoint is full. `then` runs after it either way.
    pub fn record_origin(
        self: &Arc<Self>,
        make: impl FnOnce(&Store) -> std::result::Result<Manifest, String> + Send + 'static,
        then: impl FnOnce() + Send + 'static,
    ) {
        self.origin_recorded.send_replace(false);
        let this = self.clone();
        tokio::spawn(async move {
            let store = this.store.clone();
            let recorded = tokio::task::spawn_blocking(move || {
                let r = make(&store).and_then(|m| store.publish(&m).map_err(|e| e.to_string()));
                then();
                r
            })
            .await
            .unwrap_or_else(|e| Err(format!("origin task: {e}")));
            if let Err(e) = recorded {
                log::error!(
                    "container {}: cannot record where its lineage begins, its next checkpoint is full: {e}",
                    this.target.container_id
                );
                this.state.lock().unwrap().force_full = true;
            }
            this.origin_recorded.send_replace(true);
        });
    }

    /// Takes a turn's answer: returns at once; the checkpoint (if any) runs in the background.
    pub fn submit(self: &Arc<Self>, turn_id: &str, answer: &Answer) {
        let answer = &*policy::apply(self.target.policy, answer);
        let mut st = self.state.lock().unwrap();
        st.submitted_seq = st.submitted_seq.max(answer.seq);
        if answer.kind == Kind::None && !st.force_full {
            log::info!(
                "turn {turn_id} of {}: no checkpoint needed",
                self.target.container_id
            );
            return;
        }
        let mut work = st.pending.take().unwrap_or_default();
        work.add(turn_id, answer);
        st.in_flight.push(turn_id.to_string());
        if st.running {
            log::info!(
                "turn {turn_id} of {}: a checkpoint is running; coalesced with {:?}",
                self.target.container_id,
                work.turn_ids
            );
            st.pending = Some(work);
            return;
        }
        st.running = true;
        drop(st);
        let this = self.clone();
        tokio::spawn(async move { this.run(work).await });
    }

    /// The execs whose main process runs at a turn end, as (pid, exec id): a process image
    /// cannot hold them, so a job waits for them and names them if it gives up.
    pub fn note_running_execs(&self, execs: Vec<(u32, String)>) {
        self.state.lock().unwrap().running_execs = execs.into_iter().collect();
    }

    async fn run(self: Arc<Self>, mut work: Work) {
        // The sender lives as long as `self`, so this only ends once the origin is recorded.
        let _ = self
            .origin_recorded
            .subscribe()
            .wait_for(|recorded| *recorded)
            .await;
        loop {
            let force_full = std::mem::take(&mut self.state.lock().unwrap().force_full)
                || std::mem::take(&mut work.fs_unknown);
            if force_full {
                work.fs = true;
                work.proc = true;
            }
            let waited = match work.proc {
                true => self.wait_for_execs(&mut work).await,
                false => Ok(()),
            };
            let turn_ids = work.turn_ids.clone();
            let idle = match self.inspection.lock().await.as_ref() {
                Some(i) => i.idle_since_mark(),
                None => Vec::new(),
            };
            // An aborted job's fs capture that still runs ends first (outside the engine).
            drop(self.capture.lock().await);
            let result = match waited {
                Ok(()) => match self.target.engine.admit(&work.turn_ids.join(",")).await {
                    Ok(permit) => {
                        let result = self.bounded_job(&work, force_full).await;
                        permit.finish(result.as_ref().map_or(0, crate::engine::bytes_written));
                        result
                    }
                    Err(e) => Err(Error::FailedPrecondition(format!(
                        "no checkpoint taken: {e}"
                    ))),
                },
                Err(e) => Err(e),
            };
            if !idle.is_empty() {
                let inspection = self.inspection.clone();
                let _ = tokio::task::spawn_blocking(move || {
                    if let Some(i) = inspection.blocking_lock().as_mut() {
                        i.refresh_after_freeze(&idle);
                    }
                })
                .await;
            }
            match result {
                Ok(m) => log::info!(
                    "checkpoint {} of {} (turns {turn_ids:?}): {:?}, {} layers, freeze {:.1} ms, total {:.1} ms",
                    m.seq,
                    self.target.container_id,
                    m.kind,
                    m.fs_layers.len(),
                    m.timings.freeze_ms,
                    m.timings.total_ms
                ),
                Err(e) => {
                    log::error!(
                        "checkpoint of {} for turns {turn_ids:?} FAILED, the next turn takes a full checkpoint: {e}",
                        self.target.container_id
                    );
                    self.record_failure(&work, &e);
                    self.state.lock().unwrap().force_full = true;
                }
            }
            let mut st = self.state.lock().unwrap();
            st.in_flight.retain(|t| !turn_ids.contains(t));
            match st.pending.take() {
                Some(next) => work = next,
                None => {
                    st.running = false;
                    drop(st);
                    self.idle.send_modify(|g| *g += 1);
                    return;
                }
            }
        }
    }

    /// Waits until every live process of the container descends from its init (an exec's
    /// running main process does not), bounded by the action wait bound and cut short by a
    /// waiting kill. If it had to wait, inspects the container again: the checkpoint then
    /// covers what the execs did after the turn end, and turn ends that arrived meanwhile are
    /// taken into this job (a checkpoint of the later state must hold their changes too).
    async fn wait_for_execs(&self, work: &mut Work) -> Result<()> {
        let t = &self.target;
        let started = Instant::now();
        let mut waited_for: Option<String> = None;
        loop {
            let (init, cgroup) = (t.init_pid, t.cgroup2_dir.clone());
            let check = tokio::task::spawn_blocking(move || process::check_dumpable(init, &cgroup))
                .await
                .map_err(|e| Error::Other(format!("process check task: {e}")))?;
            let (pids, cmdlines) = match check {
                Ok(_) => break,
                Err(process::ProcError::Undumpable { pids, cmdlines, .. }) => (pids, cmdlines),
                Err(e) => return Err(Error::Other(format!("process checkpoint: {e}"))),
            };
            let outside = self.describe_outside(&pids, &cmdlines);
            if waited_for.is_none() {
                log::info!(
                    "checkpoint of {} for turns {:?} waits for {outside}: not in the tree a process image holds",
                    t.container_id,
                    work.turn_ids
                );
            }
            let why = if self
                .state
                .lock()
                .unwrap()
                .waiting_actions
                .iter()
                .any(|a| a == "kill")
            {
                Some(format!(
                    "when the next action (a kill) arrived {:?} after the checkpoint began waiting for it",
                    started.elapsed()
                ))
            } else if started.elapsed() >= self.wait_bound {
                Some(format!(
                    "{:?} after the checkpoint began waiting for it ([checkpoint] action_wait_timeout_ms)",
                    self.wait_bound
                ))
            } else {
                None
            };
            if let Some(why) = why {
                return Err(Error::FailedPrecondition(format!(
                    "no process checkpoint: {outside} still running {why}; an exec's main process \
                     is outside the process tree `runc checkpoint` dumps (its parent is the shim, \
                     not the container's init), so a checkpoint is only possible once it has ended"
                )));
            }
            waited_for = Some(outside);
            tokio::time::sleep(EXEC_POLL).await;
        }
        let Some(waited_for) = waited_for else {
            return Ok(());
        };
        let waited = started.elapsed();
        let last_turn = work.turn_ids.last().cloned().unwrap_or_default();
        let inspection = self.inspection.clone();
        let answer = tokio::task::spawn_blocking(move || {
            inspection.blocking_lock().as_mut().map(|i| i.turn_end())
        })
        .await
        .map_err(|e| Error::Other(format!("inspection task: {e}")))?
        .ok_or_else(|| Error::Other("the container is no longer inspected".into()))?;
        // The store root is the sandbox's directory (turns::sandbox_dir), next to its answers.
        let turns = self.store.root().join("turns");
        if let Err(e) =
            crate::turns::store_answer(&turns, &format!("{last_turn}+exec-end"), &answer)
        {
            log::warn!(
                "cannot store the answer after the execs of {} ended: {e}",
                t.container_id
            );
        }
        // A turn end answered just before ours may still be on its way to `submit`: its
        // changes are relative to a mark ours replaced, so this job must hold them.
        let deadline = Instant::now() + EXEC_POLL * 50;
        while self.state.lock().unwrap().submitted_seq + 1 < answer.seq && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        {
            let mut st = self.state.lock().unwrap();
            st.submitted_seq = st.submitted_seq.max(answer.seq);
            if let Some(later) = st.pending.take() {
                work.absorb(later);
            }
        }
        log::info!(
            "checkpoint of {} for turns {:?}: waited {waited:?} for {waited_for}; then {}",
            t.container_id,
            work.turn_ids,
            answer.summary()
        );
        work.add(&format!("{last_turn}+exec-end"), &answer);
        // Not a turn of its own: only its findings join the job.
        work.turn_ids.pop();
        work.explanation.insert(
            work.explanation.len() - 1,
            format!("waited {waited:?} for {waited_for} to end (outside the tree a process image holds); then:"),
        );
        Ok(())
    }

    /// Names processes outside init's tree as `exec ID (pid P <cmdline>, ...)`, grouped by the
    /// exec whose main process they are or descend from (when it ran at the latest turn end).
    fn describe_outside(&self, pids: &[u32], cmdlines: &[String]) -> String {
        let execs = self.state.lock().unwrap().running_execs.clone();
        let exec_of = |pid: u32| -> Option<&String> {
            let mut cur = pid;
            for _ in 0..64 {
                if let Some(id) = execs.get(&cur) {
                    return Some(id);
                }
                cur = procs::read_stat(cur).ok().flatten()?.ppid;
                if cur <= 1 {
                    return None;
                }
            }
            None
        };
        let mut groups: Vec<(Option<&String>, Vec<String>)> = Vec::new();
        for (pid, cmd) in pids.iter().zip(cmdlines) {
            let exec = exec_of(*pid);
            let entry = format!("pid {pid} `{cmd}`");
            match groups.iter_mut().find(|(e, _)| *e == exec) {
                Some((_, list)) => list.push(entry),
                None => groups.push((exec, vec![entry])),
            }
        }
        groups
            .into_iter()
            .map(|(exec, list)| match exec {
                Some(id) => format!("exec {id} ({})", list.join(", ")),
                None => format!("process(es) {}", list.join(", ")),
            })
            .collect::<Vec<_>>()
            .join(" and ")
    }

    /// Publishes a `failed` manifest keeping the previous references, so the lineage shows the
    /// failed turn; if even that cannot be written (a full disk), the log has it.
    fn record_failure(&self, work: &Work, e: &Error) {
        let result = (|| -> std::result::Result<(), store::StoreError> {
            let parent = self.store.latest()?;
            let mut m = Manifest::child_of(
                parent.as_ref(),
                self.store.next_seq()?,
                &work.turn_ids.join(","),
                CheckpointKind::Failed,
            );
            m.explanation = format!("failed: {e}");
            self.store.publish(&m)
        })();
        if let Err(pe) = result {
            log::error!(
                "cannot record the failed checkpoint of {}: {pe}",
                self.target.container_id
            );
        }
    }

    /// [`Coordinator::job`] within `[engine] job_timeout_ms`: past it, what the job started is
    /// killed and the container thawed ([`deadline::abort`]), and the job is given
    /// [`ABORT_GRACE`] to end; whatever it then returns, it fails (a job that already
    /// published keeps its checkpoint).
    async fn bounded_job(&self, work: &Work, new_chain: bool) -> Result<Manifest> {
        let limit = self.target.engine.job_timeout();
        self.aborted.store(false, Ordering::SeqCst);
        let job = self.job(work, new_chain);
        tokio::pin!(job);
        if let Ok(result) = tokio::time::timeout(limit, &mut job).await {
            return result;
        }
        self.aborted.store(true, Ordering::SeqCst);
        let abort = || {
            let (id, init) = (self.target.container_id.clone(), self.target.init_pid);
            tokio::task::spawn_blocking(move || deadline::abort(&id, init))
        };
        let aborted = abort().await.unwrap_or_default();
        let why = format!(
            "the checkpoint held its engine slot longer than {limit:?} ([engine] job_timeout_ms) and was aborted: {aborted}"
        );
        log::error!("container {}: {why}", self.target.container_id);
        let ended = tokio::time::timeout(ABORT_GRACE, &mut job).await;
        // Anything the job started between the look and its end.
        let late = abort().await.unwrap_or_default();
        if !late.killed.is_empty() {
            log::error!(
                "container {}: after the abort: {late}",
                self.target.container_id
            );
        }
        match ended {
            Ok(Ok(m)) => {
                log::warn!(
                    "container {}: checkpoint {} was published right at its deadline",
                    self.target.container_id,
                    m.seq
                );
                Ok(m)
            }
            Ok(Err(e)) => Err(Error::FailedPrecondition(format!("{why} ({e})"))),
            Err(_) => Err(Error::FailedPrecondition(why)),
        }
    }

    fn check_aborted(&self) -> Result<()> {
        match self.aborted.load(Ordering::SeqCst) {
            true => Err(Error::Other("aborted at its deadline".into())),
            false => Ok(()),
        }
    }

    async fn job(&self, work: &Work, new_chain: bool) -> Result<Manifest> {
        let started = Instant::now();
        let t = &self.target;
        let parent = self.store.latest().map_err(store_err)?;
        let seq = self.store.next_seq().map_err(store_err)?;
        let mut m = Manifest::child_of(parent.as_ref(), seq, &work.turn_ids.join(","), work.kind());
        m.explanation = work.explanation.join("\n");
        let mut timings = Timings::default();
        if work.fs {
            let upper = t.upperdir.clone().ok_or_else(|| {
                Error::Other("the rootfs is not an overlay: no fs checkpoint possible".into())
            })?;
            let (store, target) = (self.store.clone(), t.clone());
            let (added, modified, deleted) = if new_chain {
                // After a failure nothing is known about what the missing layers held: one
                // layer of the whole upperdir, starting a new chain on top of the image.
                let limits = (&t.limits).into();
                let all = crate::inspector::fs::TreeManifest::scan_with(
                    &upper,
                    &limits,
                    t.overlay_xattrs,
                )
                .map_err(|e| Error::Other(e.to_string()))?;
                let d = crate::inspector::fs::diff(
                    &crate::inspector::fs::TreeManifest::default(),
                    &all,
                    &[],
                );
                (d.added, d.modified, d.deleted)
            } else {
                (
                    work.added.clone(),
                    work.modified.clone(),
                    work.deleted.clone(),
                )
            };
            // A tracked volume is not in the upperdir, and its contents are not captured yet
            // (the manifest has no place for them): say so rather than imply they are kept.
            let mut in_volumes = 0;
            let mut outside_volumes = |v: Vec<PathBuf>| -> Vec<PathBuf> {
                let (inside, outside): (Vec<_>, Vec<_>) = v
                    .into_iter()
                    .partition(|p| target.volumes.iter().any(|vol| p.starts_with(vol)));
                in_volumes += inside.len();
                outside
            };
            let (added, modified, deleted) = (
                outside_volumes(added),
                outside_volumes(modified),
                outside_volumes(deleted),
            );
            if in_volumes > 0 {
                let volumes: Vec<String> =
                    t.volumes.iter().map(|v| v.display().to_string()).collect();
                let note = format!(
                    "not captured: {in_volumes} change(s) under tracked volume(s) {} (volume contents are not part of checkpoints yet)",
                    volumes.join(", ")
                );
                log::warn!("checkpoint {seq} of {}: {note}", t.container_id);
                m.explanation.push('\n');
                m.explanation.push_str(&note);
            }
            let init_pid = t.init_pid;
            let opts = layer::LayerOptions {
                max_bytes: t.limits.max_layer_bytes,
                max_depth: t.limits.max_walk_depth,
                xattrs: t.overlay_xattrs,
            };
            let capturing = self.capture.clone().lock_owned().await;
            let (desc, stats) = tokio::task::spawn_blocking(move || {
                let _capturing = capturing;
                let freezer = crate::sys::cgroup::freezer::CgroupFreezer::for_pid(init_pid)
                    .map_err(Error::io("find the container's freezer"))?;
                let paths = FsDiffPaths {
                    added: &added,
                    modified: &modified,
                    deleted: &deleted,
                };
                layer::write_fs_layer_with(&store, &upper, &paths, &freezer, &opts)
                    .map_err(|e| Error::Other(e.to_string()))
            })
            .await
            .map_err(|e| Error::Other(format!("fs checkpoint task: {e}")))??;
            if new_chain {
                // The layers the container's image carries stay: the upperdir is relative to them.
                m.fs_layers.truncate(m.image_layers);
            }
            m.fs_layers.push(desc);
            timings.freeze_ms = Timings::ms(stats.freeze);
            timings.capture_ms = Timings::ms(stats.capture);
        }
        if work.proc {
            self.check_aborted()?;
            let dir = self.store.proc_dir(seq);
            let cp = process::checkpoint(
                &t.runc,
                &t.container_id,
                t.init_pid,
                &t.cgroup2_dir,
                &dir,
                &self.store.chunks_dir(),
            )
            .await
            .map_err(|e| Error::Other(format!("process checkpoint: {e}")))?;
            m.process = Some(ProcessImage {
                image: format!(
                    "proc/{}",
                    dir.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                ),
                bytes_stored: cp.bytes_stored,
                bytes_logical: cp.bytes_logical,
                pids: cp.pids,
            });
        }
        timings.total_ms = Timings::ms(started.elapsed());
        m.timings = timings;
        self.check_aborted()?;
        self.store.publish(&m).map_err(store_err)?;
        match self.store.apply_retention(self.keep_last, self.keep_every) {
            Ok(r) if !r.removed_proc.is_empty() => {
                // Jobs of a sandbox run one at a time, so no dedup into these chunks overlaps.
                let keep: Vec<PathBuf> = self
                    .store
                    .list()
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|m| m.process.as_ref().map(|p| self.store.root().join(&p.image)))
                    .collect();
                if let Err(e) = pages::collect_garbage(&self.store.chunks_dir(), &keep) {
                    log::warn!(
                        "page chunk collection in the store of {}: {e}",
                        t.container_id
                    );
                }
            }
            Ok(_) => {}
            Err(e) => log::warn!("retention in the store of {}: {e}", t.container_id),
        }
        Ok(m)
    }

    /// Waits until the checkpoints of ended turns are durable: the next action on the container
    /// must not change it before its recovery point exists. Bounded by the configured wait.
    pub async fn wait_durable(&self, action: &str) -> Result<()> {
        let mut rx = self.idle.subscribe();
        let busy = |st: &State| st.running || st.pending.is_some();
        if !busy(&self.state.lock().unwrap()) {
            return Ok(());
        }
        let started = Instant::now();
        let _waiting = WaitingAction::new(&self.state, action);
        // A job of this container still queued on the host goes first now.
        let _urgent = self.target.engine.urgent();
        let wait = async {
            loop {
                if !busy(&self.state.lock().unwrap()) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        };
        if tokio::time::timeout(self.wait_bound, wait).await.is_err() {
            let turns = self.state.lock().unwrap().in_flight.clone();
            return Err(Error::FailedPrecondition(format!(
                "{action} on {} waited {:?} for the checkpoint of turn(s) {turns:?}, which is still not durable ([checkpoint] action_wait_timeout_ms)",
                self.target.container_id, self.wait_bound
            )));
        }
        log::debug!(
            "{action} on {} waited {:?} for its checkpoint",
            self.target.container_id,
            started.elapsed()
        );
        Ok(())
    }
}

/// An action in [`Coordinator::wait_durable`], listed in the state while it waits (also when
/// its caller gives up and drops the wait).
struct WaitingAction<'a> {
    state: &'a Mutex<State>,
    action: String,
}

impl<'a> WaitingAction<'a> {
    fn new(state: &'a Mutex<State>, action: &str) -> Self {
        state
            .lock()
            .unwrap()
            .waiting_actions
            .push(action.to_string());
        WaitingAction {
            state,
            action: action.to_string(),
        }
    }
}

impl Drop for WaitingAction<'_> {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap();
        if let Some(i) = st.waiting_actions.iter().position(|a| *a == self.action) {
            st.waiting_actions.remove(i);
        }
    }
}

fn store_err(e: store::StoreError) -> Error {
    Error::Other(e.to_string())
}

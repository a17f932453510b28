//! The checkpoint coordinator of one sandbox: a turn's answer becomes a background job; the next
//! action on the container waits until that job is durable (bounded), and turn ends that arrive
//! while a job runs are coalesced into the next job. After a failed job the next one takes
//! everything (a new fs chain and a process image).
//!
//! It decides; it does not touch the container. It asks the container's inspection through
//! [`Inspect`] and captures files and processes through [`Capture`] (the real ones: the
//! sandbox's inspection, and [`super::jobs::ContainerCapture`]), so its logic is tested here
//! with fakes.
//!
//! An exec still running at a turn end (the trap): its main process is a child of the shim,
//! outside the tree `runc checkpoint` dumps, and CRIU can only dump one tree (whose root must be
//! the pid namespace's init). So a job that takes a process image first waits for such
//! processes to end, bounded by the action wait bound, then inspects the container again and
//! takes the checkpoint of the state at that moment (the turn's answer plus what the execs did
//! after the turn end). An exec still running at the bound, or when the next action is a kill
//! (which would otherwise wait for the very process it ends), makes the turn `failed` with the
//! exec named, and the next turn takes a full checkpoint. The turn end itself still returns at
//! once.
//!
//! Deadlines (host engine, `[engine]`): a job that gets no slot within `wait_timeout_ms` is
//! recorded `failed` with the slots' holders named; a job that holds its slot longer than
//! `job_timeout_ms` is aborted (its fs capture told to stop through the job's [`Cancel`],
//! then [`Capture::abort`]: `runc checkpoint` and CRIU killed, the container thawed) and
//! recorded `failed`. The fs capture runs on a blocking thread that cannot be killed: it looks
//! at the flag before every entry and every chunk of file data and ends within a chunk's copy,
//! its temporary files removed. Should it still run (a single stuck read), the sandbox's next
//! job waits for it (outside the engine) so that two captures never overlap.

use std::{
    collections::{BTreeSet, HashMap},
    future::Future,
    path::{Component, Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use tokio::sync::{watch, OwnedMutexGuard};

use super::{
    deadline::{Aborted, Cancel},
    error::{CheckpointError, GaveUp},
    pages, policy,
    store::{CheckpointKind, Descriptor, Manifest, ProcessImage, Store, Timings},
};
use crate::{
    engine::Admission,
    inspector::{fs::FsDiff, Answer, Kind},
};

type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// How often a job waiting for running execs looks again.
pub use super::action::Action;

const EXEC_POLL: Duration = Duration::from_millis(20);
/// How long an aborted job gets to end on its own once what it started was killed.
const ABORT_GRACE: Duration = Duration::from_secs(1);

/// The container's inspection, as a job needs it.
pub trait Inspect: Send + Sync + 'static {
    /// The processes not scheduled since the mark, with their run counts (empty when the
    /// container is not inspected).
    fn idle_since_mark(&self) -> impl Future<Output = Vec<(u32, u64)>> + Send;
    /// After a job froze and thawed the container: refreshes the mark of the processes that
    /// were idle before ([`Inspect::idle_since_mark`]), so the next turn does not count what
    /// the freeze changed.
    fn refresh_after_freeze(&self, idle: Vec<(u32, u64)>) -> impl Future<Output = ()> + Send;
    /// Answers a turn end now and makes the present the new mark; the answer is stored as turn
    /// `turn_id`. A job calls it after the execs it waited for ended.
    fn turn_end(&self, turn_id: &str) -> impl Future<Output = Result<Answer>> + Send;
}

/// What a process image took.
#[derive(Debug, Clone, Default)]
pub struct ProcessCaptured {
    /// Host pids of the processes in the image.
    pub pids: Vec<u32>,
    /// The image as CRIU wrote it.
    pub bytes_logical: u64,
    /// What it added to the disk after deduplication.
    pub bytes_stored: u64,
    /// Where its time went.
    pub timings: super::store::ProcessTimings,
}

/// What an fs capture wrote.
#[derive(Debug, Clone)]
pub struct FsLayer {
    pub descriptor: Descriptor,
    /// How long the container was frozen.
    pub freeze: Duration,
    pub capture: Duration,
}

/// The capture of a container's files and processes, as a job needs it.
pub trait Capture: Send + Sync + 'static {
    /// The live processes of the container a process image would leave out (an exec's running
    /// main process and what it started), as (pid, command line); empty when none.
    fn outside_init(&self) -> impl Future<Output = Result<Vec<(u32, String)>>> + Send;
    /// The parent of `pid`, if it still runs (to tell which exec a process belongs to).
    fn parent_of(&self, pid: u32) -> Option<u32>;
    /// Every path of the upperdir, as added: the changes of a new chain.
    fn scan_upperdir(&self) -> impl Future<Output = Result<FsDiff>> + Send;
    /// Writes the fs layer of `changes` into `store`. `capturing` is held until the capture
    /// has really ended, also when the job is aborted before. Once `cancel` is set (the job
    /// passed its deadline) the capture stops promptly and fails, leaving nothing in the store.
    fn fs_layer(
        &self,
        store: Arc<Store>,
        changes: FsDiff,
        volumes: Vec<VolumeChanges>,
        capturing: OwnedMutexGuard<()>,
        cancel: Cancel,
    ) -> impl Future<Output = Result<FsLayer>> + Send;
    /// Takes a process image into `dir` (which does not exist yet), its pages into `chunks`.
    fn process_image(
        &self,
        dir: PathBuf,
        chunks: PathBuf,
    ) -> impl Future<Output = Result<ProcessCaptured>> + Send;
    /// Kills what the running job started and thaws the container.
    fn abort(&self) -> impl Future<Output = Aborted> + Send;
}

/// How a sandbox's checkpoints are taken and kept.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Which checkpoint a turn end takes ([`policy`]).
    pub policy: policy::CheckpointPolicy,
    /// Container paths of tracked volumes: their contents are not in the upperdir.
    pub volumes: Vec<PathBuf>,
    pub keep_last: Option<u32>,
    pub keep_every: Option<u32>,
    /// How long an action waits for a checkpoint (`[checkpoint] action_wait_timeout_ms`), and a
    /// job for running execs.
    pub wait_bound: Duration,
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
    /// A turn the inspector could not observe (a degraded answer) is among them.
    degraded: bool,
    /// A turn whose answer could not be recorded is among them
    /// ([`Coordinator::submit_unrecorded`]): the job takes everything.
    unrecorded: bool,
    /// When the first of its turns ended.
    turn_ended: Option<SystemTime>,
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
        self.degraded |= !a.degraded.is_empty();
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
        self.degraded |= later.degraded;
        self.unrecorded |= later.unrecorded;
        self.turn_ended = match (self.turn_ended, later.turn_ended) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// [`Manifest::turn_ended_ms`] of its checkpoint.
    fn turn_ended_ms(&self) -> Option<u64> {
        self.turn_ended.map(|t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_millis() as u64
        })
    }

    /// Whether a turn among them asks the job to take everything (a new fs chain of the whole
    /// upperdir and a process image); the request is consumed, and the work then takes both.
    fn take_everything(&mut self) -> bool {
        let everything =
            std::mem::take(&mut self.fs_unknown) | std::mem::take(&mut self.unrecorded);
        if everything {
            self.fs = true;
            self.proc = true;
        }
        everything
    }

    fn kind(&self) -> CheckpointKind {
        match (self.fs, self.proc) {
            (true, true) => CheckpointKind::Full,
            (true, false) => CheckpointKind::Fs,
            _ => CheckpointKind::Proc,
        }
    }

    fn changes(&self) -> FsDiff {
        FsDiff {
            added: self.added.clone(),
            modified: self.modified.clone(),
            deleted: self.deleted.clone(),
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
    /// The actions waiting in [`Coordinator::wait_durable`] now.
    waiting_actions: Vec<Action>,
    /// The execs whose main process ran at the latest turn end: pid -> exec id.
    running_execs: HashMap<u32, String>,
}

pub struct Coordinator<I, C> {
    container_id: String,
    store: Arc<Store>,
    inspect: I,
    capture: C,
    settings: Settings,
    /// Where its jobs wait for their turn among the host's ([`crate::engine`]).
    engine: Arc<Admission>,
    state: Mutex<State>,
    /// Bumped each time the coordinator becomes idle (no job running or pending).
    idle: watch::Sender<u64>,
    /// False while the origin manifest is being recorded in the background
    /// ([`Coordinator::record_origin`]): jobs wait for it, as their lineage begins there.
    origin_recorded: watch::Sender<bool>,
    /// Held by an fs capture while it runs (also after its job was aborted).
    capturing: Arc<tokio::sync::Mutex<()>>,
}

impl<I: Inspect, C: Capture> Coordinator<I, C> {
    pub fn new(
        container_id: &str,
        store: Store,
        inspect: I,
        capture: C,
        settings: Settings,
        engine: Arc<Admission>,
    ) -> Arc<Self> {
        Arc::new(Coordinator {
            container_id: container_id.to_string(),
            store: Arc::new(store),
            inspect,
            capture,
            settings,
            engine,
            state: Mutex::new(State::default()),
            idle: watch::channel(0).0,
            origin_recorded: watch::channel(true).0,
            capturing: Arc::new(tokio::sync::Mutex::new(())),
        })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Bumped each time every submitted turn's checkpoint is durable (the replicator wakes
    /// on it); closed when the coordinator goes.
    pub fn durable_changes(&self) -> watch::Receiver<u64> {
        self.idle.subscribe()
    }

    /// Whether no job runs or waits (every submitted turn's checkpoint is durable).
    pub fn is_idle(&self) -> bool {
        let st = self.state.lock().unwrap();
        !st.running && st.pending.is_none()
    }

    /// The container's files no longer match its newest checkpoint's chain (an in-place
    /// rollback could not record where it went): the next checkpoint takes everything.
    /// (A turn end whose answer could not be recorded uses [`Coordinator::submit_unrecorded`].)
    pub fn lose_chain(&self) {
        self.state.lock().unwrap().force_full = true;
    }

    /// Records the origin manifest that `make` builds (a restored container's, which imports
    /// the process image it was restored from: a copy and deduplication of up to hundreds of
    /// MB) in the background. Actions need not wait for it (they cannot change the image it
    /// reads); checkpoint jobs do, as their lineage begins there. If it fails, the next
    /// checkpoint is full. `then` runs after it either way.
    pub fn record_origin(
        self: &Arc<Self>,
        make: impl FnOnce(&Store) -> Result<Manifest> + Send + 'static,
        then: impl FnOnce() + Send + 'static,
    ) {
        self.origin_recorded.send_replace(false);
        let this = self.clone();
        tokio::spawn(async move {
            let store = this.store.clone();
            let recorded = tokio::task::spawn_blocking(move || {
                let r = make(&store).and_then(|m| Ok(store.publish(&m)?));
                then();
                r
            })
            .await
            .map_err(CheckpointError::task("origin"))
            .and_then(|r| r);
            if let Err(e) = recorded {
                log::error!(
                    "container {}: cannot record where its lineage begins, its next checkpoint is full: {e}",
                    this.container_id
                );
                this.state.lock().unwrap().force_full = true;
            }
            this.origin_recorded.send_replace(true);
        });
    }

    /// Takes a turn's answer: returns at once; the checkpoint (if any) runs in the background.
    pub fn submit(self: &Arc<Self>, turn_id: &str, answer: &Answer) {
        self.take_answer(turn_id, answer, false);
    }

    /// Takes the answer of a turn end that could not be recorded in the turns directory (a
    /// full or read-only state disk). The inspection's mark has already moved, so what the
    /// turn changed is known from this answer only: the turn is checkpointed whole (a new fs
    /// chain of the whole upperdir and a process image), whatever its answer says, `none`
    /// included. Its checkpoint, named by the turn, stands in for the missing record, and
    /// nothing it changed depends on a record that is not there.
    pub fn submit_unrecorded(self: &Arc<Self>, turn_id: &str, answer: &Answer) {
        log::warn!(
            "turn {turn_id} of {}: its answer ({}) could not be recorded, it is checkpointed whole",
            self.container_id,
            answer.summary()
        );
        self.take_answer(turn_id, answer, true);
    }

    fn take_answer(self: &Arc<Self>, turn_id: &str, answer: &Answer, unrecorded: bool) {
        let answer = &*policy::apply(self.settings.policy, answer);
        let mut st = self.state.lock().unwrap();
        st.submitted_seq = st.submitted_seq.max(answer.seq);
        if answer.kind == Kind::None && !st.force_full && !unrecorded {
            log::info!(
                "turn {turn_id} of {}: no checkpoint needed",
                self.container_id
            );
            return;
        }
        let mut work = st.pending.take().unwrap_or_default();
        work.turn_ended.get_or_insert_with(SystemTime::now);
        work.add(turn_id, answer);
        work.unrecorded |= unrecorded;
        st.in_flight.push(turn_id.to_string());
        if st.running {
            log::info!(
                "turn {turn_id} of {}: a checkpoint is running; coalesced with {:?}",
                self.container_id,
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
            let mut force_full = std::mem::take(&mut self.state.lock().unwrap().force_full);
            if force_full {
                work.fs = true;
                work.proc = true;
            }
            force_full |= work.take_everything();
            let waited = match work.proc {
                true => self.wait_for_execs(&mut work).await,
                false => Ok(()),
            };
            // The wait may have taken in more (the container inspected again, turn ends that
            // arrived meanwhile): an answer among them that asks for everything gets it.
            force_full |= work.take_everything();
            let turn_ids = work.turn_ids.clone();
            let idle = self.inspect.idle_since_mark().await;
            // An aborted job's fs capture that still runs ends first (outside the engine).
            drop(self.capturing.lock().await);
            let result = match waited {
                Ok(()) => match self.engine.admit(&work.turn_ids.join(",")).await {
                    Ok(permit) => {
                        let result = self.bounded_job(&work, force_full).await;
                        permit.finish(result.as_ref().map_or(0, bytes_written));
                        result
                    }
                    Err(e) => Err(CheckpointError::NoSlot(e)),
                },
                Err(e) => Err(e),
            };
            if !idle.is_empty() {
                self.inspect.refresh_after_freeze(idle).await;
            }
            match result {
                Ok(m) => log::info!(
                    "checkpoint {} of {} (turns {turn_ids:?}): {:?}, {} layers, freeze {:.1} ms, total {:.1} ms",
                    m.seq,
                    self.container_id,
                    m.kind,
                    m.fs_layers.len(),
                    m.timings.freeze_ms,
                    m.timings.total_ms
                ),
                Err(e) => {
                    log::error!(
                        "checkpoint of {} for turns {turn_ids:?} FAILED, the next turn takes a full checkpoint: {e}",
                        self.container_id
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
        let started = Instant::now();
        let mut waited_for: Option<String> = None;
        loop {
            let outside = self.capture.outside_init().await?;
            if outside.is_empty() {
                break;
            }
            let outside = self.describe_outside(&outside);
            if waited_for.is_none() {
                log::info!(
                    "checkpoint of {} for turns {:?} waits for {outside}: not in the tree a process image holds",
                    self.container_id,
                    work.turn_ids
                );
            }
            let kill_waits = self
                .state
                .lock()
                .unwrap()
                .waiting_actions
                .contains(&Action::Kill);
            let gave_up = if kill_waits {
                Some(GaveUp::Kill {
                    after: started.elapsed(),
                })
            } else if started.elapsed() >= self.settings.wait_bound {
                Some(GaveUp::Bound(self.settings.wait_bound))
            } else {
                None
            };
            if let Some(gave_up) = gave_up {
                return Err(CheckpointError::ExecsRunning { outside, gave_up });
            }
            waited_for = Some(outside);
            tokio::time::sleep(EXEC_POLL).await;
        }
        let Some(waited_for) = waited_for else {
            return Ok(());
        };
        let waited = started.elapsed();
        let turn_id = format!(
            "{}+exec-end",
            work.turn_ids.last().map(String::as_str).unwrap_or_default()
        );
        let answer = self.inspect.turn_end(&turn_id).await?;
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
            self.container_id,
            work.turn_ids,
            answer.summary()
        );
        work.add(&turn_id, &answer);
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
    fn describe_outside(&self, outside: &[(u32, String)]) -> String {
        let execs = self.state.lock().unwrap().running_execs.clone();
        let exec_of = |pid: u32| -> Option<&String> {
            let mut cur = pid;
            for _ in 0..64 {
                if let Some(id) = execs.get(&cur) {
                    return Some(id);
                }
                cur = self.capture.parent_of(cur)?;
                if cur <= 1 {
                    return None;
                }
            }
            None
        };
        let mut groups: Vec<(Option<&String>, Vec<String>)> = Vec::new();
        for (pid, cmd) in outside {
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
    fn record_failure(&self, work: &Work, e: &CheckpointError) {
        let result = (|| -> Result<(), super::store::StoreError> {
            let parent = self.store.latest()?;
            let mut m = Manifest::child_of(
                parent.as_ref(),
                self.store.next_seq()?,
                &work.turn_ids.join(","),
                CheckpointKind::Failed,
            );
            m.explanation = format!("failed: {e}");
            m.attempted = Some(work.kind());
            m.degraded = work.degraded;
            self.store.publish(&m)
        })();
        if let Err(pe) = result {
            log::error!(
                "cannot record the failed checkpoint of {}: {pe}",
                self.container_id
            );
        }
    }

    /// [`Coordinator::job`] within `[engine] job_timeout_ms`: past it, the job is cancelled
    /// (it starts nothing more, publishes nothing, and its fs capture stops), what it started
    /// is killed and the container thawed ([`Capture::abort`]), and the job is given
    /// [`ABORT_GRACE`] to end; whatever it then returns, it fails (a job that already
    /// published keeps its checkpoint).
    async fn bounded_job(&self, work: &Work, new_chain: bool) -> Result<Manifest> {
        let limit = self.engine.job_timeout();
        let cancel = Cancel::new();
        let job = self.job(work, new_chain, &cancel);
        tokio::pin!(job);
        if let Ok(result) = tokio::time::timeout(limit, &mut job).await {
            return result;
        }
        cancel.cancel();
        let aborted = self.capture.abort().await;
        let deadline = |late| CheckpointError::Deadline {
            limit,
            aborted: aborted.clone(),
            late,
        };
        log::error!("container {}: {}", self.container_id, deadline(None));
        let ended = tokio::time::timeout(ABORT_GRACE, &mut job).await;
        // Anything the job started between the look and its end.
        let late = self.capture.abort().await;
        if !late.killed.is_empty() {
            log::error!("container {}: after the abort: {late}", self.container_id);
        }
        match ended {
            Ok(Ok(m)) => {
                log::warn!(
                    "container {}: checkpoint {} was published right at its deadline",
                    self.container_id,
                    m.seq
                );
                Ok(m)
            }
            Ok(Err(e)) => Err(deadline(Some(Box::new(e)))),
            Err(_) => Err(deadline(None)),
        }
    }

    async fn job(&self, work: &Work, new_chain: bool, cancel: &Cancel) -> Result<Manifest> {
        let check_aborted = || match cancel.is_cancelled() {
            true => Err(CheckpointError::Aborted),
            false => Ok(()),
        };
        let started = Instant::now();
        let parent = self.store.latest()?;
        let seq = self.store.next_seq()?;
        let mut m = Manifest::child_of(parent.as_ref(), seq, &work.turn_ids.join(","), work.kind());
        m.explanation = work.explanation.join("\n");
        m.degraded = work.degraded;
        m.turn_ended_ms = work.turn_ended_ms();
        let mut timings = Timings::default();
        if work.fs {
            // After a failure nothing is known about what the missing layers held: one layer of
            // the whole upperdir, starting a new chain on top of the image.
            let changes = match new_chain {
                true => self.capture.scan_upperdir().await?,
                false => work.changes(),
            };
            // A tracked volume is not in the upperdir: its changes go into the same layer below
            // its path, read from its host directory; the first layer of a chain that has no
            // base of it takes it whole.
            if new_chain {
                m.volumes.clear();
            }
            let (changes, volumes) = split_volumes(changes, &self.settings.volumes, &m.volumes);
            let capturing = self.capturing.clone().lock_owned().await;
            let layer = self
                .capture
                .fs_layer(
                    self.store.clone(),
                    changes,
                    volumes,
                    capturing,
                    cancel.clone(),
                )
                .await?;
            if new_chain {
                // The layers the container's image carries stay: the upperdir is relative to them.
                m.fs_layers.truncate(m.image_layers);
            }
            m.volumes = self.settings.volumes.clone();
            m.fs_layers.push(layer.descriptor);
            timings.freeze_ms = Timings::ms(layer.freeze);
            timings.capture_ms = Timings::ms(layer.capture);
        }
        if work.proc {
            check_aborted()?;
            let dir = self.store.proc_dir(seq);
            let cp = self
                .capture
                .process_image(dir.clone(), self.store.chunks_dir())
                .await?;
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
            timings.process = Some(cp.timings);
        }
        timings.total_ms = Timings::ms(started.elapsed());
        m.timings = timings;
        check_aborted()?;
        let publishing = Instant::now();
        self.store.publish(&m)?;
        log::info!(
            "checkpoint {} of {}: published in {:.1} ms after a job of {:.1} ms",
            m.seq,
            self.container_id,
            Timings::ms(publishing.elapsed()),
            m.timings.total_ms
        );
        self.apply_retention();
        Ok(m)
    }

    /// Retention after a publish; chunks no kept process image uses any more go with it.
    fn apply_retention(&self) {
        let (keep_last, keep_every) = (self.settings.keep_last, self.settings.keep_every);
        // What it removes goes on counting in `crabctl metrics`; retention goes on if that
        // cannot be recorded (a full disk is what it may be freeing).
        let root = self.store.root().to_path_buf();
        let record = |manifests: &[&Manifest], answers: &[PathBuf]| {
            if let Err(e) = crate::metrics::retire(&root, manifests, answers) {
                log::warn!(
                    "retention in the store of {}: cannot keep the figures of what it removes in {}: {e}",
                    self.container_id,
                    crate::metrics::RETIRED_FILE
                );
            }
        };
        match self
            .store
            .apply_retention_with(keep_last, keep_every, record)
        {
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
                        self.container_id
                    );
                }
            }
            Ok(_) => {}
            Err(e) => log::warn!("retention in the store of {}: {e}", self.container_id),
        }
    }

    /// Waits until the checkpoints of ended turns are durable: the next action on the container
    /// must not change it before its recovery point exists. Bounded by the configured wait.
    pub async fn wait_durable(&self, action: Action) -> Result<()> {
        let mut rx = self.idle.subscribe();
        let busy = |st: &State| st.running || st.pending.is_some();
        if !busy(&self.state.lock().unwrap()) {
            return Ok(());
        }
        let started = Instant::now();
        let _waiting = WaitingAction::new(&self.state, action);
        // A job of this container still queued on the host goes first now.
        let _urgent = self.engine.urgent();
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
        if tokio::time::timeout(self.settings.wait_bound, wait)
            .await
            .is_err()
        {
            let turns = self.state.lock().unwrap().in_flight.clone();
            return Err(CheckpointError::NotDurable {
                action,
                container: self.container_id.clone(),
                waited: self.settings.wait_bound,
                turns,
            });
        }
        log::debug!(
            "{action} on {} waited {:?} for its checkpoint",
            self.container_id,
            started.elapsed()
        );
        Ok(())
    }
}

/// What of a tracked volume an fs layer captures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeChanges {
    /// The volume's path in the container.
    pub at: PathBuf,
    /// Changed paths relative to the volume's root, or `None`: the whole volume (its base).
    pub paths: Option<BTreeSet<PathBuf>>,
}

/// Splits `changes` into those of the rootfs and those of each tracked volume (`volumes`, the
/// longest path wins for nested ones). Volumes not in `based` are taken whole.
fn split_volumes(
    changes: FsDiff,
    volumes: &[PathBuf],
    based: &[PathBuf],
) -> (FsDiff, Vec<VolumeChanges>) {
    let mut by_volume: Vec<BTreeSet<PathBuf>> = vec![BTreeSet::new(); volumes.len()];
    let mut outside = |v: Vec<PathBuf>| -> Vec<PathBuf> {
        v.into_iter()
            .filter(|p| {
                let owner = volumes
                    .iter()
                    .enumerate()
                    .filter(|(_, vol)| p.starts_with(vol))
                    .max_by_key(|(_, vol)| vol.components().count());
                match owner {
                    Some((i, vol)) => {
                        let rel = p.strip_prefix(vol).unwrap_or(Path::new(""));
                        // The inspector's paths are normalized; anything else is not followed.
                        match rel.components().all(|c| matches!(c, Component::Normal(_))) {
                            true => {
                                by_volume[i].insert(rel.to_path_buf());
                            }
                            false => {
                                log::warn!("not a path below {}: {}", vol.display(), p.display())
                            }
                        }
                        false
                    }
                    None => true,
                }
            })
            .collect()
    };
    let changes = FsDiff {
        added: outside(changes.added),
        modified: outside(changes.modified),
        deleted: outside(changes.deleted),
    };
    let volumes = volumes
        .iter()
        .zip(by_volume)
        .filter_map(|(at, paths)| match based.contains(at) {
            false => Some(VolumeChanges {
                at: at.clone(),
                paths: None,
            }),
            true if paths.is_empty() => None,
            true => Some(VolumeChanges {
                at: at.clone(),
                paths: Some(paths),
            }),
        })
        .collect();
    (changes, volumes)
}

/// The bytes a finished job counts against the host engine's budget: the fs layer it wrote
/// and its process image as CRIU wrote it (before deduplication; the new chunks are not
/// counted again).
fn bytes_written(m: &Manifest) -> u64 {
    let layer = match m.kind {
        CheckpointKind::Fs | CheckpointKind::Full => m.fs_layers.last().map_or(0, |d| d.size),
        _ => 0,
    };
    let process = match m.kind {
        CheckpointKind::Proc | CheckpointKind::Full => {
            m.process.as_ref().map_or(0, |p| p.bytes_logical)
        }
        _ => 0,
    };
    layer + process
}

/// An action in [`Coordinator::wait_durable`], listed in the state while it waits (also when
/// its caller gives up and drops the wait).
struct WaitingAction<'a> {
    state: &'a Mutex<State>,
    action: Action,
}

impl<'a> WaitingAction<'a> {
    fn new(state: &'a Mutex<State>, action: Action) -> Self {
        state.lock().unwrap().waiting_actions.push(action);
        WaitingAction { state, action }
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

#[cfg(test)]
mod tests;

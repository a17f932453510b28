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
mod tests {
    //! The coordinator's decisions, with a fake inspection and a fake capture over a real
    //! store and host engine in a temporary directory (no root, no runc).

    use std::{
        io::Write,
        sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    };

    use crab_runtime_config::EngineConfig;
    use tokio::sync::Semaphore;

    use super::*;
    use crate::inspector::{FsFinding, ProcFinding};

    fn answer(seq: u64, kind: Kind, added: &[&str]) -> Answer {
        Answer {
            container_id: "c1".into(),
            seq,
            kind,
            fs: FsFinding {
                changed: !added.is_empty(),
                scanned: true,
                added: added.iter().map(PathBuf::from).collect(),
                ..Default::default()
            },
            procs: ProcFinding::default(),
            degraded: Vec::new(),
            elapsed_us: 1,
        }
    }

    /// Answers with an fs change at `after-exec`, numbered on from `seq`.
    #[derive(Default)]
    struct FakeInspect {
        seq: AtomicU64,
        /// The turn ids its answers were stored as.
        stored: Mutex<Vec<String>>,
        refreshed: AtomicUsize,
        /// Its answers say the upperdir could not be scanned.
        unobserved: AtomicBool,
    }

    impl Inspect for Arc<FakeInspect> {
        async fn idle_since_mark(&self) -> Vec<(u32, u64)> {
            vec![(7, 1)]
        }

        async fn refresh_after_freeze(&self, idle: Vec<(u32, u64)>) {
            assert_eq!(idle, vec![(7, 1)]);
            self.refreshed.fetch_add(1, Ordering::SeqCst);
        }

        async fn turn_end(&self, turn_id: &str) -> Result<Answer> {
            self.stored.lock().unwrap().push(turn_id.to_string());
            let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
            let mut a = answer(seq, Kind::Fs, &["after-exec"]);
            a.fs.unobserved = self.unobserved.load(Ordering::SeqCst);
            Ok(a)
        }
    }

    /// Captures into the real store; an fs capture waits for a permit of `release` or for its
    /// job's cancel flag (then it fails as the real capture does).
    struct FakeCapture {
        release: Semaphore,
        fs_calls: Mutex<Vec<FsDiff>>,
        volume_calls: Mutex<Vec<Vec<VolumeChanges>>>,
        scans: AtomicUsize,
        proc_calls: AtomicUsize,
        /// How many of the next fs captures fail.
        fail_fs: AtomicUsize,
        outside: Mutex<Vec<(u32, String)>>,
        parents: HashMap<u32, u32>,
        aborts: AtomicUsize,
        /// Whether the first abort releases the waiting capture (as killing runc would).
        abort_releases: AtomicBool,
        /// Fs captures that ended because they were cancelled.
        cancelled: AtomicUsize,
    }

    impl FakeCapture {
        fn new(permits: usize) -> Arc<FakeCapture> {
            Arc::new(FakeCapture {
                release: Semaphore::new(permits),
                fs_calls: Mutex::default(),
                volume_calls: Mutex::default(),
                scans: AtomicUsize::new(0),
                proc_calls: AtomicUsize::new(0),
                fail_fs: AtomicUsize::new(0),
                outside: Mutex::default(),
                parents: HashMap::from([(4243, 4242), (4242, 1)]),
                aborts: AtomicUsize::new(0),
                abort_releases: AtomicBool::new(true),
                cancelled: AtomicUsize::new(0),
            })
        }

        fn fs_calls(&self) -> usize {
            self.fs_calls.lock().unwrap().len()
        }
    }

    impl Capture for Arc<FakeCapture> {
        async fn outside_init(&self) -> Result<Vec<(u32, String)>> {
            Ok(self.outside.lock().unwrap().clone())
        }

        fn parent_of(&self, pid: u32) -> Option<u32> {
            self.parents.get(&pid).copied()
        }

        async fn scan_upperdir(&self) -> Result<FsDiff> {
            self.scans.fetch_add(1, Ordering::SeqCst);
            Ok(FsDiff {
                added: vec![PathBuf::from("everything")],
                ..Default::default()
            })
        }

        async fn fs_layer(
            &self,
            store: Arc<Store>,
            changes: FsDiff,
            volumes: Vec<VolumeChanges>,
            capturing: OwnedMutexGuard<()>,
            cancel: Cancel,
        ) -> Result<FsLayer> {
            self.fs_calls.lock().unwrap().push(changes.clone());
            self.volume_calls.lock().unwrap().push(volumes);
            let cancelled = async {
                while !cancel.is_cancelled() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            };
            tokio::select! {
                permit = self.release.acquire() => permit.unwrap().forget(),
                () = cancelled => {}
            }
            if cancel.is_cancelled() {
                self.cancelled.fetch_add(1, Ordering::SeqCst);
                return Err(super::super::layer::LayerError::Cancelled { written: 0 }.into());
            }
            if self
                .fail_fs
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                return Err(CheckpointError::NotOverlay);
            }
            let _capturing = capturing;
            let mut tmp = store.temp_file("layer")?;
            let data = format!("{:?}", changes.added);
            tmp.file().write_all(data.as_bytes()).unwrap();
            Ok(FsLayer {
                descriptor: store.put_blob(tmp.path())?,
                freeze: Duration::from_millis(1),
                capture: Duration::from_millis(1),
            })
        }

        async fn process_image(&self, dir: PathBuf, _chunks: PathBuf) -> Result<ProcessCaptured> {
            self.proc_calls.fetch_add(1, Ordering::SeqCst);
            std::fs::create_dir_all(&dir).unwrap();
            Ok(ProcessCaptured {
                pids: vec![1],
                bytes_logical: 10,
                bytes_stored: 5,
                ..Default::default()
            })
        }

        /// Killing the capture makes it return (the first time, if `abort_releases`).
        async fn abort(&self) -> Aborted {
            if self.aborts.fetch_add(1, Ordering::SeqCst) == 0
                && self.abort_releases.load(Ordering::SeqCst)
            {
                self.release.add_permits(1);
            }
            Aborted::default()
        }
    }

    type TestCoordinator = Coordinator<Arc<FakeInspect>, Arc<FakeCapture>>;

    struct Sandbox {
        co: Arc<TestCoordinator>,
        inspect: Arc<FakeInspect>,
        capture: Arc<FakeCapture>,
        _dir: tempfile::TempDir,
    }

    fn settings() -> Settings {
        Settings {
            policy: policy::CheckpointPolicy::Minimal,
            volumes: Vec::new(),
            keep_last: None,
            keep_every: None,
            wait_bound: Duration::from_secs(10),
        }
    }

    fn sandbox(settings: Settings, capture: Arc<FakeCapture>, job_timeout: Duration) -> Sandbox {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("sandbox")).unwrap();
        let engine = Admission::new(
            &EngineConfig {
                root: dir.path().join("engine"),
                job_timeout_ms: job_timeout.as_millis() as u64,
                ..EngineConfig::default()
            },
            "ns",
            "c1",
        );
        let inspect = Arc::new(FakeInspect::default());
        let co = Coordinator::new(
            "c1",
            store,
            inspect.clone(),
            capture.clone(),
            settings,
            engine,
        );
        Sandbox {
            co,
            inspect,
            capture,
            _dir: dir,
        }
    }

    impl Sandbox {
        /// The published manifests as (turn ids, kind).
        fn lineage(&self) -> Vec<(String, CheckpointKind)> {
            let list = self.co.store().list().unwrap();
            list.into_iter().map(|m| (m.turn_id, m.kind)).collect()
        }

        fn latest(&self) -> Manifest {
            self.co.store().latest().unwrap().unwrap()
        }

        /// Waits (as an action would) until no job runs or is pending.
        async fn idle(&self) {
            self.co.wait_durable(Action::Start).await.unwrap();
        }
    }

    async fn eventually(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    const LONG: Duration = Duration::from_secs(600);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn turn_ends_during_a_job_are_coalesced_into_the_next() {
        let now_ms = || {
            SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        };
        let s = sandbox(settings(), FakeCapture::new(0), LONG);
        s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
        eventually("the first job captures", || s.capture.fs_calls() == 1).await;
        let t2_before = now_ms();
        s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
        let t2_after = now_ms();
        tokio::time::sleep(Duration::from_millis(20)).await;
        s.co.submit("t3", &answer(3, Kind::Proc, &[]));
        s.capture.release.add_permits(2);
        s.idle().await;
        assert_eq!(
            s.lineage(),
            vec![
                ("t1".into(), CheckpointKind::Fs),
                ("t2,t3".into(), CheckpointKind::Full)
            ]
        );
        let calls = s.capture.fs_calls.lock().unwrap().clone();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].added, vec![PathBuf::from("b")]);
        assert_eq!(s.capture.proc_calls.load(Ordering::SeqCst), 1);
        let m = s.latest();
        assert_eq!(
            m.fs_layers.len(),
            2,
            "the second layer is on top of the first"
        );
        assert_eq!(m.explanation.lines().count(), 2, "{}", m.explanation);
        // Its recovery point is as old as the first turn it covers.
        let ended = m.turn_ended_ms.expect("the turn end is recorded");
        assert!(
            (t2_before..=t2_after).contains(&ended),
            "{ended} not t2's end"
        );
        // Each job refreshed the mark of the processes its freeze woke.
        assert_eq!(s.inspect.refreshed.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_job_makes_the_next_one_full_on_a_new_chain() {
        let s = sandbox(settings(), FakeCapture::new(100), LONG);
        s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
        s.idle().await;
        s.capture.fail_fs.store(1, Ordering::SeqCst);
        s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
        s.idle().await;
        let failed = s.latest();
        assert_eq!(failed.kind, CheckpointKind::Failed);
        assert_eq!(
            failed.explanation,
            "failed: the rootfs is not an overlay: no fs checkpoint possible"
        );
        assert_eq!(failed.fs_layers.len(), 1, "a failure keeps the references");
        // An unchanged turn still takes everything now, starting the fs chain again.
        s.co.submit("t3", &answer(3, Kind::None, &[]));
        s.idle().await;
        let m = s.latest();
        assert_eq!((m.turn_id.as_str(), m.kind), ("t3", CheckpointKind::Full));
        assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
        assert_eq!(m.fs_layers.len(), 1, "a new chain: {:?}", m.fs_layers);
        let calls = s.capture.fs_calls.lock().unwrap().clone();
        assert_eq!(
            calls.last().unwrap().added,
            vec![PathBuf::from("everything")]
        );
        assert!(m.process.is_some());
        // And then the minimal checkpoint again.
        s.co.submit("t4", &answer(4, Kind::None, &[]));
        s.idle().await;
        assert_eq!(s.lineage().len(), 3, "no checkpoint for an unchanged turn");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unobserved_turn_takes_a_new_chain() {
        let s = sandbox(settings(), FakeCapture::new(100), LONG);
        let mut a = answer(1, Kind::Fs, &["a"]);
        a.fs.unobserved = true;
        s.co.submit("t1", &a);
        s.idle().await;
        assert_eq!(s.latest().kind, CheckpointKind::Full);
        assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
    }

    /// A turn end whose answer could not be recorded: its checkpoint takes everything, whatever
    /// the answer says (`none` included), also when it waits behind a running job; the turns
    /// after it are checkpointed by their changes again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_turn_whose_answer_was_not_recorded_is_checkpointed_whole() {
        let s = sandbox(settings(), FakeCapture::new(0), LONG);
        s.capture.release.add_permits(3);
        s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
        s.idle().await;
        s.co.submit_unrecorded("t2", &answer(2, Kind::None, &[]));
        s.idle().await;
        let m = s.latest();
        assert_eq!((m.turn_id.as_str(), m.kind), ("t2", CheckpointKind::Full));
        assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
        assert_eq!(m.fs_layers.len(), 1, "a new chain: {:?}", m.fs_layers);
        assert!(m.process.is_some());
        assert_eq!(s.capture.proc_calls.load(Ordering::SeqCst), 1);
        // The next turn is checkpointed by its changes.
        s.co.submit("t3", &answer(3, Kind::Fs, &["c"]));
        s.idle().await;
        let m = s.latest();
        assert_eq!((m.turn_id.as_str(), m.kind), ("t3", CheckpointKind::Fs));
        assert_eq!(s.capture.scans.load(Ordering::SeqCst), 1);
        assert_eq!(m.fs_layers.len(), 2);
        // Behind a running job: the unrecorded turn's own job takes everything.
        s.co.submit("t4", &answer(4, Kind::Fs, &["d"]));
        eventually("t4's job captures", || s.capture.fs_calls() == 4).await;
        s.co.submit_unrecorded("t5", &answer(5, Kind::Fs, &["e"]));
        s.capture.release.add_permits(2);
        s.idle().await;
        assert_eq!(
            s.lineage()[3..],
            [
                ("t4".into(), CheckpointKind::Fs),
                ("t5".into(), CheckpointKind::Full)
            ]
        );
        assert_eq!(s.capture.scans.load(Ordering::SeqCst), 2);
        assert_eq!(s.latest().fs_layers.len(), 1, "a new chain");
        // Back to minimal: an unchanged turn takes no checkpoint.
        s.co.submit("t6", &answer(6, Kind::None, &[]));
        s.idle().await;
        assert_eq!(s.lineage().len(), 5);
    }

    /// What a job takes in while it waits for running execs (its fresh answer, turn ends that
    /// arrived meanwhile) can ask for everything too: an upperdir that could not be scanned, an
    /// answer that could not be recorded. The job then takes the whole upperdir on a new chain,
    /// never a layer of the paths it happens to know.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn what_the_wait_for_execs_takes_in_can_make_the_job_whole() {
        for unrecorded_meanwhile in [false, true] {
            let s = sandbox(settings(), FakeCapture::new(100), LONG);
            s.co.submit("t0", &answer(1, Kind::Fs, &["a"]));
            s.idle().await;
            s.inspect.seq.store(2, Ordering::SeqCst);
            s.inspect
                .unobserved
                .store(!unrecorded_meanwhile, Ordering::SeqCst);
            *s.capture.outside.lock().unwrap() = vec![(4242, "make".into())];
            s.co.note_running_execs(vec![(4242, "e1".into())]);
            s.co.submit("t1", &answer(2, Kind::Proc, &[]));
            tokio::time::sleep(Duration::from_millis(60)).await;
            if unrecorded_meanwhile {
                s.co.submit_unrecorded("t2", &answer(3, Kind::None, &[]));
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
            s.capture.outside.lock().unwrap().clear();
            s.idle().await;
            let m = s.latest();
            let want = match unrecorded_meanwhile {
                true => "t1,t2",
                false => "t1",
            };
            assert_eq!((m.turn_id.as_str(), m.kind), (want, CheckpointKind::Full));
            assert_eq!(
                s.capture.scans.load(Ordering::SeqCst),
                1,
                "the whole upperdir (unrecorded meanwhile: {unrecorded_meanwhile})"
            );
            assert_eq!(m.fs_layers.len(), 1, "a new chain: {:?}", m.fs_layers);
            assert_eq!(s.lineage().len(), 2, "{:?}", s.lineage());
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_action_waits_at_most_the_bound() {
        let bound = Duration::from_millis(150);
        let s = sandbox(
            Settings {
                wait_bound: bound,
                ..settings()
            },
            FakeCapture::new(0),
            LONG,
        );
        s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
        let started = Instant::now();
        let e = s.co.wait_durable(Action::Update).await.unwrap_err();
        let waited = started.elapsed();
        assert!(waited >= bound && waited < bound * 10, "{waited:?}");
        assert!(matches!(
            &e,
            CheckpointError::NotDurable { action: Action::Update, turns, .. } if turns == &["t1"]
        ));
        let text = e.to_string();
        assert!(
            text.starts_with("update on c1 waited 150ms for the checkpoint of turn(s) [\"t1\"]")
                && text.contains("action_wait_timeout_ms"),
            "{text}"
        );
        assert!(s.co.state.lock().unwrap().waiting_actions.is_empty());
        s.capture.release.add_permits(1);
        eventually("the job ends", || !s.co.state.lock().unwrap().running).await;
        // Nothing left to wait for.
        let started = Instant::now();
        s.co.wait_durable(Action::Update).await.unwrap();
        assert!(started.elapsed() < bound);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kill_cuts_the_wait_for_execs_short() {
        let s = sandbox(settings(), FakeCapture::new(100), LONG);
        *s.capture.outside.lock().unwrap() = vec![(4242, "sleep 100".into()), (4243, "cat".into())];
        s.co.note_running_execs(vec![(4242, "e1".into())]);
        s.co.submit("t1", &answer(1, Kind::Proc, &[]));
        tokio::time::sleep(EXEC_POLL * 3).await;
        let started = Instant::now();
        // The kill waits for the job, which gives up at once for it.
        s.co.wait_durable(Action::Kill).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        let m = s.latest();
        assert_eq!(m.kind, CheckpointKind::Failed);
        assert!(
            m.explanation.starts_with(
                "failed: no process checkpoint: exec e1 (pid 4242 `sleep 100`, pid 4243 `cat`) \
                 still running when the next action (a kill) arrived"
            ),
            "{}",
            m.explanation
        );
        assert_eq!(s.capture.proc_calls.load(Ordering::SeqCst), 0);
        assert!(s.co.state.lock().unwrap().force_full);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn execs_still_running_at_the_bound_fail_the_turn() {
        let s = sandbox(
            Settings {
                wait_bound: Duration::from_millis(100),
                ..settings()
            },
            FakeCapture::new(100),
            LONG,
        );
        *s.capture.outside.lock().unwrap() = vec![(9, "top".into())];
        s.co.submit("t1", &answer(1, Kind::Proc, &[]));
        eventually("the job fails", || !s.lineage().is_empty()).await;
        let m = s.latest();
        assert!(
            m.explanation.starts_with(
                "failed: no process checkpoint: process(es) pid 9 `top` still running 100ms after \
                 the checkpoint began waiting for it ([checkpoint] action_wait_timeout_ms)"
            ),
            "{}",
            m.explanation
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn execs_that_end_are_waited_for_then_the_container_is_inspected_again() {
        let s = sandbox(settings(), FakeCapture::new(100), LONG);
        s.inspect.seq.store(1, Ordering::SeqCst);
        *s.capture.outside.lock().unwrap() = vec![(4242, "make".into())];
        s.co.note_running_execs(vec![(4242, "e1".into())]);
        s.co.submit("t1", &answer(1, Kind::Proc, &[]));
        tokio::time::sleep(Duration::from_millis(100)).await;
        s.capture.outside.lock().unwrap().clear();
        s.idle().await;
        let m = s.latest();
        // The checkpoint is of the state after the exec: its file change joins the job.
        assert_eq!((m.turn_id.as_str(), m.kind), ("t1", CheckpointKind::Full));
        assert_eq!(*s.inspect.stored.lock().unwrap(), vec!["t1+exec-end"]);
        let calls = s.capture.fs_calls.lock().unwrap().clone();
        assert_eq!(calls[0].added, vec![PathBuf::from("after-exec")]);
        let lines: Vec<&str> = m.explanation.lines().collect();
        assert_eq!(lines.len(), 3, "{}", m.explanation);
        assert!(
            lines[1].starts_with("waited ") && lines[1].contains("for exec e1 (pid 4242 `make`)"),
            "{}",
            lines[1]
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_past_its_deadline_is_aborted_and_fails() {
        let s = sandbox(settings(), FakeCapture::new(0), Duration::from_millis(100));
        s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
        s.idle().await;
        let m = s.latest();
        assert_eq!(m.kind, CheckpointKind::Failed);
        assert_eq!(
            m.explanation,
            "failed: the checkpoint held its engine slot longer than 100ms ([engine] \
             job_timeout_ms) and was aborted: no process dump was running, the container's \
             freezer could not be reached (the fs capture was stopped after writing 0 bytes of \
             its layer; nothing of it is stored)"
        );
        // Once to end the job, once more for what it may have started meanwhile.
        assert_eq!(s.capture.aborts.load(Ordering::SeqCst), 2);
        assert_eq!(s.capture.cancelled.load(Ordering::SeqCst), 1);
        // The next job is not aborted.
        s.capture.release.add_permits(1);
        s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
        s.idle().await;
        assert_eq!(s.latest().kind, CheckpointKind::Full);
    }

    /// An fs capture that nothing the abort kills would end (the real one: a blocking thread
    /// copying a big file) stops on the job's cancel flag: the job fails at its deadline, not
    /// at the end of the abort grace, and the next job need not wait for the capture.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_fs_capture_past_the_deadline_is_cancelled() {
        let s = sandbox(settings(), FakeCapture::new(0), Duration::from_millis(100));
        s.capture.abort_releases.store(false, Ordering::SeqCst);
        let t = Instant::now();
        s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
        s.idle().await;
        let took = t.elapsed();
        assert!(took < ABORT_GRACE, "the job ended after {took:?}");
        let m = s.latest();
        assert_eq!(m.kind, CheckpointKind::Failed);
        assert!(
            m.explanation.contains("job_timeout_ms")
                && m.explanation.contains("the fs capture was stopped"),
            "{}",
            m.explanation
        );
        assert_eq!(s.capture.cancelled.load(Ordering::SeqCst), 1);
        // The capture ended: the next job does not wait for it, and is not cancelled.
        s.capture.release.add_permits(1);
        s.co.submit("t2", &answer(2, Kind::Fs, &["b"]));
        tokio::time::timeout(Duration::from_secs(5), s.idle())
            .await
            .expect("the next job waited for the cancelled capture");
        assert_eq!(s.latest().kind, CheckpointKind::Full);
        assert_eq!(s.capture.cancelled.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_policy_decides_the_kind() {
        let s = sandbox(
            Settings {
                policy: policy::CheckpointPolicy::FullEveryTurn,
                ..settings()
            },
            FakeCapture::new(100),
            LONG,
        );
        s.co.submit("t1", &answer(1, Kind::None, &[]));
        s.idle().await;
        assert_eq!(s.lineage(), vec![("t1".into(), CheckpointKind::Full)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tracked_volumes_are_captured_whole_then_by_their_changes() {
        let s = sandbox(
            Settings {
                volumes: vec![PathBuf::from("/workspace")],
                ..settings()
            },
            FakeCapture::new(100),
            LONG,
        );
        let vol = |paths: Option<&[&str]>| VolumeChanges {
            at: PathBuf::from("/workspace"),
            paths: paths.map(|p| p.iter().map(PathBuf::from).collect()),
        };
        // The first fs layer takes the volume whole, whatever of it changed.
        s.co.submit("t1", &answer(1, Kind::Fs, &["/workspace/a", "/app/b"]));
        s.idle().await;
        // Then only its changes, relative to its root; none when it did not change.
        s.co.submit(
            "t2",
            &answer(2, Kind::Fs, &["/workspace/d/e", "/workspace"]),
        );
        s.idle().await;
        s.co.submit("t3", &answer(3, Kind::Fs, &["/app/c"]));
        s.idle().await;
        let calls = s.capture.fs_calls.lock().unwrap().clone();
        assert_eq!(calls[0].added, vec![PathBuf::from("/app/b")]);
        assert!(calls[1].added.is_empty());
        let volumes = s.capture.volume_calls.lock().unwrap().clone();
        assert_eq!(
            volumes,
            vec![vec![vol(None)], vec![vol(Some(&["", "d/e"]))], vec![]]
        );
        let m = s.latest();
        assert_eq!(m.volumes, vec![PathBuf::from("/workspace")]);
        assert!(!m.explanation.contains("not captured"), "{}", m.explanation);
        // A failure starts a new chain: the volume is taken whole again.
        s.capture.fail_fs.store(1, Ordering::SeqCst);
        s.co.submit("t4", &answer(4, Kind::Fs, &["/workspace/x"]));
        s.idle().await;
        assert_eq!(s.latest().kind, CheckpointKind::Failed);
        s.co.submit("t5", &answer(5, Kind::Fs, &["/workspace/y"]));
        s.idle().await;
        let volumes = s.capture.volume_calls.lock().unwrap().clone();
        assert_eq!(volumes.last().unwrap(), &vec![vol(None)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_origin_makes_the_next_checkpoint_full() {
        let s = sandbox(settings(), FakeCapture::new(100), LONG);
        let (tx, rx) = std::sync::mpsc::channel();
        s.co.record_origin(
            |_| Err(CheckpointError::NotInspected),
            move || tx.send(()).unwrap(),
        );
        s.co.submit("t1", &answer(1, Kind::Fs, &["a"]));
        tokio::task::spawn_blocking(move || rx.recv().unwrap())
            .await
            .unwrap();
        s.idle().await;
        assert_eq!(s.lineage(), vec![("t1".into(), CheckpointKind::Full)]);
    }

    #[test]
    fn bytes_written_counts_what_the_job_wrote() {
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let layer = |size| Descriptor {
            digest: String::new(),
            diff_id: String::new(),
            size,
            media_type: String::new(),
        };
        let mut m = Manifest::child_of(None, store.next_seq().unwrap(), "t", CheckpointKind::Fs);
        m.fs_layers = vec![layer(100), layer(7)];
        m.process = Some(ProcessImage {
            image: "proc/000001".into(),
            bytes_stored: 1,
            bytes_logical: 50,
            pids: vec![1],
        });
        assert_eq!(bytes_written(&m), 7, "the new layer only");
        m.kind = CheckpointKind::Full;
        assert_eq!(bytes_written(&m), 57);
        m.kind = CheckpointKind::Proc;
        assert_eq!(bytes_written(&m), 50);
        m.kind = CheckpointKind::Failed;
        assert_eq!(bytes_written(&m), 0);
    }

    #[test]
    fn volumes_split_off_their_changes() {
        let d = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        let changes = FsDiff {
            added: d(&["/w/a", "/wx/b", "/w/n/x", "/w/../etc/passwd"]),
            modified: d(&["/w"]),
            deleted: d(&["/v/c"]),
        };
        let (out, volumes) = split_volumes(changes, &d(&["/w", "/v", "/w/n"]), &d(&["/w", "/w/n"]));
        assert_eq!(
            out.added,
            d(&["/wx/b"]),
            "a prefix of a name is not a parent"
        );
        assert!(out.modified.is_empty() && out.deleted.is_empty());
        let set = |v: &[&str]| Some(v.iter().map(PathBuf::from).collect::<BTreeSet<_>>());
        assert_eq!(
            volumes,
            vec![
                // `..` is never followed: left out of every tree.
                VolumeChanges {
                    at: "/w".into(),
                    paths: set(&["", "a"])
                },
                // Not based yet: whole.
                VolumeChanges {
                    at: "/v".into(),
                    paths: None
                },
                // Nested: the longest path owns its changes.
                VolumeChanges {
                    at: "/w/n".into(),
                    paths: set(&["x"])
                },
            ]
        );
    }
}

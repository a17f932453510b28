//! One container's turn path: the owner of its inspection, its checkpoint coordinator and its
//! turns directory. The task core ([`crate::containers`]) asks it to end a turn, to hold an
//! action until the checkpoints before it are durable, and to take the base mark at start;
//! nothing else reaches into the inspection or the coordinator.
//!
//! A turn end, top to bottom: [`Sandbox::end_turn`] answers it on the inspection
//! ([`crate::inspector::Inspection::turn_end`], off the async runtime) and stores the answer
//! (`<state_dir>/<namespace>/<container>/turns/<seq>.json`, [`store_answer`]), then gives it
//! to the coordinator ([`Coordinator::submit`]), which turns it into a background job; an
//! answer that could not be stored is given all the same, and its turn checkpointed whole
//! ([`Coordinator::submit_unrecorded`]). Answers are written here only: a job that has to
//! inspect again (it waited for an exec to end) does so through [`Answers`], the coordinator's
//! view of this inspection.
//!
//! The inspection is used by one task at a time ([`InspectionCell`]); a panic while it is used
//! loses it, and every later turn end says so rather than pretend it was never there.

use std::{
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
    time::Duration,
};

use crab_runtime_config::Config;

use crate::{
    bundle,
    checkpoint::lineage::LineageRecord,
    checkpoint::{
        coordinator::{Inspect, Settings},
        policy,
        store::{self, CheckpointKind, Manifest, Store},
        Action, CheckpointError, ContainerCapture, Coordinator,
    },
    engine::Admission,
    error::{Error, Result},
    inspector::{
        self, bpf::HostProbes, fs::OverlayXattrs, Answer, Inspection, Kind, ProbesUnavailable,
        Target,
    },
    restore::intake::{self as restore, Taken},
    runc::Runc,
};

mod cell;

pub use cell::*;

/// The coordinator of a container's checkpoints, over its real inspection and capture.
pub type SandboxCoordinator = Coordinator<Answers, ContainerCapture>;

/// A sandbox's directory in the state dir: its checkpoint store and its turn answers.
pub fn sandbox_dir(state_dir: &Path, namespace: &str, container_id: &str) -> PathBuf {
    state_dir.join(namespace).join(container_id)
}

/// How a container's lineage begins.
// One per container start: the size of the larger variant does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Origin {
    Image,
    Checkpoint(Taken),
}

/// Where [`Sandbox::start_checkpointing`] left the origin manifest.
#[derive(Debug, PartialEq, Eq)]
pub enum OriginImport {
    /// Recorded (or its failure logged) before it returned.
    Done,
    /// Being recorded in the background, which imports and then removes the CRIU image the
    /// container was restored from.
    Background,
}

/// One container's turn path.
pub struct Sandbox {
    id: String,
    namespace: String,
    /// [`sandbox_dir`]: the checkpoint store, with the turn answers in it.
    dir: PathBuf,
    answers: Answers,
    /// Turns answers into checkpoints; set once checkpointing has started (at Create, or at
    /// Start for a container restored from a process image).
    coordinator: OnceLock<Arc<SandboxCoordinator>>,
    /// Each exec that finishes while no other runs ends a turn (zero-integration mode).
    exec_boundary: bool,
    /// The sequence number of the origin manifest this shim recorded (when it recorded it
    /// before the container started): the start of its first process epoch.
    origin_seq: Arc<std::sync::Mutex<Option<u64>>>,
    /// The page transfer of a lazy restore (set before checkpointing starts): the inspection
    /// and the process images must know while memory may still be missing.
    lazy: OnceLock<crate::checkpoint::lazy::Transfer>,
    /// The rseq areas of the restored threads (see [`Sandbox::restored_rseq`]).
    rseq: OnceLock<Vec<(u32, u64)>>,
    /// The inspection of a restored container, its base mark taken while CRIU still held the
    /// restored processes ([`Sandbox::marked_before_resume`]); taken by checkpointing.
    premarked: std::sync::Mutex<Option<Inspection>>,
    /// The inspection in use was marked before the restored processes ran: Start takes no
    /// base mark of its own.
    marked_at_restore: std::sync::atomic::AtomicBool,
    /// The lineage its store records ([`crate::checkpoint::lineage`]).
    lineage: OnceLock<LineageRecord>,
    /// Whether its network namespace may be left out of process images.
    netns: crate::checkpoint::netns::Eligibility,
}

impl Sandbox {
    /// The turn path of container `id`, not inspected (`why`) until
    /// [`Sandbox::start_checkpointing`].
    pub fn new(
        id: &str,
        namespace: &str,
        state_dir: &Path,
        exec_boundary: bool,
        why: NotInspected,
    ) -> Sandbox {
        let dir = sandbox_dir(state_dir, namespace, id);
        Sandbox {
            id: id.to_string(),
            namespace: namespace.to_string(),
            answers: Answers {
                container_id: id.to_string(),
                inspection: Arc::new(InspectionCell::new(id, why)),
                turns_dir: store::turns_dir(&dir),
                epoch: Arc::default(),
                after_rollback: Arc::default(),
            },
            origin_seq: Arc::default(),
            dir,
            coordinator: OnceLock::new(),
            exec_boundary,
            lazy: OnceLock::new(),
            rseq: OnceLock::new(),
            premarked: std::sync::Mutex::new(None),
            marked_at_restore: std::sync::atomic::AtomicBool::new(false),
            lineage: OnceLock::new(),
            netns: Default::default(),
        }
    }

    /// What decides whether the container's network namespace may be left out of its process
    /// images: its execs and its restore report here ([`crate::checkpoint::netns`]).
    pub fn netns(&self) -> &crate::checkpoint::netns::Eligibility {
        &self.netns
    }

    /// The lineage the container's store records when checkpointing starts (a later
    /// container of the same lineage resumes from its checkpoints).
    pub fn set_lineage(&self, record: LineageRecord) {
        let _ = self.lineage.set(record);
    }

    /// The restored container's inspection, its base mark taken before the restored processes
    /// ran ([`inspection_before_resume`]): checkpointing uses it, and Start takes no mark of
    /// its own. Whatever a restored process does from its first instruction on is part of the
    /// first turn. Call before [`Sandbox::start_checkpointing`].
    pub fn marked_before_resume(&self, inspection: Inspection) {
        *self.premarked.lock().unwrap_or_else(|e| e.into_inner()) = Some(inspection);
    }

    /// The container's processes were restored lazily: `transfer` says when all their memory
    /// has arrived. Call before [`Sandbox::start_checkpointing`].
    pub fn restored_lazily(&self, transfer: crate::checkpoint::lazy::Transfer) {
        let _ = self.lazy.set(transfer);
    }

    /// The container's processes were restored from a CRIU image whose threads registered
    /// these rseq areas (thread id in the container, address): the inspection leaves them out
    /// of memory images from the start ([`Inspection::restored_rseq`]). Call before
    /// [`Sandbox::start_checkpointing`].
    pub fn restored_rseq(&self, areas: Vec<(u32, u64)>) {
        let _ = self.rseq.set(areas);
    }

    /// Starts inspecting the container (init `pid`) and opens its checkpoint store, whose
    /// lineage begins with an origin manifest: the container's image as it is, or the
    /// checkpoint it was restored from (its process image imported into the store).
    pub async fn start_checkpointing(
        &self,
        bundle_dir: &Path,
        rootfs: &crate::bundle::Rootfs,
        config: &Config,
        runc: &Runc,
        pid: u32,
        origin: Origin,
    ) -> Result<OriginImport> {
        let started = self
            .try_start_checkpointing(bundle_dir, rootfs, config, runc, pid, origin)
            .await;
        if let Err(e) = &started {
            self.answers
                .inspection
                .turn_off(NotInspected::Failed(e.to_string()))
                .await;
        }
        started
    }

    async fn try_start_checkpointing(
        &self,
        bundle_dir: &Path,
        rootfs: &crate::bundle::Rootfs,
        config: &Config,
        runc: &Runc,
        pid: u32,
        origin: Origin,
    ) -> Result<OriginImport> {
        let mut spec = bundle::read_spec(bundle_dir)?;
        // A checkpoint image's crab annotations hold where the spec sets none (as at Create).
        if let Origin::Checkpoint(t) = &origin {
            crate::turns::inherit(&mut spec, &t.meta.annotations);
        }
        let (root, namespace, cid) = (self.dir.clone(), self.namespace.clone(), self.id.clone());
        // The origin manifest is recorded here, unless it imports a process image (a copy and
        // deduplication of up to hundreds of MB): that goes on in the background, below.
        let origin_seq = self.origin_seq.clone();
        let lineage = self.lineage.get().cloned();
        let (store, background) = tokio::task::spawn_blocking(move || -> Result<(Store, Option<Taken>)> {
            // Only a container restored from this store's own checkpoint carries on its lineage.
            let continues = |s: &Store| matches!(&origin, Origin::Checkpoint(t) if restore::own_source(s, &namespace, &cid, t).is_some());
            let (store, _) = Store::open_for_container(&root, continues).map_err(CheckpointError::Store)?;
            if let Some(record) = &lineage {
                if let Err(e) = crate::checkpoint::lineage::record(&store, record) {
                    log::error!("container {cid}: cannot record its lineage {}: {e}", record.lineage);
                }
            }
            let origin = match origin {
                Origin::Checkpoint(t) if restore::imports_process_image(&store, &namespace, &cid, &t) => {
                    return Ok((store, Some(t)));
                }
                Origin::Image => restore::created_manifest(&store, "").map_err(CheckpointError::from),
                Origin::Checkpoint(t) => restore::restored_manifest(&store, &namespace, &cid, &t).map_err(|e| CheckpointError::Origin(e.into())),
            };
            match origin.and_then(|m| Ok(store.publish(&m).map(|()| m.seq)?)) {
                Ok(seq) => *origin_seq.lock().unwrap() = Some(seq),
                // The container runs without a recorded origin: its next checkpoint still has
                // everything it needs (a failure there forces a full one).
                Err(e) => log::error!("container {cid}: cannot record where its lineage begins: {e}"),
            }
            Ok((store, None))
        })
        .await??;
        // What the inspection and the jobs both need, found once.
        let volumes = tracked_volumes(&spec, &config.checkpoint.tracked_volumes);
        let overlay = Overlay::of(rootfs);
        record_rootfs(&self.dir, rootfs, &overlay);
        record_spec(&self.dir, &spec);
        let cgroup2_dir =
            tokio::task::spawn_blocking(move || crate::sys::cgroup::cgroup2_dir_of(pid))
                .await?
                .map_err(|e| ProbesUnavailable::NoCgroup2 {
                    pid,
                    source: Arc::new(e),
                });
        let c = &config.checkpoint;
        self.netns.read_spec(&spec, bundle::LOOPBACK_HOOK_ARG);
        let settings = Settings {
            policy: policy::for_container(&spec, c.policy)?,
            volumes: volumes.iter().map(|(at, _)| at.clone()).collect(),
            keep_last: c.keep_last,
            keep_every: c.keep_every,
            wait_bound: Duration::from_millis(c.action_wait_timeout_ms),
        };
        let engine = Admission::new(&config.engine, &self.namespace, &self.id);
        let premarked = self
            .premarked
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let inspection = {
            let (id, overlay, cgroup2_dir) =
                (self.id.clone(), overlay.clone(), cgroup2_dir.clone());
            let (limits, volumes) = (config.limits.clone(), volumes.clone());
            let marked = &self.marked_at_restore;
            marked.store(premarked.is_some(), std::sync::atomic::Ordering::SeqCst);
            let keep = policy::keeps_self_contained(&spec, c.self_contained_changes)?;
            tokio::task::spawn_blocking(move || match premarked {
                Some(inspection) => inspection,
                None => start_inspection(&id, cgroup2_dir, overlay, volumes, limits, keep),
            })
        };
        let capture = ContainerCapture {
            container_id: self.id.clone(),
            runc: runc.clone(),
            init_pid: pid,
            cgroup2_dir: cgroup2_dir.unwrap_or_default(),
            upperdir: overlay.upperdir,
            overlay_xattrs: overlay.xattrs,
            limits: config.limits.clone(),
            volumes: volumes.clone(),
            dumper: crate::checkpoint::process::Dumper::from_config(config),
            lazy: self.lazy.get().cloned(),
            lazy_wait: Duration::from_millis(c.restore_timeout_ms),
            netns: (c.network_namespace == crab_runtime_config::NetnsDump::WhenChangeable)
                .then(|| self.netns.clone()),
        };
        let mut inspection = inspection.await?;
        // A lineage that goes on (a rollback or recovery keeping the id) numbers its answers
        // after the ones it has: a new shim must not overwrite them.
        let dir = self.dir.clone();
        let last = tokio::task::spawn_blocking(move || crate::metrics::last_answer_seq(&dir))
            .await
            .unwrap_or(0);
        inspection.continue_after(last);
        if let Some(t) = self.lazy.get().cloned() {
            inspection.restored_lazily(Arc::new(move || t.in_flight_now()));
        }
        if let Some(areas) = self.rseq.get() {
            inspection.restored_rseq(areas);
        }
        self.answers.inspection.set(inspection).await;
        let co = Coordinator::new(
            &self.id,
            store,
            self.answers.clone(),
            capture,
            settings,
            engine,
        );
        let import = match background.is_some() {
            true => OriginImport::Background,
            false => OriginImport::Done,
        };
        if let Some(t) = background {
            // The CRIU image the container was restored from (under its bundle) is imported
            // into the store and then removed.
            let image = t.criu_dir.clone().filter(|d| d.starts_with(bundle_dir));
            let (namespace, cid) = (self.namespace.clone(), self.id.clone());
            co.record_origin(
                move |store| {
                    restore::restored_manifest(store, &namespace, &cid, &t)
                        .map_err(|e| CheckpointError::Origin(e.into()))
                },
                move || {
                    if let Some(dir) = image {
                        let _ = std::fs::remove_dir_all(dir);
                    }
                },
            );
        }
        self.replicate(config, &co);
        let _ = self.coordinator.set(co);
        Ok(import)
    }

    /// With `[replication]`, pushes each newest durable checkpoint of the sandbox to the
    /// registry in the background ([`crate::replication::Replicator`]).
    fn replicate(&self, config: &Config, co: &SandboxCoordinator) {
        let registry = match crate::replication::Registry::from_config(&config.replication) {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                log::error!("container {}: not replicated: {e}", self.id);
                return;
            }
        };
        let Some(record) = self.lineage.get().cloned() else {
            return;
        };
        crate::replication::Replicator::spawn(
            crate::replication::ReplicatorParams {
                registry: Arc::new(registry),
                store_root: self.dir.clone(),
                namespace: self.namespace.clone(),
                container: self.id.clone(),
                record,
                signing_key: config.signing_key_path(),
                max_bytes: config.replication.max_mib << 20,
                retry_max: Duration::from_millis(config.replication.retry_max_ms),
            },
            co.durable_changes(),
        );
    }

    /// Whether each exec that finishes while no other runs ends a turn (and turns are answered).
    pub fn ends_turns_at_exec_exit(&self) -> bool {
        self.exec_boundary && self.coordinator.get().is_some()
    }

    /// Holds an action until the checkpoints of the turns before it are durable (bounded).
    pub async fn gate(&self, action: Action) -> Result<()> {
        match self.coordinator.get() {
            Some(co) => Ok(co.wait_durable(action).await?),
            None => Ok(()),
        }
    }

    /// Ends a turn: answers it, stores the answer, and hands it to the coordinator (whose
    /// checkpoint runs in the background). `running_execs` names the execs whose main process
    /// runs now, as (pid, exec id): a process image cannot hold them.
    ///
    /// An answer that cannot be stored (a full or read-only state disk) still reaches the
    /// coordinator, which then checkpoints the turn whole ([`Coordinator::submit_unrecorded`]):
    /// the inspection's mark has moved, so the turn's changes are in this answer only. The
    /// turn end is then an error all the same, saying so: the caller finds no answer of the
    /// turn among the stored ones (`crabctl turns`), and must not take an earlier one for it.
    pub async fn end_turn(
        &self,
        turn_id: &str,
        running_execs: impl FnOnce() -> Vec<(u32, String)>,
    ) -> Result<Answer> {
        let (answer, stored) = self
            .answers
            .answer(turn_id)
            .await
            .map_err(|e| Error::FailedPrecondition(e.to_string()))?;
        let co = self.coordinator.get();
        if let Some(co) = co {
            co.note_running_execs(running_execs());
            match &stored {
                Ok(_) => co.submit(turn_id, &answer),
                Err(_) => co.submit_unrecorded(turn_id, &answer),
            }
        }
        match stored {
            Ok(path) => {
                log::debug!(
                    "turn {turn_id} of {}: answer stored in {}",
                    self.id,
                    path.display()
                );
                Ok(answer)
            }
            Err(e) => Err(unrecorded(turn_id, &answer, co.is_some(), e)),
        }
    }

    /// Resets the container's files to checkpoint `seq` in place, keeping its processes (init
    /// `pid`): see [`crate::rollback`]. Waits for the checkpoints of earlier turns; refuses
    /// (`FailedPrecondition`, nothing changed) unless the checkpoint is in the current process
    /// epoch and everything since can be observed. A failure part way is an `Internal` error:
    /// the container must then be recreated from the checkpoint.
    pub async fn rollback_in_place(&self, seq: u64, pid: u32) -> Result<InPlace> {
        let refused =
            |why: String| Error::FailedPrecondition(format!("in-place rollback refused: {why}"));
        let Some(co) = self.coordinator.get().cloned() else {
            return Err(refused("the container's checkpointing is off".into()));
        };
        let waited = std::time::Instant::now();
        co.wait_durable(Action::Update).await?;
        let epoch = self.answers.epoch.clone();
        let origin_seq = *self.origin_seq.lock().unwrap();
        let id = self.id.clone();
        let co2 = co.clone();
        let run = move |i: &mut Inspection| -> Result<InPlace> {
            let co = co2;
            if !co.is_idle() {
                return Err(refused(
                    "a checkpoint of a turn end began meanwhile: try again".into(),
                ));
            }
            let store = co.store();
            let target = store.get(seq).map_err(|e| refused(e.to_string()))?;
            let latest = store
                .latest()
                .map_err(|e| refused(e.to_string()))?
                .ok_or_else(|| refused("the store holds no checkpoint".into()))?;
            let origin = origin_seq.and_then(|s| store.get(s).ok());
            if !epoch.lock().unwrap().holds(&target, origin.as_ref()) {
                return Err(refused(format!(
                    "the processes may have changed since checkpoint {seq} (turn {:?}): a later \
                     turn changed them, or this shim did not answer that turn",
                    target.turn_id
                )));
            }
            let reset =
                crate::rollback::reset(i, store, &target, &latest, pid).map_err(|e| match e {
                    crate::rollback::ResetError::Refused(why) => refused(why.to_string()),
                    e @ crate::rollback::ResetError::Failed(_) => {
                        // The files match neither the checkpoint nor the chain: the next checkpoint
                        // takes them whole.
                        co.lose_chain();
                        Error::Rollback {
                            id: id.to_string(),
                            seq,
                            source: Box::new(e),
                        }
                    }
                })?;
            // The lineage goes on from the checkpoint: a `restored` manifest with its references.
            let recorded = (|| -> std::result::Result<u64, store::StoreError> {
                let mut m = Manifest::child_of(
                    Some(&latest),
                    store.next_seq()?,
                    &target.turn_id,
                    CheckpointKind::Restored,
                );
                m.parent = Some(target.seq);
                m.fs_layers = target.fs_layers.clone();
                m.image_layers = latest.image_layers;
                m.process = target.process.clone();
                m.volumes = target.volumes.clone();
                m.explanation = format!(
                    "rolled back in place to checkpoint {} (turn {:?}): {} paths reset, {} bytes written, processes kept",
                    target.seq, target.turn_id, reset.paths, reset.bytes
                );
                m.in_place = Some(store::InPlaceRollback {
                    paths: reset.paths,
                    bytes: reset.bytes,
                });
                m.timings = store::Timings {
                    freeze_ms: store::Timings::ms(reset.freeze),
                    capture_ms: store::Timings::ms(reset.apply),
                    total_ms: store::Timings::ms(reset.total),
                    process: None,
                };
                // Its name is made durable after the answer (below), or by the next publish.
                store.publish_unsynced(&m)?;
                Ok(m.seq)
            })();
            let recorded = match recorded {
                Ok(s) => Some(s),
                Err(e) => {
                    log::error!("container {id}: cannot record the in-place rollback to checkpoint {seq}, its next checkpoint is full: {e}");
                    co.lose_chain();
                    None
                }
            };
            Ok(InPlace {
                to: target,
                recorded,
                reset,
            })
        };
        let done = self
            .answers
            .inspection
            .run("rolling back in place", run)
            .await
            .map_err(|e| refused(e.to_string()))??;
        log::info!(
            "container {}: rolled back in place to checkpoint {seq} (turn {:?}): {} paths, {} bytes, frozen {:?} (applying {:?}, scans {:?}); layers read in {:?}, peek {:?}; {:?} in all",
            self.id,
            done.to.turn_id,
            done.reset.paths,
            done.reset.bytes,
            done.reset.freeze,
            done.reset.apply,
            done.reset.scans,
            done.reset.read,
            done.reset.peek,
            waited.elapsed()
        );
        *self.answers.after_rollback.lock().unwrap() = Some(RollbackNote {
            to_checkpoint: seq,
            to_turn: done.to.turn_id.clone(),
            checkpoint: done.recorded,
            in_place: true,
            paths: done.reset.paths,
        });
        let co3 = co.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = co3.store().sync_published() {
                log::warn!("cannot sync the checkpoints directory after a rollback: {e}");
            }
        });
        // The freeze woke the idle processes: their marks are refreshed, off the request.
        let idle = done.reset.idle.clone();
        self.answers
            .inspection
            .run_in_background("refreshing its mark after an in-place rollback", move |i| {
                i.refresh_after_freeze(&idle)
            })
            .await;
        Ok(done)
    }

    /// Takes the base every turn is compared with, once init `pid` has become the container's
    /// own program and its start-up has settled, without waiting for it: the inspection is
    /// taken before this returns, so whoever needs it next waits until the base is taken.
    pub async fn mark_base_in_background(&self, pid: u32) {
        if self
            .marked_at_restore
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            // Marked while CRIU held the processes; their own memory as they resume is the base.
            self.answers
                .inspection
                .run_in_background("refreshing the restored memory", |i| {
                    i.refresh_restored_memory()
                })
                .await;
            return;
        }
        self.answers
            .inspection
            .run_in_background("taking the base mark", move |i| {
                wait_for_exec(pid, Duration::from_secs(2));
                i.mark_base();
            })
            .await;
    }

    /// Returns once nothing uses the inspection (e.g. the base mark is taken).
    pub async fn settled(&self) {
        self.answers.inspection.settled().await;
    }

    /// Stops inspecting (the container is being deleted): the cgroup is unregistered from the
    /// host probes.
    pub async fn stop(&self) {
        self.answers
            .inspection
            .turn_off(NotInspected::Deleted)
            .await;
    }
}

/// Kept whole: the edge (`service::status`) tells a refusal from a failure by its kind.
impl From<CheckpointError> for Error {
    fn from(e: CheckpointError) -> Error {
        Error::Capture(Box::new(e))
    }
}

/// A container's inspection as its checkpoint coordinator uses it; the only writer of turn
/// answers.
#[derive(Clone)]
pub struct Answers {
    container_id: String,
    inspection: Arc<InspectionCell>,
    /// `turns/` in the sandbox's directory.
    turns_dir: PathBuf,
    /// The turns answered since the last process change.
    epoch: Arc<std::sync::Mutex<Epoch>>,
    /// An in-place rollback since the last answer: the next answer's record says so.
    after_rollback: Arc<std::sync::Mutex<Option<RollbackNote>>>,
}

/// At most this many turn ids of one process epoch are remembered (the oldest are forgotten:
/// their checkpoints are then rolled back to by recreating the container).
const MAX_EPOCH_TURNS: usize = 4096;

/// The current process epoch of a container: the turns answered since its processes last
/// changed (that turn included: its checkpoint holds the processes as they still are), by this
/// shim. A checkpoint of one of these turns can be rolled back to in place.
#[derive(Debug)]
pub struct Epoch {
    turns: std::collections::VecDeque<String>,
    /// Whether the origin (the container's start) is still in it.
    origin: bool,
}

impl Default for Epoch {
    fn default() -> Self {
        Epoch {
            turns: Default::default(),
            origin: true,
        }
    }
}

impl Epoch {
    /// Counts a turn's answer: a process change (or anything not observed) begins a new epoch.
    pub fn answered(&mut self, turn_id: &str, a: &Answer) {
        if a.procs.changed || !a.degraded.is_empty() || matches!(a.kind, Kind::Proc | Kind::Full) {
            self.turns.clear();
            self.origin = false;
        }
        if self.turns.len() >= MAX_EPOCH_TURNS {
            self.turns.pop_front();
        }
        self.turns.push_back(turn_id.to_string());
    }

    /// Whether checkpoint `m` holds the processes as they are now (as far as the answers tell):
    /// the origin `origin` (or what it republished) while no process changed since the start,
    /// or a later checkpoint whose last turn is in the epoch.
    pub fn holds(&self, m: &Manifest, origin: Option<&Manifest>) -> bool {
        if let Some(o) = origin {
            let same_state = o.seq == m.seq
                || (o.kind == CheckpointKind::Restored
                    && o.parent == Some(m.seq)
                    && o.fs_layers == m.fs_layers
                    && o.process == m.process);
            if same_state {
                return self.origin;
            }
            if m.seq < o.seq {
                return false;
            }
        }
        let last = m.turn_id.rsplit(',').next().unwrap_or_default();
        !last.is_empty() && self.turns.iter().any(|t| t == last)
    }
}

/// A turn's record as stored (`turns/<seq:06>.json`, [`store_answer`]) and as crabctl reads it
/// back: the inspector's answer with the harness's turn id beside it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TurnRecord {
    /// The harness's id of the turn.
    pub turn_id: String,
    #[serde(flatten)]
    pub answer: Answer,
    /// On the first turn after an in-place rollback: what it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback: Option<RollbackNote>,
}

/// What the record of the first turn after an in-place rollback says about it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct RollbackNote {
    /// The checkpoint the files were reset to, and its turn.
    pub to_checkpoint: u64,
    pub to_turn: String,
    /// The `restored` checkpoint that recorded it.
    pub checkpoint: Option<u64>,
    pub in_place: bool,
    /// Paths reset.
    pub paths: u64,
}

/// What [`Sandbox::rollback_in_place`] did.
#[derive(Debug, Clone)]
pub struct InPlace {
    pub to: Manifest,
    /// The `restored` checkpoint recording it (`None` if it could not be published: the next
    /// checkpoint is then full).
    pub recorded: Option<u64>,
    pub reset: crate::rollback::Reset,
}

impl Answers {
    /// Answers a turn end and stores the answer as turn `turn_id` (while still holding the
    /// inspection, so answers are stored in their order); the answer stands even if it could
    /// not be stored (the mark has moved: it must reach the coordinator all the same). A note
    /// of an in-place rollback that could not be stored goes with the next stored answer.
    async fn answer(
        &self,
        turn_id: &str,
    ) -> Result<(Answer, Result<PathBuf>), InspectionUnavailable> {
        let (dir, turn_id) = (self.turns_dir.clone(), turn_id.to_string());
        let (epoch, after_rollback) = (self.epoch.clone(), self.after_rollback.clone());
        self.inspection
            .run("answering a turn end", move |i| {
                let answer = i.turn_end();
                epoch.lock().unwrap().answered(&turn_id, &answer);
                let record = TurnRecord {
                    turn_id,
                    answer,
                    rollback: after_rollback.lock().unwrap().take(),
                };
                let stored = store_answer(&dir, &record);
                if let (Err(_), Some(note)) = (&stored, record.rollback) {
                    after_rollback.lock().unwrap().get_or_insert(note);
                }
                (record.answer, stored)
            })
            .await
    }
}

impl Inspect for Answers {
    async fn idle_since_mark(&self) -> Vec<(u32, u64)> {
        let idle = self
            .inspection
            .run("reading its marks", |i| i.idle_since_mark());
        idle.await.unwrap_or_default()
    }

    async fn refresh_after_freeze(&self, idle: Vec<(u32, u64)>) {
        let refresh = move |i: &mut Inspection| i.refresh_after_freeze(&idle);
        let _ = self
            .inspection
            .run("refreshing its mark after a freeze", refresh)
            .await;
    }

    async fn turn_end(&self, turn_id: &str) -> std::result::Result<Answer, CheckpointError> {
        let (answer, stored) = self.answer(turn_id).await.map_err(|e| match e {
            e @ InspectionUnavailable::Lost { .. } => {
                CheckpointError::InspectionLost(e.to_string())
            }
            _ => CheckpointError::NotInspected,
        })?;
        // Not a turn of its own: the answer joins the running job, whose checkpoint therefore
        // holds what it found whether or not it is recorded (and a job that fails makes the
        // next one take everything).
        if let Err(e) = stored {
            log::warn!(
                "cannot store the answer after the execs of {} ended (the checkpoint being taken \
                 holds its changes all the same): {e}",
                self.container_id
            );
        }
        Ok(answer)
    }
}

/// `rootfs.json` in a container's checkpoint directory: where its rootfs is and the overlay
/// directories it is made of, for `crabctl export` of a container whose rootfs the caller
/// mounted (Docker Engine), which has no image or snapshot in containerd to build on and whose
/// `merged` mount may be gone by the time it is exported.
pub const ROOTFS_RECORD: &str = "rootfs.json";

/// The contents of [`ROOTFS_RECORD`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RootfsRecord {
    pub format: u32,
    pub mounted_by: crate::bundle::MountedBy,
    pub root_path: PathBuf,
    #[serde(default)]
    pub upperdir: Option<PathBuf>,
    /// In overlay order: the first is the topmost.
    #[serde(default)]
    pub lowerdirs: Vec<PathBuf>,
}

/// `spec.json` in a container's checkpoint directory: what an image of its checkpoints needs of
/// its OCI spec (the process's args, env and cwd, the hostname, the `io.crab/*` annotations
/// that travel with a checkpoint), in the spec's own shape, for `crabctl export` of a container
/// whose record is gone (`docker run --rm` after a crash, `ctr rm`): the image then runs the
/// container's command, not its base image's. Written 0600: the env may hold secrets.
pub const SPEC_RECORD: &str = "spec.json";

/// Writes [`SPEC_RECORD`] into `dir` (whole or not at all); a failure is logged: only an export
/// of a container without a record needs it, and that falls back to the base image's config.
fn record_spec(dir: &Path, spec: &oci_spec::runtime::Spec) {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let process = spec.process().as_ref();
    let record = serde_json::json!({
        "process": {
            "args": process.and_then(|p| p.args().clone()).unwrap_or_default(),
            "env": process.and_then(|p| p.env().clone()).unwrap_or_default(),
            "cwd": process.map(|p| p.cwd().clone()),
        },
        "hostname": spec.hostname(),
        "annotations": crate::turns::travelling(&spec.annotations().clone().unwrap_or_default()),
    });
    let write = || -> std::io::Result<()> {
        let tmp = dir.join(format!(".{SPEC_RECORD}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&serde_json::to_vec_pretty(&record).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dir.join(SPEC_RECORD))
    };
    if let Err(e) = write() {
        log::warn!("cannot record the spec in {}: {e}", dir.display());
    }
}

/// Writes [`ROOTFS_RECORD`] into `dir` (whole or not at all); a failure is logged: only an
/// export of a caller-mounted rootfs needs it, and that says so when it is missing.
fn record_rootfs(dir: &Path, rootfs: &crate::bundle::Rootfs, overlay: &Overlay) {
    let record = RootfsRecord {
        format: 1,
        mounted_by: rootfs.mounted_by,
        root_path: rootfs.path.clone(),
        upperdir: overlay.upperdir.clone(),
        lowerdirs: overlay.lowerdirs.clone(),
    };
    let write = || -> std::io::Result<()> {
        let tmp = dir.join(format!(".{ROOTFS_RECORD}.tmp"));
        let data = serde_json::to_vec_pretty(&record).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, data)?;
        std::fs::rename(&tmp, dir.join(ROOTFS_RECORD))
    };
    if let Err(e) = write() {
        log::warn!("cannot record the rootfs in {}: {e}", dir.display());
    }
}

/// The rootfs overlay: its directories and which xattrs are its own.
#[derive(Debug, Clone, Default)]
struct Overlay {
    upperdir: Option<PathBuf>,
    lowerdirs: Vec<PathBuf>,
    xattrs: OverlayXattrs,
    /// `st_dev` of the overlay mounted at the rootfs path: changes made there by tasks
    /// outside the container count for it ([`inspector::Target::rootfs_dev`]).
    dev: Option<u64>,
}

impl Overlay {
    fn of(rootfs: &crate::bundle::Rootfs) -> Overlay {
        let Some(m) = crate::bundle::RootfsMount::overlay(&rootfs.mounts) else {
            return Overlay::default();
        };
        let (upperdir, lowerdirs) = inspector::fs::overlay_dirs(&m.options)
            .map(|(u, l)| (Some(u), l))
            .unwrap_or((None, Vec::new()));
        Overlay {
            upperdir,
            lowerdirs,
            xattrs: OverlayXattrs::of_mount(&m.options),
            dev: overlay_dev(&rootfs.path),
        }
    }
}

/// `st_dev` of the filesystem at `path` if it is an overlay (a container's own superblock; the
/// host's root filesystem never is), else `None`, logged.
fn overlay_dev(path: &Path) -> Option<u64> {
    const OVERLAYFS_SUPER_MAGIC: nix::sys::statfs::FsType = nix::sys::statfs::FsType(0x794c_7630);
    let kind = match nix::sys::statfs::statfs(path) {
        Ok(s) => s.filesystem_type(),
        Err(e) => {
            log::warn!(
                "cannot statfs the rootfs {}: changes made there from outside the container \
                 are not seen: {e}",
                path.display()
            );
            return None;
        }
    };
    if kind != OVERLAYFS_SUPER_MAGIC {
        log::warn!(
            "the rootfs {} is not an overlay mount ({:#x}): changes made there from outside the \
             container are not seen",
            path.display(),
            kind.0
        );
        return None;
    }
    match nix::sys::stat::stat(path) {
        Ok(st) => Some(st.st_dev),
        Err(e) => {
            log::warn!("cannot stat the rootfs {}: {e}", path.display());
            None
        }
    }
}

/// The host probes, loaded (or opened from their pins) once per shim process.
fn host_probes() -> std::result::Result<Arc<HostProbes>, ProbesUnavailable> {
    static PROBES: OnceLock<std::result::Result<Arc<HostProbes>, ProbesUnavailable>> =
        OnceLock::new();
    PROBES
        .get_or_init(|| {
            let probes =
                HostProbes::open_or_load().map_err(|e| ProbesUnavailable::Bpf(Arc::new(e)))?;
            match probes.sweep_dead() {
                Ok(ids) if !ids.is_empty() => {
                    log::info!("unwatched {} cgroups left by shims that died", ids.len())
                }
                Ok(_) => {}
                Err(e) => log::warn!("cannot sweep the watched cgroups: {e}"),
            }
            Ok(Arc::new(probes))
        })
        .clone()
}

/// The inspection of container `id`, restored from a CRIU image (its init `init`), with its
/// base mark taken now: while CRIU holds every restored thread at pre-resume (registers,
/// signal masks and pending signals, memory, fds and queues all as they will run, the
/// restorer unmapped), so that nothing a restored process does after it resumes is in the
/// base. `rseq` are the image's rseq areas (left out of memory images from the start). The
/// probes watch the container's cgroup from here on.
pub fn inspection_before_resume(
    id: &str,
    init: u32,
    rootfs: &crate::bundle::Rootfs,
    spec: &oci_spec::runtime::Spec,
    config: &Config,
    rseq: &[(u32, u64)],
) -> Inspection {
    let cgroup2_dir =
        crate::sys::cgroup::cgroup2_dir_of(init).map_err(|e| ProbesUnavailable::NoCgroup2 {
            pid: init,
            source: Arc::new(e),
        });
    let volumes = tracked_volumes(spec, &config.checkpoint.tracked_volumes);
    let overlay = Overlay::of(rootfs);
    // Checked at Create; an annotation the checkpoint image brought is read the same way.
    let keep = policy::keeps_self_contained(spec, config.checkpoint.self_contained_changes)
        .unwrap_or_else(|e| {
            log::warn!("container {id}: {e}: self-contained changes are checkpointed");
            false
        });
    let mut inspection = start_inspection(
        id,
        cgroup2_dir,
        overlay,
        volumes,
        config.limits.clone(),
        keep,
    );
    // CRIU and its action script are in the container's cgroup until the restore ends.
    inspection.restored_tree(init);
    inspection.restored_rseq(rseq);
    inspection.mark_base_held_by_criu();
    inspection
}

/// Starts inspecting a created container whose cgroup2 directory is `cgroup2_dir` (or why it
/// has none); `keep_self_contained`: its turn ends keep the image of a process whose memory
/// changed by its own doing alone.
fn start_inspection(
    container_id: &str,
    cgroup2_dir: std::result::Result<PathBuf, ProbesUnavailable>,
    overlay: Overlay,
    volumes: Vec<(PathBuf, PathBuf)>,
    limits: crab_runtime_config::LimitsConfig,
    keep_self_contained: bool,
) -> Inspection {
    let probes = match &cgroup2_dir {
        Ok(_) => host_probes(),
        Err(e) => Err(e.clone()),
    };
    let target = Target {
        container_id: container_id.to_string(),
        cgroup2_dir: cgroup2_dir.unwrap_or_default(),
        upperdir: overlay.upperdir,
        lowerdirs: overlay.lowerdirs,
        volumes,
        overlay_xattrs: overlay.xattrs,
        rootfs_dev: overlay.dev,
        limits,
        keep_self_contained,
    };
    Inspection::new(target, probes)
}

/// The tracked volumes: the container's writable bind mounts of host directories at or below
/// a path the config lists (`[checkpoint] tracked_volumes`), as (path in the container, host
/// directory). Read-only mounts, mounts of single files and other filesystems are not: their
/// contents cannot change or cannot be diffed (each skip is logged).
pub fn tracked_volumes(
    spec: &oci_spec::runtime::Spec,
    tracked: &[PathBuf],
) -> Vec<(PathBuf, PathBuf)> {
    let mounts = spec.mounts().as_deref().unwrap_or_default();
    let mut out: Vec<(PathBuf, PathBuf)> = Vec::new();
    for m in mounts {
        let at = m.destination();
        if !at.is_absolute() || !tracked.iter().any(|t| at.starts_with(t)) {
            continue;
        }
        let options = m.options().as_deref().unwrap_or_default();
        let bind = m.typ().as_deref() == Some("bind")
            || options.iter().any(|o| o == "bind" || o == "rbind");
        let skip = |why: &str| log::info!("volume {} is not tracked: {why}", at.display());
        let Some(source) = m.source().clone().filter(|_| bind) else {
            skip("not a bind mount");
            continue;
        };
        if options.iter().any(|o| o == "ro") {
            skip("read-only");
            continue;
        }
        if !source.is_dir() {
            skip("not a directory");
            continue;
        }
        // A later mount at the same place hides the earlier one.
        out.retain(|(a, _)| a != at);
        out.push((at.clone(), source));
    }
    out
}

/// The error of a turn end whose answer `e` kept from being stored; `checkpointed`: the
/// coordinator took the turn whole all the same.
fn unrecorded(turn_id: &str, answer: &Answer, checkpointed: bool, e: Error) -> Error {
    let kind = format!("{:?}", answer.kind).to_lowercase();
    let what = match checkpointed {
        true => format!(
            "the answer of turn {turn_id} ({kind}) could not be stored, so the turn is \
             checkpointed whole (files and processes) instead"
        ),
        false => format!("the answer of turn {turn_id} ({kind}) could not be stored"),
    };
    match e {
        Error::Io { context, source } => Error::Io {
            context: format!("{what}: {context}"),
            source,
        },
        Error::Json { context, source } => Error::Json {
            context: format!("{what}: {context}"),
            source,
        },
        e => Error::Other(format!("{what}: {e}")),
    }
}

/// Writes the turn's record atomically (temp file, fsync, rename): a reader never sees half of
/// it. The first answer after an in-place rollback says so (`rollback`).
fn store_answer(dir: &Path, record: &TurnRecord) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(Error::io(format!("cannot create {}", dir.display())))?;
    let seq = record.answer.seq;
    let path = dir.join(format!("{seq:06}.json"));
    let tmp = dir.join(format!(".{seq:06}.json.tmp"));
    let data = serde_json::to_vec_pretty(record).map_err(|source| Error::Json {
        context: "encode the turn answer".into(),
        source,
    })?;
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(Error::io(format!("cannot store {}", path.display())))?;
    Ok(path)
}

/// Waits (bounded) until `pid` no longer runs `runc init`: `runc start` returns once it has
/// released the init, which then execs the container's program on its own schedule.
fn wait_for_exec(pid: u32, bound: Duration) {
    let deadline = std::time::Instant::now() + bound;
    loop {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let mut args = cmdline.split(|b| *b == 0);
        let is_runc_init =
            args.next().is_some_and(|a| a.ends_with(b"runc")) && args.next() == Some(b"init");
        if !is_runc_init || std::time::Instant::now() >= deadline {
            if is_runc_init {
                log::warn!("pid {pid} still runs `runc init` {bound:?} after start");
            }
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[cfg(test)]
mod tests;

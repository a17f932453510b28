//! Checkpoints: the smallest sufficient one at each turn end, off the agent's critical path.
//!
//! - [`store`]: the per-sandbox store (manifests `C_i = (P_j, F_k)`, blobs, atomic publish,
//!   retention); [`layer`]: fs diff layers (OCI tar+zstd, container frozen only while read);
//! - [`process`]: process images with CRIU via runc (the trap check, image verification);
//!   [`pages`]: their page data, content-addressed so unchanged pages are stored once;
//! - [`restore`]: a container started from a checkpoint image (the reserved directory in its
//!   rootfs) and the origin manifests that begin each container's lineage;
//! - [`Coordinator`] (here): a turn's answer becomes a background job; the next action on the
//!   container waits until that job is durable (bounded), and turn ends that arrive while a
//!   job runs are coalesced into the next job.

pub mod layer;
pub mod pages;
pub mod policy;
pub mod process;
pub mod restore;
pub mod store;

use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::watch;

use self::{
    layer::{CgroupFreezer, FsDiffPaths},
    store::{CheckpointKind, Manifest, ProcessImage, Store, Timings},
};
use crate::{
    error::{Error, Result},
    inspector::{Answer, Inspection, Kind},
    runc::Runc,
};

/// What a job needs to know about its container.
#[derive(Clone)]
pub struct JobTarget {
    pub container_id: String,
    pub runc: Runc,
    pub init_pid: u32,
    pub cgroup2_dir: PathBuf,
    pub upperdir: Option<PathBuf>,
    /// Container paths under tracked volumes: their contents are not in the upperdir.
    pub volumes: Vec<PathBuf>,
    /// Which checkpoint a turn end takes ([`policy`]).
    pub policy: policy::CheckpointPolicy,
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
        self.explanation.push(a.summary());
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
    keep_last: Option<u32>,
    keep_every: Option<u32>,
    wait_bound: Duration,
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
            keep_last,
            keep_every,
            wait_bound,
        })
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Takes a turn's answer: returns at once; the checkpoint (if any) runs in the background.
    pub fn submit(self: &Arc<Self>, turn_id: &str, answer: &Answer) {
        let answer = &*policy::apply(self.target.policy, answer);
        let mut st = self.state.lock().unwrap();
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

    async fn run(self: Arc<Self>, mut work: Work) {
        loop {
            let force_full = std::mem::take(&mut self.state.lock().unwrap().force_full);
            if force_full {
                work.fs = true;
                work.proc = true;
            }
            let turn_ids = work.turn_ids.clone();
            let idle = match self.inspection.lock().await.as_ref() {
                Some(i) => i.idle_since_mark(),
                None => Vec::new(),
            };
            let result = self.job(&work, force_full).await;
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
                let all = crate::inspector::fs::Manifest::scan(&upper)
                    .map_err(|e| Error::Other(e.to_string()))?;
                let d = crate::inspector::fs::diff(
                    &crate::inspector::fs::Manifest::default(),
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
            let outside_volumes = |v: Vec<PathBuf>| -> Vec<PathBuf> {
                v.into_iter()
                    .filter(|p| !target.volumes.iter().any(|vol| p.starts_with(vol)))
                    .collect()
            };
            let (added, modified, deleted) = (
                outside_volumes(added),
                outside_volumes(modified),
                outside_volumes(deleted),
            );
            let init_pid = t.init_pid;
            let (desc, stats) = tokio::task::spawn_blocking(move || {
                let freezer = CgroupFreezer::for_pid(init_pid)
                    .map_err(Error::io("find the container's freezer"))?;
                let paths = FsDiffPaths {
                    added: &added,
                    modified: &modified,
                    deleted: &deleted,
                };
                layer::write_fs_layer(&store, &upper, &paths, &freezer)
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

fn store_err(e: store::StoreError) -> Error {
    Error::Other(e.to_string())
}

//! The task service's core: containers, their processes and their lifecycle over runc.
//! It speaks in plain values: requests arrive as such from the protocol edge, and what
//! happens is reported as [`TaskEvent`]s, which the edge publishes.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use containerd_shim::ExitSignal;
use crab_runtime_config::{Config, ConfigSource, ShimOptions};

use crate::{
    bundle::{self, RootfsMount},
    checkpoint::{lazy, Action},
    error::{Error, Result},
    events::{EventSender, TaskEvent},
    oom,
    process::{ExitInfo, Process, Snapshot, Status},
    reaper::ExitSubscription,
    restore::{
        gate as restore_gate,
        intake::{self as restore, Taken, Verdict},
        kernel,
        scratch::RestoreDir,
        trust,
    },
    runc::{Runc, RuncError},
    sandbox::{NotInspected, Origin, OriginImport, Sandbox},
    stdio::{PreparedIo, StdioSpec},
    turns,
};

/// How long an exit waits for the process's output to be copied out before it is published.
/// Output held open by a process left behind is not waited for beyond this.
const OUTPUT_DRAIN_BOUND: Duration = Duration::from_millis(500);
/// Where runc's seccomp programs are cached, in `store.state_dir` (a dot: no namespace is
/// named so).
const SECCOMP_CACHE_DIR: &str = ".seccomp-programs";

pub struct CreateParams {
    pub id: String,
    pub bundle: PathBuf,
    pub rootfs: Vec<RootfsMount>,
    pub stdio: StdioSpec,
    /// containerd's runtime options (`runtimeoptions.v1.Options`), type URL and bytes.
    pub options: Option<(String, Vec<u8>)>,
    pub checkpoint: String,
}

/// containerd's checkpoint options (`containerd.runc.v1.CheckpointOptions`), as plain values.
#[derive(Debug, Default)]
pub struct TaskCheckpointOptions {
    pub exit: bool,
    pub open_tcp: bool,
    pub external_unix_sockets: bool,
    pub terminal: bool,
    pub file_locks: bool,
    pub cgroups_mode: Option<String>,
    pub work_path: Option<PathBuf>,
    pub work_path_was_default: bool,
}

pub struct Container {
    pub id: String,
    pub bundle: PathBuf,
    runc: Runc,
    /// The key containerd's checkpoints of it are signed with (`[restore] signing_key`).
    signing_key: PathBuf,
    kill_all_on_exit: bool,
    rootfs_mounted: bool,
    /// Its rootfs as Create found it (what a containerd checkpoint of it is bound to).
    rootfs: bundle::Rootfs,
    pub init: Arc<Process>,
    execs: Mutex<HashMap<String, Arc<Process>>>,
    /// Annotations received through `Update` (turn boundaries, later).
    annotations: Mutex<HashMap<String, String>>,
    /// Set when init exited while execs still ran: its exit is published after theirs.
    init_exit_pending: Mutex<Option<ExitInfo>>,
    /// Serialises lifecycle changes of the container (start, pause, resume, update, delete).
    lifecycle: tokio::sync::Mutex<()>,
    _oom: Mutex<Option<oom::OomWatcher>>,
    /// Its turn path: inspection, turn answers, checkpoints.
    sandbox: Sandbox,
    /// The argv prefixes of execs that are no agent actions (probes; [`turns::PROBE_COMMANDS`]).
    probes: Vec<Vec<String>>,
    /// A process image to restore at Start instead of `runc start` (with what checkpointing
    /// needs once the restored init is known).
    pending_restore: Mutex<Option<PendingRestore>>,
    /// Where its process image was copied to restore it (in the store), until Delete.
    restore_dir: Mutex<Option<RestoreDir>>,
}

/// A fresh restore directory for container `id` ([`RestoreDir`]), named in its bundle for the
/// cleanup after a shim died.
fn scratch_dir(
    config: &Config,
    namespace: &str,
    id: &str,
    bundle: &Path,
) -> std::result::Result<RestoreDir, restore::RestoreError> {
    let io = |path: PathBuf| move |source| restore::RestoreError::Io { path, source };
    let root = config
        .store
        .state_dir
        .join(crate::restore::scratch::RESTORES_DIR);
    let dir = RestoreDir::create(&config.store.state_dir, namespace, id).map_err(io(root))?;
    dir.record_in(bundle)
        .map_err(io(bundle.join(crate::restore::scratch::BUNDLE_RECORD)))?;
    log::info!(
        "create {id}: its process image is copied to {} to restore it",
        dir.path().display()
    );
    Ok(dir)
}

/// What Start needs to restore a container's processes.
struct PendingRestore {
    /// The CRIU image directory.
    image: PathBuf,
    /// crab's description of the checkpoint (none for containerd's own checkpoints).
    taken: Option<Taken>,
    config: Config,
    rootfs: bundle::Rootfs,
    stdio: StdioSpec,
    checkpointing: bool,
    /// The rw layer a containerd checkpoint was dumped with ([`restore::rw`]): checked at
    /// Start, after the CRI has put its rootfs diff back and before CRIU runs.
    expect_rw: Option<String>,
}

/// Counts a restore's outcome in the host engine's directory (`crabctl metrics`); a failure
/// to count is logged, never the restore's.
fn count_restore(engine: &crab_runtime_config::EngineConfig, ok: bool) {
    if let Err(e) = crate::engine::Engine::new(engine).count_restore(ok) {
        log::warn!("cannot count a restore for crabctl metrics: {e}");
    }
}

impl Container {
    pub fn process(&self, exec_id: &str) -> Result<Arc<Process>> {
        if exec_id.is_empty() {
            return Ok(self.init.clone());
        }
        self.execs
            .lock()
            .unwrap()
            .get(exec_id)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("exec {exec_id} in container {}", self.id)))
    }

    /// The running execs that are agent actions (probes are not).
    fn running_execs(&self) -> usize {
        self.execs
            .lock()
            .unwrap()
            .values()
            .filter(|p| !p.probe && matches!(p.status(), Status::Running | Status::Paused))
            .count()
    }

    /// The running execs' main processes, as (pid, exec id): the coordinator names them when
    /// a process checkpoint has to wait for them (they are outside init's tree).
    fn running_exec_pids(&self) -> Vec<(u32, String)> {
        let execs = self.execs.lock().unwrap();
        execs
            .values()
            .filter(|p| p.pid() != 0 && matches!(p.status(), Status::Running | Status::Paused))
            .map(|p| (p.pid(), p.exec_id.clone()))
            .collect()
    }

    pub fn annotations(&self) -> HashMap<String, String> {
        self.annotations.lock().unwrap().clone()
    }
}

/// Which process a pid belongs to; and exits that arrived before their pid was known.
#[derive(Default)]
struct PidTable {
    owners: HashMap<u32, (String, String)>,
    /// Processes being started: while any is, exits of unknown pids are kept, since
    /// `runc exec --detach` can return after its process already exited and was reaped.
    starting: usize,
    early_exits: HashMap<u32, i32>,
}

impl PidTable {
    /// A process is being started: until it is known, exits of unknown pids are kept.
    fn begin_start(&mut self) {
        self.starting += 1;
    }

    /// The start under way is done: `pid` (when the process started) belongs to `owner`
    /// (container id, exec id) unless it exited already, whose status is returned then.
    fn finish_start(&mut self, pid: Option<u32>, owner: (String, String)) -> Option<i32> {
        self.starting -= 1;
        let early = pid.and_then(|pid| self.early_exits.remove(&pid));
        if let (Some(pid), None) = (pid, early) {
            self.owners.insert(pid, owner);
        }
        if self.starting == 0 {
            self.early_exits.clear();
        }
        early
    }

    /// Process `pid` exited with `code`: its owner if known (and forgotten); an unknown pid's
    /// exit is kept while a start is under way (it may be that start's process).
    fn exited(&mut self, pid: u32, code: i32) -> Option<(String, String)> {
        let owner = self.owners.remove(&pid);
        if owner.is_none() && self.starting > 0 {
            self.early_exits.insert(pid, code);
        }
        owner
    }
}

pub struct Containers {
    namespace: String,
    /// The engine's record of the snapshots a container runs on (containerd's API, from the
    /// protocol edge): which layers a checkpoint image's rootfs was unpacked from.
    snapshots: Arc<dyn crate::restore::layers::SnapshotSource>,
    events: EventSender,
    map: Mutex<HashMap<String, Arc<Container>>>,
    pids: Mutex<PidTable>,
    shutdown: Arc<ExitSignal>,
}

pub struct ProcessState {
    pub container_id: String,
    pub bundle: PathBuf,
    pub exec_id: String,
    pub stdio: StdioSpec,
    pub snapshot: Snapshot,
}

impl Containers {
    /// The core of a shim serving containerd namespace `namespace`: it reports to `events`
    /// and signals `shutdown` when the shim is to end.
    pub fn new(
        namespace: String,
        snapshots: Arc<dyn crate::restore::layers::SnapshotSource>,
        events: EventSender,
        shutdown: Arc<ExitSignal>,
    ) -> Arc<Self> {
        Arc::new(Self {
            namespace,
            snapshots,
            events,
            map: Mutex::new(HashMap::new()),
            pids: Mutex::new(PidTable::default()),
            shutdown,
        })
    }

    /// Consumes exits from the reaper for as long as the shim runs.
    pub fn spawn_exit_loop(self: &Arc<Self>, mut exits: ExitSubscription) {
        let this = self.clone();
        tokio::spawn(async move {
            while let Some((pid, code)) = exits.recv().await {
                this.on_exit(pid as u32, code);
            }
        });
    }

    pub fn get(&self, id: &str) -> Result<Arc<Container>> {
        self.map
            .lock()
            .unwrap()
            .get(id)
            .cloned()
            .ok_or_else(|| Error::NotFound(format!("container {id}")))
    }

    pub fn is_empty(&self) -> bool {
        self.map.lock().unwrap().is_empty()
    }

    /// The crab config that containerd's runtime options (type URL, value) lead to, and the
    /// options decoded: crab's own name the config; with runc's (crab registered with runc's
    /// runtime type) or none, `$CRAB_CONFIG` or the default file does, and runc's settings
    /// apply on top (see [`crab_runtime_config::ShimOptions`]).
    pub(crate) fn load_config(
        options: &Option<(String, Vec<u8>)>,
    ) -> Result<(Config, ConfigSource, ShimOptions)> {
        let options = match options {
            Some((type_url, value)) => ShimOptions::decode(type_url, value)?,
            None => ShimOptions::None,
        };
        let (config, source) = options.load_config()?;
        Ok((config, source, options))
    }

    pub async fn create(&self, p: CreateParams) -> Result<u32> {
        if self.map.lock().unwrap().contains_key(&p.id) {
            return Err(Error::AlreadyExists(format!("container {}", p.id)));
        }
        let (config, source, options) = Self::load_config(&p.options)?;
        let runc = Runc::from_config(&config, options.runc(), &self.namespace, &p.bundle)?;
        log::info!(
            "create {}: config from {source}{}, runc {}",
            p.id,
            match options {
                ShimOptions::Runc(_) => " with runc's runtime options",
                _ => "",
            },
            runc.binary.display()
        );
        let spec = bundle::read_spec(&p.bundle)?;
        turns::check_spec_annotations(&spec)?;
        crate::grouping::check_group(&spec, &self.namespace, &config.shim.groups)
            .map_err(Error::InvalidArgument)?;
        let (exec_boundary, probes) = turn_settings(&spec, &config)?;
        let rootfs_mounted = bundle::mount_rootfs(&p.bundle, &p.rootfs).await?;
        // Docker Engine sends no mounts: it mounted the rootfs itself, at the spec's root.path.
        let rootfs = {
            let (bundle, spec, mounts) = (p.bundle.clone(), spec.clone(), p.rootfs.clone());
            tokio::task::spawn_blocking(move || bundle::Rootfs::resolve(&bundle, &spec, &mounts))
                .await
                .map_err(Error::Task)?
        };
        if rootfs.mounted_by == bundle::MountedBy::Caller {
            log::info!(
                "create {}: rootfs mounted by the caller at {} ({})",
                p.id,
                rootfs.path.display(),
                match bundle::RootfsMount::overlay(&rootfs.mounts) {
                    Some(_) => "an overlay",
                    None => "not an overlay: its changes cannot be seen",
                }
            );
        }
        let unmount = |why: &dyn std::fmt::Display| {
            log::warn!("create of {} failed: {why}", p.id);
            if rootfs_mounted {
                bundle::unmount_rootfs(&p.bundle);
            }
        };
        let checkpointing = config.checkpoint.enabled && turns::is_inspected(&spec);
        if let Some(score) = spec.process().as_ref().and_then(|p| p.oom_score_adj()) {
            crate::placement::follow_container_oom_score(&p.id, score);
        }
        // A checkpoint to start from: containerd's (`ctr run --checkpoint`), or crab's in the
        // rootfs of a checkpoint image.
        // Whoever signed it, a process image may not ask for more than this spec grants.
        let granted = crate::restore::privilege::Granted::from_spec(&spec);
        let engine = config.engine.clone();
        let mut start_fresh = false;
        let mut expect_rw = None;
        // The restore's copy of a process image: removed when Create fails (dropped), else at
        // Delete.
        let mut restore_dir = None;
        let taken = match p.checkpoint.is_empty() {
            true => {
                // Which layers the engine unpacked, asked only of a rootfs with a checkpoint.
                let unpacked = match rootfs.path.join(restore::RESERVED_DIR).exists() {
                    true => {
                        let t = std::time::Instant::now();
                        let u = crate::restore::layers::identify(
                            self.snapshots.as_ref(),
                            &self.namespace,
                            &p.id,
                            &rootfs.path,
                            rootfs.mounted_by == bundle::MountedBy::Containerd,
                            RootfsMount::overlay(&rootfs.mounts).map(|m| m.options.as_slice()),
                        )
                        .await;
                        log::info!(
                            "create {}: rootfs layers asked of the engine in {:.1} ms: {}",
                            p.id,
                            t.elapsed().as_secs_f64() * 1e3,
                            match &u {
                                Ok(u) => u.source.clone(),
                                Err(e) => e.clone(),
                            }
                        );
                        u
                    }
                    false => Err("the rootfs holds no checkpoint".into()),
                };
                let (rootfs, bundle) = (rootfs.path.clone(), p.bundle.clone());
                let (config, id, ns) = (config.clone(), p.id.clone(), self.namespace.clone());
                let taken = tokio::task::spawn_blocking(move || {
                    // A process image is copied to disk, in the store, never into the bundle
                    // (tmpfs on most hosts): see [`RestoreDir`].
                    let scratch =
                        match std::fs::symlink_metadata(rootfs.join(restore::RESERVED_DIR)) {
                            Ok(_) => Some(scratch_dir(&config, &ns, &id, &bundle)?),
                            Err(_) => None,
                        };
                    let dest = match &scratch {
                        Some(s) => s.criu(),
                        None => bundle.join(crate::restore::scratch::CRIU_SUBDIR),
                    };
                    let trusted = || crate::checkpoint::provenance::trusted_keys(&config);
                    let cache = crate::restore::cache::RestoreCache::from_config(&config);
                    let guard = restore::RestoreGuard {
                        container: &id,
                        trusted: &trusted,
                        unsigned: config.restore.unsigned_images,
                        limits: restore::ImageLimits::from_config(&config.restore),
                        granted: &granted,
                        cache: cache.as_ref(),
                        // Start holds the restored processes at CRIU's post-restore gate
                        // until the verdict ([`restore_gate`]).
                        defer_pages: config.restore.verify_during_restore,
                        unpacked: &unpacked,
                    };
                    let taken = restore::take_from_rootfs(&rootfs, &dest, &guard)?;
                    // Without a process image nothing was copied: the directory goes now.
                    let scratch =
                        scratch.filter(|_| taken.as_ref().is_some_and(|t| t.criu_dir.is_some()));
                    Ok::<_, restore::RestoreError>((taken, scratch))
                })
                .await;
                match taken {
                    Ok(Ok((t, dir))) => {
                        restore_dir = dir;
                        t
                    }
                    Ok(Err(e)) => {
                        unmount(&e);
                        count_restore(&engine, false);
                        return Err(Error::FailedPrecondition(format!(
                            "cannot start {} from its image: {e}",
                            p.id
                        )));
                    }
                    Err(e) => {
                        unmount(&e);
                        return Err(Error::Task(e));
                    }
                }
            }
            // containerd's own checkpoint (`ctr c restore`, `ctr run --checkpoint`, the CRI's
            // restore): the same trust decision as crab's images ([`trust`]), then the image's
            // claims against the spec (the kernel check follows at Start).
            false => {
                let dir = PathBuf::from(&p.checkpoint);
                let config = config.clone();
                let decided = tokio::task::spawn_blocking(move || {
                    let trusted = || crate::checkpoint::provenance::trusted_keys(&config);
                    let limits = restore::ImageLimits::from_config(&config.restore);
                    let decision = trust::containerd_checkpoint(
                        &dir,
                        &trusted,
                        config.restore.unsigned_images,
                        limits,
                    )
                    .map_err(|e| e.to_string())?;
                    if !matches!(decision, trust::Decision::StartFresh { .. }) {
                        restore::check_privilege(&dir, &granted).map_err(|e| e.to_string())?;
                    }
                    Ok::<_, String>(decision)
                })
                .await;
                match decided {
                    Ok(Ok(decision)) => {
                        match &decision {
                            trust::Decision::Signed {
                                files,
                                bytes,
                                rootfs: bound,
                            } => {
                                log::info!(
                                    "create {}: containerd's checkpoint is signed by a trusted \
                                     key ({files} files, {bytes} bytes verified)",
                                    p.id
                                );
                                match bound {
                                    Some(b) => {
                                        if let Err(e) = self.check_image(&p.id, &rootfs, b).await {
                                            unmount(&e);
                                            count_restore(&engine, false);
                                            return Err(Error::FailedPrecondition(format!(
                                                "cannot restore {}: {e}",
                                                p.id
                                            )));
                                        }
                                        expect_rw = Some(b.rw.clone());
                                    }
                                    None => log::warn!(
                                        "create {}: its signature names no rootfs (the shim \
                                         that dumped it could not tell its image and rw \
                                         layer): the processes are restored on the rootfs \
                                         containerd made",
                                        p.id
                                    ),
                                }
                            }
                            trust::Decision::KernelCheckOnly { why } => log::warn!(
                                "create {}: {why}: restoring it on the kernel check alone \
                                 ([restore] unsigned_images = \"kernel-check\")",
                                p.id
                            ),
                            trust::Decision::StartFresh { why } => {
                                log::warn!(
                                    "create {}: {why}: starting the container without its \
                                     processes ([restore] unsigned_images = \"start-fresh\")",
                                    p.id
                                );
                                start_fresh = true;
                            }
                        }
                        None
                    }
                    Ok(Err(e)) => {
                        unmount(&e);
                        count_restore(&engine, false);
                        return Err(Error::FailedPrecondition(format!(
                            "cannot restore {}: {e}",
                            p.id
                        )));
                    }
                    Err(e) => {
                        unmount(&e);
                        return Err(Error::Task(e));
                    }
                }
            }
        };
        // The tracked volumes the checkpoint holds come back into their host directories.
        if let Some(t) = taken.as_ref().filter(|t| !t.meta.volumes.is_empty()) {
            let volumes =
                crate::sandbox::tracked_volumes(&spec, &config.checkpoint.tracked_volumes);
            let (held, root, id) = (t.meta.volumes.clone(), rootfs.path.clone(), p.id.clone());
            let limits = crate::restore::volumes::VolumeLimits::from_config(&config.limits);
            let restored = tokio::task::spawn_blocking(move || {
                for (at, dir) in volumes.iter().filter(|(at, _)| held.contains(at)) {
                    let c = crate::restore::volumes::restore_volume(at, &root, dir, limits)?;
                    log::info!(
                        "container {id}: volume {} restored into {} ({} files, {} bytes{})",
                        at.display(),
                        dir.display(),
                        c.files,
                        c.bytes,
                        match c.skipped {
                            0 => String::new(),
                            n => format!(", {n} devices/FIFOs/sockets left out"),
                        }
                    );
                }
                Ok::<_, crate::restore::volumes::VolumeRestoreError>(())
            })
            .await;
            let failed = match restored {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(Error::FailedPrecondition(format!(
                    "cannot start {} from its checkpoint: {e}",
                    p.id
                ))),
                Err(e) => Some(Error::Task(e)),
            };
            if let Some(e) = failed {
                unmount(&e);
                count_restore(&engine, false);
                return Err(e);
            }
        }
        // A checkpoint image's crab annotations (its source container's turn boundary,
        // checkpoint policy, probe commands) hold unless this spec sets its own: a restored
        // sandbox goes on checkpointing as it did.
        let (exec_boundary, probes) = match &taken {
            Some(t) if !t.meta.annotations.is_empty() => {
                let mut spec = spec.clone();
                match turns::inherit(&mut spec, &t.meta.annotations) {
                    lent if lent.is_empty() => (exec_boundary, probes),
                    lent => {
                        log::info!(
                            "create {}: keeps its checkpoint image's {} (its spec sets none)",
                            p.id,
                            lent.join(", ")
                        );
                        turn_settings(&spec, &config).inspect_err(|e| unmount(e))?
                    }
                }
            }
            _ => (exec_boundary, probes),
        };
        let restore_image = match (&taken, p.checkpoint.is_empty()) {
            (_, false) if start_fresh => None,
            (_, false) => Some(PathBuf::from(&p.checkpoint)),
            (Some(t), true) => t.criu_dir.clone(),
            (None, true) => None,
        };
        // CRIU (4.2, through runc 1.3) cannot restore a process tree into a user namespace the
        // container joins (a Kubernetes pod with `hostUsers: false`): it makes a user namespace
        // of its own for the tree, which then may not enter the pod's network namespace
        // (`Can't setns .../net: Operation not permitted`). Refused here, before anything runs,
        // with what works instead; the image's files restore (a filesystem checkpoint).
        if restore_image.is_some() && bundle::joins_user_namespace(&spec) {
            let e = Error::FailedPrecondition(format!(
                "cannot restore the processes of {} into the user namespace it joins (a pod \
                 with hostUsers: false): CRIU cannot restore a process tree into an existing \
                 user namespace. Restore this checkpoint into a pod without a user namespace, or \
                 take filesystem-only checkpoints in such pods (io.crab/checkpoint-policy: \
                 fs-every-turn), \
                 whose images restore there",
                p.id
            ));
            unmount(&e);
            return Err(e);
        }
        let init = Arc::new(Process::new(String::new(), p.stdio.clone(), None));
        let sandbox = Sandbox::new(
            &p.id,
            &self.namespace,
            &config.store.state_dir,
            exec_boundary,
            match (checkpointing, &restore_image) {
                (false, _) => NotInspected::Disabled,
                (true, Some(_)) => NotInspected::UntilStart,
                (true, None) => NotInspected::Starting,
            },
        );
        let mut pending_restore = None;
        let pid = match restore_image {
            Some(image) => {
                // `docker run IMAGE CMD`, a pod's `command`: with a process image they are not
                // what runs, and the log says so (docs/docker-and-harnesses.md).
                log::info!(
                    "create {}: restores the checkpointed processes at Start; the spec's command \
                     ({:?}) does not run",
                    p.id,
                    spec.process()
                        .as_ref()
                        .and_then(|p| p.args().clone())
                        .unwrap_or_default()
                        .join(" ")
                );
                // Restored at Start, as containerd's runc shim does: Create leaves it created.
                pending_restore = Some(PendingRestore {
                    image,
                    taken,
                    config: config.clone(),
                    rootfs: rootfs.clone(),
                    stdio: p.stdio.clone(),
                    checkpointing,
                    expect_rw,
                });
                0
            }
            None => {
                let (pid, io) = match self.create_init(&p, &runc).await {
                    Ok(v) => v,
                    Err(e) => {
                        if let Err(d) = runc.delete(&p.id, true).await {
                            log::warn!("cleanup after failed create of {}: {d}", p.id);
                        }
                        unmount(&e);
                        if taken.is_some() {
                            count_restore(&engine, false);
                        }
                        return Err(e);
                    }
                };
                // A checkpoint without a process image is restored once its files are there.
                if taken.is_some() {
                    count_restore(&engine, true);
                }
                if checkpointing {
                    let origin = match taken {
                        Some(t) => Origin::Checkpoint(t),
                        None => Origin::Image,
                    };
                    match sandbox
                        .start_checkpointing(&p.bundle, &rootfs, &config, &runc, pid, origin)
                        .await
                    {
                        Ok(_) => {}
                        Err(e) => {
                            let _ = runc.delete(&p.id, true).await;
                            unmount(&e);
                            return Err(e);
                        }
                    }
                }
                init.set_pid(pid);
                init.set_io(io).await;
                pid
            }
        };
        let container = Arc::new(Container {
            id: p.id.clone(),
            bundle: p.bundle.clone(),
            runc,
            signing_key: config.signing_key_path(),
            kill_all_on_exit: bundle::must_kill_all_on_exit(&spec),
            rootfs_mounted,
            rootfs: rootfs.clone(),
            init,
            execs: Mutex::new(HashMap::new()),
            annotations: Mutex::new(HashMap::new()),
            init_exit_pending: Mutex::new(None),
            lifecycle: tokio::sync::Mutex::new(()),
            _oom: Mutex::new(None),
            sandbox,
            probes,
            pending_restore: Mutex::new(pending_restore),
            restore_dir: Mutex::new(restore_dir),
        });
        self.map
            .lock()
            .unwrap()
            .insert(p.id.clone(), container.clone());
        if pid != 0 {
            self.pids
                .lock()
                .unwrap()
                .owners
                .insert(pid, (p.id.clone(), String::new()));
            self.watch_oom(&container, pid);
        }
        self.events
            .publish(TaskEvent::Create {
                container_id: p.id.clone(),
                bundle: p.bundle.clone(),
                rootfs: p.rootfs.clone(),
                stdio: p.stdio.clone(),
                checkpoint: p.checkpoint.clone(),
                pid,
            })
            .await;
        Ok(pid)
    }

    async fn create_init(
        &self,
        p: &CreateParams,
        runc: &Runc,
    ) -> Result<(u32, crate::stdio::ProcessIo)> {
        bundle::save_runc(&p.bundle, runc)?;
        let mut prepared = PreparedIo::new(&p.stdio, &p.id, &self.namespace, runc.io_owner).await?;
        let pid_file = bundle::init_pid_file(&p.bundle);
        let child = std::mem::replace(&mut prepared.child, crate::runc::ChildStdio::null());
        let console = prepared.console.as_ref().map(|c| c.path.clone());
        runc.create(&p.id, &p.bundle, &pid_file, console.as_deref(), child)
            .await?;
        let io = prepared.start().await?;
        Ok((bundle::read_pid(&pid_file)?, io))
    }

    fn watch_oom(&self, container: &Arc<Container>, pid: u32) {
        let (events, id) = (self.events.clone(), container.id.clone());
        let on_oom = move || {
            log::warn!("container {id}: OOM kill");
            events.send(TaskEvent::Oom {
                container_id: id.clone(),
            });
        };
        match oom::watch(pid as i32, on_oom) {
            Ok(w) => *container._oom.lock().unwrap() = Some(w),
            Err(e) => log::warn!("container {}: no OOM notifications: {e}", container.id),
        }
    }

    pub async fn start(&self, id: &str, exec_id: &str) -> Result<u32> {
        let c = self.get(id)?;
        // A probe (the kubelet's liveness check) must not wait behind a long checkpoint.
        let probe = !exec_id.is_empty() && c.process(exec_id)?.probe;
        if !probe {
            c.sandbox
                .gate(match exec_id.is_empty() {
                    true => Action::Start,
                    false => Action::ExecStart,
                })
                .await?;
        }
        if !exec_id.is_empty() && !probe {
            // Not before the base mark that Start left running in the background (nor while a
            // checkpoint job uses the inspection). A probe's effects are no turn's: it goes on.
            c.sandbox.settled().await;
        }
        if exec_id.is_empty() {
            let _guard = c.lifecycle.lock().await;
            let _starting = c.init.start_lock.lock().await;
            c.init.transition(&[Status::Created], Status::Created)?;
            let pending = c.pending_restore.lock().unwrap().take();
            let early_exit = match pending {
                Some(r) => {
                    let engine = r.config.engine.clone();
                    let restored = self.restore_init(&c, r).await;
                    count_restore(&engine, restored.is_ok());
                    restored?
                }
                None => {
                    c.runc.start(id).await?;
                    None
                }
            };
            c.init.transition(&[Status::Created], Status::Running)?;
            let pid = c.init.pid();
            // The base every turn is compared with, taken after `runc init` has become the
            // container's own program and its start-up has settled. Start does not wait for it
            // (tens of ms, pod start time under Kubernetes): it holds the inspection, and execs
            // wait for that (`gate`), so none can change the container before the base is taken.
            c.sandbox.mark_base_in_background(pid).await;
            self.events
                .publish(TaskEvent::Start {
                    container_id: id.into(),
                    pid,
                })
                .await;
            if let Some(code) = early_exit {
                let this_init = c.init.clone();
                drop(_starting);
                drop(_guard);
                self.handle_exit(c, this_init, code).await;
            }
            return Ok(pid);
        }
        let p = c.process(exec_id)?;
        if !matches!(c.init.status(), Status::Running) {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is not running"
            )));
        }
        let starting = p.start_lock.lock().await;
        p.transition(&[Status::Created], Status::Running)?;
        self.pids.lock().unwrap().begin_start();
        let started = self.start_exec(&c, &p).await;
        let early_exit = self.pids.lock().unwrap().finish_start(
            started.as_ref().ok().copied(),
            (id.to_string(), exec_id.to_string()),
        );
        let pid = match started {
            Ok(pid) => pid,
            Err(e) => {
                // The exec never ran: it is stopped, with runc's error as its story.
                if let Some(info) = p.record_exit(255) {
                    p.announce_exit(info);
                }
                return Err(e);
            }
        };
        self.events
            .publish(TaskEvent::ExecStarted {
                container_id: id.into(),
                exec_id: exec_id.into(),
                pid,
            })
            .await;
        drop(starting);
        if let Some(code) = early_exit {
            self.handle_exit(c, p, code).await;
        }
        Ok(pid)
    }

    /// Start of a container created from a process image: `runc restore` brings its processes
    /// back; then checkpointing begins, its lineage starting at the restored checkpoint.
    /// Returns the init's exit status if it already exited (and was reaped) meanwhile.
    async fn restore_init(&self, c: &Arc<Container>, r: PendingRestore) -> Result<Option<i32>> {
        let started = std::time::Instant::now();
        if let Some(want) = &r.expect_rw {
            if let Err(e) = Self::check_rw(&c.id, &r.rootfs, want).await {
                if let Some(info) = c.init.record_exit(255) {
                    c.init.announce_exit(info);
                }
                return Err(Error::FailedPrecondition(format!(
                    "cannot restore {}: {e}",
                    c.id
                )));
            }
        }
        let pid_file = bundle::init_pid_file(&c.bundle);
        let mut prepared =
            PreparedIo::new(&r.stdio, &c.id, &self.namespace, c.runc.io_owner).await?;
        let child = std::mem::replace(&mut prepared.child, crate::runc::ChildStdio::null());
        let work = c.bundle.join("criu-restore-work");
        let mut daemon = self.lazy_pages_daemon(c, &r, &work).await;
        let opts = crate::runc::CheckpointOpts {
            image_path: r.image.clone(),
            work_path: Some(work.clone()),
            tcp_established: true,
            ext_unix_sk: true,
            file_locks: true,
            lazy_pages: daemon.is_some(),
            ..Default::default()
        };
        if bundle::read_spec(&c.bundle).is_ok_and(|spec| bundle::creates_network_namespace(&spec)) {
            // Connections over 127.0.0.1 need `lo` up before CRIU puts them back.
            // An upgraded (replaced) shim binary is `... (deleted)`: runc could not run it,
            // and a hook that cannot run fails the restore.
            let added = std::env::current_exe()
                .map_err(|e| Error::Other(format!("the shim's own path: {e}")))
                .and_then(|exe| {
                    if exe.is_file() {
                        bundle::add_loopback_hook(&c.bundle, &exe)
                    } else {
                        Err(Error::Other(format!("{} is gone", exe.display())))
                    }
                });
            if let Err(e) = added {
                log::warn!("container {}: no loopback hook for the restore ({e}): TCP connections over 127.0.0.1 cannot come back", c.id);
            }
        }
        // Every restore goes through CRIU's gate ([`restore_gate`]): at post-restore the
        // restored processes wait for the verdict on the image's page files (their digests
        // may still be being checked), at pre-resume for the kernel check ([`kernel`]), which
        // compares what CRIU restored with this container's spec. No gate, no restore.
        let spec = bundle::read_spec(&c.bundle)?;
        // runc's seccomp program for this spec (learnt once per profile and runc binary).
        let cache = r.config.store.state_dir.join(SECCOMP_CACHE_DIR);
        let seccomp_reference =
            match crate::restore::seccomp::reference(&spec, &c.runc, &cache).await {
                Ok(reference) => reference,
                Err(e) => {
                    drop(daemon);
                    if let Some(info) = c.init.record_exit(255) {
                        c.init.announce_exit(info);
                    }
                    return Err(Error::FailedPrecondition(format!(
                        "cannot restore {}: {e}: the kernel check could not compare the restored \
                     seccomp filters",
                        c.id
                    )));
                }
            };
        if let crate::restore::seccomp::Reference::NotCompared(why) = &seccomp_reference {
            log::warn!(
                "container {}: the restored seccomp filters are not compared: {why}",
                c.id
            );
        }
        let verification = r.taken.as_ref().and_then(|t| t.verification.clone());
        let early = verification.as_ref().and_then(|v| v.verdict());
        let gate = match restore_gate::Gate::install(&c.bundle, spec.annotations().as_ref()) {
            Ok(g) => g,
            Err(e) => {
                drop(daemon);
                if let Some(info) = c.init.record_exit(255) {
                    c.init.announce_exit(info);
                }
                return Err(Error::FailedPrecondition(format!(
                    "cannot restore {}: {e}: without the restore gate the restored processes \
                     cannot be checked before they run",
                    c.id
                )));
            }
        };
        // The gate's two verdicts: the page files' (post-restore) and the kernel check's
        // (pre-resume). Without their handles there is no restore.
        let (opener, (resume, cancel_resume)) =
            match gate.opener().and_then(|o| Ok((o, gate.resume()?))) {
                Ok(handles) => handles,
                Err(e) => {
                    drop(daemon);
                    gate.finish();
                    if let Some(info) = c.init.record_exit(255) {
                        c.init.announce_exit(info);
                    }
                    return Err(Error::FailedPrecondition(format!(
                        "cannot restore {}: {e}",
                        c.id
                    )));
                }
            };
        let mut verdict_task = None;
        match (verification.clone(), &early) {
            (Some(v), None) => {
                verdict_task = Some(tokio::task::spawn_blocking(move || {
                    let d = v.wait();
                    if let Err(e) = opener.open(d.result.is_ok()) {
                        log::warn!("restore gate: giving the verdict: {e}");
                    }
                    d
                }));
            }
            // Nothing (left) to verify: post-restore passes at once (a verdict already found
            // against the image never lets CRIU start, below).
            _ => {
                if let Err(e) = opener.open(early.as_ref().is_none_or(|d| d.result.is_ok())) {
                    log::warn!("restore gate: giving the verdict: {e}");
                }
            }
        }
        // The check's task iterator loads while CRIU restores (the check waits for it).
        tokio::task::spawn_blocking(|| {
            if let Err(e) = crate::restore::seccomp::preload() {
                log::warn!("loading the kernel check's task iterator: {e}");
            }
        });
        let mut expected = kernel::Expected::from_spec(&spec);
        expected.seccomp = seccomp_reference;
        let kernel_task = tokio::task::spawn_blocking(move || {
            resume.wait(|script, init| kernel::check_restored(&expected, script, init))
        });
        let mut gate = Some(gate);
        let refused_early = early.as_ref().and_then(|d| d.result.clone().err());
        self.pids.lock().unwrap().begin_start();
        let bound = Duration::from_millis(r.config.checkpoint.restore_timeout_ms);
        let console = prepared.console.as_ref().map(|c| c.path.clone());
        let restore = async {
            match refused_early {
                Some(why) => Err(Error::FailedPrecondition(why)),
                None => c
                    .runc
                    .restore(
                        &c.id,
                        &c.bundle,
                        &pid_file,
                        &opts,
                        console.as_deref(),
                        child,
                    )
                    .await
                    .map_err(Error::from),
            }
        };
        tokio::pin!(restore);
        // Raced against a lazy-pages daemon that fails first: the restore would wait for it
        // (CRIU reports the end of the restore to it) until the bound, and what it restored
        // could not get its pages.
        let raced = async {
            loop {
                let daemon_ended = async {
                    match daemon.as_mut() {
                        Some((d, _)) if !d.has_exited() => d.wait_exit().await,
                        _ => std::future::pending().await,
                    }
                };
                tokio::select! {
                    r = &mut restore => break Ok(r),
                    code = daemon_ended => if code != 0 {
                        break Err(code);
                    },
                }
            }
        };
        // A restore that overran its bound, or whose page daemon failed, is abandoned: CRIU
        // and what it restored so far live in the container's cgroup by now; killing them
        // makes runc fail (and return) on its own.
        let outcome = match tokio::time::timeout(bound, raced).await {
            Ok(Ok(result)) => Ok(result),
            Ok(Err(code)) => {
                let why = daemon
                    .as_ref()
                    .map(|(d, _)| d.failure(code))
                    .unwrap_or_default();
                Err((
                    format!("{why} before the restore ended"),
                    Error::FailedPrecondition(format!(
                        "the lazy restore's page daemon failed: {why}"
                    )),
                ))
            }
            Err(_) => Err((
                format!("took longer than {bound:?}"),
                Error::TimedOut(format!("the restore took longer than {bound:?} ([checkpoint] restore_timeout_ms) and was abandoned")),
            )),
        };
        // Abandoned (its page daemon failed, or it overran its bound): that is why it failed,
        // whatever the kernel check then read of a tree being torn down.
        let abandoned = outcome.is_err();
        let restored = match outcome {
            Ok(result) => result,
            Err((what, err)) => {
                let killed = kill_cgroup_members(&bundle::read_spec(&c.bundle)?, &c.id);
                log::error!("restore of {}: {what}: killed {killed} processes", c.id);
                let _ = tokio::time::timeout(Duration::from_secs(10), &mut restore).await;
                // A killed CRIU leaves its cgroup yard mounted in the work directory.
                unmount_all_under(&work);
                Err(err)
            }
        };
        // The kernel check: CRIU waited at pre-resume while it ran, or never got there (the
        // cancel then wakes its thread).
        cancel_resume.cancel();
        let checked = kernel_task
            .await
            .unwrap_or_else(|e| restore_gate::Resumed::NotReached(e.to_string()));
        let restored = match (restored, checked) {
            (Ok(()), restore_gate::Resumed::Checked(Ok(passed))) => {
                log::info!(
                    "container {}: kernel check passed in {:.2} ms ({} processes, {} threads, \
                     {} mounts compared with the spec; runc's seccomp program found in {} \
                     threads) while CRIU held them at pre-resume",
                    c.id,
                    passed.took.as_secs_f64() * 1e3,
                    passed.processes,
                    passed.threads,
                    passed.mounts,
                    passed.seccomp_matched
                );
                Ok(())
            }
            (r, restore_gate::Resumed::Checked(Err(why))) => {
                // Killed at the gate already (the tree, then CRIU); whatever is left of the
                // container's processes goes too.
                kill_cgroup_members(&spec, &c.id);
                // A killed CRIU leaves its cgroup yard mounted in the work directory.
                unmount_all_under(&work);
                match r {
                    Err(e) if abandoned => {
                        log::error!(
                            "restore of {}: {e} (the kernel check, on what was left: {why})",
                            c.id
                        );
                        Err(e)
                    }
                    _ => {
                        log::error!("restore of {} refused by the kernel check: {why}", c.id);
                        Err(Error::FailedPrecondition(why))
                    }
                }
            }
            (Ok(()), restore_gate::Resumed::NotReached(why)) => {
                let killed = kill_cgroup_members(&spec, &c.id);
                log::error!(
                    "restore of {}: CRIU resumed the restored processes without the kernel \
                     check ({why}): killed {killed} processes",
                    c.id
                );
                Err(Error::FailedPrecondition(format!(
                    "CRIU resumed the restored processes without the kernel check ({why}): \
                     killed them"
                )))
            }
            (Err(e), _) => Err(e),
        };
        // The verdict on the page files: waited for when the processes run (nothing may run
        // that was not signed), else taken if it is there (it may say why CRIU failed).
        let gated = verdict_task.is_some();
        let verdict = match verdict_task {
            Some(task) if restored.is_ok() => task.await.ok(),
            Some(task) => {
                task.abort();
                verification.as_ref().and_then(|v| v.verdict())
            }
            None => early,
        };
        let reached = gate.as_ref().and_then(|g| g.reached());
        if let Some(g) = gate.take() {
            g.finish();
        }
        let restored =
            match (restored, verdict.as_ref()) {
                (
                    r,
                    Some(Verdict {
                        result: Err(why), ..
                    }),
                ) => {
                    if r.is_ok() {
                        // CRIU let them run without the gate's word: they must not go on.
                        let killed = kill_cgroup_members(&bundle::read_spec(&c.bundle)?, &c.id);
                        log::error!(
                        "restore of {}: {why}, but its processes were resumed (the restore gate \
                         was {}): killed {killed} processes",
                        c.id,
                        if reached.is_some() { "ignored" } else { "not run" }
                    );
                    }
                    Err(Error::FailedPrecondition(why.clone()))
                }
                (Ok(()), Some(d)) => {
                    let waited = reached
                        .and_then(|at| d.at.duration_since(at).ok())
                        .unwrap_or_default();
                    let how = match (gated, reached) {
                        (false, _) => "before the restore began".to_string(),
                        (true, Some(_)) => format!(
                        "while CRIU restored; CRIU waited {:.1} ms for them at its post-restore \
                         gate",
                        waited.as_secs_f64() * 1e3
                    ),
                        // The processes ran before the verdict, which found nothing wrong.
                        (true, None) => {
                            log::warn!(
                                "container {}: CRIU did not run the restore gate: its processes \
                             were resumed before their page files were verified",
                                c.id
                            );
                            "while CRIU restored, without the gate".to_string()
                        }
                    };
                    log::info!(
                    "checkpoint image of {}: its page files ({} bytes) verified in {:.1} ms {how}",
                    c.id,
                    verification.as_ref().map_or(0, |v| v.bytes()),
                    d.took.as_secs_f64() * 1e3,
                );
                    Ok(())
                }
                (r, _) => r,
            };
        let pid = restored.and_then(|()| bundle::read_pid(&pid_file));
        let early_exit = self
            .pids
            .lock()
            .unwrap()
            .finish_start(pid.as_ref().ok().copied(), (c.id.clone(), String::new()));
        let pid = match pid {
            Ok(pid) => pid,
            Err(e) => {
                drop(daemon);
                if let Err(d) = c.runc.delete(&c.id, true).await {
                    log::debug!("cleanup after failed restore of {}: {d}", c.id);
                }
                let criu = crate::checkpoint::process::criu_errors(&work.join("restore.log"))
                    .map(|l| format!("; CRIU: {}", l.join(" | ")))
                    .unwrap_or_default();
                if let Some(info) = c.init.record_exit(255) {
                    c.init.announce_exit(info);
                }
                return Err(Error::FailedPrecondition(format!(
                    "cannot restore {} from its checkpoint: {e}{criu} (log: {})",
                    c.id,
                    work.join("restore.log").display()
                )));
            }
        };
        // A lazy restore's daemon is still handing pages over: checkpoints and the inspection
        // must know until it is done, and it is watched from now on, before anything below can
        // fail (a daemon dropped here would leave the processes running with pages missing).
        // The image it reads goes after it, if this restore is the one to remove it.
        let lazily = daemon.is_some();
        let (remove_image_tx, remove_image_rx) = tokio::sync::oneshot::channel::<PathBuf>();
        match daemon.take() {
            Some((daemon, spec)) => {
                let transfer = lazy::Transfer::in_flight();
                c.sandbox.restored_lazily(transfer.clone());
                let (id, bound) = (c.id.clone(), r.config.checkpoint.restore_timeout_ms);
                let restored_at = std::time::Instant::now();
                tokio::spawn(async move {
                    let kill = |why: &str| match kill_cgroup_members(&spec, &id) {
                        // Its processes were gone already (killed, or the container deleted
                        // during the transfer): the daemon had nothing left to serve.
                        0 => log::info!(
                            "container {id}: its processes ended before their lazy restore \
                             had handed every page over ({why})"
                        ),
                        killed => log::error!(
                            "container {id}: its memory did not all arrive ({why}): killed its \
                             {killed} processes rather than let them run with pages missing"
                        ),
                    };
                    let work =
                        lazy::watch(daemon, transfer.clone(), Duration::from_millis(bound), kill)
                            .await;
                    if transfer.state() == lazy::State::Done {
                        log::info!(
                            "container {}: every page of its lazy restore arrived {:?} after the \
                             restore",
                            id,
                            restored_at.elapsed()
                        );
                    }
                    let _ = std::fs::remove_dir_all(work);
                    // Sent once Start knows whether the image is its to remove; never sent
                    // when Start failed after the restore (the image goes with the bundle).
                    if let Ok(image) = remove_image_rx.await {
                        let _ = std::fs::remove_dir_all(image);
                    }
                });
            }
            None => {
                let _ = std::fs::remove_dir_all(&work);
            }
        }
        if bundle::read_spec(&c.bundle).is_ok_and(|spec| bundle::creates_network_namespace(&spec)) {
            if let Err(e) = crate::sys::netns::bring_up_loopback(pid) {
                log::warn!(
                    "container {}: restored, but its loopback interface is down: {e}",
                    c.id
                );
            }
        }
        let io = prepared.start().await?;
        c.init.set_pid(pid);
        c.init.set_io(io).await;
        self.watch_oom(c, pid);
        log::info!(
            "container {} restored from {} in {:?} (init pid {pid}{})",
            c.id,
            r.image.display(),
            started.elapsed(),
            match lazily {
                true => ", memory arriving lazily",
                false => "",
            }
        );
        // The restored-from image under the bundle goes once it is no longer needed: at once, or
        // after the origin has imported it (start_checkpointing).
        let mut image_imported = false;
        if r.checkpointing {
            // The threads' rseq areas, which the image records and CRIU registered again:
            // read back from the image that was just restored (a few small files).
            let image = r.image.clone();
            match tokio::task::spawn_blocking(move || {
                crate::checkpoint::criu_image::read_facts(&image)
            })
            .await
            {
                Ok(Ok(facts)) => c.sandbox.restored_rseq(
                    facts
                        .threads
                        .iter()
                        .filter_map(|t| Some((t.tid, t.rseq?)))
                        .collect(),
                ),
                Ok(Err(e)) => log::warn!("container {}: rseq areas of its image: {e}", c.id),
                Err(e) => log::warn!("container {}: rseq areas of its image: {e}", c.id),
            }
            let origin = match r.taken {
                Some(t) => Origin::Checkpoint(t),
                None => Origin::Image,
            };
            let ours =
                matches!(&origin, Origin::Checkpoint(t) if t.criu_dir.as_ref() == Some(&r.image));
            match c
                .sandbox
                .start_checkpointing(&c.bundle, &r.rootfs, &r.config, &c.runc, pid, origin)
                .await
            {
                Ok(import) => {
                    image_imported = ours && import == OriginImport::Background;
                }
                Err(e) => log::error!(
                    "container {} runs restored but without checkpoints: {e}",
                    c.id
                ),
            }
        }
        if !image_imported && r.image.starts_with(&c.bundle) {
            match lazily {
                // The daemon may still read it.
                true => {
                    let _ = remove_image_tx.send(r.image);
                }
                false => {
                    let _ = std::fs::remove_dir_all(&r.image);
                }
            }
        }
        Ok(early_exit)
    }

    /// A `criu lazy-pages` daemon for the restore of `r`, listening in `work`, when
    /// `[restore] lazy_pages_min_mib` asks for one at the image's size, with the bundle's spec
    /// (what a failed page transfer kills the container by); `None` restores eagerly (also
    /// when the daemon cannot start: that costs time, not correctness).
    async fn lazy_pages_daemon(
        &self,
        c: &Container,
        r: &PendingRestore,
        work: &Path,
    ) -> Option<(lazy::Daemon, oci_spec::runtime::Spec)> {
        let min = r.config.restore.lazy_pages_min_mib;
        if min == 0 {
            return None;
        }
        let spec = bundle::read_spec(&c.bundle).ok()?;
        let image = r.image.clone();
        let bytes = tokio::task::spawn_blocking(move || lazy::page_bytes(&image))
            .await
            .unwrap_or(0);
        if bytes < min.saturating_mul(1 << 20) {
            return None;
        }
        let criu = crate::checkpoint::criu_rpc::criu_binary(&r.config);
        match lazy::Daemon::start(&criu, &r.image, work).await {
            Ok(d) => Some((d, spec)),
            Err(e) => {
                log::warn!(
                    "container {}: restoring {} MiB of memory eagerly: {e}",
                    c.id,
                    bytes >> 20
                );
                None
            }
        }
    }

    async fn start_exec(&self, c: &Container, p: &Process) -> Result<u32> {
        let spec_file = c.bundle.join(format!("exec-{}.json", p.exec_id));
        let pid_file = c.bundle.join(format!("exec-{}.pid", p.exec_id));
        std::fs::write(&spec_file, p.exec_spec.as_deref().unwrap_or_default())
            .map_err(Error::io(format!("cannot write {}", spec_file.display())))?;
        let mut prepared =
            PreparedIo::new(&p.stdio, &p.exec_id, &self.namespace, c.runc.io_owner).await?;
        prepared.null_from_container(c.init.pid());
        let child = std::mem::replace(&mut prepared.child, crate::runc::ChildStdio::null());
        let console = prepared.console.as_ref().map(|c| c.path.clone());
        let result = c
            .runc
            .exec(&c.id, &spec_file, &pid_file, console.as_deref(), child)
            .await;
        let _ = std::fs::remove_file(&spec_file);
        result?;
        let io = prepared.start().await?;
        let pid = bundle::read_pid(&pid_file)?;
        let _ = std::fs::remove_file(&pid_file);
        p.set_pid(pid);
        p.set_io(io).await;
        Ok(pid)
    }

    pub async fn add_exec(
        &self,
        id: &str,
        exec_id: &str,
        stdio: StdioSpec,
        spec: Vec<u8>,
    ) -> Result<()> {
        let c = self.get(id)?;
        if exec_id.is_empty() {
            return Err(Error::InvalidArgument("exec id must not be empty".into()));
        }
        if matches!(c.init.status(), Status::Stopped) {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is stopped"
            )));
        }
        let process = serde_json::from_slice::<oci_spec::runtime::Process>(&spec)
            .map_err(|e| Error::InvalidArgument(format!("exec {exec_id} process spec: {e}")))?;
        let probe = turns::is_probe(&c.probes, process.args().as_deref().unwrap_or_default());
        if probe {
            log::debug!("exec {exec_id} of {id} is a probe: it neither waits for nor ends turns");
        }
        {
            let mut execs = c.execs.lock().unwrap();
            if execs.contains_key(exec_id) {
                return Err(Error::AlreadyExists(format!(
                    "exec {exec_id} in container {id}"
                )));
            }
            let mut process = Process::new(exec_id.into(), stdio, Some(spec));
            process.probe = probe;
            execs.insert(exec_id.to_string(), Arc::new(process));
        }
        self.events
            .publish(TaskEvent::ExecAdded {
                container_id: id.into(),
                exec_id: exec_id.into(),
            })
            .await;
        Ok(())
    }

    fn on_exit(self: &Arc<Self>, pid: u32, code: i32) {
        let owner = self.pids.lock().unwrap().exited(pid, code);
        let Some((cid, exec_id)) = owner else { return };
        let Ok(c) = self.get(&cid) else { return };
        let Ok(p) = c.process(&exec_id) else { return };
        let this = self.clone();
        // Exits are handled off the reaper loop: draining output may take a moment.
        tokio::spawn(async move { this.handle_exit(c, p, code).await });
    }

    async fn handle_exit(&self, c: Arc<Container>, p: Arc<Process>, code: i32) {
        drop(p.start_lock.lock().await);
        p.drain_output(OUTPUT_DRAIN_BOUND).await;
        let Some(info) = p.record_exit(code as u32) else {
            return;
        };
        log::debug!(
            "container {} process {} (pid {}) exited with {}",
            c.id,
            p.display_id(),
            info.pid,
            info.status
        );
        if p.exec_id.is_empty() {
            if c.kill_all_on_exit {
                if let Err(e) = c.runc.kill(&c.id, libc::SIGKILL as u32, true).await {
                    log::debug!("kill --all after init exit of {}: {e}", c.id);
                }
            }
            if c.running_execs() > 0 {
                *c.init_exit_pending.lock().unwrap() = Some(info);
                return;
            }
            self.publish_exit(&c, &p, info).await;
        } else {
            // In exec-boundary mode the turn ends before the exit is published: the client can
            // start its next action only after the answer exists (and that action then waits
            // for the checkpoint).
            if !p.probe && c.sandbox.ends_turns_at_exec_exit() && c.running_execs() == 0 {
                let turn_id = format!("exec-{}", p.exec_id);
                if let Err(e) = c.sandbox.end_turn(&turn_id, || c.running_exec_pids()).await {
                    log::error!("turn end after exec {} of {}: {e}", p.exec_id, c.id);
                }
            }
            self.publish_exit(&c, &p, info).await;
            if c.running_execs() == 0 {
                let pending = c.init_exit_pending.lock().unwrap().take();
                if let Some(init_info) = pending {
                    self.publish_exit(&c, &c.init, init_info).await;
                }
            }
        }
    }

    async fn publish_exit(&self, c: &Container, p: &Process, info: ExitInfo) {
        let id = if p.exec_id.is_empty() {
            c.id.clone()
        } else {
            p.exec_id.clone()
        };
        self.events
            .publish(TaskEvent::Exit {
                container_id: c.id.clone(),
                id,
                pid: info.pid,
                exit_status: info.status,
                exited_at: info.at,
            })
            .await;
        p.announce_exit(info);
    }

    pub fn state(&self, id: &str, exec_id: &str) -> Result<ProcessState> {
        let c = self.get(id)?;
        let p = c.process(exec_id)?;
        let snapshot = p.snapshot();
        Ok(ProcessState {
            container_id: c.id.clone(),
            bundle: c.bundle.clone(),
            exec_id: exec_id.into(),
            stdio: p.stdio.clone(),
            snapshot,
        })
    }

    pub async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitInfo> {
        let p = self.get(id)?.process(exec_id)?;
        Ok(p.wait().await)
    }

    pub async fn kill(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let c = self.get(id)?;
        let p = c.process(exec_id)?;
        // A signal changes the sandbox too, but stopping a container must always work: after
        // the bound the kill goes ahead (said in the log). Not for a probe, nor for an exec that
        // already ended (the CRI kills every ExecSync process as it cleans up): that signal
        // changes nothing.
        let ended_exec = !exec_id.is_empty() && p.snapshot().status == Status::Stopped;
        if !p.probe && !ended_exec {
            if let Err(e) = c.sandbox.gate(Action::Kill).await {
                log::warn!("{e}; killing anyway");
            }
        }
        let snap = p.snapshot();
        if exec_id.is_empty() {
            if snap.exit.is_some() && !all {
                return Err(Error::NotFound("process already finished".into()));
            }
            return c.runc.kill(id, signal, all).await.map_err(gone_or);
        }
        match snap.status {
            Status::Created => Err(Error::FailedPrecondition(format!(
                "exec {exec_id} is not started"
            ))),
            Status::Stopped => Err(Error::NotFound("process already finished".into())),
            Status::Running | Status::Paused => {
                let sig = nix::sys::signal::Signal::try_from(signal as i32)
                    .map_err(|_| Error::InvalidArgument(format!("signal {signal}")))?;
                match nix::sys::signal::kill(nix::unistd::Pid::from_raw(snap.pid as i32), sig) {
                    Err(nix::errno::Errno::ESRCH) => {
                        Err(Error::NotFound("process already finished".into()))
                    }
                    other => Ok(other?),
                }
            }
        }
    }

    pub async fn delete(&self, id: &str, exec_id: &str) -> Result<ExitInfo> {
        let c = self.get(id)?;
        if !exec_id.is_empty() {
            let p = c.process(exec_id)?;
            let snap = p.snapshot();
            if matches!(snap.status, Status::Running | Status::Paused) {
                return Err(Error::FailedPrecondition(format!(
                    "cannot delete running exec {exec_id}"
                )));
            }
            c.execs.lock().unwrap().remove(exec_id);
            p.close_io().await;
            return Ok(snap.exit.unwrap_or(ExitInfo {
                pid: snap.pid,
                status: 0,
                at: std::time::SystemTime::now(),
            }));
        }
        let _guard = c.lifecycle.lock().await;
        let snap = c.init.snapshot();
        if matches!(snap.status, Status::Running | Status::Paused) && snap.exit.is_none() {
            return Err(Error::FailedPrecondition(format!(
                "cannot delete running container {id}"
            )));
        }
        // `--force` freezes and kills whatever is left, which takes ~100 ms on a cgroup v1
        // freezer even when nothing is: only a created-but-never-started init needs it.
        let force = snap.exit.is_none();
        // A container waiting to be restored does not exist for runc yet.
        let never_created = c.pending_restore.lock().unwrap().take().is_some();
        drop(c.restore_dir.lock().unwrap().take());
        let _ = std::fs::remove_file(c.bundle.join(crate::restore::scratch::BUNDLE_RECORD));
        if !never_created {
            if let Err(e) = c.runc.delete(id, force).await {
                if force {
                    return Err(e.into());
                }
                log::info!("delete {id}: {e}; retrying with --force");
                c.runc.delete(id, true).await?;
            }
        }
        let exit = snap.exit.unwrap_or(ExitInfo {
            pid: snap.pid,
            status: 128 + libc::SIGKILL as u32,
            at: std::time::SystemTime::now(),
        });
        self.pids
            .lock()
            .unwrap()
            .owners
            .retain(|_, (cid, _)| cid != id);
        c.init.close_io().await;
        let execs: Vec<_> = c.execs.lock().unwrap().drain().map(|(_, p)| p).collect();
        for p in execs {
            p.close_io().await;
        }
        c._oom.lock().unwrap().take();
        c.sandbox.stop().await;
        if c.rootfs_mounted {
            bundle::unmount_rootfs(&c.bundle);
        }
        self.map.lock().unwrap().remove(id);
        self.events
            .publish(TaskEvent::Delete {
                container_id: id.into(),
                pid: exit.pid,
                exit_status: exit.status,
                exited_at: exit.at,
            })
            .await;
        Ok(exit)
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        let c = self.get(id)?;
        let _guard = c.lifecycle.lock().await;
        c.init.transition(&[Status::Running], Status::Running)?;
        c.runc.pause(id).await?;
        c.init.transition(&[Status::Running], Status::Paused)?;
        self.events
            .publish(TaskEvent::Paused {
                container_id: id.into(),
            })
            .await;
        Ok(())
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        let c = self.get(id)?;
        let _guard = c.lifecycle.lock().await;
        c.init.transition(&[Status::Paused], Status::Paused)?;
        c.runc.resume(id).await?;
        c.init.transition(&[Status::Paused], Status::Running)?;
        self.events
            .publish(TaskEvent::Resumed {
                container_id: id.into(),
            })
            .await;
        Ok(())
    }

    /// Pids of the container, each with its exec id when it is an exec's main process.
    pub async fn pids(&self, id: &str) -> Result<Vec<(u32, Option<String>)>> {
        let c = self.get(id)?;
        let pids = c.runc.ps(id).await?;
        let execs: HashMap<u32, String> = c
            .execs
            .lock()
            .unwrap()
            .values()
            .map(|p| (p.pid(), p.exec_id.clone()))
            .filter(|(pid, _)| *pid != 0)
            .collect();
        Ok(pids
            .into_iter()
            .map(|pid| (pid as u32, execs.get(&(pid as u32)).cloned()))
            .collect())
    }

    pub async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        let p = self.get(id)?.process(exec_id)?;
        p.with_io(|io| {
            io.close_stdin();
            Ok(())
        })
        .await
    }

    pub async fn resize_pty(&self, id: &str, exec_id: &str, width: u32, height: u32) -> Result<()> {
        let p = self.get(id)?.process(exec_id)?;
        p.with_io(|io| io.resize(width, height)).await
    }

    /// Applies new resources (JSON `LinuxResources`, if any) and keeps the annotations.
    pub async fn update(
        &self,
        id: &str,
        resources: Option<Vec<u8>>,
        annotations: HashMap<String, String>,
    ) -> Result<()> {
        let c = self.get(id)?;
        let turn_end = turns::requested_turn_end(&annotations)?;
        let with_resources = resources.as_ref().is_some_and(|r| !r.is_empty());
        if let Some(seq) = turns::requested_rollback(&annotations, with_resources)? {
            let _guard = c.lifecycle.lock().await;
            if c.init.status() != Status::Running {
                return Err(Error::FailedPrecondition(format!(
                    "in-place rollback refused: container {id} is not running ({:?})",
                    c.init.status()
                )));
            }
            c.sandbox.rollback_in_place(seq, c.init.pid()).await?;
            return Ok(());
        }
        let _guard = c.lifecycle.lock().await;
        if let Some(json) = resources.filter(|r| !r.is_empty()) {
            c.sandbox.gate(Action::Update).await?;
            serde_json::from_slice::<oci_spec::runtime::LinuxResources>(&json)
                .map_err(|e| Error::InvalidArgument(format!("resources: {e}")))?;
            let file = c.bundle.join("update-resources.json");
            std::fs::write(&file, &json)
                .map_err(Error::io(format!("cannot write {}", file.display())))?;
            let result = c.runc.update(id, &file).await;
            let _ = std::fs::remove_file(&file);
            result?;
        }
        if !annotations.is_empty() {
            log::debug!("container {id}: annotations {annotations:?}");
            c.annotations.lock().unwrap().extend(annotations);
        }
        if let Some(turn_id) = turn_end {
            c.sandbox
                .end_turn(&turn_id, || c.running_exec_pids())
                .await?;
        }
        Ok(())
    }

    /// Which image the engine unpacked container `id`'s rootfs from ([`restore::layers`]).
    async fn rootfs_image(
        &self,
        id: &str,
        rootfs: &bundle::Rootfs,
    ) -> std::result::Result<crate::restore::layers::Unpacked, String> {
        let overlay = RootfsMount::overlay(&rootfs.mounts)
            .ok_or_else(|| "its rootfs is not an overlay: its image cannot be told".to_string())?;
        crate::restore::layers::identify(
            self.snapshots.as_ref(),
            &self.namespace,
            id,
            &rootfs.path,
            rootfs.mounted_by == bundle::MountedBy::Containerd,
            Some(overlay.options.as_slice()),
        )
        .await
    }

    /// A containerd checkpoint's processes go back on the image they were dumped on.
    async fn check_image(
        &self,
        id: &str,
        rootfs: &bundle::Rootfs,
        bound: &crate::checkpoint::provenance::RootfsBinding,
    ) -> std::result::Result<(), String> {
        let t = std::time::Instant::now();
        let u = self
            .rootfs_image(id, rootfs)
            .await
            .map_err(|e| format!("its signature binds it to image {}, and {e}", bound.image))?;
        if u.top != bound.image {
            return Err(format!(
                "it was dumped on image {} and its rootfs is image {} ({}): its processes \
                 would run on other files",
                bound.image, u.top, u.source
            ));
        }
        log::info!(
            "create {id}: its rootfs is the image it was dumped on ({}, asked in {:.1} ms)",
            u.source,
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// What the rootfs's rw layer changes in its image ([`restore::rw`]).
    async fn rw_digest(
        rootfs: &bundle::Rootfs,
        limits: crate::restore::rw::RwLimits,
    ) -> std::result::Result<crate::restore::rw::RwDigest, String> {
        let options = RootfsMount::overlay(&rootfs.mounts)
            .map(|m| m.options.clone())
            .ok_or_else(|| "its rootfs is not an overlay".to_string())?;
        tokio::task::spawn_blocking(move || {
            let (upper, lowers) = crate::inspector::fs::overlay_dirs(&options)
                .ok_or_else(|| "its rootfs overlay has no upper directory".to_string())?;
            let xattrs = crate::inspector::fs::OverlayXattrs::of_mount(&options);
            crate::restore::rw::digest(&upper, &lowers, xattrs, limits)
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// A containerd checkpoint's processes go back on the rw layer they were dumped with (put
    /// back by `ctr c restore --rw` before Create, by the CRI between Create and Start).
    async fn check_rw(
        id: &str,
        rootfs: &bundle::Rootfs,
        want: &str,
    ) -> std::result::Result<(), String> {
        let t = std::time::Instant::now();
        let got = Self::rw_digest(rootfs, crate::restore::rw::RwLimits::default())
            .await
            .map_err(|e| format!("its signature binds its rw layer, and {e}"))?;
        if got.digest != want {
            return Err(format!(
                "its rootfs's rw layer is not the one it was dumped with (it changes {} paths \
                 of the image, not as the signed change does): restore it with its own rw \
                 layer (`ctr c restore --rw`; the CRI puts the checkpoint's rootfs diff back \
                 itself)",
                got.changes
            ));
        }
        log::info!(
            "container {id}: its rw layer is the one it was dumped with ({} paths, {} bytes \
             hashed in {:.1} ms)",
            got.changes,
            got.bytes,
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// The rootfs container `id` runs on, for the signature of a containerd checkpoint of it:
    /// its image's chain id and what its rw layer changes (containerd pauses the container
    /// while it checkpoints it and diffs the rw layer).
    async fn rootfs_binding(
        &self,
        c: &Container,
    ) -> std::result::Result<crate::checkpoint::provenance::RootfsBinding, String> {
        let image = self.rootfs_image(&c.id, &c.rootfs).await?.top;
        let rw = Self::rw_digest(&c.rootfs, crate::restore::rw::RwLimits::default()).await?;
        log::info!(
            "checkpoint of {}: its rw layer changes {} paths ({} bytes hashed)",
            c.id,
            rw.changes,
            rw.bytes
        );
        Ok(crate::checkpoint::provenance::RootfsBinding {
            image,
            rw: rw.digest,
        })
    }

    /// containerd's own checkpoint (`ctr task checkpoint`): a CRIU image of the whole
    /// container into `path`. Refused, before anything is dumped, when a live process would
    /// be missing from the image (an exec's main process is not in init's tree).
    pub async fn checkpoint_task(
        &self,
        id: &str,
        path: &Path,
        opts: TaskCheckpointOptions,
    ) -> Result<()> {
        let c = self.get(id)?;
        let _guard = c.lifecycle.lock().await;
        c.init
            .transition(&[Status::Running, Status::Paused], c.init.status())?;
        let init_pid = c.init.pid();
        let cgroup = crate::sys::cgroup::Cgroups::of(init_pid)?
            .unified
            .ok_or_else(|| Error::NoCgroup(format!("no cgroup2 directory for container {id}")))?;
        crate::checkpoint::process::check_dumpable(init_pid, &cgroup)
            .map_err(|e| Error::FailedPrecondition(format!("cannot checkpoint {id}: {e}")))?;
        let work = match opts.work_path {
            Some(w) => w,
            None => c.bundle.join("criu-work"),
        };
        let result = c
            .runc
            .checkpoint(
                id,
                &crate::runc::CheckpointOpts {
                    image_path: path.to_path_buf(),
                    work_path: Some(work.clone()),
                    leave_running: !opts.exit,
                    tcp_established: opts.open_tcp,
                    ext_unix_sk: opts.external_unix_sockets,
                    file_locks: opts.file_locks,
                    shell_job: opts.terminal,
                    manage_cgroups_mode: opts.cgroups_mode,
                    lazy_pages: false,
                },
            )
            .await;
        if result.is_ok() && opts.work_path_was_default {
            let _ = std::fs::remove_dir_all(&work);
        }
        // Signed with this host's key, so that a restore of it (`ctr c restore`, the CRI's)
        // passes the same trust decision as crab's own images.
        if result.is_ok() {
            let binding = match self.rootfs_binding(&c).await {
                Ok(b) => Some(b),
                Err(e) => {
                    log::warn!(
                        "checkpoint of {id}: its rootfs cannot be bound to the signature \
                         ({e}): a restore of it is told so"
                    );
                    None
                }
            };
            let (key_path, dir) = (c.signing_key.clone(), path.to_path_buf());
            let signed = tokio::task::spawn_blocking(move || {
                let key = crate::checkpoint::provenance::signing_key(&key_path)?;
                trust::sign_containerd_checkpoint(&dir, &key, binding)
            })
            .await
            .map_err(Error::Task)?;
            match signed {
                Ok(n) => log::info!("checkpoint of {id}: {n} CRIU files signed for containerd"),
                Err(e) => {
                    return Err(Error::FailedPrecondition(format!(
                        "cannot sign the checkpoint of {id}: {e}"
                    )))
                }
            }
        }
        result.map_err(|e| match e {
            RuncError::Failed { message, .. } => RuncError::Failed {
                command: "checkpoint",
                message: format!("{message} (CRIU log: {})", work.join("dump.log").display()),
            }
            .into(),
            e => e.into(),
        })
    }

    pub fn init_pid(&self, id: &str) -> Result<u32> {
        Ok(self.get(id)?.init.pid())
    }

    /// Ends the shim if it serves no container any more (or at once with `now`).
    pub fn shutdown(&self, now: bool) -> bool {
        if now || self.is_empty() {
            self.shutdown.signal();
            return true;
        }
        false
    }
}

/// What `spec` says of the container's turns: its turn boundary and probe commands, its
/// checkpoint policy checked too (the coordinator reads it again; here so that a bad value
/// fails Create and changes nothing).
fn turn_settings(
    spec: &oci_spec::runtime::Spec,
    config: &Config,
) -> Result<(bool, Vec<Vec<String>>)> {
    let boundary = turns::exec_boundary(spec, config.checkpoint.turn_boundary)?;
    let probes = turns::probe_commands(spec)?;
    crate::checkpoint::policy::for_container(spec, config.checkpoint.policy)?;
    Ok((boundary, probes))
}

/// runc's failure to signal a process, as the Task API words a process already gone.
fn gone_or(e: RuncError) -> Error {
    match e.is_gone() {
        true => Error::NotFound("process already finished".into()),
        false => e.into(),
    }
}

/// SIGKILLs every process in container `id`'s cgroup (from the spec's `cgroupsPath`, as
/// runc places it with the cgroupfs or the systemd driver); returns how many.
fn kill_cgroup_members(spec: &oci_spec::runtime::Spec, id: &str) -> usize {
    let path = spec
        .linux()
        .as_ref()
        .and_then(|l| l.cgroups_path().clone())
        .map(|p| p.display().to_string());
    let suffix = match path.as_deref() {
        // systemd driver: "slice:prefix:name" is the unit prefix-name.scope.
        Some(p) if p.split(':').count() == 3 => {
            let parts: Vec<&str> = p.split(':').collect();
            format!("/{}-{}.scope", parts[1], parts[2])
        }
        Some(p) => format!("/{}", p.trim_start_matches('/')),
        None => format!("/{id}"),
    };
    let mut killed = 0;
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let cgroups = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
        if cgroups.lines().any(|l| {
            l.splitn(3, ':')
                .nth(2)
                .is_some_and(|p| p == suffix || p.ends_with(&suffix))
        }) {
            // SAFETY: plain kill(2) of a pid in the container's cgroup.
            if unsafe { libc::kill(pid, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
    }
    killed
}

/// Detaches every mount at or below `dir` (deepest first).
fn unmount_all_under(dir: &Path) {
    let mounts = crate::sys::mountinfo::read_self().unwrap_or_default();
    for p in crate::sys::mountinfo::mount_points_under(&mounts, dir) {
        if let Err(e) = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH) {
            log::warn!("cannot unmount {}: {e}", p.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(c: &str, e: &str) -> (String, String) {
        (c.to_string(), e.to_string())
    }

    #[test]
    fn a_known_pid_exits_once_to_its_owner() {
        let mut t = PidTable::default();
        t.begin_start();
        assert_eq!(t.finish_start(Some(10), owner("c", "e1")), None);
        assert_eq!(t.exited(10, 0), Some(owner("c", "e1")));
        // Forgotten once reported (a pid is reused by some later process).
        assert_eq!(t.exited(10, 0), None);
        assert!(t.early_exits.is_empty(), "nothing was starting");
    }

    /// `runc exec --detach` can return after its process exited and was reaped: the exit
    /// arrived for a pid not known yet, and the start that learns the pid gets it.
    #[test]
    fn an_exit_before_its_start_is_known_goes_to_that_start() {
        let mut t = PidTable::default();
        t.begin_start();
        assert_eq!(t.exited(20, 7), None);
        assert_eq!(t.finish_start(Some(20), owner("c", "e")), Some(7));
        // Exited already: not registered, so a reused pid 20 is nobody's.
        assert_eq!(t.exited(20, 0), None);
        assert!(t.owners.is_empty() && t.early_exits.is_empty());
    }

    #[test]
    fn unknown_exits_are_kept_only_while_a_start_is_under_way() {
        let mut t = PidTable::default();
        // Nothing starting: an unknown pid (not ours, or gone) is dropped.
        assert_eq!(t.exited(30, 1), None);
        assert!(t.early_exits.is_empty());
        // Two starts overlap: exits are kept until the last one finished.
        t.begin_start();
        t.begin_start();
        t.exited(31, 2);
        t.exited(32, 3);
        assert_eq!(t.finish_start(Some(31), owner("a", "x")), Some(2));
        assert_eq!(
            t.early_exits.get(&32),
            Some(&3),
            "the other start may own it"
        );
        // The second start failed (no pid): the kept exits are nobody's, and go.
        assert_eq!(t.finish_start(None, owner("b", "y")), None);
        assert_eq!(t.starting, 0);
        assert!(t.early_exits.is_empty() && t.owners.is_empty());
    }

    #[test]
    fn a_started_process_that_has_not_exited_is_registered() {
        let mut t = PidTable::default();
        t.begin_start();
        t.exited(41, 9); // someone else's
        assert_eq!(t.finish_start(Some(40), owner("c", "")), None);
        assert_eq!(t.owners.get(&40), Some(&owner("c", "")));
        assert!(t.early_exits.is_empty(), "cleared with the last start");
    }

    /// `runtimeoptions.v1.Options` with `ConfigBody` (field 3) set to `body`.
    fn options_with_body(body: &str) -> Vec<u8> {
        let mut v = vec![0x1a];
        let mut len = body.len();
        while len >= 0x80 {
            v.push((len as u8 & 0x7f) | 0x80);
            len >>= 7;
        }
        v.push(len as u8);
        v.extend_from_slice(body.as_bytes());
        v
    }

    #[test]
    fn crab_runtime_options_carry_the_config() {
        let url = format!(
            "type.googleapis.com/{}",
            crab_runtime_config::RUNTIME_OPTIONS_TYPE_URL
        );
        let body = "[runc]\nsystemd_cgroup = true\n";
        let (config, source, _) =
            Containers::load_config(&Some((url.clone(), options_with_body(body)))).unwrap();
        assert!(config.runc.systemd_cgroup);
        assert_eq!(source.to_string(), "<runtime options ConfigBody>");
        // Undecodable options and an invalid config are refused, not replaced by defaults.
        let bad_wire = vec![0x18, 0x01]; // field 3 as a varint
        assert!(Containers::load_config(&Some((url.clone(), bad_wire))).is_err());
        let e = Containers::load_config(&Some((url, options_with_body("[runc\n")))).unwrap_err();
        assert!(e.to_string().contains("ConfigBody"), "{e}");
    }

    #[test]
    fn runtime_options_of_another_runtime_are_refused() {
        let e = Containers::load_config(&Some((
            "io.containerd.runsc.v1.options".into(),
            vec![0x08, 0x01],
        )))
        .unwrap_err();
        assert!(matches!(e, Error::Config(_)), "{e}");
        assert!(
            e.to_string().contains("neither crab's") && e.to_string().contains("ConfigBody"),
            "{e}"
        );
    }

    /// crab registered with runc's runtime type gets runc's options: its config comes from
    /// `$CRAB_CONFIG` or the default, with runc's settings on top.
    #[test]
    fn runc_runtime_options_are_taken() {
        // no_pivot_root = true, binary_name = "runc", io_uid = 1000, io_gid = 1000
        let value = vec![
            0x08, 0x01, 0x32, 0x04, b'r', b'u', b'n', b'c', 0x20, 0xe8, 0x07, 0x28, 0xe8, 0x07,
        ];
        let (config, _, options) =
            Containers::load_config(&Some(("containerd.runc.v1.Options".into(), value))).unwrap();
        assert_eq!(config.runc.binary, std::path::Path::new("runc"));
        let runc = Runc::from_config(&config, options.runc(), "k8s.io", "/b".as_ref()).unwrap();
        assert!(runc.no_pivot_root && !runc.no_new_keyring);
        assert_eq!(runc.io_owner, Some((1000, 1000)));
        assert_eq!(runc.root, config.runc.root.join("k8s.io"));
    }
}

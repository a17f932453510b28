//! The task service's core: containers, their processes and their lifecycle over runc.
//! It speaks in plain values: requests arrive as such from the protocol edge, and what
//! happens is reported as [`TaskEvent`]s, which the edge publishes.
//!
//! This file holds the shared types and the small lookups; each task verb has a file of its
//! own: [`create`] (with the checkpoint a container starts from), [`start`], [`restore`] (of
//! a process image, at Start), [`exec`], [`kill`], [`exit`], [`delete`], [`update`] (pause,
//! resume, pids, stdin, pty, resources) and [`checkpoint`] (containerd's own checkpoint).

mod checkpoint;
#[cfg(test)]
mod core_tests;
mod create;
mod delete;
mod exec;
mod exit;
#[cfg(test)]
mod fake;
mod host;
mod kill;
mod restore;
#[cfg(test)]
mod restore_tests;
mod resume;
mod start;
mod update;

/// The task core's own reasons a checkpoint is not restored, kept as the source of the
/// core's [`Error`] (its `Restore`, `Resume` and `Refused` kinds).
pub use checkpoint::BindingError;
pub use host::{Host, SystemHost};
pub use restore::{NotRun, Unguarded};
pub use resume::ResumeError;

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use containerd_shim::ExitSignal;
use crab_runtime_config::{Config, ConfigSource, ShimOptions};

use crate::{
    bundle::{self, RootfsMount},
    error::{Error, Result},
    events::{EventSender, TaskEvent},
    oom,
    process::{ExitInfo, Process, Snapshot, Status},
    reaper::ExitSubscription,
    restore::{intake::Taken, scratch::RestoreDir},
    runc::{OciRuntime, Runc},
    sandbox::Sandbox,
    stdio::StdioSpec,
};

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
    /// How runc is run for it (persisted in the bundle; what CRIU's runs are given too).
    runc: Runc,
    /// What the task verbs run: that runc (a fake in the core's unit tests).
    runtime: Arc<dyn OciRuntime>,
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
    /// The argv prefixes of execs that are no agent actions (probes;
    /// [`crate::turns::PROBE_COMMANDS`]).
    probes: Vec<Vec<String>>,
    /// A process image to restore at Start instead of `runc start` (with what checkpointing
    /// needs once the restored init is known).
    pending_restore: Mutex<Option<PendingRestore>>,
    /// Where its process image was copied to restore it (in the store), until Delete.
    restore_dir: Mutex<Option<RestoreDir>>,
}

/// What Start needs to restore a container's processes: made by Create ([`create`]),
/// restored by Start ([`restore`]).
struct PendingRestore {
    /// The CRIU image directory.
    image: PathBuf,
    /// crab's description of the checkpoint (none for containerd's own checkpoints).
    taken: Option<Taken>,
    config: Config,
    rootfs: bundle::Rootfs,
    stdio: StdioSpec,
    checkpointing: bool,
    /// The rw layer a containerd checkpoint was dumped with ([`crate::restore::rw`]): checked
    /// at Start, after the CRI has put its rootfs diff back and before CRIU runs.
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

    /// Execs (probes aside) whose exit event is not published yet: running, or exited with
    /// their exit still on its way (a turn ending at it first). Init's exit waits for them.
    fn unannounced_execs(&self) -> usize {
        self.execs
            .lock()
            .unwrap()
            .values()
            .filter(|p| !p.probe && p.status() != Status::Created && !p.exit_announced())
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
    /// The OCI runtime of a container, from how runc is to be run for it.
    runtimes: RuntimeFactory,
    /// What the core asks of the host itself (cgroups, the processes a dump would hold).
    host: Arc<dyn Host>,
}

/// Makes a container's [`OciRuntime`] from its [`Runc`] settings: runc itself in the shim, a
/// fake in the core's unit tests.
pub type RuntimeFactory = Arc<dyn Fn(&Runc) -> Arc<dyn OciRuntime> + Send + Sync>;

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
        let runc: RuntimeFactory = Arc::new(|r: &Runc| Arc::new(r.clone()) as Arc<dyn OciRuntime>);
        Self::with_seams(
            namespace,
            snapshots,
            events,
            shutdown,
            runc,
            Arc::new(SystemHost),
        )
    }

    /// [`Self::new`] with containers run by the runtimes `runtimes` makes, on `host`.
    pub fn with_seams(
        namespace: String,
        snapshots: Arc<dyn crate::restore::layers::SnapshotSource>,
        events: EventSender,
        shutdown: Arc<ExitSignal>,
        runtimes: RuntimeFactory,
        host: Arc<dyn Host>,
    ) -> Arc<Self> {
        Arc::new(Self {
            namespace,
            snapshots,
            events,
            map: Mutex::new(HashMap::new()),
            pids: Mutex::new(PidTable::default()),
            shutdown,
            runtimes,
            host,
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

#[cfg(test)]
mod tests {
    use super::core_tests::{crab_options_url, options_with_body};
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

    #[test]
    fn crab_runtime_options_carry_the_config() {
        let url = crab_options_url();
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

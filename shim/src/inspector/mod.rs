//! The inspector: what did a container's turn leave behind since the last mark?
//!
//! Kernel events (eBPF, [`bpf`]) say cheaply *whether* anything that could matter happened
//! (a mutating file syscall, a fork/exec/exit, a process being scheduled); user space then
//! computes the exact *net* effect only where something happened: the overlay upperdir
//! against the manifest of the mark ([`fs`]), the live processes against those of the mark
//! ([`procs`]), and the memory of processes that ran against their image at the mark
//! ([`memory`]). Anything the inspector cannot observe makes the answer "everything
//! changed" ([`Kind::Full`]), said loudly: it never skips state silently.

pub mod bpf;
mod decide;
pub use decide::NotOwn;
pub mod fs;
pub mod held;
pub mod lower;
pub mod memory;
pub mod procs;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use serde::Serialize;

use crate::sys::beneath;

use self::{
    bpf::{BpfError, CgroupCounters, HostProbes},
    decide::{MemoryStep, NextMark},
    fs::{FsDiff, FsError, TreeManifest},
    memory::{MemError, MemoryImage, Observation},
    procs::{ProcInfo, ProcfsError},
};

/// Why the inspector could not observe (part of) a turn. Any of these makes the answer `full`;
/// their text is what [`Answer::degraded`] says.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("eBPF probes unavailable: {0}")]
    ProbesUnavailable(#[source] ProbesUnavailable),
    #[error("cannot watch cgroup {}: {source}", dir.display())]
    Watch {
        dir: PathBuf,
        #[source]
        source: WatchError,
    },
    #[error("cannot read kernel counters: {0}")]
    Counters(#[source] Box<BpfError>),
    #[error("cannot list processes: {0}")]
    Processes(#[source] ProcfsError),
    #[error("cannot scan upperdir {}: {source}", upper.display())]
    ScanUpper {
        upper: PathBuf,
        #[source]
        source: FsError,
    },
    #[error("rootfs is not an overlay: its changes cannot be seen")]
    NotOverlay,
    #[error("cannot scan volume {} ({}): {source}", at.display(), dir.display())]
    ScanVolume {
        at: PathBuf,
        dir: PathBuf,
        #[source]
        source: FsError,
    },
    #[error("cannot scan the container's tmpfs mount {}: {source}", at.display())]
    ScanTmpfs {
        at: PathBuf,
        #[source]
        source: FsError,
    },
    #[error("the container has {0} tmpfs mounts, more than the {MAX_TMPFS_MOUNTS} the inspector compares")]
    TooManyTmpfs(usize),
    #[error("cannot list files held by pid {pid}: {source}")]
    HeldFiles {
        pid: u32,
        #[source]
        source: ProcfsError,
    },
    #[error("no mark to compare with")]
    NoMark,
    #[error("cannot read memory of pid {pid}: {source}")]
    Memory {
        pid: u32,
        #[source]
        source: MemError,
    },
}

/// Why an inspection has no host probes to count with (then it is blind: every turn `full`).
/// Cheap to clone: the probes are loaded once per shim and every container hears the same why.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProbesUnavailable {
    /// Loading or opening the host-wide programs failed.
    #[error("{0}")]
    Bpf(Arc<BpfError>),
    /// The container's cgroup2 directory is unknown, so there is nothing to watch.
    #[error("no cgroup2 directory for pid {pid}: {source}")]
    NoCgroup2 {
        pid: u32,
        #[source]
        source: Arc<std::io::Error>,
    },
}

/// Why a container's cgroup could not be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// Its directory has no cgroup id (not on cgroup2, or gone).
    #[error("{0}")]
    CgroupId(#[source] std::io::Error),
    #[error("{0}")]
    Bpf(#[source] Box<BpfError>),
}

/// The smallest checkpoint that preserves what a turn left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    None,
    Fs,
    Proc,
    Full,
}

impl Kind {
    fn from_parts(fs: bool, proc: bool) -> Kind {
        match (fs, proc) {
            (false, false) => Kind::None,
            (true, false) => Kind::Fs,
            (false, true) => Kind::Proc,
            (true, true) => Kind::Full,
        }
    }
}

/// The answer's kind: anything that degraded the turn makes it `full` whatever was found (what
/// could not be observed may have changed); otherwise the smallest kind that covers the files'
/// and the processes' change.
fn answer_kind(degraded: &[String], fs_changed: bool, procs_changed: bool) -> Kind {
    if degraded.is_empty() {
        Kind::from_parts(fs_changed, procs_changed)
    } else {
        Kind::Full
    }
}

/// What the inspector watches in one container.
#[derive(Debug, Clone)]
pub struct Target {
    pub container_id: String,
    /// The container's cgroup2 directory (its inode is the cgroup id BPF filters on).
    pub cgroup2_dir: PathBuf,
    /// The overlay upperdir and lowerdirs (top first), when the rootfs is an overlay.
    pub upperdir: Option<PathBuf>,
    pub lowerdirs: Vec<PathBuf>,
    /// Tracked writable volumes: (path in the container, host directory).
    pub volumes: Vec<(PathBuf, PathBuf)>,
    /// Which xattr prefix is overlay state on the rootfs mount (`userxattr` or not).
    pub overlay_xattrs: fs::OverlayXattrs,
    /// `st_dev` of the container's overlay rootfs as mounted: the probes count the changes
    /// that tasks outside the container make there (`docker cp`, a host tool chrooted or
    /// nsentered into it) as the container's ([`bpf::FsClass::Outside`]). `None`: not an
    /// overlay, such changes are not seen.
    pub rootfs_dev: Option<u64>,
    /// What one observation may cost the shim (`[limits]`).
    pub limits: crab_runtime_config::LimitsConfig,
    /// Keep the image of a process whose memory changed by its own doing alone
    /// (`[checkpoint] self_contained_changes = "keep"`, [`decide::not_own`]).
    pub keep_self_contained: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProcSummary {
    pub pid: u32,
    pub cmdline: String,
}

impl From<&ProcInfo> for ProcSummary {
    fn from(p: &ProcInfo) -> Self {
        let cmdline = if p.cmdline.is_empty() {
            format!("[{}]", p.comm)
        } else {
            p.cmdline.join(" ")
        };
        ProcSummary {
            pid: p.pid,
            cmdline,
        }
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct FsFinding {
    pub changed: bool,
    /// Whether the upperdir was compared at all (not when no mutating syscall happened).
    pub scanned: bool,
    /// The upperdir or a tracked volume could not be scanned (unreadable, or over a `[limits]`
    /// bound): the paths below are incomplete, a checkpoint must capture everything or fail.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unobserved: bool,
    /// Mutating syscalls seen since the mark, by class.
    pub syscalls: BTreeMap<String, u64>,
    pub added: Vec<PathBuf>,
    pub modified: Vec<PathBuf>,
    pub deleted: Vec<PathBuf>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct MemoryFinding {
    pub pid: u32,
    pub cmdline: String,
    pub changed_pages: u64,
    pub added_pages: u64,
    pub removed_pages: u64,
    pub scanned_pages: u64,
    /// The image compared with was taken while a lazy restore's pages were still arriving:
    /// the comparison cannot prove that nothing changed, so this counts as a change.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub unproven_base: bool,
    /// Changed pages by region (`[heap]`, a file, `anon@start`), most first: for the log.
    #[serde(skip)]
    pub regions: Vec<(String, u64)>,
    /// Kernel-held state that differs (pending signals, stopped, fds and what they hold,
    /// credentials, cwd): a change even with the same memory.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub state: Vec<String>,
    /// The change was the process's own doing alone and the policy keeps its last image
    /// ([`decide::not_own`]): no change for the turn's answer.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub self_contained: bool,
    /// The policy keeps self-contained changes, but not this one: the first reason
    /// ([`decide::NotOwn`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub not_kept: Option<decide::NotOwn>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ProcFinding {
    pub changed: bool,
    pub started: Vec<ProcSummary>,
    pub ended: Vec<ProcSummary>,
    /// Persisting processes whose executable image changed (exec without fork).
    pub reexeced: Vec<ProcSummary>,
    /// Persisting processes that hold a file this turn changed (open or mapped).
    pub held_changed: Vec<(u32, PathBuf)>,
    /// Persisting processes that ran, with their memory comparison.
    pub memory: Vec<MemoryFinding>,
    /// Persisting processes that did not run since the mark and whose kernel-held state is
    /// the mark's (memory unchanged, exactly).
    pub idle: Vec<u32>,
    /// Kernel state outside any compared process state that tasks of the container changed
    /// since the mark, by class ([`bpf::StateClass`]): each makes the processes count as changed.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub kernel: BTreeMap<String, u64>,
    pub forks: u64,
    pub execs: u64,
    pub exits: u64,
    /// What the observation read (memory, each shared object once; fdinfo) and carried over.
    #[serde(skip_serializing_if = "memory::ObservationStats::is_empty")]
    pub read: memory::ObservationStats,
}

/// Whether the processes changed since the mark, from what the turn found of them: a process
/// started, ended or re-exec'd, a persisting one holds a file the turn changed, kernel state
/// outside the processes changed, or a persisting one's memory or kernel-held state differs
/// from its image at the mark, or that image cannot prove it does not (an unproven base).
/// Idle processes, ones that ran without change or whose change was self-contained (kept by
/// the policy) and the fork, exec and exit counts alone do not make a change.
fn procs_changed(p: &ProcFinding) -> bool {
    !p.started.is_empty()
        || !p.ended.is_empty()
        || !p.reexeced.is_empty()
        || !p.held_changed.is_empty()
        || !p.kernel.is_empty()
        || p.memory.iter().any(|m| {
            !m.self_contained
                && (m.unproven_base
                    || m.changed_pages + m.added_pages + m.removed_pages > 0
                    || !m.state.is_empty())
        })
}

/// The inspector's answer for one turn, with the why.
#[derive(Debug, Clone, Serialize)]
pub struct Answer {
    pub container_id: String,
    pub seq: u64,
    pub kind: Kind,
    pub fs: FsFinding,
    pub procs: ProcFinding,
    /// Why the inspector could not observe the turn (then `kind` is `full`).
    pub degraded: Vec<String>,
    pub elapsed_us: u64,
}

impl Answer {
    /// One line for logs.
    pub fn summary(&self) -> String {
        let mut why = Vec::new();
        if !self.degraded.is_empty() {
            why.push(format!("DEGRADED: {}", self.degraded.join("; ")));
        }
        if self.fs.changed {
            why.push(format!(
                "fs: +{} ~{} -{} (e.g. {})",
                self.fs.added.len(),
                self.fs.modified.len(),
                self.fs.deleted.len(),
                self.fs
                    .added
                    .iter()
                    .chain(&self.fs.modified)
                    .chain(&self.fs.deleted)
                    .next()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            ));
        } else if !self.fs.scanned {
            why.push("fs: no mutating syscall".into());
        } else {
            why.push(format!(
                "fs: {} mutating syscalls, no net change",
                self.fs.syscalls.values().sum::<u64>()
            ));
        }
        let p = &self.procs;
        if p.changed {
            let mut parts = Vec::new();
            if !p.started.is_empty() {
                parts.push(format!(
                    "started {}",
                    p.started
                        .iter()
                        .map(|s| format!("{} ({})", s.pid, s.cmdline))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            if !p.ended.is_empty() {
                parts.push(format!(
                    "ended {}",
                    p.ended
                        .iter()
                        .map(|s| s.pid.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            if !p.reexeced.is_empty() {
                parts.push(format!(
                    "re-exec'd {}",
                    p.reexeced
                        .iter()
                        .map(|s| s.pid.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            if !p.kernel.is_empty() {
                parts.push(format!(
                    "kernel state changed by {}",
                    p.kernel
                        .iter()
                        .map(|(k, n)| format!("{k}: {n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            for m in p.memory.iter().filter(|m| !m.state.is_empty()) {
                parts.push(format!("pid {} {}", m.pid, m.state.join(", ")));
            }
            for m in p.memory.iter().filter(|m| {
                !m.self_contained
                    && (m.unproven_base || m.changed_pages + m.added_pages + m.removed_pages > 0)
            }) {
                parts.push(format!(
                    "pid {} memory {} pages changed{}{}",
                    m.pid,
                    m.changed_pages + m.added_pages + m.removed_pages,
                    match m.regions.is_empty() {
                        true => String::new(),
                        false => format!(
                            " ({})",
                            m.regions
                                .iter()
                                .map(|(r, n)| format!("{r}: {n}"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    },
                    match m.unproven_base {
                        true => " (compared with an image taken during a lazy restore: a change)",
                        false => "",
                    }
                ));
            }
            for (pid, path) in &p.held_changed {
                parts.push(format!("pid {pid} holds changed {}", path.display()));
            }
            why.push(format!("proc: {}", parts.join("; ")));
        } else {
            let own = p.memory.iter().filter(|m| m.self_contained).count();
            why.push(format!(
                "proc: unchanged ({} idle, {} ran without change{})",
                p.idle.len(),
                p.memory.len() - own,
                match own {
                    0 => String::new(),
                    n => format!(", {n} changed by their own doing alone: images kept"),
                }
            ));
        }
        let r = &p.read;
        if r.memory_bytes + r.shared_bytes_reused > 0 {
            why.push(format!(
                "read {} KiB of memory ({} shared objects, {} KiB of shared mappings already read)",
                r.memory_bytes >> 10,
                r.shared_objects,
                r.shared_bytes_reused >> 10
            ));
        }
        format!(
            "turn {} of {}: {:?} in {} us; {}",
            self.seq,
            self.container_id,
            self.kind,
            self.elapsed_us,
            why.join("; ")
        )
    }
}

/// The state a turn is compared against.
struct Mark {
    counters: CgroupCounters,
    manifest: TreeManifest,
    /// One per tracked volume, in `Target::volumes` order.
    volumes: Vec<TreeManifest>,
    processes: Vec<ProcInfo>,
    run_counts: HashMap<u32, u64>,
    memory: HashMap<u32, MemoryImage>,
    /// Pids whose memory image was taken while a lazy restore's pages were still arriving: a
    /// page not there yet reads as never touched, so a comparison with such an image cannot
    /// prove "unchanged" and counts as a change ([`MemoryFinding::unproven_base`]).
    unproven: HashSet<u32>,
    /// The `[limits]` bound the mark's observation passed: its memory images are incomplete.
    over_limit: Option<String>,
    /// The container's tmpfs mounts (`/dev`, `/dev/shm`, a `--tmpfs`) by mount point: no
    /// upperdir holds them, a process checkpoint does ([`Inspection::scan_tmpfs`]).
    tmpfs: Vec<(PathBuf, TreeManifest)>,
}

/// What a turn end gathers for the next mark while it observes the processes, and the
/// observation all its memory images share.
struct TurnImages {
    run_counts: HashMap<u32, u64>,
    memory_images: HashMap<u32, MemoryImage>,
    /// The pids whose image cannot prove "unchanged" ([`Mark::unproven`]).
    unproven: HashSet<u32>,
    /// Images taken from here on may lack pages of a lazy restore still under way.
    missing: bool,
    /// One observation for all the images: each shared object read once, the container's
    /// bounds over them all.
    obs: Observation,
    /// What is left of the turn end's wait for processes caught awake ([`ASLEEP_WAIT`], for
    /// all of them together: a container of busy processes does not hold its turn end longer).
    asleep_budget: std::time::Duration,
}

impl TurnImages {
    fn new(missing: bool, limits: &crab_runtime_config::LimitsConfig) -> TurnImages {
        TurnImages {
            run_counts: HashMap::new(),
            memory_images: HashMap::new(),
            unproven: HashSet::new(),
            missing,
            obs: Observation::within(limits),
            asleep_budget: ASLEEP_WAIT,
        }
    }
}

/// Watches one container: holds its last mark and answers turn ends.
pub struct Inspection {
    target: Target,
    probes: Option<Arc<HostProbes>>,
    cgroup_id: Option<u64>,
    mark: Option<Mark>,
    seq: u64,
    /// Why observation is impossible for this container (BPF unavailable, ...).
    blind: Option<InspectError>,
    /// Whether a lazy restore's pages may still be missing from the processes' memory (see
    /// [`Self::restored_lazily`]).
    pages_in_flight: Option<PagesInFlight>,
    /// The rseq areas of restored threads, from their checkpoint image (see
    /// [`Self::restored_rseq`]).
    rseq_seeds: RseqSeeds,
    /// While set, the container's processes are only this restored init and its descendants
    /// (at pre-resume CRIU itself, and its action script, are in the container's cgroup too:
    /// see [`Self::mark_base_held_by_criu`]).
    only_tree: Option<u32>,
    /// The host probes count the interactions of the container's processes since before its
    /// first mark (asked for when the policy keeps self-contained changes).
    counts_interactions: bool,
}

/// At most this many tmpfs mounts of a container are compared ([`Inspection::scan_tmpfs`]).
const MAX_TMPFS_MOUNTS: usize = 64;

/// Host pid -> (host tid, rseq area address) of its threads, as their checkpoint image said.
type RseqSeeds = HashMap<u32, Vec<(u32, u64)>>;

/// Says whether a lazy restore's pages may still be missing from the processes' memory.
pub type PagesInFlight = std::sync::Arc<dyn Fn() -> bool + Send + Sync>;

impl Inspection {
    /// Starts watching: registers the container's cgroup with the host probes. A failure
    /// does not fail the container: the inspection is then blind and every answer `full`.
    pub fn new(target: Target, probes: Result<Arc<HostProbes>, ProbesUnavailable>) -> Inspection {
        let mut blind = None;
        let (probes, cgroup_id) = match probes {
            Ok(p) => match crate::sys::cgroup::cgroup_id(&target.cgroup2_dir)
                .map_err(WatchError::CgroupId)
                .and_then(|id| {
                    p.watch_bounded(id, Some(target.limits.max_bpf_processes))
                        .map_err(|e| WatchError::Bpf(Box::new(e)))?;
                    if let Some(dev) = target.rootfs_dev {
                        // Not seeing outside changes could miss one: blind (every turn full).
                        if let Err(e) = p.watch_rootfs(id, dev) {
                            let _ = p.unwatch(id);
                            return Err(WatchError::Bpf(Box::new(e)));
                        }
                    }
                    Ok(id)
                }) {
                Ok(id) => (Some(p), Some(id)),
                Err(source) => {
                    blind = Some(InspectError::Watch {
                        dir: target.cgroup2_dir.clone(),
                        source,
                    });
                    (None, None)
                }
            },
            Err(e) => {
                blind = Some(InspectError::ProbesUnavailable(e));
                (None, None)
            }
        };
        if let Some(why) = &blind {
            log::warn!(
                "inspector for {} is BLIND, every turn will be a full checkpoint: {why}",
                target.container_id
            );
        }
        // Before any mark: an image's count then covers everything since it was taken.
        let counts_interactions = target.keep_self_contained
            && probes
                .as_ref()
                .is_some_and(|p| match p.track_interactions() {
                    Ok(()) => true,
                    Err(e) => {
                        log::warn!(
                            "inspector for {}: cannot count interactions, self-contained changes \
                         are checkpointed: {e}",
                            target.container_id
                        );
                        false
                    }
                });
        Inspection {
            target,
            probes,
            cgroup_id,
            mark: None,
            seq: 0,
            blind,
            pages_in_flight: None,
            rseq_seeds: HashMap::new(),
            only_tree: None,
            counts_interactions,
        }
    }

    /// Until [`Self::mark_base_held_by_criu`] has taken the mark, the container's processes
    /// are only the restored `init` and its descendants.
    pub fn restored_tree(&mut self, init: u32) {
        self.only_tree = Some(init);
    }

    /// The container's processes were just restored from a checkpoint image whose threads
    /// had these rseq areas (`areas`: thread id in the container's pid namespace, address).
    /// CRIU registers them again before the threads resume, and the kernel rewrites them
    /// whenever a thread is scheduled; the host probes learn an area only when its thread
    /// leaves a CPU while the cgroup is watched, which a restored thread may have done before
    /// the watch began and then not again for long (a sleeper). Known from the image, the
    /// areas are left out of memory images from the first one on, so a sleeper woken later
    /// (by a freeze for a checkpoint) does not count as changed.
    ///
    /// A seed lasts as long as its thread; a thread that exits, or a process that execs,
    /// ends it (as in the probes).
    pub fn restored_rseq(&mut self, areas: &[(u32, u64)]) {
        if areas.is_empty() {
            return;
        }
        let by_ns_tid: HashMap<u32, u64> = areas.iter().copied().collect();
        let mut seeded = 0;
        for p in self.processes().unwrap_or_default() {
            let found: Vec<(u32, u64)> = procs::threads_by_ns_tid(p.pid)
                .into_iter()
                .filter_map(|(tid, ns_tid)| by_ns_tid.get(&ns_tid).map(|a| (tid, *a)))
                .collect();
            if !found.is_empty() {
                seeded += found.len();
                self.rseq_seeds.insert(p.pid, found);
            }
        }
        log::debug!(
            "inspector for {}: {seeded} of {} restored threads' rseq areas found",
            self.target.container_id,
            areas.len()
        );
    }

    /// The container's processes were restored lazily: until `in_flight` says otherwise, pages
    /// may be missing from their memory (they arrive on first touch or in the background), and
    /// memory images taken meanwhile cannot prove that nothing changed.
    pub fn restored_lazily(&mut self, in_flight: PagesInFlight) {
        self.pages_in_flight = Some(in_flight);
    }

    /// Whether memory images taken now may lack pages of a lazy restore.
    fn pages_missing(&self) -> bool {
        self.pages_in_flight.as_ref().is_some_and(|f| f())
    }

    /// Numbers the next answers after `seq` (the last one its store already holds).
    pub fn continue_after(&mut self, seq: u64) {
        self.seq = self.seq.max(seq);
    }

    /// Waits (bounded) until no process of the container is running: a program that just
    /// started (dynamic loading, initialisation) is still changing its memory, and the base
    /// mark should hold it as it idles, not halfway through its start.
    fn settle(&self, bound: std::time::Duration) {
        let deadline = Instant::now() + bound;
        let mut last: Option<Vec<(u32, Option<u64>)>> = None;
        let mut quiet_polls = 0;
        while Instant::now() < deadline {
            let procs = self.processes().unwrap_or_default();
            let busy = procs.iter().any(|p| {
                procs::read_stat(p.pid)
                    .ok()
                    .flatten()
                    .is_some_and(|s| matches!(s.state, 'R' | 'D'))
            });
            // Neither runnable nor scheduled since the last poll (when the probes can tell).
            let runs: Vec<(u32, Option<u64>)> = procs
                .iter()
                .map(|p| (p.pid, self.run_count(p.pid)))
                .collect();
            let quiet = !busy && last.as_ref() == Some(&runs);
            quiet_polls = if quiet { quiet_polls + 1 } else { 0 };
            if quiet_polls >= 3 {
                return;
            }
            last = Some(runs);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        log::debug!(
            "inspector for {}: processes still busy {bound:?} after start",
            self.target.container_id
        );
    }

    /// Takes the base mark (at container start): the upperdir as it is now, the processes
    /// alive now and their memory.
    ///
    /// The upperdir is not empty at start: runc creates the mount points the image lacks
    /// (a volume's `/workspace`, `/etc/resolv.conf`) in it. Those are the runtime's, not a
    /// turn's: with an empty base, the first turn that scans (any write hint, or a shared
    /// writable mapping) would report them `added` and take a needless fs checkpoint.
    pub fn mark_base(&mut self) {
        self.settle(std::time::Duration::from_secs(1));
        self.take_base_mark();
    }

    /// [`Self::mark_base`] of a restored container whose threads CRIU holds at pre-resume
    /// (ptrace-stopped at the exit of their `rt_sigreturn`, everything else as they will run):
    /// nothing moves, so nothing is settled; a thread reads stopped (`t`) only because CRIU
    /// holds it, so no thread of the mark is stopped. (A process restored stopped reads as a
    /// change at the first turn end: a checkpoint too many, never one too few.)
    pub fn mark_base_held_by_criu(&mut self) {
        self.take_base_mark();
        self.only_tree = None;
        if let Some(mark) = &mut self.mark {
            for image in mark.memory.values_mut() {
                for t in &mut image.state.threads {
                    t.stopped = false;
                }
            }
        }
    }

    /// Once a restored container marked at pre-resume ([`Self::mark_base_held_by_criu`]) has
    /// resumed and settled: its processes' memory images in the mark, and their run counts,
    /// are taken again, so that what a process writes into its own memory as it resumes (an
    /// interrupted sleep, restarted by its libc, writes `errno` and its stack) is the base, as
    /// any restore of that checkpoint would write it. Everything else stays as CRIU held it:
    /// files, tmpfs mounts, the processes alive, what the kernel holds for them, the counters
    /// (so a file written, a process started or ended, a signal sent or bytes queued as they
    /// resume are the first turn's). A process whose memory cannot be read again keeps its
    /// image from pre-resume (the turn then compares with that: a change, never a miss).
    pub fn refresh_restored_memory(&mut self) {
        let started = Instant::now();
        self.settle(std::time::Duration::from_secs(1));
        let Some(mut mark) = self.mark.take() else {
            return;
        };
        let mut obs = Observation::within(&self.target.limits);
        let mut fresh = HashMap::new();
        for &pid in mark.memory.keys() {
            match self.capture(pid, &mut obs) {
                Ok(img) => {
                    fresh.insert(pid, img);
                }
                Err(e) => log::debug!("memory of restored pid {pid}: {e}"),
            }
            if let Some(n) = self.run_count(pid) {
                mark.run_counts.insert(pid, n);
            }
        }
        for img in fresh.values_mut() {
            obs.settle(img);
        }
        if let Some(e) = obs.over_limit() {
            mark.over_limit = Some(e.to_string());
        }
        let n = fresh.len();
        for (pid, mut img) in fresh {
            if let Some(held) = mark.memory.get_mut(&pid) {
                img.state = std::mem::take(&mut held.state);
                *held = img;
            }
        }
        self.mark = Some(mark);
        log::debug!(
            "inspector for {}: memory of {n} restored processes taken again in {:?}",
            self.target.container_id,
            started.elapsed()
        );
    }

    fn take_base_mark(&mut self) {
        let started = Instant::now();
        let upper = match &self.target.upperdir {
            Some(_) => self.scan_upper().unwrap_or_else(|e| {
                log::warn!(
                    "inspector for {}: base mark without the upperdir ({e}): the first scan \
                     compares with an empty one",
                    self.target.container_id
                );
                TreeManifest::default()
            }),
            None => TreeManifest::default(),
        };
        match self.observe_all(upper) {
            Ok(mark) => self.mark = Some(mark),
            Err(e) => {
                log::warn!(
                    "inspector for {}: cannot take the base mark: {e}",
                    self.target.container_id
                );
                self.mark = None;
            }
        }
        log::debug!(
            "inspector for {}: base mark in {:?}",
            self.target.container_id,
            started.elapsed()
        );
    }

    /// The cgroup's counters now; `None` when blind (which [`Self::blind`] already says).
    fn counters(&self) -> Option<Result<CgroupCounters, InspectError>> {
        match (&self.probes, self.cgroup_id) {
            (Some(p), Some(id)) => Some(
                p.counters(id)
                    .map_err(|e| InspectError::Counters(Box::new(e))),
            ),
            _ => None,
        }
    }

    fn run_count(&self, pid: u32) -> Option<u64> {
        self.probes
            .as_ref()
            .and_then(|p| p.run_count(pid).ok().flatten())
    }

    fn processes(&self) -> Result<Vec<ProcInfo>, InspectError> {
        let all = procs::list(&self.target.cgroup2_dir).map_err(InspectError::Processes)?;
        Ok(match self.only_tree {
            Some(init) => procs::tree_of(init, all),
            None => all,
        })
    }

    /// A full observation, used when there is no usable mark.
    fn observe_all(&self, manifest: TreeManifest) -> Result<Mark, InspectError> {
        let counters = self.counters().and_then(Result::ok).unwrap_or_default();
        let processes = self.processes()?;
        let mut memory = HashMap::new();
        let mut run_counts = HashMap::new();
        let unproven = match self.pages_missing() {
            true => processes.iter().map(|p| p.pid).collect(),
            false => HashSet::new(),
        };
        let mut obs = Observation::within(&self.target.limits);
        for p in &processes {
            if let Some(n) = self.run_count(p.pid) {
                run_counts.insert(p.pid, n);
            }
            match self.capture(p.pid, &mut obs) {
                Ok(img) => {
                    memory.insert(p.pid, img);
                }
                Err(e) => log::debug!("memory of pid {}: {e}", p.pid),
            }
        }
        for img in memory.values_mut() {
            obs.settle(img);
        }
        let over_limit = obs.over_limit().map(|e| e.to_string());
        let volumes = self.scan_volumes().unwrap_or_default();
        // Unscanned, the next comparison finds every entry new: a change, never a miss.
        let tmpfs = self.scan_tmpfs(&processes).unwrap_or_else(|e| {
            log::warn!("inspector for {}: {e}", self.target.container_id);
            Vec::new()
        });
        Ok(Mark {
            counters,
            manifest,
            processes,
            run_counts,
            memory,
            volumes,
            unproven,
            over_limit,
            tmpfs,
        })
    }

    /// Manifests of the container's tmpfs mounts (as the first of `processes` sees them), by
    /// mount point. Files created, written or truncated there are counted by the probes (the
    /// `tmpfs` class); entries only renamed, linked, removed, made as directories or nodes, or
    /// changed in their metadata go through syscalls that name a path the probes do not
    /// resolve: a turn with such a syscall compares these manifests. Each mount is opened
    /// beneath the process's root (no symlink followed, nothing above the root) and walked
    /// without entering the mounts below it; a mount point that is no directory (a file bind
    /// mount) or that is gone is left out.
    fn scan_tmpfs(
        &self,
        processes: &[ProcInfo],
    ) -> Result<Vec<(PathBuf, TreeManifest)>, InspectError> {
        use std::os::fd::AsFd;
        let Some(p) = processes.first() else {
            return Ok(Vec::new());
        };
        let mounts =
            match crate::sys::mountinfo::read(Path::new(&format!("/proc/{}/mountinfo", p.pid))) {
                Ok(m) => m,
                // Gone meanwhile: the process comparison says so.
                Err(_) => return Ok(Vec::new()),
            };
        let mut points: Vec<PathBuf> = mounts
            .into_iter()
            .filter(|m| m.fstype == "tmpfs" && m.mount_point != Path::new("/"))
            .map(|m| m.mount_point)
            .collect();
        points.sort();
        points.dedup();
        if points.is_empty() {
            return Ok(Vec::new());
        }
        // A container allowed to mount could make any number: past the bound the turn is
        // unobserved (degraded, answered full), never a long walk.
        if points.len() > MAX_TMPFS_MOUNTS {
            return Err(InspectError::TooManyTmpfs(points.len()));
        }
        let root_path = format!("/proc/{}/root", p.pid);
        let flags = nix::fcntl::OFlag::O_PATH
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_CLOEXEC;
        let root = match crate::sys::file::open(root_path.as_str(), flags) {
            Ok(fd) => fd,
            Err(_) => return Ok(Vec::new()),
        };
        let limits: fs::ScanLimits = (&self.target.limits).into();
        let mut out = Vec::with_capacity(points.len());
        for at in points {
            let rel = at.strip_prefix("/").unwrap_or(&at);
            let dir = crate::sys::beneath::resolve_beneath(root.as_fd(), rel)
                .and_then(|p| crate::sys::beneath::open_dir_beneath(p.as_fd(), Path::new("")));
            let dir = match dir {
                Ok(d) => d,
                Err(e) => {
                    log::debug!(
                        "inspector for {}: tmpfs mount {} left out: {e}",
                        self.target.container_id,
                        at.display()
                    );
                    continue;
                }
            };
            let manifest = TreeManifest::scan_one_fs(dir, &at, &limits).map_err(|source| {
                InspectError::ScanTmpfs {
                    at: at.clone(),
                    source,
                }
            })?;
            out.push((at, manifest));
        }
        Ok(out)
    }

    /// Process `pid`'s interactions now, when the inspection counts them.
    fn interactions(&self, pid: u32) -> Option<u64> {
        interactions_of(self.probes.as_deref(), self.counts_interactions, pid)
    }

    /// Whether a change found now may be kept as self-contained: the policy says so and the
    /// interactions program is still attached (its pins were not removed since the mark).
    fn keeps_self_contained(&self) -> bool {
        self.counts_interactions
            && self
                .probes
                .as_ref()
                .is_some_and(|p| p.interactions_tracked())
    }

    fn capture(&self, pid: u32, obs: &mut Observation) -> Result<MemoryImage, memory::MemError> {
        // Read before: whatever reached the process from here on is not in this count.
        let interactions = self.interactions(pid);
        let mut img = capture_bounded(
            pid,
            self.target.limits.max_fdinfo_bytes,
            volatile_of(self.probes.as_deref(), &self.rseq_seeds, pid),
            obs,
        )?;
        self.note_signals(pid, &mut img.state);
        img.interactions = interactions;
        Ok(img)
    }

    /// What the kernel holds for `pid` now that can change while it does not run, without its
    /// memory (see [`memory::read_held_state`]).
    fn held_state_of(
        &self,
        pid: u32,
        obs: &mut Observation,
    ) -> Result<memory::ProcState, MemError> {
        let mut st = memory::read_held_state(pid, obs)?;
        self.note_signals(pid, &mut st);
        Ok(st)
    }

    /// Notes in `st` how many signals were queued to `pid`, while some are pending.
    fn note_signals(&self, pid: u32, st: &mut memory::ProcState) {
        st.signals_while_pending = st.pending().then(|| {
            self.probes
                .as_ref()
                .and_then(|p| p.signals_queued(pid).ok().flatten())
                // No count while a signal is pending: never the same twice.
                .unwrap_or_else(|| {
                    static UNKNOWN: std::sync::atomic::AtomicU64 =
                        std::sync::atomic::AtomicU64::new(1 << 63);
                    UNKNOWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                })
        });
    }

    /// What the processes' kernel-held state shows changed since `o` was observed (the
    /// container frozen by the caller): for an in-place rollback, which keeps them only when
    /// nothing did. Empty: nothing changed.
    pub fn processes_changed_since(&self, o: &Observed) -> Vec<String> {
        let mut out = Vec::new();
        let mut obs = Observation::within(&self.target.limits);
        for p in &o.0.processes {
            let Some(img) = o.0.memory.get(&p.pid) else {
                out.push(format!("pid {}: no image at the peek", p.pid));
                continue;
            };
            match self.held_state_of(p.pid, &mut obs) {
                Ok(st) => {
                    for c in memory::compare_held(&img.state, &st) {
                        out.push(format!("pid {}: {c}", p.pid));
                    }
                }
                Err(e) => out.push(format!("pid {}: {e}", p.pid)),
            }
        }
        out
    }

    fn scan_volumes(&self) -> Result<Vec<TreeManifest>, InspectError> {
        self.target
            .volumes
            .iter()
            .map(|(at, dir)| {
                TreeManifest::scan_with(
                    dir,
                    &(&self.target.limits).into(),
                    fs::OverlayXattrs::Trusted,
                )
                .map_err(|source| InspectError::ScanVolume {
                    at: at.clone(),
                    dir: dir.clone(),
                    source,
                })
            })
            .collect()
    }

    fn scan_upper(&self) -> Result<TreeManifest, InspectError> {
        match &self.target.upperdir {
            Some(upper) => TreeManifest::scan_with(
                upper,
                &(&self.target.limits).into(),
                self.target.overlay_xattrs,
            )
            .map_err(|source| InspectError::ScanUpper {
                upper: upper.clone(),
                source,
            }),
            None => Err(InspectError::NotOverlay),
        }
    }

    /// Stores into a page that is already dirty in a shared writable mapping leave no trace
    /// in the file's times until writeback; writing those pages back now makes the next store
    /// fault and move mtime, so the scan after this (and the next turn's) sees it.
    ///
    /// Returns why the turn cannot be fully observed: a shared writable mapping of a file on a
    /// tree crab tracks (the rootfs overlay, a tracked volume) that could not be armed, so that
    /// stores into it may leave no trace. Those make the answer `full`, never a missed change.
    ///
    /// The path a process's maps print is the container's to choose (a memfd is named by its
    /// creator, slashes and `..` included, and the container can plant anything at that name in
    /// its upperdir: a device node, a FIFO, a symlink to a host file). So:
    /// - which file is mapped is decided by identity, not by name: the name must lead, in the
    ///   process's own view (`/proc/PID/root`, no symlinks, nothing opened), to the very inode the
    ///   maps line names (device and inode number). A memfd, SysV or tmpfs object (its memory is
    ///   hashed by [`memory`] through `/proc/PID/map_files`, the object itself) or a file on an
    ///   untracked mount is not armed; a file on a tracked tree whose name leads elsewhere
    ///   (unlinked, renamed, replaced) cannot be armed and is reported.
    /// - the host file is then opened beneath the upperdir or volume with
    ///   [`fs::arm_shared_mapping`]: no symlinks, no `..` above it, regular files only.
    ///
    /// Why not arm through `/proc/PID/map_files/<range>`, which is the mapped file itself? On
    /// an overlay it is the overlay's file, whose page cache is empty (the pages live in the
    /// upper file's): `sync_file_range` on it writes nothing back. The upper file has to be
    /// found by its path beneath the upperdir; the identity check above is what makes that
    /// path trustworthy.
    fn arm_shared_mappings(&self) -> Vec<String> {
        let Some(upper) = &self.target.upperdir else {
            return Vec::new();
        };
        // Tracked trees: (path in the container, host root handle, device in the container's view).
        let mut roots: Vec<(PathBuf, OwnedFd)> = Vec::new();
        for (at, dir) in std::iter::once((Path::new("/"), upper.as_path())).chain(
            self.target
                .volumes
                .iter()
                .map(|(a, d)| (a.as_path(), d.as_path())),
        ) {
            match beneath::open_root(dir) {
                Ok(fd) => roots.push((at.to_path_buf(), fd)),
                Err(e) => log::debug!("arm shared mappings: cannot open {}: {e}", dir.display()),
            }
        }
        let Ok(processes) = self.processes() else {
            return Vec::new();
        };
        // Reasons are kept for the first few mappings only: the count of mappings is the
        // container's to choose, the size of an answer is not.
        const SAID: usize = 8;
        let mut unseen = Vec::new();
        let mut more = 0usize;
        let mut note = |why: String| {
            if unseen.len() < SAID {
                unseen.push(why)
            } else {
                more += 1
            }
        };
        for p in processes {
            let Ok(maps) = procs::read_maps(p.pid) else {
                continue;
            };
            let mut shared = maps
                .iter()
                .filter(|m| {
                    m.perms[3] == b's'
                        && m.perms[1] == b'w'
                        && m.inode != 0
                        && m.path.starts_with(b"/")
                })
                .peekable();
            if shared.peek().is_none() {
                continue;
            }
            // The process's view; if it is gone, so are its mappings.
            let Ok(view) = beneath::process_root(p.pid) else {
                continue;
            };
            let tracked: Vec<(&Path, BorrowedFd<'_>, Option<u64>)> = roots
                .iter()
                .map(|(at, fd)| {
                    (
                        at.as_path(),
                        fd.as_fd(),
                        procs::identity_in_view(view.as_fd(), at)
                            .ok()
                            .map(|(dev, _)| dev),
                    )
                })
                .collect();
            for m in shared {
                let path = PathBuf::from(OsStr::from_bytes(&procs::unescape_maps_path(&m.path)));
                match locate_mapping(view.as_fd(), &path, procs::maps_dev(m), m.inode, &tracked) {
                    Mapped::Tracked(root, rel) => {
                        if let Err(e) = fs::arm_shared_mapping(root, &rel) {
                            note(format!("pid {} maps {} shared and writable, and it cannot be armed: {e}", p.pid, path.display()));
                        }
                    }
                    Mapped::Untracked => {}
                    Mapped::Unreachable => note(format!(
                        "pid {} maps a file shared and writable whose name {:?} no longer leads to it (unlinked, renamed or replaced): its stores may leave no trace",
                        p.pid,
                        path.display()
                    )),
                }
            }
        }
        if more > 0 {
            unseen.push(format!(
                "{more} more shared writable mappings that cannot be armed"
            ));
        }
        unseen
    }

    /// Processes that have not been scheduled since the mark (so their memory still equals
    /// the mark's image), with their run counts now.
    pub fn idle_since_mark(&self) -> Vec<(u32, u64)> {
        let Some(m) = &self.mark else {
            return Vec::new();
        };
        m.processes
            .iter()
            .filter_map(|p| {
                let now = self.run_count(p.pid)?;
                (m.run_counts.get(&p.pid) == Some(&now)).then_some((p.pid, now))
            })
            .collect()
    }

    /// After a checkpoint froze and thawed the container: the freezer wakes every process, and
    /// waking rewrites a little of their memory (an interrupted sleep stores its remaining time,
    /// the kernel updates the rseq area). For the processes that were idle since the mark up to
    /// the freeze (`idle`, from [`Self::idle_since_mark`]), that change is crab's own, not the
    /// agent's: their images at the mark are refreshed so the next turn does not count it.
    ///
    /// A thawed process rewrites that memory when it next runs, which may be after the thaw
    /// returned: each is waited for (bounded) until it has run and gone back to sleep since the
    /// freeze (its run count, taken before the freeze, moved by two: the switch-out into the
    /// freezer and the one after the thaw), so that its image is taken after the rewrite.
    pub fn refresh_after_freeze(&mut self, idle: &[(u32, u64)]) {
        let deadline = Instant::now() + REFRESH_WAIT;
        let missing = self.pages_missing();
        let Some(mark) = self.mark.as_mut() else {
            return;
        };
        let mut obs = Observation::within(&self.target.limits);
        for &(pid, before) in idle {
            let count = || {
                self.probes
                    .as_ref()
                    .and_then(|p| p.run_count(pid).ok().flatten())
            };
            let Some(n) = (loop {
                match count() {
                    Some(n) if n < before + 2 && Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_micros(200))
                    }
                    n => break n,
                }
            }) else {
                continue;
            };
            let interactions =
                interactions_of(self.probes.as_deref(), self.counts_interactions, pid);
            match capture_bounded(
                pid,
                self.target.limits.max_fdinfo_bytes,
                volatile_of(self.probes.as_deref(), &self.rseq_seeds, pid),
                &mut obs,
            ) {
                Ok(mut img) => {
                    obs.settle(&mut img);
                    img.interactions = interactions;
                    mark.memory.insert(pid, img);
                    mark.run_counts.insert(pid, n);
                    if missing {
                        mark.unproven.insert(pid);
                    } else {
                        mark.unproven.remove(&pid);
                    }
                }
                Err(e) => log::debug!("refresh of pid {pid} after a freeze: {e}"),
            }
        }
    }

    /// Answers a turn end and makes the present the new mark.
    pub fn turn_end(&mut self) -> Answer {
        self.seq += 1;
        let prev = self.mark.take();
        let (answer, mark) = self.observe_since(prev.as_ref(), self.seq);
        self.mark = mark;
        // A seed ends with its process's image (an exec) or the process.
        for p in answer.procs.reexeced.iter().chain(&answer.procs.ended) {
            self.rseq_seeds.remove(&p.pid);
        }
        if answer.degraded.is_empty() {
            log::info!("{}", answer.summary());
        } else {
            log::warn!("{}", answer.summary());
        }
        answer
    }

    /// What a turn end would answer now, without ending a turn: the mark stays as it is. Also
    /// returns the observation of the present, which [`Self::rebase`] can make the mark.
    pub fn peek(&self) -> (Answer, Option<Observed>) {
        let (answer, mark) = self.observe_since(self.mark.as_ref(), self.seq);
        (answer, mark.map(Observed))
    }

    /// The answer of the turn since `prev` (numbered `seq`) and the mark it leaves: the present,
    /// or a fresh full observation when the present could not be observed.
    fn observe_since(&self, prev: Option<&Mark>, seq: u64) -> (Answer, Option<Mark>) {
        let started = Instant::now();
        let mut degraded = Vec::new();
        let counters = self.observe_counters(prev, &mut degraded);

        // Filesystem: scan only when a mutating syscall (or a shared writable mapping, whose
        // writes need no syscall) happened since the mark.
        let decide::FsActivity {
            scan,
            arm,
            syscalls,
        } = decide::fs_activity(counters.as_ref(), prev.map(|m| &m.counters));
        let mut fs = FsFinding {
            syscalls,
            ..FsFinding::default()
        };
        let manifest = self.observe_fs(prev, scan, arm, &mut fs, &mut degraded);
        let volumes = self.observe_volumes(prev, scan, &mut fs, &mut degraded);

        // Processes.
        let now_procs = match self.processes() {
            Ok(p) => Some(p),
            Err(e) => {
                degraded.push(e.to_string());
                None
            }
        };
        // Images taken from here on may lack pages of a lazy restore still under way.
        let mut seen = TurnImages::new(self.pages_missing(), &self.target.limits);
        let mut procs = match (&now_procs, prev) {
            (Some(now), Some(m)) => {
                self.observe_processes(now, m, counters.as_ref(), &fs, &mut seen, &mut degraded)
            }
            _ => ProcFinding::default(),
        };
        let tmpfs = self.observe_tmpfs(prev, scan, now_procs.as_deref(), &mut procs, &mut degraded);

        for img in seen.memory_images.values_mut() {
            seen.obs.settle(img);
        }
        procs.read = seen.obs.stats().clone();
        let kind = answer_kind(&degraded, fs.changed, procs.changed);
        // The present becomes the mark; if it could not be observed, the next turn takes a
        // fresh full observation.
        let mark = match decide::next_mark(counters, manifest, now_procs, volumes, &degraded) {
            NextMark::Present(counters, manifest, processes, volumes) => Some(Mark {
                counters,
                manifest,
                processes,
                run_counts: seen.run_counts,
                memory: seen.memory_images,
                volumes,
                unproven: seen.unproven,
                over_limit: None,
                // Observed whenever `degraded` is empty (which `Present` requires).
                tmpfs: tmpfs.unwrap_or_default(),
            }),
            NextMark::Fresh(manifest) => self.observe_all(manifest.unwrap_or_default()).ok(),
        };
        let answer = Answer {
            container_id: self.target.container_id.clone(),
            seq,
            kind,
            fs,
            procs,
            degraded,
            elapsed_us: started.elapsed().as_micros() as u64,
        };
        (answer, mark)
    }

    /// The cgroup's counters now (`None`: blind, or unreadable), saying in `degraded` why the
    /// turn cannot be observed as far as they and the mark `prev` tell
    /// ([`decide::counter_reasons`]).
    fn observe_counters(
        &self,
        prev: Option<&Mark>,
        degraded: &mut Vec<String>,
    ) -> Option<CgroupCounters> {
        if let Some(why) = &self.blind {
            degraded.push(why.to_string());
        }
        let counters = match self.counters() {
            Some(Ok(c)) => Some(c),
            Some(Err(e)) => {
                degraded.push(e.to_string());
                None
            }
            None => None,
        };
        degraded.extend(decide::counter_reasons(
            counters.as_ref(),
            prev.map(|m| &m.counters),
            self.target.limits.max_bpf_processes,
        ));
        counters
    }

    /// The upperdir now and its net change since the mark `prev` (into `fs`) when `scan`
    /// (arming shared writable mappings first when `arm`, see [`decide::fs_activity`]); the
    /// mark's manifest when not. `None`: it could not be scanned (said in `degraded`, and `fs`
    /// is unobserved).
    fn observe_fs(
        &self,
        prev: Option<&Mark>,
        scan: bool,
        arm: bool,
        fs: &mut FsFinding,
        degraded: &mut Vec<String>,
    ) -> Option<TreeManifest> {
        let prev_manifest = prev.map(|m| &m.manifest);
        if !scan {
            return prev_manifest.cloned();
        }
        fs.scanned = true;
        if arm {
            degraded.extend(self.arm_shared_mappings());
        }
        match self.scan_upper() {
            Ok(now) => {
                let empty = TreeManifest::default();
                let d: FsDiff = fs::diff(
                    prev_manifest.unwrap_or(&empty),
                    &now,
                    &self.target.lowerdirs,
                );
                fs.changed = !d.is_empty();
                fs.added = d.added;
                fs.modified = d.modified;
                fs.deleted = d.deleted;
                Some(now)
            }
            Err(e) => {
                fs.unobserved = true;
                degraded.push(e.to_string());
                None
            }
        }
    }

    /// The tracked volumes now and their net change since the mark `prev` (added to `fs`, as
    /// container paths below their mount points) when `scan`; the mark's manifests when not.
    /// `None`: one could not be scanned (said in `degraded`, and `fs` is unobserved).
    fn observe_volumes(
        &self,
        prev: Option<&Mark>,
        scan: bool,
        fs: &mut FsFinding,
        degraded: &mut Vec<String>,
    ) -> Option<Vec<TreeManifest>> {
        if !scan {
            return prev.map(|m| m.volumes.clone());
        }
        match self.scan_volumes() {
            Ok(now) => {
                let empty = TreeManifest::default();
                for (i, (at, _)) in self.target.volumes.iter().enumerate() {
                    let before = prev
                        .as_ref()
                        .and_then(|m| m.volumes.get(i))
                        .unwrap_or(&empty);
                    let d = fs::diff(before, &now[i], &[]);
                    let inside = |p: PathBuf| at.join(p.strip_prefix("/").unwrap_or(&p));
                    fs.changed |= !d.is_empty();
                    fs.added.extend(d.added.into_iter().map(inside));
                    fs.modified.extend(d.modified.into_iter().map(inside));
                    fs.deleted.extend(d.deleted.into_iter().map(inside));
                }
                Some(now)
            }
            Err(e) => {
                fs.unobserved = true;
                degraded.push(e.to_string());
                None
            }
        }
    }

    /// The container's tmpfs mounts compared with the mark's when the turn made a mutating
    /// file syscall (`scan`; else the mark's are carried): any entry added, changed or removed
    /// there, or a tmpfs mount come or gone, makes the processes count as changed (class
    /// `tmpfs-entries`: a process checkpoint keeps tmpfs mounts). `None` when they could not
    /// be scanned (said in `degraded`).
    fn observe_tmpfs(
        &self,
        prev: Option<&Mark>,
        scan: bool,
        now: Option<&[ProcInfo]>,
        procs: &mut ProcFinding,
        degraded: &mut Vec<String>,
    ) -> Option<Vec<(PathBuf, TreeManifest)>> {
        let m = prev?;
        if !scan {
            return Some(m.tmpfs.clone());
        }
        let now_tmpfs = match self.scan_tmpfs(now.unwrap_or_default()) {
            Ok(t) => t,
            Err(e) => {
                degraded.push(e.to_string());
                return None;
            }
        };
        let changed = decide::tmpfs_changes(&m.tmpfs, &now_tmpfs);
        if changed > 0 {
            *procs.kernel.entry("tmpfs-entries".into()).or_default() += changed;
            procs.changed = procs_changed(procs);
        }
        Some(now_tmpfs)
    }

    /// What changed of the processes since the mark `m`, `now` being those alive now: started,
    /// ended, re-exec'd, holding a file the turn changed (`fs`), memory or kernel-held state
    /// that differs from the mark's, kernel state the counters saw change. What the next mark
    /// needs of them (run counts, images) goes into `seen`.
    fn observe_processes(
        &self,
        now: &[ProcInfo],
        m: &Mark,
        counters: Option<&CgroupCounters>,
        fs: &FsFinding,
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) -> ProcFinding {
        let events = decide::process_events(counters, &m.counters);
        let delta = procs::delta(&m.processes, now);
        let mut procs = ProcFinding {
            started: delta.started.iter().map(ProcSummary::from).collect(),
            ended: delta.ended.iter().map(ProcSummary::from).collect(),
            kernel: events.kernel,
            forks: events.forks,
            execs: events.execs,
            exits: events.exits,
            ..ProcFinding::default()
        };
        let before: HashMap<u32, &ProcInfo> = m.processes.iter().map(|p| (p.pid, p)).collect();
        let changed_paths: Vec<&Path> = fs
            .added
            .iter()
            .chain(&fs.modified)
            .chain(&fs.deleted)
            .map(PathBuf::as_path)
            .collect();
        let keep = self.keeps_self_contained();
        for p in &delta.persisted {
            if before
                .get(&p.pid)
                .is_some_and(|b| b.cmdline != p.cmdline || b.comm != p.comm)
            {
                procs.reexeced.push(ProcSummary::from(p));
            }
            // CRIU restores open and mapped files by path and checks them: a file this
            // turn changed under a persisting process needs a new process image.
            if !changed_paths.is_empty() {
                note_held_files(p.pid, &changed_paths, &mut procs.held_changed, degraded);
            }
            let ran = self.ran_or_state_changed(p.pid, m, events.foreign_writes, seen, degraded);
            let how = Ran {
                ran,
                foreign_writes: events.foreign_writes,
                keep,
            };
            self.observe_memory(p, m, how, &mut procs, seen, degraded);
        }
        self.observe_started(&delta.started, seen, degraded);
        procs.changed = procs_changed(&procs);
        procs
    }

    /// Whether persisting process `pid` may have changed since the mark `m`: it ran
    /// ([`decide::ran_since_mark`]), or it did not and what the kernel holds for it changed.
    /// Notes its run count now in `seen`.
    fn ran_or_state_changed(
        &self,
        pid: u32,
        m: &Mark,
        foreign_writes: bool,
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) -> bool {
        // Memory: a process that was not scheduled since the mark did not change it,
        // unless another process wrote into it (ptrace, process_vm_writev, /proc/PID/mem).
        let runs_now = self.run_count(pid);
        let ran = decide::ran_since_mark(foreign_writes, runs_now, m.run_counts.get(&pid).copied());
        if let Some(n) = runs_now {
            seen.run_counts.insert(pid, n);
        }
        // Idle, so its memory is the mark's; what the kernel holds for it may not be
        // (a signal left pending, bytes queued in its FIFO or socket, a counter or a
        // position moved through a shared file, stopped): read that again. A change
        // makes it count as a process that ran: its whole image is taken and compared.
        let (false, Some(img)) = (ran, m.memory.get(&pid)) else {
            return ran;
        };
        match self.held_state_of(pid, &mut seen.obs) {
            Ok(st) => {
                let changes = memory::compare_held(&img.state, &st);
                if changes.is_empty() {
                    return false;
                }
                log::debug!(
                    "pid {} of {} did not run, and its kernel state changed: {}",
                    pid,
                    self.target.container_id,
                    changes.join(", ")
                );
                true
            }
            Err(e) => {
                memory_error(degraded, pid, e);
                true
            }
        }
    }

    /// The memory of persisting process `p` against its image at the mark `m`, into `procs`,
    /// as [`decide::memory_step`] says for one that `ran` or not: carried as idle, its shared
    /// memory read again, or captured and compared. The image for the next mark goes into
    /// `seen`.
    fn observe_memory(
        &self,
        p: &ProcInfo,
        m: &Mark,
        how: Ran,
        procs: &mut ProcFinding,
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) {
        let ran = how.ran;
        let prev_img = m.memory.get(&p.pid);
        let step = decide::memory_step(ran, prev_img);
        if let MemoryStep::Carry(img) = step {
            if let Err(e) = seen.obs.carry(img) {
                memory_error(degraded, p.pid, e);
            }
            seen.memory_images.insert(p.pid, img.clone());
            if m.unproven.contains(&p.pid) {
                seen.unproven.insert(p.pid);
            }
            procs.idle.push(p.pid);
            return;
        }
        if seen.missing {
            seen.unproven.insert(p.pid);
        }
        // One that did not run but maps shared memory: only that can have changed.
        let img = match step {
            MemoryStep::RefreshShared(prev_img) => {
                match memory::refresh_shared(prev_img, &mut seen.obs) {
                    Ok(Some(img)) => Ok(img),
                    Ok(None) => self.capture(p.pid, &mut seen.obs),
                    Err(e) => Err(e),
                }
            }
            _ => self.capture(p.pid, &mut seen.obs),
        };
        // Read after the image: whatever reached it before is in this count.
        let interactions_after = self.interactions(p.pid);
        match (img, prev_img) {
            (Ok(mut img), Some(prev_img)) => {
                let mut d = memory::compare(prev_img, &img);
                let mut interactions_after = interactions_after;
                // A thread of it was not asleep when its image was read (woken and waiting
                // for a CPU on a busy host): its count cannot vouch for that image. Once it is
                // asleep again (bounded), its image and count are read again.
                if how.keep
                    && d.changed_pages + d.added_pages + d.removed_pages > 0
                    && !img.state.threads.iter().all(|t| t.sleeping)
                    && all_asleep_within(p.pid, &mut seen.asleep_budget)
                {
                    if let Ok(again) = self.capture(p.pid, &mut seen.obs) {
                        interactions_after = self.interactions(p.pid);
                        d = memory::compare(prev_img, &again);
                        img = again;
                    }
                }
                let unproven_base = m.unproven.contains(&p.pid);
                let changed = d.changed_pages + d.added_pages + d.removed_pages > 0;
                let not_own = changed.then(|| {
                    decide::not_own(&decide::OwnDoing {
                        kept: how.keep,
                        foreign_writes: how.foreign_writes,
                        before: prev_img.interactions,
                        after: interactions_after,
                        prev: prev_img,
                        now: &img,
                        state_changes: d.state_counted.len(),
                        unproven: unproven_base,
                    })
                });
                let self_contained = not_own == Some(None);
                // Why a change the policy could have kept was not: in the answer and the log.
                let not_kept = not_own.flatten().filter(|_| how.keep);
                if let Some(why) = not_kept {
                    log::info!(
                        "pid {} of {} changed {} pages, not kept: {why:?}",
                        p.pid,
                        self.target.container_id,
                        d.changed_pages + d.added_pages + d.removed_pages
                    );
                }
                if self_contained {
                    log::info!(
                        "pid {} of {} changed {} pages by its own doing alone: its last image \
                         is kept",
                        p.pid,
                        self.target.container_id,
                        d.changed_pages + d.added_pages + d.removed_pages
                    );
                }
                procs.memory.push(MemoryFinding {
                    pid: p.pid,
                    cmdline: ProcSummary::from(p).cmdline,
                    changed_pages: d.changed_pages,
                    added_pages: d.added_pages,
                    removed_pages: d.removed_pages,
                    scanned_pages: d.scanned_pages,
                    unproven_base,
                    regions: d.by_region.iter().take(3).cloned().collect(),
                    state: d.state_counted.clone(),
                    self_contained,
                    not_kept,
                });
                seen.memory_images.insert(p.pid, img);
            }
            (Ok(img), None) => {
                degraded.push(decide::no_image_reason(p.pid, m.over_limit.as_deref()));
                seen.memory_images.insert(p.pid, img);
            }
            (Err(source), _) => memory_error(degraded, p.pid, source),
        }
    }

    /// Captures the processes `started` since the mark, for the next mark (`seen`): a started
    /// process is a change by itself, its memory is not compared. A `[limits]` bound its
    /// capture passed degrades the turn; any other failure is only logged.
    fn observe_started(
        &self,
        started: &[ProcInfo],
        seen: &mut TurnImages,
        degraded: &mut Vec<String>,
    ) {
        for p in started {
            if let Some(n) = self.run_count(p.pid) {
                seen.run_counts.insert(p.pid, n);
            }
            if seen.missing {
                seen.unproven.insert(p.pid);
            }
            match self.capture(p.pid, &mut seen.obs) {
                Ok(img) => {
                    seen.memory_images.insert(p.pid, img);
                }
                Err(e @ MemError::Limit { .. }) => memory_error(degraded, p.pid, e),
                Err(e) => log::debug!("memory of new pid {}: {e}", p.pid),
            }
        }
    }
}

/// What a turn end learnt of a persisting process before its memory is looked at.
#[derive(Debug, Clone, Copy)]
struct Ran {
    /// It may have changed since the mark ([`Inspection::ran_or_state_changed`]).
    ran: bool,
    /// Another task wrote into some process of the container since the mark.
    foreign_writes: bool,
    /// A self-contained change is kept ([`Inspection::keeps_self_contained`], once per turn).
    keep: bool,
}

/// An observation of the present ([`Inspection::peek`]) that can become the mark after the
/// container's files were reset in place ([`Inspection::rebase`]).
pub struct Observed(Mark);

/// The net change of the container's files since the mark, read with the container frozen
/// (for an in-place rollback, [`Inspection::fs_since_mark`]).
#[derive(Debug, Clone, Default)]
pub struct FsSinceMark {
    /// Container paths, as a turn answer lists them (volumes' below their mount points).
    pub changed: FsDiff,
    /// Changed directories of the upperdir that hide what the image has below them (opaque, or
    /// renamed with a redirect): their whole content must be compared, not only the paths
    /// listed.
    pub hiding: Vec<PathBuf>,
}

impl Inspection {
    /// What it watches.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Forks, execs, exits, foreign memory writes and kernel state changes ([`bpf::StateClass`]) in
    /// the container since `o` was observed;
    /// `None` when the probes cannot tell (blind).
    pub fn process_events_since(&self, o: &Observed) -> Option<u64> {
        let now = self.counters()?.ok()?;
        let then = &o.0.counters;
        Some(
            now.forks.saturating_sub(then.forks)
                + now.execs.saturating_sub(then.execs)
                + now.exits.saturating_sub(then.exits)
                + now
                    .foreign_mem_writes
                    .saturating_sub(then.foreign_mem_writes)
                + now.errors.saturating_sub(then.errors)
                + now.over_quota.saturating_sub(then.over_quota)
                + now.since(then).state_classes().map(|(_, n)| n).sum::<u64>(),
        )
    }

    /// The processes of `o` that have not been scheduled since it was observed, with their run
    /// counts now (for [`Self::refresh_after_freeze`] once a freeze that follows is over).
    pub fn idle_since(&self, o: &Observed) -> Vec<(u32, u64)> {
        o.0.processes
            .iter()
            .filter_map(|p| {
                let now = self.run_count(p.pid)?;
                (o.0.run_counts.get(&p.pid) == Some(&now)).then_some((p.pid, now))
            })
            .collect()
    }

    /// The net change of the files (upperdir and tracked volumes) since the mark, scanned now:
    /// the caller has frozen the container. An error when there is no mark or a tree cannot be
    /// scanned (the change is then unknown).
    pub fn fs_since_mark(&self) -> Result<FsSinceMark, InspectError> {
        let Some(mark) = &self.mark else {
            return Err(InspectError::NoMark);
        };
        let now = self.scan_upper()?;
        let mut out = FsSinceMark {
            changed: fs::diff(&mark.manifest, &now, &self.target.lowerdirs),
            hiding: Vec::new(),
        };
        for p in out.changed.added.iter().chain(&out.changed.modified) {
            let rel = p.strip_prefix("/").unwrap_or(p);
            if now
                .get(rel)
                .is_some_and(|m| m.kind == fs::EntryKind::Dir && (m.opaque || m.redirect.is_some()))
            {
                out.hiding.push(p.clone());
            }
        }
        let volumes = self.scan_volumes()?;
        let empty = TreeManifest::default();
        for (i, (at, _)) in self.target.volumes.iter().enumerate() {
            let before = mark.volumes.get(i).unwrap_or(&empty);
            let d = fs::diff(before, &volumes[i], &[]);
            let inside = |p: PathBuf| at.join(p.strip_prefix("/").unwrap_or(&p));
            out.changed.added.extend(d.added.into_iter().map(inside));
            out.changed
                .modified
                .extend(d.modified.into_iter().map(inside));
            out.changed
                .deleted
                .extend(d.deleted.into_iter().map(inside));
        }
        Ok(out)
    }

    /// Makes `o` the mark, with the files as they are now (scanned again, and the kernel
    /// counters read again): after the container's files were reset in place, with the
    /// container still frozen, the next turn is compared with the reset state.
    pub fn rebase(&mut self, o: Observed) -> Result<(), InspectError> {
        let counters = match self.counters() {
            Some(c) => c?,
            None => CgroupCounters::default(),
        };
        let manifest = self.scan_upper()?;
        let volumes = self.scan_volumes()?;
        self.mark = Some(Mark {
            counters,
            manifest,
            volumes,
            ..o.0
        });
        Ok(())
    }
}

/// How long [`Inspection::refresh_after_freeze`] waits, in all, for thawed processes to run.
const REFRESH_WAIT: std::time::Duration = std::time::Duration::from_millis(50);

/// Process `pid`'s interactions now, when `counted` (the inspection asked for them).
fn interactions_of(probes: Option<&HostProbes>, counted: bool, pid: u32) -> Option<u64> {
    probes
        .filter(|_| counted)
        .and_then(|p| p.interactions(pid).ok().flatten())
}

/// How long a turn end waits, for all processes together, for those whose change may be
/// self-contained to be asleep again ([`all_asleep_within`]).
const ASLEEP_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether every thread of process `pid` is in interruptible sleep (`S`) within what is left of
/// `budget` (which the wait uses up), looked at every millisecond. `false` when one is not by
/// then or the process cannot be read.
fn all_asleep_within(pid: u32, budget: &mut std::time::Duration) -> bool {
    let started = Instant::now();
    let asleep = asleep_by(pid, started + *budget);
    *budget = budget.saturating_sub(started.elapsed());
    asleep
}

fn asleep_by(pid: u32, deadline: Instant) -> bool {
    let task_dir = format!("/proc/{pid}/task");
    loop {
        let asleep = std::fs::read_dir(&task_dir).is_ok_and(|entries| {
            entries.flatten().all(|e| {
                std::fs::read_to_string(e.path().join("stat"))
                    .ok()
                    .and_then(|t| procs::parse_stat(&t))
                    .is_some_and(|st| st.state == 'S')
            })
        });
        if asleep {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Where the file of a shared writable mapping lives, as far as arming is concerned.
#[derive(Debug)]
enum Mapped<'a> {
    /// On a tracked tree: the host root it lies beneath and its path relative to it.
    Tracked(BorrowedFd<'a>, PathBuf),
    /// Not on a tracked tree (shared memory objects, other mounts): nothing to arm.
    Untracked,
    /// On a tracked tree, but its printed name does not lead to it.
    Unreachable,
}

/// Decides [`Mapped`] for the mapping of inode `(dev, ino)` printed as `path`, in the process
/// view `view`, given the tracked trees `(path in the container, host root, device in the view)`.
/// A tree mounted inside another (a volume under `/`) wins by the longer prefix.
fn locate_mapping<'a>(
    view: BorrowedFd<'_>,
    path: &Path,
    dev: Option<u64>,
    ino: u64,
    tracked: &[(&Path, BorrowedFd<'a>, Option<u64>)],
) -> Mapped<'a> {
    let Some(dev) = dev else {
        return Mapped::Untracked;
    };
    let on_tracked_device = tracked.iter().any(|t| t.2 == Some(dev));
    if procs::identity_in_view(view, path).ok() != Some((dev, ino)) {
        return if on_tracked_device {
            Mapped::Unreachable
        } else {
            Mapped::Untracked
        };
    }
    let tree = tracked
        .iter()
        .filter(|t| path.starts_with(t.0))
        .max_by_key(|t| t.0.components().count());
    match tree {
        Some(&(at, root, Some(tree_dev))) if tree_dev == dev => {
            Mapped::Tracked(root, path.strip_prefix(at).unwrap_or(path).to_path_buf())
        }
        _ => Mapped::Untracked,
    }
}

/// The memory of `pid` the kernel writes by itself: its threads' rseq areas, as the BPF side
/// saw them and as the checkpoint image it was restored from said (`seeds`, for the threads
/// that still exist) (`struct rseq`, 32 bytes; hashed as zeros, see [`memory`]).
fn volatile_of(probes: Option<&HostProbes>, seeds: &RseqSeeds, pid: u32) -> Vec<(u64, u64)> {
    const RSEQ_BYTES: u64 = 32;
    let mut areas: Vec<u64> = probes
        .and_then(|p| p.rseq_areas(pid).ok())
        .map(|(areas, _)| areas)
        .unwrap_or_default();
    if let Some(seeded) = seeds.get(&pid) {
        let live = procs::thread_ids(pid);
        areas.extend(
            seeded
                .iter()
                .filter(|(tid, _)| live.contains(tid))
                .map(|(_, a)| *a),
        );
    }
    areas.sort_unstable();
    areas.dedup();
    areas.into_iter().map(|a| (a, RSEQ_BYTES)).collect()
}

/// Says in `degraded` why the memory of `pid` was not compared: a bound of the container's
/// (said once, whichever process passed it) or that process's own error.
fn memory_error(degraded: &mut Vec<String>, pid: u32, source: MemError) {
    match source {
        MemError::Limit { .. } => {
            let why = source.to_string();
            if !degraded.contains(&why) {
                degraded.push(why);
            }
        }
        source => degraded.push(InspectError::Memory { pid, source }.to_string()),
    }
}

/// Notes in `held_changed` the files persisting process `pid` holds (open or mapped) that the
/// turn changed (`changed_paths`) or that are deleted.
fn note_held_files(
    pid: u32,
    changed_paths: &[&Path],
    held_changed: &mut Vec<(u32, PathBuf)>,
    degraded: &mut Vec<String>,
) {
    match procs::held_files(pid) {
        Ok(held) => {
            for h in held {
                if h.deleted || changed_paths.iter().any(|c| *c == h.path) {
                    held_changed.push((pid, h.path));
                }
            }
        }
        Err(source) => degraded.push(InspectError::HeldFiles { pid, source }.to_string()),
    }
}

/// A memory image whose fd state keeps at most `max_fdinfo_bytes` of fdinfo text, with the
/// ranges `volatile` hashed as zeros, as part of the observation `obs` (its per-container
/// bounds, its shared objects read once).
fn capture_bounded(
    pid: u32,
    max_fdinfo_bytes: u64,
    volatile: Vec<(u64, u64)>,
    obs: &mut Observation,
) -> Result<MemoryImage, memory::MemError> {
    memory::capture_in(
        pid,
        &memory::CaptureOptions {
            max_fdinfo_bytes: Some(max_fdinfo_bytes),
            volatile,
            ..Default::default()
        },
        obs,
    )
}

impl Drop for Inspection {
    fn drop(&mut self) {
        if let (Some(p), Some(id)) = (&self.probes, self.cgroup_id) {
            if let Err(e) = p.unwatch(id) {
                log::warn!(
                    "cannot unwatch cgroup {id} of {}: {e}",
                    self.target.container_id
                );
            }
        }
    }
}

/// What the root-only tests of the inspector on the real system (`tests/root_inspector.rs`)
/// call below a turn end.
#[doc(hidden)]
pub mod testing {
    use super::Inspection;

    /// Arms the container's shared writable mappings of files (as a turn end's mark does);
    /// returns what could not be armed.
    pub fn arm_shared_mappings(inspection: &Inspection) -> Vec<String> {
        inspection.arm_shared_mappings()
    }
}

#[cfg(test)]
mod tests;

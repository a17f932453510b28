//! Process checkpoints: `runc checkpoint` (CRIU) of a running container, checked to hold every
//! live process of the container, with its page data deduplicated ([`super::pages`]).
//!
//! The trap: `runc checkpoint` dumps the process tree under the container's
//! init. A process started by `exec` is a child of the shim, not of init, and while its main
//! process runs, it and its descendants are outside that tree: CRIU only warns ("Unexpected
//! process in the freezer cgroup") and the dump reports success. Background processes an exec
//! left behind after its main process exited are re-parented to init and are dumped. So
//! [`check_dumpable`] refuses up front when a live process of the container does not descend
//! from init, and [`checkpoint`] verifies afterwards, from the image's own process tree, that
//! nothing live was missed (processes may have started between the check and the dump).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs, io,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{
    inspector::procs::{self, ProcInfo},
    runc::{CheckpointOpts, OciRuntime as _, Runc},
};

use super::{
    criu_proto::{DecodeError, IMG_COMMON_MAGIC},
    criu_rpc::{proto_fields, ProtoValue},
    pages::{self, DedupStats, PagesError},
    store::{ProcessTimings, Timings},
};

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// Live processes a dump would silently leave out, typically an exec's main process that is
    /// still running (its parent is the shim).
    #[error("{} live process(es) of the container do not descend from its init {init} and would be missing from a checkpoint: {}", pids.len(), describe(pids, cmdlines))]
    Undumpable {
        init: u32,
        pids: Vec<u32>,
        cmdlines: Vec<String>,
    },
    #[error("the container's init {0} is not running")]
    InitGone(u32),
    #[error("reading the container's processes: {0}")]
    Procs(#[from] procs::ProcfsError),
    #[error("{} failed: {message}{}{}", match *driver { "runc" => "runc checkpoint", _ => "the CRIU dump" }, criu_log.as_ref().map(|l| format!(" (CRIU: {})", l.join("; "))).unwrap_or_default(), hint.map(|h| format!(". {h}")).unwrap_or_default())]
    Dump {
        /// `runc` or `criu` ([`Dumper`]).
        driver: &'static str,
        message: String,
        criu_log: Option<Vec<String>>,
        hint: Option<&'static str>,
    },
    /// The dump succeeded but its process tree lacks processes that were alive at dump time.
    #[error("checkpoint image {} lacks {} live process(es) of the container: {}", dir.display(), pids.len(), describe(pids, cmdlines))]
    Incomplete {
        dir: PathBuf,
        pids: Vec<u32>,
        cmdlines: Vec<String>,
    },
    #[error("bad CRIU image {}: {source}", path.display())]
    Image {
        path: PathBuf,
        #[source]
        source: DecodeError,
    },
    /// Processes in a job-control stop (SIGSTOP) that this dump cannot seize, and why.
    #[error("process(es) {pids:?} of the container are stopped (SIGSTOP or a terminal stop), which this dump cannot seize: {why}")]
    Stopped { pids: Vec<u32>, why: &'static str },
    #[error("page deduplication: {0}")]
    Pages(#[from] PagesError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

fn describe(pids: &[u32], cmdlines: &[String]) -> String {
    pids.iter()
        .zip(cmdlines)
        .map(|(p, c)| format!("pid {p} `{c}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn io_err(context: impl std::fmt::Display) -> impl FnOnce(io::Error) -> ProcError {
    let context = context.to_string();
    move |source| ProcError::Io { context, source }
}

fn cmdline_of(p: &ProcInfo) -> String {
    if p.cmdline.is_empty() {
        format!("[{}]", p.comm)
    } else {
        p.cmdline.join(" ")
    }
}

/// A finished process checkpoint: a CRIU image directory whose pages files were replaced by
/// recipes over the shared chunk store.
#[derive(Debug, Clone)]
pub struct ProcCheckpoint {
    pub dir: PathBuf,
    /// Host pids of the processes in the image.
    pub pids: Vec<u32>,
    /// The image as CRIU wrote it.
    pub bytes_logical: u64,
    /// What it added to the disk: its files after deduplication plus the new chunks.
    pub bytes_stored: u64,
    pub duration: Duration,
    /// `runc checkpoint` alone (the container is frozen for part of it).
    pub dump: Duration,
    pub dedup: DedupStats,
    /// Where the time went, phase by phase.
    pub timings: ProcessTimings,
}

/// How many steps up the parent chain before giving up (a loop can only come from pid reuse
/// racing with the walk).
const MAX_DEPTH: usize = 4096;

/// Does `pid` descend from `init` (or is it `init`)? `None` if a process on the way vanished:
/// its children are being re-parented, so the caller retries.
fn descends_from(pid: u32, init: u32) -> Result<Option<bool>, ProcError> {
    let mut cur = pid;
    for _ in 0..MAX_DEPTH {
        if cur == init {
            return Ok(Some(true));
        }
        if cur <= 1 {
            return Ok(Some(false));
        }
        match procs::read_stat(cur)? {
            Some(stat) => cur = stat.ppid,
            None => return Ok(None),
        }
    }
    Ok(Some(false))
}

/// Every live process in `cgroup_dir` (the container's cgroup) must descend from the container's
/// init, or `runc checkpoint` would silently leave it out. Returns the live pids (sorted), or
/// [`ProcError::Undumpable`] naming the others.
pub fn check_dumpable(init_pid: u32, cgroup_dir: &Path) -> Result<Vec<u32>, ProcError> {
    if procs::read_stat(init_pid)?.is_none() {
        return Err(ProcError::InitGone(init_pid));
    }
    let live = procs::list(cgroup_dir)?;
    let mut outside = Vec::new();
    let mut pids = Vec::with_capacity(live.len());
    for p in live {
        let mut verdict = None;
        for _ in 0..3 {
            verdict = descends_from(p.pid, init_pid)?;
            if verdict.is_some() {
                break;
            }
        }
        match verdict {
            Some(true) => pids.push(p.pid),
            // The process itself exited: nothing to dump.
            _ if procs::identity(p.pid)? != Some(p.identity()) => {}
            // Still unsettled after retries: count it as missed rather than guess.
            _ => outside.push(p),
        }
    }
    if !outside.is_empty() {
        return Err(ProcError::Undumpable {
            init: init_pid,
            pids: outside.iter().map(|p| p.pid).collect(),
            cmdlines: outside.iter().map(cmdline_of).collect(),
        });
    }
    Ok(pids)
}

pub use super::criu_proto::{parse_pstree, PstreeEntry};

/// The process tree of the CRIU image in `dir` ([`parse_pstree`]).
pub fn read_pstree(dir: &Path) -> Result<Vec<PstreeEntry>, ProcError> {
    let path = dir.join("pstree.img");
    let data = fs::read(&path).map_err(io_err(format!("reading {}", path.display())))?;
    parse_pstree(&data).map_err(|source| ProcError::Image { path, source })
}

/// `NSpid` of `/proc/PID/status`: the pid in each pid namespace, outermost first.
fn ns_pids(pid: u32) -> Result<Option<Vec<u32>>, ProcError> {
    let path = format!("/proc/{pid}/status");
    let text = match fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            return Ok(None)
        }
        Err(e) => return Err(io_err(path)(e)),
    };
    let line = text.lines().find_map(|l| l.strip_prefix("NSpid:"));
    Ok(line.map(|l| {
        l.split_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect()
    }))
}

/// Now, in the clock of `/proc/PID/stat`'s start time (boot-time clock ticks).
fn boot_ticks() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: plain syscalls with valid arguments.
    let hz = unsafe {
        libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts);
        libc::sysconf(libc::_SC_CLK_TCK)
    }
    .max(1) as u64;
    ts.tv_sec as u64 * hz + ts.tv_nsec as u64 * hz / 1_000_000_000
}

/// Compares the live processes of the container with the image's process tree. A live process
/// that started no later than the dump began (`dump_start`, boot ticks) must be in the image.
/// Returns the host pids found in the image.
///
/// Why the start and not the end of the dump: the container keeps running once CRIU thaws it,
/// so a loop that forks (`while :; do sleep 0.2; done`) has new children alive by the time
/// `runc checkpoint` returns. They began after the image was taken and are not lost; a
/// process alive before the dump began and absent from the image is.
fn verify_image(
    init_pid: u32,
    cgroup_dir: &Path,
    dir: &Path,
    dump_start: u64,
) -> Result<Vec<u32>, ProcError> {
    let tree = read_pstree(dir)?;
    let in_image: BTreeSet<u32> = tree.iter().map(|e| e.pid).collect();
    // The container's pid namespace is init's innermost one; a process of a namespace nested
    // inside it has more levels, and its pid at init's level is what CRIU recorded.
    let level = ns_pids(init_pid)?
        .ok_or(ProcError::InitGone(init_pid))?
        .len();
    let mut found = Vec::new();
    let mut missing: BTreeMap<u32, String> = BTreeMap::new();
    for p in procs::list(cgroup_dir)? {
        if p.start_time > dump_start {
            continue;
        }
        let Some(ns) = ns_pids(p.pid)? else { continue };
        match ns.get(level.wrapping_sub(1)) {
            Some(nspid) if ns.len() >= level && in_image.contains(nspid) => found.push(p.pid),
            _ => {
                // Gone meanwhile: it was not alive to be lost.
                if procs::identity(p.pid)? == Some(p.identity()) {
                    missing.insert(p.pid, cmdline_of(&p));
                }
            }
        }
    }
    if !missing.is_empty() {
        return Err(ProcError::Incomplete {
            dir: dir.to_path_buf(),
            pids: missing.keys().copied().collect(),
            cmdlines: missing.into_values().collect(),
        });
    }
    Ok(found)
}

/// The `Error` lines of CRIU's log, minus the one every dump here logs (CAP_SYS_RESOURCE is
/// withheld, so raising RLIMIT_NOFILE fails harmlessly).
pub(crate) fn criu_errors(log: &Path) -> Option<Vec<String>> {
    let text = fs::read_to_string(log).ok()?;
    let lines: Vec<String> = text
        .lines()
        .filter(|l| l.contains("Error (") && !l.contains("RLIMIT_NOFILE"))
        .map(|l| l.trim().to_string())
        .collect();
    let start = lines.len().saturating_sub(5);
    Some(lines[start..].to_vec())
}

/// Causes of dump failures that CRIU's log does not spell out.
fn known_cause(criu_log: &[String]) -> Option<&'static str> {
    // Linux 6.16 restricted SO_PASSCRED/SO_PASSSEC to unix and netlink sockets; CRIU before 4.2
    // still reads them from every socket, so it cannot dump any TCP or UDP socket there.
    criu_log.iter().any(|l| l.contains("Can't get 1:16 opt")).then_some(
        "CRIU older than 4.2 cannot dump inet sockets on Linux 6.16 and later: install CRIU 4.2 or newer",
    )
}

fn dir_bytes(dir: &Path) -> Result<u64, ProcError> {
    let mut total = 0;
    for entry in fs::read_dir(dir).map_err(io_err(format!("reading {}", dir.display())))? {
        let entry = entry.map_err(io_err(format!("reading {}", dir.display())))?;
        let meta = entry
            .metadata()
            .map_err(io_err(format!("stat {}", entry.path().display())))?;
        if meta.is_file() {
            total += meta.len();
        }
    }
    Ok(total)
}

/// CRIU's own figures of one dump, in milliseconds (its `stats-dump` file, in the work
/// directory).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CriuDumpStats {
    pub freezing_ms: f64,
    pub frozen_ms: f64,
    pub memdump_ms: f64,
    pub memwrite_ms: f64,
    pub pages_written: u64,
}

/// The head of CRIU's service files (`IMG_SERVICE_MAGIC`: statistics, not image files).
const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;
const IMG_SERVICE_MAGIC_STATS: u32 = 0x5709_3306;

/// Parses CRIU's `stats-dump`: a service or common head, the stats magic, then one
/// `StatsEntry` whose field 1 is a `DumpStatsEntry` (times in microseconds: freezing 1,
/// frozen 2, memdump 3, memwrite 4; pages_written 7). `None` when it is not that.
pub fn parse_dump_stats(data: &[u8]) -> Option<CriuDumpStats> {
    let u32_at = |p: usize| {
        data.get(p..p + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let mut pos = 0;
    let mut magic = u32_at(pos)?;
    pos += 4;
    if magic == IMG_COMMON_MAGIC || magic == IMG_SERVICE_MAGIC {
        magic = u32_at(pos)?;
        pos += 4;
    }
    if magic != IMG_SERVICE_MAGIC_STATS {
        return None;
    }
    let size = u32_at(pos)? as usize;
    pos += 4;
    let entry = data.get(pos..pos.checked_add(size)?)?;
    let dump = proto_fields(entry)?
        .into_iter()
        .find_map(|(field, v)| match (field, v) {
            (1, ProtoValue::Bytes(b)) => Some(b),
            _ => None,
        })?;
    let mut st = CriuDumpStats::default();
    for (field, v) in proto_fields(dump)? {
        let ProtoValue::Varint(v) = v else { continue };
        let ms = v as f64 / 1000.0;
        match field {
            1 => st.freezing_ms = ms,
            2 => st.frozen_ms = ms,
            3 => st.memdump_ms = ms,
            4 => st.memwrite_ms = ms,
            7 => st.pages_written = v,
            _ => {}
        }
    }
    Some(st)
}

/// How long CRIU ran by its own log: the last line's timestamp (`(SS.UUUUUU) ...`, seconds
/// since CRIU opened the log), in milliseconds.
pub fn criu_log_span(text: &str) -> Option<f64> {
    text.lines().rev().find_map(|l| {
        let stamp = l.trim_start().strip_prefix('(')?.split_once(')')?.0;
        let (sec, usec) = stamp.trim().split_once('.')?;
        let (sec, usec): (u64, u64) = (sec.parse().ok()?, usec.parse().ok()?);
        (usec < 1_000_000).then(|| sec as f64 * 1000.0 + usec as f64 / 1000.0)
    })
}

/// CRIU's figures for a dump whose work directory is `work`, into `t` (left absent if CRIU
/// left none).
fn read_criu_figures(work: &Path, t: &mut ProcessTimings) {
    if let Ok(text) = fs::read_to_string(work.join("dump.log")) {
        t.criu_ms = criu_log_span(&text);
    }
    if let Some(st) = fs::read(work.join("stats-dump"))
        .ok()
        .and_then(|d| parse_dump_stats(&d))
    {
        t.freezing_ms = Some(st.freezing_ms);
        t.frozen_ms = Some(st.frozen_ms);
        t.memdump_ms = Some(st.memdump_ms);
        t.memwrite_ms = Some(st.memwrite_ms);
    }
}

/// The directory CRIU logs to while dumping into `dir`: a sibling, so logs never enter the image;
/// named `*.tmp` so the store sweeps one left by a failed dump (kept for its log) on open.
pub fn work_dir(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".work.tmp");
    dir.with_file_name(name)
}

/// Removes a partial image; the error being returned matters more than a failed cleanup.
fn discard(dir: &Path) {
    if let Err(e) = fs::remove_dir_all(dir) {
        if e.kind() != io::ErrorKind::NotFound {
            log::warn!("cannot remove partial checkpoint {}: {e}", dir.display());
        }
    }
}

/// How a process image is dumped (`[checkpoint] process_dump`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dumper {
    /// `runc checkpoint`: runc starts CRIU (twice: its version, then the dump).
    Runc,
    /// CRIU's RPC directly ([`super::criu_rpc`]), with the options runc would pass.
    Criu { binary: PathBuf },
}

impl Dumper {
    pub fn from_config(config: &crab_runtime_config::Config) -> Dumper {
        match config.checkpoint.process_dump {
            crab_runtime_config::ProcessDump::Runc => Dumper::Runc,
            crab_runtime_config::ProcessDump::Criu => Dumper::Criu {
                binary: super::criu_rpc::criu_binary(config),
            },
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Dumper::Runc => "runc",
            Dumper::Criu { .. } => "criu",
        }
    }
}

/// Checkpoints container `id` (init `init_pid`, cgroup `cgroup_dir`) into `dir`, which must not
/// exist yet, leaving it running: [`check_dumpable`], the dump (`runc checkpoint
/// --leave-running`, or the same through CRIU's RPC: see [`Dumper`]; established TCP
/// connections, file locks and external unix sockets allowed), verification of the image's
/// process tree against the live processes, then page deduplication into `chunks`. On any
/// failure `dir` is removed; CRIU's log stays in [`work_dir`]`(dir)` only then. `netns`:
/// what the container was given, when its network namespace may be left out of the image
/// ([`super::netns`]); `None`: always dumped.
#[allow(clippy::too_many_arguments)]
pub async fn checkpoint(
    runc: &Runc,
    dumper: &Dumper,
    id: &str,
    init_pid: u32,
    cgroup_dir: &Path,
    dir: &Path,
    chunks: &Path,
    netns: Option<&super::netns::Eligibility>,
) -> Result<ProcCheckpoint, ProcError> {
    let started = Instant::now();
    let mut timings = ProcessTimings {
        driver: dumper.name().into(),
        ..Default::default()
    };
    if dir.exists() {
        return Err(io_err(format!("checkpoint directory {}", dir.display()))(
            io::ErrorKind::AlreadyExists.into(),
        ));
    }
    // The container is frozen by crab before CRIU starts: CRIU polls its freezer every 100 ms
    // (one poll is most of a small dump's freeze), this one every few microseconds. CRIU,
    // finding the cgroup frozen, seizes the tasks and leaves it frozen when done; crab thaws
    // it as soon as CRIU has answered. The trap check then also sees the very tree CRIU dumps.
    let freezing = Instant::now();
    let mut frozen = freeze(init_pid).await;
    timings.freeze_ms = Timings::ms(freezing.elapsed());
    let seize = match seize_for(id, dumper, cgroup_dir, &mut frozen).await {
        Ok(seize) => seize,
        Err(e) => {
            thaw(id, frozen).await;
            return Err(e);
        }
    };
    let result = dump_frozen(
        runc,
        dumper,
        id,
        init_pid,
        cgroup_dir,
        dir,
        seize,
        netns,
        &mut timings,
    )
    .await;
    let thawing = Instant::now();
    if thaw(id, frozen).await {
        timings.thaw_ms = Timings::ms(thawing.elapsed());
    }
    let (work, dump_start) = result?;
    let dump = Duration::from_secs_f64(timings.dump_ms / 1000.0);
    finish(
        id, init_pid, cgroup_dir, dir, chunks, &work, dump_start, dump, started, timings,
    )
    .await
}

/// Thaws what [`freeze`] froze; whether there was anything to thaw.
async fn thaw(id: &str, frozen: Option<crate::sys::cgroup::freezer::CgroupFreezer>) -> bool {
    use crate::sys::cgroup::freezer::Freezer;
    let Some(freezer) = frozen else {
        return false;
    };
    let thawed = tokio::task::spawn_blocking(move || freezer.thaw())
        .await
        .map_err(io::Error::other)
        .and_then(|r| r);
    if let Err(e) = thawed {
        log::error!("checkpoint of {id}: cannot thaw the container after the dump: {e}");
    }
    true
}

/// How CRIU stops the container's tasks for the dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seize {
    /// Through the cgroup freezer (runc's way; frozen by crab beforehand).
    Freezer,
    /// Each task with ptrace, the cgroup thawed: for a container holding a process in a
    /// job-control stop (see [`seize_for`]).
    Ptrace,
}

/// How the dump seizes the container's tasks. A process in a job-control stop (SIGSTOP)
/// cannot be seized in a frozen cgroup v1: `PTRACE_SEIZE` wakes the stopped task to move it
/// to a trap stop and waits (killable) for it to get there, which a frozen task never does,
/// so CRIU waited in D state until its timeout. Such a container is dumped with the freezer
/// thawed (`frozen` is thawed and emptied) and every task seized with ptrace, which CRIU
/// handles for stopped tasks (it records the stop and restores it). The check runs with the
/// container frozen, so no process of it can stop another meanwhile. `runc checkpoint` always
/// hands CRIU the freezer: with it such a dump fails here at once, saying why, instead of
/// after CRIU's timeout; so does a container paused by its user (its freezer is not ours to
/// thaw).
async fn seize_for(
    id: &str,
    dumper: &Dumper,
    cgroup_dir: &Path,
    frozen: &mut Option<crate::sys::cgroup::freezer::CgroupFreezer>,
) -> Result<Seize, ProcError> {
    use crate::sys::cgroup::freezer::CgroupVersion;
    let dir = cgroup_dir.to_path_buf();
    let stopped = tokio::task::spawn_blocking(move || procs::job_stopped(&dir))
        .await
        .map_err(|e| io_err("listing stopped processes")(io::Error::other(e)))??;
    if stopped.is_empty() {
        return Ok(Seize::Freezer);
    }
    let paused = frozen.as_ref().is_some_and(|f| f.frozen_by_someone_else());
    let v1 = frozen
        .as_ref()
        .is_none_or(|f| f.version() == CgroupVersion::V1);
    let refused = match dumper {
        _ if paused => Some("the container is paused, and its freezer is not crab's to thaw: resume it first"),
        Dumper::Runc if v1 => Some("`runc checkpoint` always seizes through the cgroup v1 freezer, which cannot seize a stopped task: `[checkpoint] process_dump = \"criu\"` dumps it"),
        _ => None,
    };
    if let Some(why) = refused {
        return Err(ProcError::Stopped { pids: stopped, why });
    }
    if !matches!(dumper, Dumper::Criu { .. }) {
        // runc on a cgroup v2 freezer, which was not seen to hang.
        return Ok(Seize::Freezer);
    }
    log::info!(
        "checkpoint of {id}: process(es) {stopped:?} in a job-control stop: dumped with every \
         task seized by ptrace, the freezer thawed"
    );
    thaw(id, frozen.take()).await;
    Ok(Seize::Ptrace)
}

/// Freezes the container of `init_pid` (see [`checkpoint`]); `None` when its freezer cannot
/// be used (CRIU then freezes it itself).
async fn freeze(init_pid: u32) -> Option<crate::sys::cgroup::freezer::CgroupFreezer> {
    use crate::sys::cgroup::freezer::{CgroupFreezer, Freezer};
    let frozen = tokio::task::spawn_blocking(move || {
        let f = CgroupFreezer::for_pid(init_pid)?.with_timeout(Duration::from_secs(5));
        f.freeze()?;
        Ok::<_, io::Error>(f)
    })
    .await
    .map_err(io::Error::other)
    .and_then(|r| r);
    match frozen {
        Ok(f) => Some(f),
        Err(e) => {
            log::warn!(
                "process checkpoint: cannot freeze the container beforehand ({e}): CRIU freezes it"
            );
            None
        }
    }
}

/// Whether the dump of container `id` (init `init_pid`, live `pids`, frozen) leaves its
/// network namespace out: what it was given allows it and the kernel agrees
/// ([`super::netns`]).
fn leave_out_netns(
    id: &str,
    given: &super::netns::Eligibility,
    init_pid: u32,
    pids: &[u32],
) -> bool {
    if !given.holds() {
        return false;
    }
    match super::netns::kernel_agrees(Path::new("/proc"), init_pid, pids) {
        Ok(Ok(())) => true,
        Ok(Err(dissent)) => {
            log::debug!("{id}: network namespace dumped: {dissent}");
            false
        }
        Err(e) => {
            log::debug!("{id}: network namespace dumped (cannot read /proc: {e})");
            false
        }
    }
}

/// The trap check and the dump of a frozen container (or of one CRIU seizes with ptrace:
/// `seize`); returns CRIU's work directory and the dump's start (boot ticks). `netns`: what
/// the container was given, when its network namespace may be left out
/// (`[checkpoint] network_namespace`); `None`: always dumped.
#[allow(clippy::too_many_arguments)]
async fn dump_frozen(
    runc: &Runc,
    dumper: &Dumper,
    id: &str,
    init_pid: u32,
    cgroup_dir: &Path,
    dir: &Path,
    seize: Seize,
    netns: Option<&super::netns::Eligibility>,
    timings: &mut ProcessTimings,
) -> Result<(PathBuf, u64), ProcError> {
    let checking = Instant::now();
    let pids = check_dumpable(init_pid, cgroup_dir)?;
    timings.check_ms = Timings::ms(checking.elapsed());
    let work = work_dir(dir);
    discard(&work);
    let dump_started = Instant::now();
    let dump_start = boot_ticks();
    let dumped = match dumper {
        Dumper::Runc => {
            let opts = CheckpointOpts {
                image_path: dir.to_path_buf(),
                work_path: Some(work.clone()),
                leave_running: true,
                tcp_established: true,
                ext_unix_sk: true,
                file_locks: true,
                ..Default::default()
            };
            runc.checkpoint(id, &opts).await.map_err(|e| match e {
                crate::runc::RuncError::Failed { message, .. } => message,
                e => e.to_string(),
            })
        }
        Dumper::Criu { binary } => {
            // The container is frozen: no process of it can open a connection meanwhile.
            let skip_network_lock = !super::criu_rpc::netns_needs_network_lock(init_pid);
            log::debug!("{id}: dump with the network lock: {}", !skip_network_lock);
            let empty_netns = netns.is_some_and(|e| leave_out_netns(id, e, init_pid, &pids));
            timings.netns_left_out = empty_netns;
            let opts = super::criu_rpc::DumpOptions {
                leave_running: true,
                tcp_established: true,
                ext_unix_sk: true,
                file_locks: true,
                skip_network_lock,
                ptrace_seize: seize == Seize::Ptrace,
                empty_netns,
                ..Default::default()
            };
            let run_dir = super::criu_rpc::kdat_dir();
            super::criu_rpc::dump(
                binary,
                &runc.root,
                id,
                dir,
                &work,
                &opts,
                run_dir.as_deref(),
            )
            .await
            .map_err(|e| e.to_string())
        }
    };
    timings.dump_ms = Timings::ms(dump_started.elapsed());
    read_criu_figures(&work, timings);
    if let Err(message) = dumped {
        discard(dir);
        let criu_log = criu_errors(&work.join("dump.log"));
        let hint = criu_log.as_deref().and_then(known_cause);
        return Err(ProcError::Dump {
            driver: dumper.name(),
            message,
            criu_log,
            hint,
        });
    }
    Ok((work, dump_start))
}

/// After the dump: the image's process tree against the live processes, page deduplication,
/// durability; `dir` is removed on failure.
#[allow(clippy::too_many_arguments)]
async fn finish(
    id: &str,
    init_pid: u32,
    cgroup_dir: &Path,
    dir: &Path,
    chunks: &Path,
    work: &Path,
    dump_start: u64,
    dump: Duration,
    started: Instant,
    mut timings: ProcessTimings,
) -> Result<ProcCheckpoint, ProcError> {
    let finish = async {
        let verifying = Instant::now();
        let pids = verify_image(init_pid, cgroup_dir, dir, dump_start)?;
        let bytes_logical = dir_bytes(dir)?;
        timings.verify_ms = Timings::ms(verifying.elapsed());
        let (d, c) = (dir.to_path_buf(), chunks.to_path_buf());
        let (dedup, dedup_took, sync_took) = tokio::task::spawn_blocking(move || {
            let deduping = Instant::now();
            let stats = pages::dedup_unsynced(&d, &c)?;
            let dedup_took = deduping.elapsed();
            let syncing = Instant::now();
            pages::sync(&d, &c)?;
            Ok::<_, PagesError>((stats, dedup_took, syncing.elapsed()))
        })
        .await
        .map_err(|e| io_err("page deduplication task")(io::Error::other(e)))??;
        timings.dedup_ms = Timings::ms(dedup_took);
        timings.sync_ms = Timings::ms(sync_took);
        let bytes_stored = dir_bytes(dir)? + dedup.bytes_new + dedup.index_bytes;
        Ok::<_, ProcError>((pids, bytes_logical, bytes_stored, dedup))
    };
    match finish.await {
        Ok((pids, bytes_logical, bytes_stored, dedup)) => {
            discard(work);
            let cp = ProcCheckpoint {
                dir: dir.to_path_buf(),
                pids,
                bytes_logical,
                bytes_stored,
                duration: started.elapsed(),
                dump,
                dedup,
                timings,
            };
            let t = &cp.timings;
            let opt = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v:.1}"));
            log::info!(
                "proc checkpoint of {id}: {} processes, {} bytes logical, {} stored ({} new chunks), total {:.1} ms: freeze {:.1}, check {:.1}, dump ({}) {:.1} (CRIU {}: freezing {}, frozen {}, memdump {}, memwrite {}), thaw {:.1}, verify {:.1}, dedup {:.1}, sync {:.1}",
                cp.pids.len(),
                cp.bytes_logical,
                cp.bytes_stored,
                cp.dedup.chunks_new,
                Timings::ms(cp.duration),
                t.freeze_ms,
                t.check_ms,
                t.driver,
                t.dump_ms,
                opt(t.criu_ms),
                opt(t.freezing_ms),
                opt(t.frozen_ms),
                opt(t.memdump_ms),
                opt(t.memwrite_ms),
                t.thaw_ms,
                t.verify_ms,
                t.dedup_ms,
                t.sync_ms,
            );
            Ok(cp)
        }
        Err(e) => {
            discard(dir);
            Err(e)
        }
    }
}

/// The checks [`checkpoint`] makes, callable alone by the root-only tests of real containers
/// (`tests/root_criu.rs`).
#[doc(hidden)]
pub mod testing {
    use super::*;

    /// See `boot_ticks`.
    pub fn boot_ticks() -> u64 {
        super::boot_ticks()
    }

    /// See `verify_image`.
    pub fn verify_image(
        init_pid: u32,
        cgroup_dir: &Path,
        dir: &Path,
        dump_start: u64,
    ) -> Result<Vec<u32>, ProcError> {
        super::verify_image(init_pid, cgroup_dir, dir, dump_start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn criu_figures_from_its_log_and_stats() {
        let log = "(00.000000) Version: 4.2.1\n(00.004512) Dumping\n(01.250001) Dumping finished successfully\n";
        assert_eq!(criu_log_span(log), Some(1250.001));
        // A last line without a stamp is passed over; nothing stamped at all is no figure.
        assert_eq!(criu_log_span("(00.5) a\nno stamp\n"), Some(0.005));
        for bad in ["", "nothing\n", "(x.1) a", "(1.99999999) a", "(1.-1) a"] {
            assert_eq!(criu_log_span(bad), None, "{bad:?}");
        }

        // A stats-dump as CRIU writes it: service head, stats magic, one StatsEntry whose
        // field 1 is a DumpStatsEntry (freezing 1200 us, frozen 45000, memdump 3000, memwrite
        // 9000, pages_written 2561 = varint 0x81 0x14).
        let dump = [
            0x08, 0xb0, 0x09, 0x10, 0xc8, 0xdf, 0x02, 0x18, 0xb8, 0x17, 0x20, 0xa8, 0x46, 0x38,
            0x81, 0x14,
        ];
        let mut entry = vec![0x0a, dump.len() as u8];
        entry.extend(dump);
        let mut file = Vec::new();
        file.extend(IMG_SERVICE_MAGIC.to_le_bytes());
        file.extend(IMG_SERVICE_MAGIC_STATS.to_le_bytes());
        file.extend((entry.len() as u32).to_le_bytes());
        file.extend(&entry);
        assert_eq!(
            parse_dump_stats(&file),
            Some(CriuDumpStats {
                freezing_ms: 1.2,
                frozen_ms: 45.0,
                memdump_ms: 3.0,
                memwrite_ms: 9.0,
                pages_written: 2561,
            })
        );
        // Cut short anywhere, another magic, a bad varint: no figures, no panic.
        for n in 0..file.len() {
            assert_eq!(parse_dump_stats(&file[..n]), None, "cut at {n}");
        }
        let mut other = file.clone();
        other[4] ^= 1;
        assert_eq!(parse_dump_stats(&other), None);
        let mut bad = file.clone();
        let at = bad.len() - 1;
        bad[at] = 0x80;
        assert_eq!(parse_dump_stats(&bad), None);
        assert_eq!(parse_dump_stats(&[0xff; 64]), None);
    }

    #[test]
    fn work_dir_is_a_sibling() {
        assert_eq!(
            work_dir(Path::new("/s/proc/000007")),
            Path::new("/s/proc/000007.work.tmp")
        );
    }
}

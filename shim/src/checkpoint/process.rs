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
    runc::{CheckpointOpts, Runc},
};

use super::pages::{self, DedupStats, PagesError};

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
    #[error("runc checkpoint failed: {message}{}{}", criu_log.as_ref().map(|l| format!(" (CRIU: {})", l.join("; "))).unwrap_or_default(), hint.map(|h| format!(". {h}")).unwrap_or_default())]
    Dump {
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
        source: PstreeError,
    },
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

/// One process of a CRIU image's process tree (`pstree.img`); pids are those of the container's
/// pid namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PstreeEntry {
    pub pid: u32,
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    pub threads: Vec<u32>,
}

const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
const IMG_SERVICE_MAGIC: u32 = 0x5510_5940;
const PSTREE_MAGIC: u32 = 0x5027_3030;

fn varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let b = *buf.get(*pos)?;
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

/// Decodes one `PstreeEntry` protobuf message: pid=1, ppid=2, pgid=3, sid=4, threads=5 (repeated,
/// packed or not); other fields are skipped.
fn decode_pstree_entry(msg: &[u8]) -> Option<PstreeEntry> {
    let mut e = PstreeEntry::default();
    let mut pos = 0;
    while pos < msg.len() {
        let key = varint(msg, &mut pos)?;
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            0 => {
                let v = varint(msg, &mut pos)? as u32;
                match field {
                    1 => e.pid = v,
                    2 => e.ppid = v,
                    3 => e.pgid = v,
                    4 => e.sid = v,
                    5 => e.threads.push(v),
                    _ => {}
                }
            }
            2 => {
                let len = varint(msg, &mut pos)? as usize;
                let body = msg.get(pos..pos.checked_add(len)?)?;
                pos += len;
                if field == 5 {
                    let mut p = 0;
                    while p < body.len() {
                        e.threads.push(varint(body, &mut p)? as u32);
                    }
                }
            }
            1 => pos = pos.checked_add(8)?,
            5 => pos = pos.checked_add(4)?,
            _ => return None,
        }
    }
    (pos == msg.len()).then_some(e)
}

/// What is wrong with a `pstree.img` ([`parse_pstree`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PstreeError {
    #[error("truncated magic")]
    TruncatedMagic,
    #[error("magic {0:#x} is not pstree's")]
    Magic(u32),
    #[error("truncated entry size")]
    TruncatedEntrySize,
    #[error("truncated entry")]
    TruncatedEntry,
    #[error("undecodable entry")]
    UndecodableEntry,
}

/// Parses a CRIU `pstree.img`: magic(s), then (u32 size, PstreeEntry)*.
pub fn parse_pstree(data: &[u8]) -> Result<Vec<PstreeEntry>, PstreeError> {
    let u32_at = |p: usize| {
        data.get(p..p + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let mut pos = 0;
    let mut magic = u32_at(pos).ok_or(PstreeError::TruncatedMagic)?;
    pos += 4;
    if magic == IMG_COMMON_MAGIC || magic == IMG_SERVICE_MAGIC {
        magic = u32_at(pos).ok_or(PstreeError::TruncatedMagic)?;
        pos += 4;
    }
    if magic != PSTREE_MAGIC {
        return Err(PstreeError::Magic(magic));
    }
    let mut out = Vec::new();
    while pos < data.len() {
        let size = u32_at(pos).ok_or(PstreeError::TruncatedEntrySize)? as usize;
        pos += 4;
        let msg = data
            .get(pos..pos + size)
            .ok_or(PstreeError::TruncatedEntry)?;
        pos += size;
        out.push(decode_pstree_entry(msg).ok_or(PstreeError::UndecodableEntry)?);
    }
    Ok(out)
}

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

/// Checkpoints container `id` (init `init_pid`, cgroup `cgroup_dir`) into `dir`, which must not
/// exist yet, leaving it running: [`check_dumpable`], `runc checkpoint --leave-running`
/// (established TCP connections, file locks and external unix sockets allowed), verification
/// of the image's process tree against the live processes, then page deduplication into
/// `chunks`. On any failure `dir` is removed; CRIU's log stays in [`work_dir`]`(dir)` only then.
pub async fn checkpoint(
    runc: &Runc,
    id: &str,
    init_pid: u32,
    cgroup_dir: &Path,
    dir: &Path,
    chunks: &Path,
) -> Result<ProcCheckpoint, ProcError> {
    let started = Instant::now();
    check_dumpable(init_pid, cgroup_dir)?;
    if dir.exists() {
        return Err(io_err(format!("checkpoint directory {}", dir.display()))(
            io::ErrorKind::AlreadyExists.into(),
        ));
    }
    let work = work_dir(dir);
    discard(&work);
    let opts = CheckpointOpts {
        image_path: dir.to_path_buf(),
        work_path: Some(work.clone()),
        leave_running: true,
        tcp_established: true,
        ext_unix_sk: true,
        file_locks: true,
        ..Default::default()
    };
    let dump_started = Instant::now();
    let dump_start = boot_ticks();
    let dumped = runc.checkpoint(id, &opts).await;
    let dump = dump_started.elapsed();
    if let Err(e) = dumped {
        discard(dir);
        let message = match e {
            crate::runc::RuncError::Failed { message, .. } => message,
            e => e.to_string(),
        };
        let criu_log = criu_errors(&work.join("dump.log"));
        let hint = criu_log.as_deref().and_then(known_cause);
        return Err(ProcError::Dump {
            message,
            criu_log,
            hint,
        });
    }
    let finish = async {
        let pids = verify_image(init_pid, cgroup_dir, dir, dump_start)?;
        let bytes_logical = dir_bytes(dir)?;
        let (d, c) = (dir.to_path_buf(), chunks.to_path_buf());
        let dedup = tokio::task::spawn_blocking(move || pages::dedup(&d, &c))
            .await
            .map_err(|e| io_err("page deduplication task")(io::Error::other(e)))??;
        let bytes_stored = dir_bytes(dir)? + dedup.bytes_new + dedup.index_bytes;
        Ok::<_, ProcError>((pids, bytes_logical, bytes_stored, dedup))
    };
    match finish.await {
        Ok((pids, bytes_logical, bytes_stored, dedup)) => {
            discard(&work);
            let cp = ProcCheckpoint {
                dir: dir.to_path_buf(),
                pids,
                bytes_logical,
                bytes_stored,
                duration: started.elapsed(),
                dump,
                dedup,
            };
            log::info!(
                "proc checkpoint of {id}: {} processes, {} bytes logical, {} stored ({} new chunks), dump {:?}, total {:?}",
                cp.pids.len(),
                cp.bytes_logical,
                cp.bytes_stored,
                cp.dedup.chunks_new,
                cp.dump,
                cp.duration
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
    fn pstree_decoding() {
        // From a real dump: `sh -c 'sleep 100000 & wait'` (pids 1 and 6 of the container).
        let img: &[u8] = &[
            0x19, 0x43, 0x56, 0x54, 0x30, 0x30, 0x27, 0x50, 0x0a, 0, 0, 0, 0x08, 0x01, 0x10, 0x00,
            0x18, 0x01, 0x20, 0x01, 0x28, 0x01, 0x0a, 0, 0, 0, 0x08, 0x06, 0x10, 0x01, 0x18, 0x01,
            0x20, 0x01, 0x28, 0x06,
        ];
        let tree = parse_pstree(img).unwrap();
        assert_eq!(
            tree,
            [
                PstreeEntry {
                    pid: 1,
                    ppid: 0,
                    pgid: 1,
                    sid: 1,
                    threads: vec![1]
                },
                PstreeEntry {
                    pid: 6,
                    ppid: 1,
                    pgid: 1,
                    sid: 1,
                    threads: vec![6]
                },
            ]
        );
        // Packed threads, a multi-byte varint, an unknown field.
        let mut msg = vec![
            0x08, 0xac, 0x02, 0x2a, 0x03, 0xac, 0x02, 0x07, 0x32, 0x01, 0xff,
        ];
        let mut img2 = img[..8].to_vec();
        img2.extend((msg.len() as u32).to_le_bytes());
        img2.append(&mut msg);
        assert_eq!(
            parse_pstree(&img2).unwrap(),
            [PstreeEntry {
                pid: 300,
                threads: vec![300, 7],
                ..Default::default()
            }]
        );
        assert!(parse_pstree(&img[..img.len() - 1]).is_err());
        assert!(parse_pstree(&img[8..]).is_err(), "no magic");
    }

    #[test]
    fn work_dir_is_a_sibling() {
        assert_eq!(
            work_dir(Path::new("/s/proc/000007")),
            Path::new("/s/proc/000007.work.tmp")
        );
    }
}

//! The live process set of a container's cgroup, and the files its processes hold.
//!
//! A process is identified by `(pid, start_time)`: pids are recycled, the start time (clock ticks
//! after boot, `/proc/PID/stat` field 22) of a pid is not, so a pid that died and was reused between
//! two marks shows up as one process ended and another started.
//!
//! Paths are read from the host's `/proc`, but the kernel prints them relative to the process's own
//! mount namespace root, so they are the paths as seen inside the container (`/app/x`, not the
//! overlay upperdir).

use std::collections::{BTreeMap, HashSet};
use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot parse {path}: {what}")]
    Parse { path: PathBuf, what: String },
    /// The process exited (or its pid now belongs to another process) while it was being read.
    #[error("process {0} is gone")]
    Gone(u32),
}

impl ProcError {
    fn io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> ProcError {
        let path = path.into();
        move |source| ProcError::Io { path, source }
    }
}

/// Does this error mean "the process is not there (any more)" rather than a real failure?
fn is_gone(e: &io::Error) -> bool {
    // ESRCH: reading a file of a process that is being reaped.
    matches!(e.kind(), io::ErrorKind::NotFound) || e.raw_os_error() == Some(libc::ESRCH)
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProcInfo {
    pub pid: u32,
    /// `/proc/PID/stat` field 22: clock ticks after boot.
    pub start_time: u64,
    pub ppid: u32,
    /// Kernel comm (at most 15 bytes; may contain spaces and parentheses).
    pub comm: String,
    /// Empty for zombies and kernel threads.
    pub cmdline: Vec<String>,
}

impl ProcInfo {
    pub fn identity(&self) -> (u32, u64) {
        (self.pid, self.start_time)
    }
}

/// The fields of `/proc/PID/stat` that identify a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    pub comm: String,
    pub state: char,
    pub ppid: u32,
    pub start_time: u64,
}

/// Parses `/proc/PID/stat`. comm is whatever the process named itself, so it may hold spaces,
/// parentheses and even ") " — the kernel does not escape it; only the *last* ')' ends it.
pub fn parse_stat(text: &str) -> Option<Stat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    if close < open {
        return None;
    }
    let comm = text[open + 1..close].to_string();
    // Fields after comm start with field 3 (state).
    let rest: Vec<&str> = text[close + 1..].split_ascii_whitespace().collect();
    let field = |n: usize| rest.get(n - 3).copied();
    Some(Stat {
        comm,
        state: field(3)?.chars().next()?,
        ppid: field(4)?.parse().ok()?,
        start_time: field(22)?.parse().ok()?,
    })
}

/// Reads `/proc/PID/stat`; `Ok(None)` if the process does not exist.
pub fn read_stat(pid: u32) -> Result<Option<Stat>, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    match std::fs::read(&path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            parse_stat(&text).map(Some).ok_or_else(|| ProcError::Parse {
                path,
                what: text.trim_end().to_string(),
            })
        }
        Err(e) if is_gone(&e) => Ok(None),
        Err(e) => Err(ProcError::Io { path, source: e }),
    }
}

/// `(pid, start_time)` of a live process, or `None`.
pub fn identity(pid: u32) -> Result<Option<(u32, u64)>, ProcError> {
    Ok(read_stat(pid)?.map(|s| (pid, s.start_time)))
}

/// Information about one process; `Ok(None)` if it does not exist (any more).
pub fn info(pid: u32) -> Result<Option<ProcInfo>, ProcError> {
    let Some(stat) = read_stat(pid)? else {
        return Ok(None);
    };
    let path = format!("/proc/{pid}/cmdline");
    let cmdline = match std::fs::read(&path) {
        Ok(bytes) => bytes
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
        Err(e) if is_gone(&e) => return Ok(None),
        Err(e) => return Err(ProcError::io(path)(e)),
    };
    // The cmdline read may have raced with the pid being recycled: confirm the identity.
    match read_stat(pid)? {
        Some(again) if again.start_time == stat.start_time => {}
        _ => return Ok(None),
    }
    Ok(Some(ProcInfo {
        pid,
        start_time: stat.start_time,
        ppid: stat.ppid,
        comm: stat.comm,
        cmdline,
    }))
}

/// Processes (thread-group leaders) of a cgroup directory, v1 or v2, sorted by pid. Processes that
/// exit while the list is being read are left out (their pid was listed, but they are gone now).
/// Zombies are not in `cgroup.procs` (they leave the cgroup when they exit), so an exited child
/// whose parent has not reaped it yet does not count as alive.
/// The cgroup's descendants are not included: runc puts a container in one leaf cgroup.
pub fn list(cgroup_dir: &Path) -> Result<Vec<ProcInfo>, ProcError> {
    let path = cgroup_dir.join("cgroup.procs");
    let text = std::fs::read_to_string(&path).map_err(ProcError::io(&path))?;
    let mut pids: Vec<u32> = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        pids.push(line.parse().map_err(|_| ProcError::Parse {
            path: path.clone(),
            what: format!("pid {line:?}"),
        })?);
    }
    // v1 cgroup.procs is not guaranteed sorted or free of duplicates.
    pids.sort_unstable();
    pids.dedup();
    let mut out = Vec::with_capacity(pids.len());
    for pid in pids {
        if let Some(p) = info(pid)? {
            out.push(p);
        }
    }
    Ok(out)
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcDelta {
    /// Alive now, not at the previous mark (includes a recycled pid's new process).
    pub started: Vec<ProcInfo>,
    /// Alive at the previous mark, not now.
    pub ended: Vec<ProcInfo>,
    /// Alive at both (as seen now: comm/cmdline may have changed by exec — an exec keeps pid and
    /// start time, so [`delta`] does not see it; the BPF exec counter and the memory image do).
    pub persisted: Vec<ProcInfo>,
}

impl ProcDelta {
    /// No process started or ended.
    pub fn is_empty(&self) -> bool {
        self.started.is_empty() && self.ended.is_empty()
    }
}

/// Compares two process lists by identity `(pid, start_time)`.
pub fn delta(prev: &[ProcInfo], now: &[ProcInfo]) -> ProcDelta {
    let before: HashSet<(u32, u64)> = prev.iter().map(ProcInfo::identity).collect();
    let after: HashSet<(u32, u64)> = now.iter().map(ProcInfo::identity).collect();
    let mut d = ProcDelta::default();
    for p in now {
        if before.contains(&p.identity()) {
            d.persisted.push(p.clone());
        } else {
            d.started.push(p.clone());
        }
    }
    d.ended = prev
        .iter()
        .filter(|p| !after.contains(&p.identity()))
        .cloned()
        .collect();
    for v in [&mut d.started, &mut d.ended, &mut d.persisted] {
        v.sort_by_key(ProcInfo::identity);
    }
    d
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct HeldFile {
    /// Path inside the container, without the kernel's " (deleted)" suffix.
    pub path: PathBuf,
    /// The path no longer names this file (unlinked, or replaced by a rename over it).
    pub deleted: bool,
    /// Mapped (`/proc/PID/maps`): executables, libraries, mmapped data.
    pub mapped: bool,
    /// Open through at least one file descriptor.
    pub open: bool,
}

const DELETED: &[u8] = b" (deleted)";

/// Memory that merely looks like a file in `/proc`: memfd, SysV shm, shared anonymous mappings
/// (`/dev/zero (deleted)`) and hugetlb anonymous ones. They live in no filesystem the fs side sees
/// and are part of the process image (see `memory`), so they are not held files.
fn is_anonymous_shmem(path: &[u8], deleted: bool) -> bool {
    path.starts_with(b"/memfd:")
        || (deleted
            && (path.starts_with(b"/SYSV")
                || path == b"/dev/zero"
                || path == b"/anon_hugepage"
                || path.starts_with(b"/anon_hugepage")))
}

/// Splits the kernel's " (deleted)" suffix off. A live file whose name really ends in
/// " (deleted)" prints the same, so when `resolve` can reach the candidate path we check that it
/// is still the same inode as the held file (`held` = dev, ino of the open/mapped file).
fn split_deleted(pid: u32, raw: &[u8], held: Option<(u64, u64)>) -> (Vec<u8>, bool) {
    let Some(stripped) = raw.strip_suffix(DELETED) else {
        return (raw.to_vec(), false);
    };
    if let Some((dev, ino)) = held {
        // The file may still be linked under its full (suffixed) name inside the container.
        let mut p = format!("/proc/{pid}/root").into_bytes();
        p.extend_from_slice(raw);
        if let Ok(m) = std::fs::symlink_metadata(Path::new(OsStr::from_bytes(&p))) {
            if m.dev() == dev && m.ino() == ino {
                return (raw.to_vec(), false);
            }
        }
    }
    (stripped.to_vec(), true)
}

/// Undoes the octal escapes `/proc/PID/maps` uses for newlines in paths ("\012").
fn unescape_maps_path(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\' && i + 3 < s.len() && s[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v = (s[i + 1] - b'0') as u32 * 64 + (s[i + 2] - b'0') as u32 * 8 + (s[i + 3] - b'0') as u32;
            if v <= 255 {
                out.push(v as u8);
                i += 4;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    out
}

/// One line of `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapsLine {
    pub start: u64,
    pub end: u64,
    /// "rwxp" / "rw-s" ...
    pub perms: [u8; 4],
    pub offset: u64,
    pub dev: String,
    pub inode: u64,
    /// Raw path field (may be empty, "[heap]", "/lib/x.so", "/x (deleted)", "[anon:name]").
    pub path: Vec<u8>,
}

pub fn parse_maps_line(line: &[u8]) -> Option<MapsLine> {
    // Five space-separated fields, then padding, then the path (which may contain spaces).
    let mut fields = Vec::with_capacity(5);
    let mut rest = line;
    for _ in 0..5 {
        let start = rest.iter().position(|c| *c != b' ')?;
        rest = &rest[start..];
        let end = rest.iter().position(|c| *c == b' ').unwrap_or(rest.len());
        fields.push(&rest[..end]);
        rest = &rest[end..];
    }
    let path = match rest.iter().position(|c| *c != b' ') {
        Some(p) => rest[p..].to_vec(),
        None => Vec::new(),
    };
    let range = std::str::from_utf8(fields[0]).ok()?;
    let (s, e) = range.split_once('-')?;
    let perms: [u8; 4] = fields[1].try_into().ok()?;
    Some(MapsLine {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        perms,
        offset: u64::from_str_radix(std::str::from_utf8(fields[2]).ok()?, 16).ok()?,
        dev: String::from_utf8_lossy(fields[3]).into_owned(),
        inode: std::str::from_utf8(fields[4]).ok()?.parse().ok()?,
        path,
    })
}

/// Reads and parses `/proc/PID/maps`.
pub fn read_maps(pid: u32) -> Result<Vec<MapsLine>, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/maps"));
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if is_gone(&e) => return Err(ProcError::Gone(pid)),
        Err(e) => return Err(ProcError::Io { path, source: e }),
    };
    bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            parse_maps_line(l).ok_or_else(|| ProcError::Parse {
                path: path.clone(),
                what: String::from_utf8_lossy(l).into_owned(),
            })
        })
        .collect()
}

/// Files the process has open (`/proc/PID/fd`) or mapped (`/proc/PID/maps`), one entry per
/// (path, deleted), sorted by path. Pipes, sockets, anon inodes and anonymous shared memory are
/// left out. Device nodes (/dev/null, ttys) are files with paths and are included.
/// The working directory and root are not included.
pub fn held_files(pid: u32) -> Result<Vec<HeldFile>, ProcError> {
    let before = identity(pid)?.ok_or(ProcError::Gone(pid))?;
    let mut held: BTreeMap<(Vec<u8>, bool), HeldFile> = BTreeMap::new();
    let mut add = |path: Vec<u8>, deleted: bool, mapped: bool| {
        let e = held.entry((path.clone(), deleted)).or_insert_with(|| HeldFile {
            path: PathBuf::from(OsStr::from_bytes(&path)),
            deleted,
            mapped: false,
            open: false,
        });
        if mapped {
            e.mapped = true;
        } else {
            e.open = true;
        }
    };

    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let entries = match std::fs::read_dir(&fd_dir) {
        Ok(e) => e,
        Err(e) if is_gone(&e) => return Err(ProcError::Gone(pid)),
        Err(e) => return Err(ProcError::Io { path: fd_dir, source: e }),
    };
    for entry in entries {
        let entry = entry.map_err(ProcError::io(&fd_dir))?;
        let link = entry.path();
        let target = match std::fs::read_link(&link) {
            Ok(t) => t,
            // The fd was closed between readdir and readlink.
            Err(e) if is_gone(&e) => continue,
            Err(e) => return Err(ProcError::Io { path: link, source: e }),
        };
        let raw = target.as_os_str().as_bytes();
        // "pipe:[..]", "socket:[..]", "anon_inode:[eventfd]", "net:[..]": not paths.
        if !raw.starts_with(b"/") {
            continue;
        }
        let held_id = std::fs::metadata(&link).ok().map(|m| (m.dev(), m.ino()));
        let (path, deleted) = split_deleted(pid, raw, held_id);
        if is_anonymous_shmem(&path, deleted) {
            continue;
        }
        add(path, deleted, false);
    }

    let mut seen_ranges: HashSet<Vec<u8>> = HashSet::new();
    for m in read_maps(pid)? {
        if m.inode == 0 || !m.path.starts_with(b"/") {
            continue;
        }
        let raw = unescape_maps_path(&m.path);
        if !seen_ranges.insert(raw.clone()) {
            continue;
        }
        let held_id = if raw.ends_with(DELETED) {
            let mf = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
            std::fs::metadata(mf).ok().map(|md| (md.dev(), md.ino()))
        } else {
            None
        };
        let (path, deleted) = split_deleted(pid, &raw, held_id);
        if is_anonymous_shmem(&path, deleted) {
            continue;
        }
        add(path, deleted, true);
    }

    // If the pid was recycled meanwhile, what we read may belong to two processes.
    if identity(pid)? != Some(before) {
        return Err(ProcError::Gone(pid));
    }
    Ok(held.into_values().collect())
}


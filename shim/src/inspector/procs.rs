//! The live process set of a container's cgroup, and the files its processes hold.
//!
//! A process is identified by `(pid, start_time)`: pids are recycled, the start time (clock ticks
//! after boot, `/proc/PID/stat` field 22) of a pid is not, so a pid that died and was reused between
//! two marks shows up as one process ended and another started.
//!
//! Paths are read from the host's `/proc`, but the kernel prints them relative to the process's own
//! mount namespace root, so they are the paths as seen inside the container (`/app/x`, not the
//! overlay upperdir).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsStr;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::sys::beneath;

/// Why a process's files under `/proc` could not be read (not the errors of a process
/// checkpoint, which are `checkpoint::process::ProcError`).
#[derive(Debug, thiserror::Error)]
pub enum ProcfsError {
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

impl ProcfsError {
    fn io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> ProcfsError {
        let path = path.into();
        move |source| ProcfsError::Io { path, source }
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
pub fn read_stat(pid: u32) -> Result<Option<Stat>, ProcfsError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    match std::fs::read(&path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            parse_stat(&text)
                .map(Some)
                .ok_or_else(|| ProcfsError::Parse {
                    path,
                    what: text.trim_end().to_string(),
                })
        }
        Err(e) if is_gone(&e) => Ok(None),
        Err(e) => Err(ProcfsError::Io { path, source: e }),
    }
}

/// `(pid, start_time)` of a live process, or `None`.
pub fn identity(pid: u32) -> Result<Option<(u32, u64)>, ProcfsError> {
    Ok(read_stat(pid)?.map(|s| (pid, s.start_time)))
}

/// The thread ids (host) of process `pid`; empty if it is gone.
pub fn thread_ids(pid: u32) -> Vec<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The innermost pid of an `NSpid:` line of `/proc/PID/status` text (its pid in the pid
/// namespace it lives in), or `None`.
pub fn parse_ns_pid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// `(host tid, tid in its pid namespace)` of each thread of process `pid`.
pub fn threads_by_ns_tid(pid: u32) -> Vec<(u32, u32)> {
    thread_ids(pid)
        .into_iter()
        .filter_map(|tid| {
            let status = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/status")).ok()?;
            Some((tid, parse_ns_pid(&status)?))
        })
        .collect()
}

/// Whether a thread whose `/proc/.../stat` state is `state` sits in a job-control stop
/// (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU): state `T`; or, in a frozen cgroup, where the kernel
/// reports a frozen task `D` whatever it was doing, blocked in `do_signal_stop` (`wchan`, read
/// only for `D`).
pub fn in_job_stop(state: char, wchan: impl FnOnce() -> Option<String>) -> bool {
    match state {
        'T' => true,
        'D' => wchan().is_some_and(|w| w.trim() == "do_signal_stop"),
        _ => false,
    }
}

/// The processes of cgroup `cgroup_dir` with a thread in a job-control stop ([`in_job_stop`]),
/// frozen cgroup or not. Processes and threads that go meanwhile are left out.
pub fn job_stopped(cgroup_dir: &Path) -> Result<Vec<u32>, ProcfsError> {
    let mut out = Vec::new();
    for p in list(cgroup_dir)? {
        let stopped = thread_ids(p.pid).into_iter().any(|tid| {
            let task = format!("/proc/{}/task/{tid}", p.pid);
            let state = std::fs::read(format!("{task}/stat"))
                .ok()
                .and_then(|b| parse_stat(&String::from_utf8_lossy(&b)))
                .map(|s| s.state);
            state.is_some_and(|s| {
                in_job_stop(s, || std::fs::read_to_string(format!("{task}/wchan")).ok())
            })
        });
        if stopped {
            out.push(p.pid);
        }
    }
    Ok(out)
}

/// The processes of `all` that are `init` or descend from it through parents in `all`.
pub fn tree_of(init: u32, all: Vec<ProcInfo>) -> Vec<ProcInfo> {
    let parent: HashMap<u32, u32> = all.iter().map(|p| (p.pid, p.ppid)).collect();
    let in_tree = |mut pid: u32| {
        // A chain longer than the list has a loop (pids reused meanwhile): not the tree.
        for _ in 0..=all.len() {
            if pid == init {
                return true;
            }
            match parent.get(&pid) {
                Some(&ppid) => pid = ppid,
                None => return false,
            }
        }
        false
    };
    let keep: Vec<bool> = all.iter().map(|p| in_tree(p.pid)).collect();
    all.into_iter()
        .zip(keep)
        .filter_map(|(p, k)| k.then_some(p))
        .collect()
}

/// Information about one process; `Ok(None)` if it does not exist (any more).
pub fn info(pid: u32) -> Result<Option<ProcInfo>, ProcfsError> {
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
        Err(e) => return Err(ProcfsError::io(path)(e)),
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
pub fn list(cgroup_dir: &Path) -> Result<Vec<ProcInfo>, ProcfsError> {
    let path = cgroup_dir.join("cgroup.procs");
    let text = std::fs::read_to_string(&path).map_err(ProcfsError::io(&path))?;
    let mut pids: Vec<u32> = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        pids.push(line.parse().map_err(|_| ProcfsError::Parse {
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
/// " (deleted)" prints the same, so when the process's root `view` is at hand we check whether
/// the full name still leads to the held file (`held` = dev, ino of the open/mapped file).
///
/// The name is the container's to choose (a memfd's is any string), so it is looked up beneath
/// the process's own root with no symlink followed and no `..` above it, as an `O_PATH` handle
/// that is only `fstat`ed: it can neither reach a host file nor open a device or FIFO. (A plain
/// `lstat("/proc/PID/root/<name>")` would resolve an absolute symlink in a middle component
/// against the host's root.)
fn split_deleted(
    view: Option<BorrowedFd<'_>>,
    raw: &[u8],
    held: Option<(u64, u64)>,
) -> (Vec<u8>, bool) {
    let Some(stripped) = raw.strip_suffix(DELETED) else {
        return (raw.to_vec(), false);
    };
    if let (Some(view), Some(held)) = (view, held) {
        // The file may still be linked under its full (suffixed) name inside the container.
        if identity_in_view(view, Path::new(OsStr::from_bytes(raw))).ok() == Some(held) {
            return (raw.to_vec(), false);
        }
    }
    (stripped.to_vec(), true)
}

/// `(st_dev, st_ino)` of what `path` names in a process's view (`view` from
/// [`crate::sys::beneath::process_root`]), without following symlinks or opening it.
pub fn identity_in_view(view: BorrowedFd<'_>, path: &Path) -> io::Result<(u64, u64)> {
    let handle = beneath::resolve_beneath(view, path)?;
    let st = beneath::fstat(handle.as_fd())?;
    Ok((st.st_dev, st.st_ino))
}

/// The device of a maps line's file (`major:minor` in hex, as `st_dev` encodes it).
pub fn maps_dev(m: &MapsLine) -> Option<u64> {
    let (major, minor) = m.dev.split_once(':')?;
    Some(libc::makedev(
        u32::from_str_radix(major, 16).ok()?,
        u32::from_str_radix(minor, 16).ok()?,
    ))
}

/// Undoes the octal escapes `/proc/PID/maps` uses for newlines in paths ("\012").
pub fn unescape_maps_path(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'\\'
            && i + 3 < s.len()
            && s[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (s[i + 1] - b'0') as u32 * 64
                + (s[i + 2] - b'0') as u32 * 8
                + (s[i + 3] - b'0') as u32;
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
    /// Raw path field (may be empty, `[heap]`, `/lib/x.so`, `/x (deleted)`, `[anon:name]`).
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
pub fn read_maps(pid: u32) -> Result<Vec<MapsLine>, ProcfsError> {
    let path = PathBuf::from(format!("/proc/{pid}/maps"));
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if is_gone(&e) => return Err(ProcfsError::Gone(pid)),
        Err(e) => return Err(ProcfsError::Io { path, source: e }),
    };
    bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            parse_maps_line(l).ok_or_else(|| ProcfsError::Parse {
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
pub fn held_files(pid: u32) -> Result<Vec<HeldFile>, ProcfsError> {
    let before = identity(pid)?.ok_or(ProcfsError::Gone(pid))?;
    let mut held: BTreeMap<(Vec<u8>, bool), HeldFile> = BTreeMap::new();
    let mut add = |path: Vec<u8>, deleted: bool, mapped: bool| {
        let e = held
            .entry((path.clone(), deleted))
            .or_insert_with(|| HeldFile {
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

    // Paths are printed relative to the process's root; a process that is gone has none.
    let view = beneath::process_root(pid).ok();
    let view = view.as_ref().map(|v| v.as_fd());
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let entries = match std::fs::read_dir(&fd_dir) {
        Ok(e) => e,
        Err(e) if is_gone(&e) => return Err(ProcfsError::Gone(pid)),
        Err(e) => {
            return Err(ProcfsError::Io {
                path: fd_dir,
                source: e,
            })
        }
    };
    for entry in entries {
        let entry = entry.map_err(ProcfsError::io(&fd_dir))?;
        let link = entry.path();
        let target = match std::fs::read_link(&link) {
            Ok(t) => t,
            // The fd was closed between readdir and readlink.
            Err(e) if is_gone(&e) => continue,
            Err(e) => {
                return Err(ProcfsError::Io {
                    path: link,
                    source: e,
                })
            }
        };
        let raw = target.as_os_str().as_bytes();
        // "pipe:[..]", "socket:[..]", "anon_inode:[eventfd]", "net:[..]": not paths.
        if !raw.starts_with(b"/") {
            continue;
        }
        let held_id = std::fs::metadata(&link).ok().map(|m| (m.dev(), m.ino()));
        let (path, deleted) = split_deleted(view, raw, held_id);
        if is_anonymous_shmem(&path, deleted) {
            continue;
        }
        add(path, deleted, false);
    }

    let mut seen_paths: HashSet<Vec<u8>> = HashSet::new();
    for m in read_maps(pid)? {
        if m.inode == 0 || !m.path.starts_with(b"/") {
            continue;
        }
        let raw = unescape_maps_path(&m.path);
        if !seen_paths.insert(raw.clone()) {
            continue;
        }
        let held_id = if raw.ends_with(DELETED) {
            let mf = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
            std::fs::metadata(mf).ok().map(|md| (md.dev(), md.ino()))
        } else {
            None
        };
        let (path, deleted) = split_deleted(view, &raw, held_id);
        if is_anonymous_shmem(&path, deleted) {
            continue;
        }
        add(path, deleted, true);
    }

    // If the pid was recycled meanwhile, what we read may belong to two processes.
    if identity(pid)? != Some(before) {
        return Err(ProcfsError::Gone(pid));
    }
    Ok(held.into_values().collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};

    #[test]
    fn a_job_stop_is_told_apart_frozen_or_not() {
        let no_wchan = || -> Option<String> { panic!("wchan read for a state that needs none") };
        assert!(in_job_stop('T', no_wchan));
        for state in ['R', 'S', 't', 'Z', 'X', 'I'] {
            assert!(!in_job_stop(state, no_wchan), "{state}");
        }
        // Frozen: `D` whatever the task was doing; only a stop's wchan is a stop.
        assert!(in_job_stop('D', || Some("do_signal_stop\n".into())));
        assert!(!in_job_stop('D', || Some("hrtimer_nanosleep".into())));
        assert!(!in_job_stop('D', || Some("__refrigerator".into())));
        // wchan hidden (no kallsyms: "0") or unreadable: not a stop that can be proven.
        assert!(!in_job_stop('D', || Some("0".into())));
        assert!(!in_job_stop('D', || None));
    }

    #[test]
    fn a_tree_is_the_init_and_its_descendants_only() {
        let p = |pid, ppid| ProcInfo { ppid, ..pi(pid, 1) };
        // 5 is CRIU (its parent outside the list), 6 its script; 10 the init, 11 and 12 below.
        let all = vec![
            p(5, 1),
            p(6, 5),
            p(10, 5),
            p(11, 10),
            p(12, 11),
            p(20, 21),
            p(21, 20),
        ];
        let pids: Vec<u32> = tree_of(10, all).iter().map(|p| p.pid).collect();
        assert_eq!(pids, [10, 11, 12]);
        assert!(tree_of(99, vec![p(1, 0)]).is_empty());
    }

    fn pi(pid: u32, start_time: u64) -> ProcInfo {
        ProcInfo {
            pid,
            start_time,
            ppid: 1,
            comm: "x".into(),
            cmdline: vec![],
        }
    }

    #[test]
    fn ns_pids_and_threads() {
        // The innermost of the pids (the last), in a nested namespace or none.
        assert_eq!(
            parse_ns_pid("Name:\tsh\nPid:\t812\nNSpid:\t812\t40\t7\nVmRSS: 1 kB\n"),
            Some(7)
        );
        assert_eq!(parse_ns_pid("NSpid:\t812\n"), Some(812));
        for hostile in [
            "",
            "NSpid:\n",
            "NSpid:\tx\n",
            "Pid:\t3\n",
            "NSpid:\t99999999999\n",
        ] {
            assert_eq!(parse_ns_pid(hostile), None, "{hostile:?}");
        }
        // This process: its threads are listed.
        let me = std::process::id();
        let worker =
            std::thread::spawn(|| std::thread::sleep(std::time::Duration::from_millis(300)));
        let threads = threads_by_ns_tid(me);
        assert!(threads.len() >= 2, "{threads:?}");
        assert!(threads.iter().any(|(tid, _)| *tid == me), "{threads:?}");
        assert!(thread_ids(me).contains(&me));
        worker.join().unwrap();
        assert!(thread_ids(u32::MAX).is_empty());
    }

    #[test]
    fn parse_stat_with_hostile_comm() {
        let line = "4242 (a) b (c) S 9) R 17 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 100 \
                    18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0\n";
        let s = parse_stat(line).unwrap();
        assert_eq!(s.comm, "a) b (c) S 9");
        assert_eq!((s.state, s.ppid, s.start_time), ('R', 17, 987654));
        assert!(parse_stat("4242 (x) S").is_none());
    }

    #[test]
    fn real_process_with_hostile_comm() {
        let mut c = Command::new("python3")
            .args(["-c", "open('/proc/self/comm','w').write('x) (y z) S 1'); print('ok', flush=True); input()"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut l = String::new();
        BufReader::new(c.stdout.as_mut().unwrap())
            .read_line(&mut l)
            .unwrap();
        let p = info(c.id()).unwrap().unwrap();
        let _ = c.kill();
        let _ = c.wait();
        assert_eq!(p.comm, "x) (y z) S 1");
        assert_eq!(p.ppid, std::process::id());
        assert!(p.cmdline[0].ends_with("python3"), "{:?}", p.cmdline);
        assert!(p.start_time > 0);
    }

    #[test]
    fn delta_uses_pid_and_start_time() {
        let prev = vec![pi(10, 100), pi(11, 100), pi(12, 100)];
        // 11 ended; 12's pid was recycled by a new process; 13 started.
        let now = vec![pi(10, 100), pi(12, 500), pi(13, 500)];
        let d = delta(&prev, &now);
        let ids = |v: &[ProcInfo]| v.iter().map(ProcInfo::identity).collect::<Vec<_>>();
        assert_eq!(ids(&d.persisted), vec![(10, 100)]);
        assert_eq!(ids(&d.ended), vec![(11, 100), (12, 100)]);
        assert_eq!(ids(&d.started), vec![(12, 500), (13, 500)]);
        assert!(!d.is_empty());
        assert!(delta(&prev, &prev).is_empty());
    }

    #[test]
    fn held_files_open_deleted_mapped() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let script = r#"
import os, sys, mmap
d = sys.argv[1]
f1 = open(d + '/open.txt', 'w'); f1.write('x'); f1.flush()
f2 = open(d + '/gone.txt', 'w'); os.unlink(d + '/gone.txt')
f3 = open(d + '/weird (deleted)', 'w')
with open(d + '/mapped.bin', 'wb') as f: f.write(b'\0' * 8192)
with open(d + '/mapped.bin', 'r+b') as f: m = mmap.mmap(f.fileno(), 8192)
with open(d + '/gone-mapped.bin', 'wb') as f: f.write(b'\1' * 8192)
with open(d + '/gone-mapped.bin', 'rb') as f: m2 = mmap.mmap(f.fileno(), 8192, prot=mmap.PROT_READ)
os.unlink(d + '/gone-mapped.bin')
mfd = os.memfd_create('crab-test')
shm = mmap.mmap(-1, 8192, flags=mmap.MAP_SHARED)
r, w = os.pipe()
print('ready', flush=True)
sys.stdin.readline()
"#;
        let mut c = Command::new("python3")
            .args(["-c", script, d])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut l = String::new();
        BufReader::new(c.stdout.as_mut().unwrap())
            .read_line(&mut l)
            .unwrap();
        assert_eq!(l, "ready\n");
        let held = held_files(c.id()).unwrap();
        let _ = c.kill();
        let _ = c.wait();
        let find = |name: &str| {
            held.iter()
                .find(|h| h.path == dir.path().join(name))
                .cloned()
        };
        let h = |open, mapped, deleted| Some((open, mapped, deleted));
        let flags = |f: Option<HeldFile>| f.map(|f| (f.open, f.mapped, f.deleted));
        assert_eq!(flags(find("open.txt")), h(true, false, false), "{held:#?}");
        assert_eq!(flags(find("gone.txt")), h(true, false, true), "{held:#?}");
        assert_eq!(
            flags(find("weird (deleted)")),
            h(true, false, false),
            "{held:#?}"
        );
        // Python's mmap keeps a dup of the fd: mapped and open.
        assert_eq!(flags(find("mapped.bin")), h(true, true, false), "{held:#?}");
        assert_eq!(
            flags(find("gone-mapped.bin")),
            h(true, true, true),
            "{held:#?}"
        );
        assert!(
            held.iter()
                .any(|f| f.mapped && !f.open && f.path.to_string_lossy().contains("libc")),
            "{held:#?}"
        );
        assert!(
            held.iter()
                .any(|f| f.mapped && f.path.to_string_lossy().contains("python")),
            "{held:#?}"
        );
        for f in &held {
            let p = f.path.to_string_lossy();
            assert!(p.starts_with('/'), "{p}");
            assert!(
                !p.contains("memfd") && !p.contains("/dev/zero") && !p.contains("pipe:"),
                "{p}"
            );
        }
    }

    /// The " (deleted)" check looks the full name up inside the process's view without
    /// following symlinks: a symlinked directory on the way (which an absolute symlink would
    /// have resolved against the host's root) does not make a deleted file look live.
    #[test]
    fn split_deleted_does_not_follow_symlinks() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::fs::write(real.join("f (deleted)"), "x").unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        let md = std::fs::metadata(real.join("f (deleted)")).unwrap();
        let held = Some((md.dev(), md.ino()));
        let view = beneath::process_root(std::process::id()).unwrap();
        let name = |p: &Path| p.join("f (deleted)").as_os_str().as_bytes().to_vec();
        // Reached without a symlink: the suffix is part of a live name.
        let raw = name(&real);
        assert_eq!(
            split_deleted(Some(view.as_fd()), &raw, held),
            (raw.clone(), false)
        );
        // Through the symlink: not followed, so the suffix is taken as the kernel's.
        let raw = name(&dir.path().join("link"));
        let (path, deleted) = split_deleted(Some(view.as_fd()), &raw, held);
        assert!(
            deleted && !path.ends_with(DELETED),
            "{:?}",
            String::from_utf8_lossy(&path)
        );
    }

    #[test]
    fn held_files_of_missing_process() {
        let mut c = Command::new("true").spawn().unwrap();
        let pid = c.id();
        c.wait().unwrap();
        assert!(matches!(held_files(pid), Err(ProcfsError::Gone(p)) if p == pid));
    }
}

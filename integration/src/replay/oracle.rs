//! Ground truth for the inspector, computed from the host without any of crab's code: what
//! the sandbox's state is at each turn end, and so what each turn really changed.
//!
//! A [`Snapshot`] holds:
//! - the files: every entry of the container's overlay upperdir (found from containerd's
//!   snapshot mounts) with its content digest, mode, owner, mtime, symlink target and xattrs;
//!   each path is then compared by what the container *sees* there (the upper entry, a whiteout
//!   meaning absent, else the lower layers' entry), so a copy-up that changed nothing is no
//!   change, and a timestamp, mode or content that moved is one. Directory timestamps are not
//!   state (they move whenever an entry comes or goes).
//! - the processes of the container's cgroup (pid + start time, so a reused pid is a new
//!   process), each with its executable, a digest of its memory (the layout of every mapping
//!   and the bytes of every writable one, read through `/proc/<pid>/mem`), and the files it
//!   holds (open descriptors and mapped files).
//!
//! A turn is judged from four snapshots: before and after the previous turn end (`B`, `A`) and
//! before and after this one. What changed between the previous `A` and this `B` is the
//! turn's net change. Something that moved *across* a turn end (between its `B` and `A`: a
//! background writer, or crab's own freeze waking a process) makes the truth uncertain for
//! that item: it is reported as ambiguous, never as a false negative or positive.
//!
//! Rules that the oracle applies on purpose, as crab must (see ../shared/DESIGN.md):
//! - a process that persists and holds (open or mapped) a file the turn changed needs a new
//!   process image (CRIU checks held files on restore);
//! - short-lived processes and temp files that came and went are no change.
//!
//! Not seen (by crab either): tmpfs mounts (/run, /dev/shm), network state outside processes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::CString;
use std::fs::{self, File};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;

/// What the container sees at one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Absent,
    Dir {
        mode: u32,
        uid: u32,
        gid: u32,
        opaque: bool,
        xattrs: Xattrs,
    },
    File {
        mode: u32,
        uid: u32,
        gid: u32,
        size: u64,
        mtime_ns: i128,
        digest: u64,
        xattrs: Xattrs,
    },
    Symlink {
        uid: u32,
        gid: u32,
        target: Vec<u8>,
    },
    Special {
        mode: u32,
        uid: u32,
        gid: u32,
        rdev: u64,
    },
}

type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// An upperdir entry: a node, or a whiteout hiding the lower layers' entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upper {
    Whiteout,
    Node(Node),
}

/// A process of the container, keyed by (host pid, start time in clock ticks).
pub type ProcKey = (u32, u64);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcNode {
    pub cmdline: String,
    pub exe: Option<PathBuf>,
    /// `None` when the memory could not be read (the process is then judged ambiguous).
    pub memory: Option<u64>,
    /// Container paths it has open or mapped.
    pub held: BTreeSet<PathBuf>,
}

impl ProcNode {
    fn state(&self) -> (&Option<PathBuf>, &Option<u64>) {
        (&self.exe, &self.memory)
    }
}

#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Upperdir entries by path relative to the upperdir.
    pub upper: BTreeMap<PathBuf, Upper>,
    pub procs: BTreeMap<ProcKey, ProcNode>,
    /// What could not be read (reported with the turn).
    pub errors: Vec<String>,
}

/// Where a container's state lives on the host.
#[derive(Debug, Clone)]
pub struct Target {
    pub upperdir: PathBuf,
    /// Top first.
    pub lowerdirs: Vec<PathBuf>,
    /// The container's cgroup2 directory.
    pub cgroup: PathBuf,
}

/// The upperdir and lowerdirs of an overlay mount's options.
pub fn overlay_dirs(options: &[String]) -> Option<(PathBuf, Vec<PathBuf>)> {
    let get = |key: &str| options.iter().find_map(|o| o.strip_prefix(key));
    let upper = PathBuf::from(get("upperdir=")?);
    let lower = get("lowerdir=")
        .map(|l| {
            l.split(':')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default();
    Some((upper, lower))
}

/// The cgroup2 directory of a host pid (`0::/path` in /proc/<pid>/cgroup, under the cgroup2
/// mount).
/// The CPU time (ns) every thread of every process in cgroup `dir` has used, summed, and how
/// many times they were scheduled (`/proc/PID/task/TID/schedstat`): equal twice apart means
/// nothing ran in between.
pub fn cgroup_cpu(dir: &Path) -> (u64, u64) {
    let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    let (mut ns, mut slices) = (0u64, 0u64);
    for pid in procs.split_whitespace() {
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let stat = fs::read_to_string(t.path().join("schedstat")).unwrap_or_default();
            let f: Vec<u64> = stat
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            ns += f.first().copied().unwrap_or(0);
            slices += f.get(2).copied().unwrap_or(0);
        }
    }
    (ns, slices)
}

/// Waits (bounded by `bound`) until nothing in cgroup `dir` runs for `quiet`: a process woken
/// (by crab's freeze, or a program still starting) has gone back to sleep. Returns whether it
/// did.
pub fn settle(dir: &Path, quiet: std::time::Duration, bound: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + bound;
    let mut last = cgroup_cpu(dir);
    loop {
        std::thread::sleep(quiet);
        let now = cgroup_cpu(dir);
        if now == last {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        last = now;
    }
}

pub fn cgroup2_dir(pid: u32) -> std::io::Result<PathBuf> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let rel = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or_else(|| std::io::Error::other(format!("pid {pid} has no cgroup2 path")))?;
    let mount = crate::host::mountinfo()
        .into_iter()
        .find(|m| m.fstype == "cgroup2")
        .ok_or_else(|| std::io::Error::other("no cgroup2 mount"))?;
    Ok(mount.mount_point.join(rel.trim_start_matches('/')))
}

/// Takes snapshots of one container; caches what cannot change (the lower layers) and file
/// digests by (device, inode, size, mtime, ctime).
pub struct Observer {
    target: Target,
    lower: HashMap<PathBuf, Node>,
    digests: HashMap<(u64, u64, u64, i128, i128), u64>,
}

impl Observer {
    pub fn new(target: Target) -> Observer {
        Observer {
            target,
            lower: HashMap::new(),
            digests: HashMap::new(),
        }
    }

    /// The container's cgroup2 directory.
    pub fn cgroup(&self) -> &Path {
        &self.target.cgroup
    }

    pub fn snapshot(&mut self) -> Snapshot {
        let mut s = Snapshot::default();
        let upper = self.target.upperdir.clone();
        self.walk(&upper, Path::new(""), &mut s);
        self.scan_processes(&mut s);
        s
    }

    fn walk(&mut self, root: &Path, rel: &Path, s: &mut Snapshot) {
        let dir = root.join(rel);
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !rel.as_os_str().is_empty() => {
                return
            }
            Err(e) => {
                s.errors.push(format!("read_dir {}: {e}", dir.display()));
                return;
            }
        };
        let mut names: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        names.sort();
        for name in names {
            let rel = rel.join(&name);
            // Entries that vanish mid-walk are not an error: the next snapshot has the truth.
            let Ok(meta) = fs::symlink_metadata(root.join(&rel)) else {
                continue;
            };
            let Some(entry) = self.upper_entry(&root.join(&rel), &meta) else {
                continue;
            };
            let descend = matches!(entry, Upper::Node(Node::Dir { .. }));
            s.upper.insert(rel.clone(), entry);
            if descend {
                self.walk(root, &rel, s);
            }
        }
    }

    fn upper_entry(&mut self, path: &Path, meta: &fs::Metadata) -> Option<Upper> {
        let ft = meta.file_type();
        use std::os::unix::fs::FileTypeExt;
        if ft.is_char_device() && meta.rdev() == 0 {
            return Some(Upper::Whiteout);
        }
        let xattrs = xattrs(path);
        if ft.is_file() && meta.len() == 0 && xattrs.overlay.iter().any(|(k, _)| k == b"whiteout") {
            return Some(Upper::Whiteout);
        }
        self.node(path, meta, xattrs).map(Upper::Node)
    }

    fn node(&mut self, path: &Path, meta: &fs::Metadata, x: XattrSet) -> Option<Node> {
        let ft = meta.file_type();
        let (uid, gid) = (meta.uid(), meta.gid());
        Some(if ft.is_dir() {
            let opaque = x.overlay.iter().any(|(k, v)| k == b"opaque" && v == b"y");
            Node::Dir {
                mode: meta.mode() & 0o7777,
                uid,
                gid,
                opaque,
                xattrs: x.other,
            }
        } else if ft.is_file() {
            let mtime_ns = meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128;
            let ctime_ns = meta.ctime() as i128 * 1_000_000_000 + meta.ctime_nsec() as i128;
            let key = (meta.dev(), meta.ino(), meta.len(), mtime_ns, ctime_ns);
            let digest = match self.digests.get(&key) {
                Some(d) => *d,
                None => {
                    let d = file_digest(path).ok()?;
                    self.digests.insert(key, d);
                    d
                }
            };
            Node::File {
                mode: meta.mode() & 0o7777,
                uid,
                gid,
                size: meta.len(),
                mtime_ns,
                digest,
                xattrs: x.other,
            }
        } else if ft.is_symlink() {
            Node::Symlink {
                uid,
                gid,
                target: fs::read_link(path).ok()?.as_os_str().as_bytes().to_vec(),
            }
        } else {
            Node::Special {
                mode: meta.mode(),
                uid,
                gid,
                rdev: meta.rdev(),
            }
        })
    }

    /// What the container sees at `rel` given the upperdir entries of `s`.
    fn effective(&mut self, s: &Snapshot, rel: &Path) -> Node {
        match s.upper.get(rel) {
            Some(Upper::Whiteout) => return Node::Absent,
            Some(Upper::Node(n)) => return n.clone(),
            None => {}
        }
        // An upper ancestor that is a whiteout, not a directory, or an opaque directory hides
        // whatever the lower layers have below it.
        for anc in rel
            .ancestors()
            .skip(1)
            .filter(|a| !a.as_os_str().is_empty())
        {
            match s.upper.get(anc) {
                Some(Upper::Node(Node::Dir { opaque: false, .. })) | None => {}
                Some(_) => return Node::Absent,
            }
        }
        self.lower_node(rel)
    }

    fn lower_node(&mut self, rel: &Path) -> Node {
        if let Some(n) = self.lower.get(rel) {
            return n.clone();
        }
        let mut found = Node::Absent;
        for dir in self.target.lowerdirs.clone() {
            let path = dir.join(rel);
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            found = match self.upper_entry(&path, &meta) {
                Some(Upper::Node(n)) => n,
                _ => Node::Absent,
            };
            break;
        }
        self.lower.insert(rel.to_path_buf(), found.clone());
        found
    }

    fn scan_processes(&mut self, s: &mut Snapshot) {
        let mut pids = Vec::new();
        collect_procs(&self.target.cgroup, &mut pids, &mut s.errors);
        pids.sort_unstable();
        pids.dedup();
        for pid in pids {
            let Some((state, start)) = stat(pid) else {
                continue;
            };
            if state == 'Z' || state == 'X' {
                continue;
            }
            let cmdline = fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| {
                    String::from_utf8_lossy(&b)
                        .replace('\0', " ")
                        .trim_end()
                        .to_string()
                })
                .unwrap_or_default();
            let exe = fs::read_link(format!("/proc/{pid}/exe")).ok();
            let memory = match memory_digest(pid) {
                Ok(d) => Some(d),
                Err(e) => {
                    s.errors
                        .push(format!("memory of pid {pid} ({cmdline}): {e}"));
                    None
                }
            };
            s.procs.insert(
                (pid, start),
                ProcNode {
                    cmdline,
                    exe,
                    memory,
                    held: held_files(pid),
                },
            );
        }
    }

    /// Resolves four snapshots (previous B and A, this B and A) into what the container saw at
    /// every path any of them has in its upperdir, and every process any of them had.
    pub fn resolve(&mut self, s: [&Snapshot; 4]) -> Resolved {
        let paths: BTreeSet<&PathBuf> = s.iter().flat_map(|x| x.upper.keys()).collect();
        let fs = paths
            .into_iter()
            .map(|p| {
                let nodes = [0, 1, 2, 3].map(|i| self.effective(s[i], p));
                (Path::new("/").join(p), nodes)
            })
            .collect();
        let keys: BTreeSet<ProcKey> = s.iter().flat_map(|x| x.procs.keys().copied()).collect();
        let procs = keys
            .into_iter()
            .map(|k| (k, [0, 1, 2, 3].map(|i| s[i].procs.get(&k).cloned())))
            .collect();
        Resolved { fs, procs }
    }
}

/// Per container path (`/app/x`) and per process: their state in the four snapshots of a turn
/// (previous B, previous A, this B, this A).
#[derive(Debug, Default)]
pub struct Resolved {
    pub fs: BTreeMap<PathBuf, [Node; 4]>,
    pub procs: BTreeMap<ProcKey, [Option<ProcNode>; 4]>,
}

/// crab's stored answer for a turn, as far as the oracle needs it.
#[derive(Debug, Clone, Default)]
pub struct CrabAnswer {
    pub fs: bool,
    pub proc: bool,
    pub paths: BTreeSet<PathBuf>,
    pub deleted: BTreeSet<PathBuf>,
    pub degraded: bool,
}

impl CrabAnswer {
    /// From a stored turn answer (`turns/<seq>.json`).
    pub fn from_json(a: &Value) -> CrabAnswer {
        let kind = a["kind"].as_str().unwrap_or("full");
        let list = |k: &str| -> BTreeSet<PathBuf> {
            a["fs"][k]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|p| p.as_str())
                .map(PathBuf::from)
                .collect()
        };
        let deleted = list("deleted");
        let mut paths = list("added");
        paths.extend(list("modified"));
        paths.extend(deleted.iter().cloned());
        CrabAnswer {
            fs: matches!(kind, "fs" | "full"),
            proc: matches!(kind, "proc" | "full"),
            paths,
            deleted,
            degraded: a["degraded"].as_array().is_some_and(|d| !d.is_empty()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    TruePositive,
    TrueNegative,
    FalsePositive,
    FalseNegative,
    Ambiguous,
}

/// The oracle's judgement of one turn.
#[derive(Debug, Clone, Serialize)]
pub struct Judgement {
    pub fs: Verdict,
    pub proc: Verdict,
    /// Container paths whose state the turn changed, and that held still across both turn ends.
    pub fs_changed: Vec<PathBuf>,
    /// Paths that moved across a turn end (their truth is uncertain).
    pub fs_unstable: Vec<PathBuf>,
    /// Changed paths crab's answer does not list (its layer would miss them): false negatives
    /// at the level of content, even when the kind was right.
    pub fs_missed: Vec<PathBuf>,
    /// Paths crab lists whose state did not change (an extra entry in the layer).
    pub fs_extra: Vec<PathBuf>,
    /// Why a process image was needed: started / ended / re-exec'd / memory / holds.
    pub proc_changed: Vec<String>,
    pub proc_unstable: Vec<String>,
}

fn verdict(said: bool, certain: bool, changed: bool, unstable: bool) -> Verdict {
    match (said, certain, changed, unstable) {
        (true, true, _, _) => Verdict::TruePositive,
        (false, true, _, _) => Verdict::FalseNegative,
        // Changed, but only things that also moved across a turn end.
        (true, false, true, _) => Verdict::TruePositive,
        (_, false, _, true) | (false, false, true, false) => Verdict::Ambiguous,
        (true, false, false, false) => Verdict::FalsePositive,
        (false, false, false, false) => Verdict::TrueNegative,
    }
}

/// Judges crab's answer for a turn against the resolved snapshots.
///
/// `froze` says whether crab's checkpoint job ran across the previous and this turn end: its
/// freeze (and a CRIU dump) wakes every process, which rewrites a little of their memory, and
/// crab re-marks the idle ones after its own freeze. A process that moved across such a turn
/// end is judged by what changed between the snapshots around the turn (previous A, this B):
/// crab's own doing is not the agent's. Files are not touched by a freeze.
pub fn judge(r: &Resolved, crab: &CrabAnswer, froze: [bool; 2]) -> Judgement {
    let mut fs_changed = Vec::new();
    let mut fs_unstable = Vec::new();
    let mut any_fs_change = false;
    for (p, n) in &r.fs {
        let changed = n[1] != n[2];
        let unstable = n[0] != n[1] || n[2] != n[3];
        any_fs_change |= changed;
        if unstable {
            fs_unstable.push(p.clone());
        } else if changed {
            fs_changed.push(p.clone());
        }
    }
    let covered = |p: &Path| {
        crab.paths.contains(p) || p.ancestors().skip(1).any(|a| crab.deleted.contains(a))
    };
    let fs_missed: Vec<PathBuf> = fs_changed.iter().filter(|p| !covered(p)).cloned().collect();
    let fs_extra: Vec<PathBuf> = crab
        .paths
        .iter()
        .filter(|p| {
            r.fs.get(*p)
                .is_none_or(|n| n[1] == n[2] && n[0] == n[1] && n[2] == n[3])
        })
        .cloned()
        .collect();
    let mut fs = verdict(
        crab.fs,
        !fs_changed.is_empty(),
        any_fs_change,
        !fs_unstable.is_empty(),
    );
    if fs == Verdict::TruePositive && !fs_missed.is_empty() {
        fs = Verdict::FalseNegative;
    }

    let changed_paths: BTreeSet<&PathBuf> = fs_changed.iter().collect();
    let unstable_paths: BTreeSet<&PathBuf> = fs_unstable.iter().collect();
    let mut proc_changed = Vec::new();
    let mut proc_unstable = Vec::new();
    let mut any_proc_change = false;
    for ((pid, _), n) in &r.procs {
        let st = |i: usize| n[i].as_ref().map(ProcNode::state);
        let name = n
            .iter()
            .flatten()
            .next()
            .map(|p| p.cmdline.as_str())
            .unwrap_or("?");
        let what = match (&n[1], &n[2]) {
            (None, Some(_)) => "started",
            (Some(_), None) => "ended",
            (Some(a), Some(b)) if a.exe != b.exe => "re-exec'd",
            (Some(a), Some(b)) if a.memory.is_none() || b.memory.is_none() => "memory unreadable",
            _ => "memory changed",
        };
        let changed = st(1) != st(2) || what == "memory unreadable";
        // Across a turn end: a start or an exit is never crab's doing; a memory change is,
        // where crab's job froze the container.
        let moved = |a: usize, b: usize, froze: bool| match (&n[a], &n[b]) {
            (Some(x), Some(y)) => !froze && x.state() != y.state(),
            (x, y) => x.is_some() != y.is_some(),
        };
        let unstable =
            moved(0, 1, froze[0]) || moved(2, 3, froze[1]) || what == "memory unreadable";
        any_proc_change |= changed;
        if unstable && changed {
            proc_unstable.push(format!(
                "pid {pid} ({name}): {what}, and moved across a turn end"
            ));
        } else if unstable {
            proc_unstable.push(format!("pid {pid} ({name}): moved across a turn end"));
        } else if changed {
            proc_changed.push(format!("pid {pid} ({name}): {what}"));
        }
        // A persisting process that holds a changed file.
        if let (Some(_), Some(now)) = (&n[1], &n[2]) {
            for h in &now.held {
                let held = h.to_string_lossy();
                let path = PathBuf::from(held.strip_suffix(" (deleted)").unwrap_or(&held));
                if changed_paths.contains(&path) {
                    any_proc_change = true;
                    proc_changed.push(format!(
                        "pid {pid} ({name}): holds changed {}",
                        path.display()
                    ));
                } else if unstable_paths.contains(&path) {
                    proc_unstable.push(format!(
                        "pid {pid} ({name}): holds {}, which moved across a turn end",
                        path.display()
                    ));
                }
            }
        }
    }
    let proc = verdict(
        crab.proc,
        !proc_changed.is_empty(),
        any_proc_change,
        !proc_unstable.is_empty(),
    );
    Judgement {
        fs,
        proc,
        fs_changed,
        fs_unstable,
        fs_missed,
        fs_extra,
        proc_changed,
        proc_unstable,
    }
}

// ---------------------------------------------------------------------------------------------
// Host reads

struct XattrSet {
    /// `trusted.overlay.*` / `user.overlay.*`, without the prefix (overlayfs' own state).
    overlay: Vec<(Vec<u8>, Vec<u8>)>,
    other: Xattrs,
}

fn xattrs(path: &Path) -> XattrSet {
    let mut set = XattrSet {
        overlay: Vec::new(),
        other: Vec::new(),
    };
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return set;
    };
    let mut names = vec![0u8; 4096];
    // SAFETY: c is NUL-terminated; the buffer's length is passed.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n <= 0 {
        return set;
    }
    names.truncate(n as usize);
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let mut value = vec![0u8; 65536];
        // SAFETY: both strings are NUL-terminated; the buffer's length is passed.
        let len = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if len < 0 {
            continue;
        }
        value.truncate(len as usize);
        match name
            .strip_prefix(b"trusted.overlay.")
            .or_else(|| name.strip_prefix(b"user.overlay."))
        {
            Some(short) => set.overlay.push((short.to_vec(), value)),
            None => set.other.push((name.to_vec(), value)),
        }
    }
    set.other.sort();
    set
}

/// A fast 64-bit digest (multiply-rotate over 8-byte words, length folded in): equal content
/// gives equal digests; a change goes unnoticed only by a 64-bit collision.
#[derive(Clone)]
struct Digest {
    h: u64,
    len: u64,
    tail: Vec<u8>,
}

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;

impl Digest {
    fn new() -> Digest {
        Digest {
            h: 0x2545_F491_4F6C_DD1D,
            len: 0,
            tail: Vec::new(),
        }
    }

    fn word(&mut self, w: u64) {
        self.h = (self.h ^ w.wrapping_mul(K1).rotate_left(31).wrapping_mul(K2))
            .rotate_left(27)
            .wrapping_mul(5)
            .wrapping_add(0x52DC_E729);
    }

    fn update(&mut self, mut data: &[u8]) {
        self.len += data.len() as u64;
        if !self.tail.is_empty() {
            let need = (8 - self.tail.len()).min(data.len());
            self.tail.extend_from_slice(&data[..need]);
            data = &data[need..];
            if self.tail.len() < 8 {
                return;
            }
            let w = u64::from_le_bytes(self.tail[..8].try_into().expect("8 bytes"));
            self.word(w);
            self.tail.clear();
        }
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            self.word(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        self.tail.extend_from_slice(chunks.remainder());
    }

    fn finish(mut self) -> u64 {
        let mut last = [0u8; 8];
        last[..self.tail.len()].copy_from_slice(&self.tail);
        let len = self.len;
        self.word(u64::from_le_bytes(last));
        self.word(len);
        let mut h = self.h;
        h ^= h >> 33;
        h = h.wrapping_mul(K2);
        h ^= h >> 29;
        h
    }
}

fn file_digest(path: &Path) -> std::io::Result<u64> {
    let mut f = File::open(path)?;
    let mut d = Digest::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(d.finish());
        }
        d.update(&buf[..n]);
    }
}

fn collect_procs(dir: &Path, out: &mut Vec<u32>, errors: &mut Vec<String>) {
    match fs::read_to_string(dir.join("cgroup.procs")) {
        Ok(t) => out.extend(t.lines().filter_map(|l| l.trim().parse::<u32>().ok())),
        // The container is gone (its last turn killed init?): no processes.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
        Err(e) => errors.push(format!("{}/cgroup.procs: {e}", dir.display())),
    }
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            collect_procs(&e.path(), out, errors);
        }
    }
}

/// (state, start time) from /proc/<pid>/stat.
fn stat(pid: u32) -> Option<(char, u64)> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Field 3 (state) is rest[0]; field 22 (starttime) is rest[19].
    Some((
        fields.first()?.chars().next()?,
        fields.get(19)?.parse().ok()?,
    ))
}

/// The layout of every mapping and the bytes of every writable one.
fn memory_digest(pid: u32) -> std::io::Result<u64> {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mem = File::open(format!("/proc/{pid}/mem"))?;
    let mut d = Digest::new();
    let mut buf = vec![0u8; 1 << 20];
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let (offset, _dev, inode) = (f.next().unwrap_or(""), f.next(), f.next().unwrap_or(""));
        let path = f.collect::<Vec<_>>().join(" ");
        d.update(range.as_bytes());
        d.update(perms.as_bytes());
        d.update(offset.as_bytes());
        d.update(inode.as_bytes());
        d.update(path.as_bytes());
        if perms.as_bytes().get(1) != Some(&b'w') || path == "[vvar]" {
            continue;
        }
        let Some((start, end)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            continue;
        };
        let mut at = start;
        while at < end {
            let n = (end - at).min(buf.len() as u64) as usize;
            match mem.read_at(&mut buf[..n], at) {
                Ok(0) => break,
                Ok(k) => {
                    d.update(&buf[..k]);
                    at += k as u64;
                }
                Err(_) => {
                    // An unreadable page (a guard page): note where, skip a page.
                    d.update(b"unreadable");
                    at += 4096;
                }
            }
        }
    }
    Ok(d.finish())
}

/// Container paths a process has open or mapped (as its own root sees them).
fn held_files(pid: u32) -> BTreeSet<PathBuf> {
    let mut held = BTreeSet::new();
    for e in fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(t) = fs::read_link(e.path()) {
            if t.is_absolute() {
                held.insert(t);
            }
        }
    }
    if let Ok(maps) = fs::read_to_string(format!("/proc/{pid}/maps")) {
        for line in maps.lines() {
            if let Some(i) = line.find(" /") {
                held.insert(PathBuf::from(line[i + 1..].trim()));
            }
        }
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;

    const NO_FREEZE: [bool; 2] = [false, false];

    fn file(digest: u64) -> Node {
        Node::File {
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: 1,
            mtime_ns: 1,
            digest,
            xattrs: Vec::new(),
        }
    }

    fn resolved(fs: &[(&str, [Node; 4])]) -> Resolved {
        Resolved {
            fs: fs
                .iter()
                .map(|(p, n)| (PathBuf::from(p), n.clone()))
                .collect(),
            procs: BTreeMap::new(),
        }
    }

    fn crab(fs: bool, proc: bool, paths: &[&str]) -> CrabAnswer {
        CrabAnswer {
            fs,
            proc,
            paths: paths.iter().map(PathBuf::from).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn digest_is_streaming_and_sensitive() {
        let whole = {
            let mut d = Digest::new();
            d.update(b"hello, oracle world");
            d.finish()
        };
        let parts = {
            let mut d = Digest::new();
            for c in [&b"hel"[..], b"lo, orac", b"", b"le world"] {
                d.update(c);
            }
            d.finish()
        };
        assert_eq!(whole, parts);
        let other = |s: &[u8]| {
            let mut d = Digest::new();
            d.update(s);
            d.finish()
        };
        assert_ne!(whole, other(b"hello, oracle worle"));
        assert_ne!(other(b""), other(b"\0"));
        assert_ne!(other(b"ab"), other(b"ba"));
    }

    #[test]
    fn fs_verdicts() {
        let (a, b) = (file(1), file(2));
        let abs = Node::Absent;
        // Changed between the previous A and this B, still across both turn ends.
        let r = resolved(&[("/app/x", [a.clone(), a.clone(), b.clone(), b.clone()])]);
        assert_eq!(
            judge(&r, &crab(true, false, &["/app/x"]), NO_FREEZE).fs,
            Verdict::TruePositive
        );
        let j = judge(&r, &crab(false, false, &[]), NO_FREEZE);
        assert_eq!((j.fs, j.fs_missed.len()), (Verdict::FalseNegative, 1));
        // The right kind but the path missing from the layer is a false negative too.
        let j = judge(&r, &crab(true, false, &["/app/y"]), NO_FREEZE);
        assert_eq!(
            (j.fs, j.fs_missed, j.fs_extra),
            (
                Verdict::FalseNegative,
                vec![PathBuf::from("/app/x")],
                vec![PathBuf::from("/app/y")]
            )
        );
        // Came and went, or copied up unchanged: no change.
        let r = resolved(&[
            (
                "/tmp/t",
                [abs.clone(), abs.clone(), abs.clone(), abs.clone()],
            ),
            ("/etc", [a.clone(), a.clone(), a.clone(), a.clone()]),
        ]);
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).fs,
            Verdict::TrueNegative
        );
        assert_eq!(
            judge(&r, &crab(true, false, &["/etc"]), NO_FREEZE).fs,
            Verdict::FalsePositive
        );
        // A writer across this turn end: uncertain unless crab took it.
        let r = resolved(&[("/app/log", [a.clone(), a.clone(), a.clone(), b.clone()])]);
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).fs,
            Verdict::Ambiguous
        );
        assert_eq!(
            judge(&r, &crab(true, false, &["/app/log"]), NO_FREEZE).fs,
            Verdict::Ambiguous
        );
        let r = resolved(&[("/app/log", [a.clone(), b.clone(), file(3), file(4)])]);
        assert_eq!(
            judge(&r, &crab(true, false, &["/app/log"]), NO_FREEZE).fs,
            Verdict::TruePositive
        );
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).fs,
            Verdict::Ambiguous
        );
    }

    #[test]
    fn deleted_directories_cover_their_content() {
        let a = file(1);
        let r = resolved(&[(
            "/app/d/x",
            [a.clone(), a.clone(), Node::Absent, Node::Absent],
        )]);
        let mut c = crab(true, false, &["/app/d"]);
        c.deleted.insert(PathBuf::from("/app/d"));
        let j = judge(&r, &c, NO_FREEZE);
        assert_eq!((j.fs, j.fs_missed.len()), (Verdict::TruePositive, 0));
    }

    fn proc(mem: u64, held: &[&str]) -> Option<ProcNode> {
        Some(ProcNode {
            cmdline: "p".into(),
            exe: Some("/usr/bin/p".into()),
            memory: Some(mem),
            held: held.iter().map(PathBuf::from).collect(),
        })
    }

    #[test]
    fn proc_verdicts() {
        let with = |n: [Option<ProcNode>; 4]| Resolved {
            fs: BTreeMap::new(),
            procs: BTreeMap::from([((10, 1), n)]),
        };
        // Started during the turn.
        let r = with([None, None, proc(1, &[]), proc(1, &[])]);
        assert_eq!(
            judge(&r, &crab(false, true, &[]), NO_FREEZE).proc,
            Verdict::TruePositive
        );
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).proc,
            Verdict::FalseNegative
        );
        // Idle throughout.
        let r = with([proc(1, &[]), proc(1, &[]), proc(1, &[]), proc(1, &[])]);
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).proc,
            Verdict::TrueNegative
        );
        assert_eq!(
            judge(&r, &crab(false, true, &[]), NO_FREEZE).proc,
            Verdict::FalsePositive
        );
        // Memory changed during the turn.
        let r = with([proc(1, &[]), proc(1, &[]), proc(2, &[]), proc(2, &[])]);
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).proc,
            Verdict::FalseNegative
        );
        // Moved across the previous turn end: uncertain, unless crab's own checkpoint job
        // (its freeze) ran then.
        let r = with([proc(1, &[]), proc(2, &[]), proc(2, &[]), proc(2, &[])]);
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).proc,
            Verdict::Ambiguous
        );
        let j = judge(&r, &crab(false, false, &[]), [true, false]);
        assert_eq!(j.proc, Verdict::TrueNegative);
        // Ended across the previous turn end, where crab checkpointed: not crab's doing, so
        // crab's mark may have had it alive (its "ended" is then right) or not.
        let r = with([proc(1, &[]), None, None, None]);
        assert_eq!(
            judge(&r, &crab(false, true, &[]), [true, false]).proc,
            Verdict::Ambiguous
        );
        assert_eq!(
            judge(&r, &crab(false, false, &[]), [true, false]).proc,
            Verdict::Ambiguous
        );
        // Changed during the turn, then dumped by crab across this turn end.
        let r = with([proc(1, &[]), proc(1, &[]), proc(2, &[]), proc(3, &[])]);
        assert_eq!(
            judge(&r, &crab(false, true, &[]), [false, true]).proc,
            Verdict::TruePositive
        );
        assert_eq!(
            judge(&r, &crab(true, false, &[]), [false, true]).proc,
            Verdict::FalseNegative
        );
        // Unreadable memory is never a certain answer.
        let mut n = proc(1, &[]);
        n.as_mut().unwrap().memory = None;
        let r = with([n.clone(), n.clone(), n.clone(), n]);
        assert_eq!(
            judge(&r, &crab(false, false, &[]), NO_FREEZE).proc,
            Verdict::Ambiguous
        );
    }

    #[test]
    fn a_process_holding_a_changed_file_needs_an_image() {
        let (a, b) = (file(1), file(2));
        let mut r = resolved(&[("/app/data.db", [a.clone(), a, b.clone(), b])]);
        r.procs.insert(
            (10, 1),
            [
                proc(1, &["/app/data.db"]),
                proc(1, &["/app/data.db"]),
                proc(1, &["/app/data.db"]),
                proc(1, &["/app/data.db"]),
            ],
        );
        let j = judge(&r, &crab(true, false, &["/app/data.db"]), NO_FREEZE);
        assert_eq!(j.proc, Verdict::FalseNegative, "{:?}", j.proc_changed);
        assert_eq!(
            judge(&r, &crab(true, true, &["/app/data.db"]), NO_FREEZE).proc,
            Verdict::TruePositive
        );
    }

    #[test]
    fn overlay_options() {
        let o: Vec<String> = [
            "index=off",
            "workdir=/w",
            "upperdir=/u/fs",
            "lowerdir=/l/2/fs:/l/1/fs",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (u, l) = overlay_dirs(&o).unwrap();
        assert_eq!(u, Path::new("/u/fs"));
        assert_eq!(l, [PathBuf::from("/l/2/fs"), PathBuf::from("/l/1/fs")]);
        assert!(overlay_dirs(&o[..1]).is_none());
    }

    #[test]
    fn crab_answer_from_json() {
        let a: Value = serde_json::from_str(
            r#"{"kind": "full", "fs": {"added": ["/app/a"], "modified": ["/etc/x"], "deleted": ["/app/d"]}, "degraded": []}"#,
        )
        .unwrap();
        let c = CrabAnswer::from_json(&a);
        assert!(c.fs && c.proc && !c.degraded);
        assert_eq!(c.paths.len(), 3);
        assert!(c.deleted.contains(Path::new("/app/d")));
        let c = CrabAnswer::from_json(&serde_json::json!({"kind": "none"}));
        assert!(!c.fs && !c.proc);
    }

    /// The merged view from an upper and a lower directory: copy-ups that changed nothing are
    /// equal to the lower entry, whiteouts and opaque directories hide it.
    #[test]
    fn effective_state_of_an_overlay() {
        let t = tempfile::tempdir().unwrap();
        let (upper, lower) = (t.path().join("upper"), t.path().join("lower"));
        for d in [&upper, &lower] {
            fs::create_dir_all(d.join("etc")).unwrap();
            fs::create_dir_all(d.join("opt/sub")).unwrap();
        }
        fs::write(lower.join("etc/same"), "x").unwrap();
        fs::write(lower.join("etc/edited"), "old").unwrap();
        fs::write(lower.join("opt/sub/hidden"), "h").unwrap();
        // A copy-up with the same content and times.
        fs::copy(lower.join("etc/same"), upper.join("etc/same")).unwrap();
        let m = fs::metadata(lower.join("etc/same")).unwrap();
        let times = fs::FileTimes::new().set_modified(m.modified().unwrap());
        File::options()
            .write(true)
            .open(upper.join("etc/same"))
            .unwrap()
            .set_times(times)
            .unwrap();
        fs::write(upper.join("etc/edited"), "new").unwrap();
        let mut o = Observer::new(Target {
            upperdir: upper.clone(),
            lowerdirs: vec![lower.clone()],
            cgroup: t.path().join("no-cgroup"),
        });
        let s = o.snapshot();
        assert_eq!(
            o.effective(&s, Path::new("etc/same")),
            o.lower_node(Path::new("etc/same"))
        );
        assert_ne!(
            o.effective(&s, Path::new("etc/edited")),
            o.lower_node(Path::new("etc/edited"))
        );
        assert_eq!(
            o.effective(&s, Path::new("etc")),
            o.lower_node(Path::new("etc")),
            "a copied-up directory"
        );
        assert_ne!(o.effective(&s, Path::new("opt/sub/hidden")), Node::Absent);
        // Whiteouts need mknod (root); skip that part elsewhere.
        let wh = CString::new(upper.join("etc/same").as_os_str().as_bytes()).unwrap();
        fs::remove_file(upper.join("etc/same")).unwrap();
        // SAFETY: a valid path; char device 0:0 is overlayfs' whiteout.
        if unsafe { libc::mknod(wh.as_ptr(), libc::S_IFCHR | 0o600, 0) } == 0 {
            let s = o.snapshot();
            assert_eq!(s.upper.get(Path::new("etc/same")), Some(&Upper::Whiteout));
            assert_eq!(o.effective(&s, Path::new("etc/same")), Node::Absent);
        }
        // An opaque directory hides what is below it in the lower layers (setting trusted.*
        // needs root too).
        let sub = CString::new(upper.join("opt/sub").as_os_str().as_bytes()).unwrap();
        // SAFETY: valid NUL-terminated strings and a one-byte value.
        if unsafe {
            libc::lsetxattr(
                sub.as_ptr(),
                c"trusted.overlay.opaque".as_ptr(),
                b"y".as_ptr().cast(),
                1,
                0,
            )
        } == 0
        {
            let s = o.snapshot();
            assert_eq!(o.effective(&s, Path::new("opt/sub/hidden")), Node::Absent);
        }
        // The paths of the snapshots, resolved, are container paths.
        let s = o.snapshot();
        let r = o.resolve([&s, &s, &s, &s]);
        assert!(r.fs.contains_key(Path::new("/etc/edited")));
    }
}

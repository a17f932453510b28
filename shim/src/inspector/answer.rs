//! The inspector's answer for one turn: its kind and what was found of the files and the
//! processes, with the why.
//!
//! These types are also the schema of the stored answer (`turns/<seq>.json`, with the turn
//! id beside: `sandbox::TurnRecord`) that crabctl reads back: a field an older shim did not
//! write takes its default, so older answers still parse.

use std::{collections::BTreeMap, path::PathBuf};

use serde::{Deserialize, Serialize};

use super::{decide, fs, memory, procs::ProcInfo};

/// The smallest checkpoint that preserves what a turn left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
pub(super) fn answer_kind(degraded: &[String], fs_changed: bool, procs_changed: bool) -> Kind {
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
    /// nsentered into it) as the container's ([`super::bpf::FsClass::Outside`]). `None`: not an
    /// overlay, such changes are not seen.
    pub rootfs_dev: Option<u64>,
    /// What one observation may cost the shim (`[limits]`).
    pub limits: crab_runtime_config::LimitsConfig,
    /// Keep the image of a process whose memory changed by its own doing alone
    /// (`[checkpoint] self_contained_changes = "keep"`, [`decide::not_own`]).
    pub keep_self_contained: bool,
}

/// A process by pid and command line (`[comm]` when it has none).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// What changed in the container's files during the turn.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FsFinding {
    pub changed: bool,
    /// Whether the upperdir was compared at all (not when no mutating syscall happened).
    pub scanned: bool,
    /// The upperdir or a tracked volume could not be scanned (unreadable, or over a `[limits]`
    /// bound): the paths below are incomplete, a checkpoint must capture everything or fail.
    pub unobserved: bool,
    /// Mutating syscalls seen since the mark, by class.
    pub syscalls: BTreeMap<String, u64>,
    pub added: Vec<PathBuf>,
    pub modified: Vec<PathBuf>,
    pub deleted: Vec<PathBuf>,
}

/// A persisting process that ran during the turn, and how its memory changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
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

/// What changed in the container's processes during the turn.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
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
    /// since the mark, by class ([`super::bpf::StateClass`]): each makes the processes count as changed.
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
pub(super) fn procs_changed(p: &ProcFinding) -> bool {
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub container_id: String,
    /// The turn's number in its task (1 for the first turn after the container started).
    pub seq: u64,
    pub kind: Kind,
    pub fs: FsFinding,
    pub procs: ProcFinding,
    /// Why the inspector could not observe the turn (then `kind` is `full`).
    #[serde(default)]
    pub degraded: Vec<String>,
    #[serde(default)]
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

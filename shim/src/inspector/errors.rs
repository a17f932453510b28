//! Why the inspector could not observe (part of) a turn, or watch a container at all.

use std::{path::PathBuf, sync::Arc};

use super::{bpf::BpfError, fs::FsError, memory::MemError, procs::ProcfsError};

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

/// At most this many tmpfs mounts of a container are compared ([`Inspection::scan_tmpfs`]).
pub(super) const MAX_TMPFS_MOUNTS: usize = 64;

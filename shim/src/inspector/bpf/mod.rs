//! eBPF side of the inspector: host-wide programs, per-cgroup counters.
//!
//! The programs in `bpf-programs/inspector.bpf.c` are compiled by `build.rs`
//! and embedded in the shim. They are loaded **once per host**: the first shim
//! loads and attaches them and pins maps, programs and links under
//! `/sys/fs/bpf/crab/<version>/` (`maps/`, `progs/`, `links/`), published by an
//! atomic rename while holding `flock` on the pin root. The pinned links keep
//! the programs attached after that shim exits; every later shim only opens the
//! pinned maps. `<version>` is `v<ABI_VERSION>-<hash of the BPF object>`, so a
//! shim never talks to programs other than the ones it was built with; the
//! shim that loads a new version retires older ones nothing watches through.
//!
//! A shim registers its container by cgroup id ([`crate::sys::cgroup::cgroup_id`]
//! of the container's cgroup2 directory) with [`HostProbes::watch`] and removes it
//! with [`HostProbes::unwatch`]. Programs filter on `bpf_get_current_cgroup_id()`
//! with one hash lookup, so per-syscall cost does not grow with the number of
//! watched cgroups. Tasks in child cgroups of a watched cgroup count for it.
//!
//! What is counted (tracepoints only; see the C source for the exact list):
//! - filesystem mutations by class ([`FsClass`]): open family only with
//!   write/create/truncate/tmpfile flags and only if the result is not a
//!   device, FIFO or socket; write family only on regular files; rename,
//!   unlink, mkdir, rmdir, link, symlink, chmod, chown, xattrs, utimes, mknod
//!   and unix-socket bind, truncate, fallocate, copy_file_range, clone ioctls,
//!   io_uring/AIO use, shared writable file mappings (mmap and mprotect);
//! - processes: forks, threads, execs, exits;
//! - memory of other processes: ptrace, process_vm_writev, writes to /proc;
//! - scheduling: per process, how many times its threads left a CPU.
//!
//! Nothing a container does can fill a map its neighbours need: `watched` holds one entry per
//! watched cgroup (written by the shims alone), and per-process run counts are task storage
//! (`BPF_MAP_TYPE_TASK_STORAGE` on each process's thread-group leader: made at its first
//! switch-out, gone with it), which has no host-wide capacity. They used to be a host-wide hash
//! of 65,536 pids, which one container of many sleeping processes could fill, making every
//! watched container's turns `full` (DEGRADED).
//!
//! Fail safe: whatever the BPF side cannot record (a run entry it cannot make, a program
//! skipped by the kernel's recursion protection, a 32-bit process running:
//! its compat syscalls bypass the syscall tracepoints) shows up in
//! [`CgroupCounters::errors`]; a caller seeing it move must treat the turn as
//! "everything changed".
//!
//! Not seen at all: `int 0x80` syscalls issued by 64-bit processes, io_uring
//! SQPOLL submissions after the ring's setup/enter calls, and memory of a
//! process changed through memory it shares with another (shared anonymous
//! mappings, SysV/POSIX shm, memfd): its run count only says whether it ran.
//!
//! - [`programs`]: the programs and maps of the embedded object, loading and attaching them
//! - [`pins`]: the pinned versions under the pin root: opening, publishing, retiring them
//! - [`probes`]: [`HostProbes`], what a shim does with them (watch, count, run counts)

mod pins;
mod probes;
mod programs;
#[cfg(test)]
mod tests;

#[doc(hidden)]
pub mod testing;

use std::io;
use std::path::{Path, PathBuf};

use aya::maps::MapError;
use aya::programs::ProgramError;

pub use self::pins::remove_pinned;
pub use self::probes::HostProbes;
pub use self::programs::version_dir_name;
pub use crate::sys::bpf::ProgramStats;

/// Bump whenever a map layout in `bpf-programs/include/inspector.h` changes.
pub const ABI_VERSION: u32 = 9;
/// Where the host-wide programs are pinned.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/crab";
/// Number of [`FsClass`] values.
pub const FS_CLASSES: usize = 20;
/// Number of [`StateClass`] values.
pub const STATE_CLASSES: usize = 9;
/// Cgroup levels whose descendants the programs match (`MAX_LEVELS` in inspector.h).
const MAX_LEVELS: u64 = 16;

/// Errors of the eBPF inspector.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{path} is not a bpf filesystem")]
    NotBpfFs { path: PathBuf },
    #[error("reading kernel BTF: {0}")]
    Btf(#[from] aya::BtfError),
    #[error("loading the inspector BPF object: {0}")]
    Load(#[from] aya::EbpfError),
    #[error("BPF object has no program {0}")]
    MissingProgram(&'static str),
    #[error("BPF program {name}: {source}")]
    Program {
        name: &'static str,
        source: ProgramError,
    },
    #[error("required tracepoint syscalls/{0} is missing from this kernel")]
    MissingTracepoint(&'static str),
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        source: aya::pin::PinError,
    },
    #[error("BPF map {name}: {source}")]
    Map {
        name: &'static str,
        source: MapError,
    },
    #[error("link of {name}: {source}")]
    Link {
        name: &'static str,
        source: aya::programs::links::LinkError,
    },
    #[error("pinned inspector at {path} is incomplete: {detail}")]
    Incomplete { path: PathBuf, detail: String },
    #[error("cgroup {0} is not watched")]
    NotWatched(u64),
    #[error("cgroup {id} is at level {level}; descendants are only tracked up to level {max}", max = MAX_LEVELS - 1)]
    TooDeep { id: u64, level: u64 },
    #[error("{op}: {source}")]
    Syscall { op: &'static str, source: io::Error },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> BpfError + 'a {
    move |source| BpfError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

fn map_err(name: &'static str) -> impl FnOnce(MapError) -> BpfError {
    move |source| BpfError::Map { name, source }
}

/// Why a filesystem mutation was counted (for explanations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FsClass {
    OpenWrite,
    Write,
    Truncate,
    Rename,
    Unlink,
    Mkdir,
    Rmdir,
    Link,
    Symlink,
    Chmod,
    Chown,
    Xattr,
    Utimes,
    Mknod,
    Fallocate,
    CopyRange,
    MmapShared,
    /// The kernel wrote a core file for a process that crashed.
    Coredump,
    Other,
    /// A task outside every watched cgroup changed files of the container's rootfs: `docker
    /// cp`, a host tool chrooted or nsentered into it, a write through its host path
    /// ([`HostProbes::watch_rootfs`]).
    Outside,
}

impl FsClass {
    /// In the order of `enum fs_class` in inspector.h (index = value).
    pub const ALL: [FsClass; FS_CLASSES] = [
        FsClass::OpenWrite,
        FsClass::Write,
        FsClass::Truncate,
        FsClass::Rename,
        FsClass::Unlink,
        FsClass::Mkdir,
        FsClass::Rmdir,
        FsClass::Link,
        FsClass::Symlink,
        FsClass::Chmod,
        FsClass::Chown,
        FsClass::Xattr,
        FsClass::Utimes,
        FsClass::Mknod,
        FsClass::Fallocate,
        FsClass::CopyRange,
        FsClass::MmapShared,
        FsClass::Coredump,
        FsClass::Other,
        FsClass::Outside,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(&self) -> &'static str {
        match self {
            FsClass::OpenWrite => "open-write",
            FsClass::Write => "write",
            FsClass::Truncate => "truncate",
            FsClass::Rename => "rename",
            FsClass::Unlink => "unlink",
            FsClass::Mkdir => "mkdir",
            FsClass::Rmdir => "rmdir",
            FsClass::Link => "link",
            FsClass::Symlink => "symlink",
            FsClass::Chmod => "chmod",
            FsClass::Chown => "chown",
            FsClass::Xattr => "xattr",
            FsClass::Utimes => "utimes",
            FsClass::Mknod => "mknod",
            FsClass::Fallocate => "fallocate",
            FsClass::CopyRange => "copy-range",
            FsClass::MmapShared => "mmap-shared-write",
            FsClass::Coredump => "coredump",
            FsClass::Other => "other",
            FsClass::Outside => "outside",
        }
    }
}

/// Kernel state a task changed outside the filesystem and outside its own process that a turn
/// end cannot compare (`enum state_class` of inspector.h): any of these since the mark makes the
/// container's processes count as changed, since a process checkpoint holds that state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StateClass {
    /// pidfd_getfd: a copy of another process's file, on which anything may follow.
    PidfdGetfd,
    /// ioctl(UFFDIO_*): pages filled into whichever process registered the range.
    Userfaultfd,
    /// ptrace requests that write a tracee (pokes, registers, signal mask, siginfo).
    PtraceWrite,
    /// prlimit, setpriority, ioprio_set, sched_set* of another process.
    OtherProcess,
    /// SysV message queues, semaphores, shared memory (the IPC namespace's objects).
    SysvIpc,
    /// sethostname, setdomainname.
    Uts,
    /// A write to a /proc file other than a process's `mem`.
    Procfs,
    /// io_uring or AIO: operations that need no syscall of their own.
    AsyncIo,
    /// A file of a tmpfs mount (`/dev/shm`, `/dev`, a `--tmpfs`) or a memfd created, truncated
    /// or written: no upperdir holds it, a process checkpoint does (CRIU keeps tmpfs mounts).
    Tmpfs,
}

impl StateClass {
    /// In the order of `enum state_class` in inspector.h (index = value).
    pub const ALL: [StateClass; STATE_CLASSES] = [
        StateClass::PidfdGetfd,
        StateClass::Userfaultfd,
        StateClass::PtraceWrite,
        StateClass::OtherProcess,
        StateClass::SysvIpc,
        StateClass::Uts,
        StateClass::Procfs,
        StateClass::AsyncIo,
        StateClass::Tmpfs,
    ];

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(&self) -> &'static str {
        match self {
            StateClass::PidfdGetfd => "pidfd-getfd",
            StateClass::Userfaultfd => "userfaultfd",
            StateClass::PtraceWrite => "ptrace-write",
            StateClass::OtherProcess => "other-process",
            StateClass::SysvIpc => "sysv-ipc",
            StateClass::Uts => "uts",
            StateClass::Procfs => "procfs",
            StateClass::AsyncIo => "async-io",
            StateClass::Tmpfs => "tmpfs",
        }
    }
}

/// Counters of one watched cgroup, cumulative since [`HostProbes::watch`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CgroupCounters {
    /// Mutating fs syscalls entered by tasks of the cgroup.
    pub fs_mutations: u64,
    /// Per class (index = [`FsClass::index`]), for explanations.
    pub fs_by_class: [u64; FS_CLASSES],
    /// mmap(PROT_WRITE, MAP_SHARED) of a regular file, or mprotect adding
    /// PROT_WRITE to a shared file mapping: later writes need no syscall.
    pub shared_writable_mmaps: u64,
    /// New processes (thread-group leaders) created in the cgroup.
    pub forks: u64,
    /// New threads of existing processes.
    pub threads: u64,
    pub execs: u64,
    /// Processes whose last thread exited.
    pub exits: u64,
    /// ptrace, process_vm_writev or writes to /proc/PID/mem: another process's
    /// memory may have changed although that process did not run.
    pub foreign_mem_writes: u64,
    /// Per [`StateClass`] (index = [`StateClass::index`]).
    pub state_by_class: [u64; STATE_CLASSES],
    /// Anything the BPF side could not record (map full, programs skipped by
    /// the kernel): non-zero growth means "everything changed".
    pub errors: u64,
    /// Processes that got no run count because the cgroup held its quota of them
    /// ([`HostProbes::watch_bounded`], `[limits] max_bpf_processes`): growth means the
    /// cgroup's own run counts are incomplete (its turns are DEGRADED), nobody else's.
    pub over_quota: u64,
}

impl CgroupCounters {
    /// What happened between `earlier` and `self` (both from the same watch).
    pub fn since(&self, earlier: &CgroupCounters) -> CgroupCounters {
        let mut fs_by_class = [0; FS_CLASSES];
        for (i, v) in fs_by_class.iter_mut().enumerate() {
            *v = self.fs_by_class[i].saturating_sub(earlier.fs_by_class[i]);
        }
        let mut state_by_class = [0; STATE_CLASSES];
        for (i, v) in state_by_class.iter_mut().enumerate() {
            *v = self.state_by_class[i].saturating_sub(earlier.state_by_class[i]);
        }
        CgroupCounters {
            fs_mutations: self.fs_mutations.saturating_sub(earlier.fs_mutations),
            fs_by_class,
            shared_writable_mmaps: self
                .shared_writable_mmaps
                .saturating_sub(earlier.shared_writable_mmaps),
            forks: self.forks.saturating_sub(earlier.forks),
            threads: self.threads.saturating_sub(earlier.threads),
            execs: self.execs.saturating_sub(earlier.execs),
            exits: self.exits.saturating_sub(earlier.exits),
            foreign_mem_writes: self
                .foreign_mem_writes
                .saturating_sub(earlier.foreign_mem_writes),
            state_by_class,
            errors: self.errors.saturating_sub(earlier.errors),
            over_quota: self.over_quota.saturating_sub(earlier.over_quota),
        }
    }

    /// Non-zero kernel-state classes ("pidfd-getfd: 1").
    pub fn state_classes(&self) -> impl Iterator<Item = (StateClass, u64)> + '_ {
        StateClass::ALL
            .iter()
            .map(|c| (*c, self.state_by_class[c.index()]))
            .filter(|(_, n)| *n > 0)
    }

    /// Non-zero classes, for explanations ("write: 3, rename: 1").
    pub fn fs_classes(&self) -> impl Iterator<Item = (FsClass, u64)> + '_ {
        FsClass::ALL
            .iter()
            .map(|c| (*c, self.fs_by_class[c.index()]))
            .filter(|(_, n)| *n > 0)
    }
}

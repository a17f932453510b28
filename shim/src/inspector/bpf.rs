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
//! A shim registers its container by cgroup id ([`cgroup_id`] of the
//! container's cgroup2 directory) with [`HostProbes::watch`] and removes it
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
//! Fail safe: whatever the BPF side cannot record (a full map, a program
//! skipped by the kernel's recursion protection, a 32-bit process running:
//! its compat syscalls bypass the syscall tracepoints) shows up in
//! [`CgroupCounters::errors`]; a caller seeing it move must treat the turn as
//! "everything changed".
//!
//! Not seen at all: `int 0x80` syscalls issued by 64-bit processes, io_uring
//! SQPOLL submissions after the ring's setup/enter calls, and memory of a
//! process changed through memory it shares with another (shared anonymous
//! mappings, SysV/POSIX shm, memfd): its run count only says whether it ran.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::fs::{self, File};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aya::maps::{
    Array, HashMap as BpfHashMap, Map, MapData, MapError, MapInfo, PerCpuArray, PerCpuHashMap,
    PerCpuValues,
};
use aya::programs::links::FdLink;
use aya::programs::{BtfTracePoint, ProgramError, TracePoint};
use aya::{Btf, Ebpf, EbpfLoader, Pod};
use log::{debug, info, warn};

/// Bump whenever a map layout in `bpf-programs/include/inspector.h` changes.
pub const ABI_VERSION: u32 = 4;
/// Where the host-wide programs are pinned.
pub const DEFAULT_PIN_ROOT: &str = "/sys/fs/bpf/crab";
/// Number of [`FsClass`] values.
pub const FS_CLASSES: usize = 18;

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/inspector.bpf.o"));

const BPF_FS_MAGIC: i64 = 0xcafe4a11;
const TRACEFS_MAGIC: i64 = 0x74726163;
const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;
const BPFFS_MOUNT: &str = "/sys/fs/bpf";
const TRACEFS_MOUNT: &str = "/sys/kernel/tracing";
const MAX_LEVELS: u64 = 16; // MAX_LEVELS in inspector.h
const ONCPU_VALID: u64 = 1 << 32;

/// Syscall tracepoints (`syscalls/<name>`) per program. A tracepoint missing
/// from the running kernel is a syscall it does not have (arm64 has no
/// open/creat/rename/mkdir...), so it is skipped; [`REQUIRED_SYSCALL_TPS`]
/// must exist everywhere.
const SYSCALL_PROGRAMS: &[(&str, &[&str])] = &[
    ("crab_open_x", &["sys_exit_open"]),
    ("crab_openat_x", &["sys_exit_openat"]),
    ("crab_openat2_x", &["sys_exit_openat2"]),
    ("crab_creat_x", &["sys_exit_creat"]),
    ("crab_open_handle", &["sys_enter_open_by_handle_at"]),
    (
        "crab_write",
        &[
            "sys_enter_write",
            "sys_enter_pwrite64",
            "sys_enter_writev",
            "sys_enter_pwritev",
            "sys_enter_pwritev2",
            "sys_enter_sendfile64",
        ],
    ),
    ("crab_splice", &["sys_enter_splice"]),
    (
        "crab_truncate",
        &["sys_enter_truncate", "sys_enter_ftruncate"],
    ),
    (
        "crab_rename",
        &[
            "sys_enter_rename",
            "sys_enter_renameat",
            "sys_enter_renameat2",
        ],
    ),
    ("crab_unlink", &["sys_enter_unlink"]),
    ("crab_unlinkat", &["sys_enter_unlinkat"]),
    ("crab_rmdir", &["sys_enter_rmdir"]),
    ("crab_mkdir", &["sys_enter_mkdir", "sys_enter_mkdirat"]),
    ("crab_link", &["sys_enter_link", "sys_enter_linkat"]),
    (
        "crab_symlink",
        &["sys_enter_symlink", "sys_enter_symlinkat"],
    ),
    (
        "crab_chmod",
        &[
            "sys_enter_chmod",
            "sys_enter_fchmod",
            "sys_enter_fchmodat",
            "sys_enter_fchmodat2",
        ],
    ),
    (
        "crab_chown",
        &[
            "sys_enter_chown",
            "sys_enter_fchown",
            "sys_enter_lchown",
            "sys_enter_fchownat",
        ],
    ),
    (
        "crab_xattr",
        &[
            "sys_enter_setxattr",
            "sys_enter_lsetxattr",
            "sys_enter_fsetxattr",
            "sys_enter_removexattr",
            "sys_enter_lremovexattr",
            "sys_enter_fremovexattr",
            "sys_enter_setxattrat",
            "sys_enter_removexattrat",
            "sys_enter_file_setattr",
        ],
    ),
    (
        "crab_utimes",
        &[
            "sys_enter_utime",
            "sys_enter_utimes",
            "sys_enter_futimesat",
            "sys_enter_utimensat",
        ],
    ),
    ("crab_mknod", &["sys_enter_mknod", "sys_enter_mknodat"]),
    ("crab_bind", &["sys_enter_bind"]),
    ("crab_fallocate", &["sys_enter_fallocate"]),
    ("crab_copy_range", &["sys_enter_copy_file_range"]),
    ("crab_ioctl", &["sys_enter_ioctl"]),
    (
        "crab_async_io",
        &[
            "sys_enter_io_uring_setup",
            "sys_enter_io_uring_enter",
            "sys_enter_io_uring_register",
            "sys_enter_io_submit",
        ],
    ),
    ("crab_mmap", &["sys_enter_mmap"]),
    ("crab_mprotect", &["sys_enter_mprotect"]),
    (
        "crab_foreign",
        &["sys_enter_ptrace", "sys_enter_process_vm_writev"],
    ),
];

/// Without these the kernel has no syscall tracepoints worth the name.
const REQUIRED_SYSCALL_TPS: &[&str] = &[
    "sys_enter_openat",
    "sys_exit_openat",
    "sys_enter_write",
    "sys_enter_unlinkat",
    "sys_enter_renameat2",
    "sys_enter_mkdirat",
    "sys_enter_fchmodat",
    "sys_enter_mmap",
];

/// BTF-typed raw tracepoints (`tp_btf`): (program, tracepoint).
const BTF_TRACEPOINTS: &[(&str, &str)] = &[
    ("crab_exec", "sched_process_exec"),
    ("crab_fork", "sched_process_fork"),
    ("crab_exit", "sched_process_exit"),
    ("crab_sched_switch", "sched_switch"),
];

const MAP_NAMES: &[&str] = &["watched", "levels", "runs", "oncpu"];

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
    Other,
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
        FsClass::Other,
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
            FsClass::Other => "other",
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
    /// ptrace, process_vm_writev or writes to /proc files: another process's
    /// memory may have changed although that process did not run.
    pub foreign_mem_writes: u64,
    /// Anything the BPF side could not record (map full, programs skipped by
    /// the kernel): non-zero growth means "everything changed".
    pub errors: u64,
}

impl CgroupCounters {
    /// What happened between `earlier` and `self` (both from the same watch).
    pub fn since(&self, earlier: &CgroupCounters) -> CgroupCounters {
        let mut fs_by_class = [0; FS_CLASSES];
        for (i, v) in fs_by_class.iter_mut().enumerate() {
            *v = self.fs_by_class[i].saturating_sub(earlier.fs_by_class[i]);
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
            errors: self.errors.saturating_sub(earlier.errors),
        }
    }

    /// Non-zero classes, for explanations ("write: 3, rename: 1").
    pub fn fs_classes(&self) -> impl Iterator<Item = (FsClass, u64)> + '_ {
        FsClass::ALL
            .iter()
            .map(|c| (*c, self.fs_by_class[c.index()]))
            .filter(|(_, n)| *n > 0)
    }
}

/// `struct counters` of inspector.h.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct RawCounters {
    fs_by_class: [u64; FS_CLASSES],
    shared_writable_mmaps: u64,
    forks: u64,
    threads: u64,
    execs: u64,
    exits: u64,
    foreign_mem_writes: u64,
    errors: u64,
    level: u64,
    misses_base: u64,
}

// SAFETY: plain old data, repr(C), every bit pattern valid.
unsafe impl Pod for RawCounters {}

/// `struct run` of inspector.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct RawRun {
    switches_out: u64,
    cgroup_id: u64,
    flags: u64,
}

// SAFETY: as above.
unsafe impl Pod for RawRun {}

impl Maps {
    fn program_stats(&self) -> Result<Vec<ProgramStats>, BpfError> {
        self.programs
            .iter()
            .map(|fd| {
                prog_stats(fd.as_raw_fd()).map_err(|source| BpfError::Syscall {
                    op: "BPF_OBJ_GET_INFO_BY_FD",
                    source,
                })
            })
            .collect()
    }

    fn recursion_misses(&self) -> Result<u64, BpfError> {
        Ok(self
            .program_stats()?
            .iter()
            .map(|p| p.recursion_misses)
            .sum())
    }
}

/// One version's pins, opened. Behind a mutex: aya's maps want `&mut` to
/// write, and [`HostProbes::watch`] may swap in a fresh set (see there).
struct Maps {
    dir: PathBuf,
    /// Kernel id of `watched`: tells whether `dir` still holds our maps.
    watched_id: u32,
    /// Pinned programs, to read their statistics (recursion misses).
    programs: Vec<OwnedFd>,
    watched: PerCpuHashMap<MapData, u64, RawCounters>,
    levels: Array<MapData, u64>,
    runs: BpfHashMap<MapData, u32, RawRun>,
    oncpu: PerCpuArray<MapData, u64>,
}

/// Handle on the host-wide inspector programs (maps opened from bpffs).
pub struct HostProbes {
    root: PathBuf,
    maps: Mutex<Maps>,
    loaded_here: bool,
}

impl std::fmt::Debug for HostProbes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostProbes")
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl HostProbes {
    /// Opens the host-wide programs pinned under `/sys/fs/bpf/crab/<version>/`,
    /// loading and attaching them first if absent (first shim on the host).
    /// Concurrent first shims serialize on `flock` of the pin root, so only one
    /// attaches. Mounts bpffs and tracefs if missing.
    pub fn open_or_load() -> Result<HostProbes, BpfError> {
        Self::open_or_load_at(Path::new(DEFAULT_PIN_ROOT))
    }

    /// [`Self::open_or_load`] with another pin root (tests, side-by-side
    /// installs). The root must be inside a bpf filesystem.
    pub fn open_or_load_at(root: &Path) -> Result<HostProbes, BpfError> {
        ensure_mounted(BPFFS_MOUNT, "bpf", BPF_FS_MAGIC)?;
        ensure_mounted(TRACEFS_MOUNT, "tracefs", TRACEFS_MAGIC)?;
        fs::create_dir_all(root).map_err(io_err("creating", root))?;
        if statfs_type(root).map_err(io_err("statfs", root))? != BPF_FS_MAGIC {
            return Err(BpfError::NotBpfFs {
                path: root.to_path_buf(),
            });
        }
        // bpffs refuses names with dots: none below.
        let dir = root.join(version_dir_name());
        if dir.exists() {
            // Fast path, no lock. It fails only if the pins go away meanwhile
            // (collect_stale_versions); then take the slow path.
            if let Ok(maps) = open_pinned(&dir) {
                return Ok(HostProbes::new(root, maps, false));
            }
        }
        let _lock = DirLock::exclusive(root)?;
        // Another shim may have published while we waited for the lock.
        let loaded_here = !dir.exists();
        if loaded_here {
            load_and_pin(root, &dir)?;
            collect_stale_versions_locked(root);
        }
        Ok(HostProbes::new(root, open_pinned(&dir)?, loaded_here))
    }

    fn new(root: &Path, maps: Maps, loaded_here: bool) -> HostProbes {
        HostProbes {
            root: root.to_path_buf(),
            maps: Mutex::new(maps),
            loaded_here,
        }
    }

    /// Whether this call loaded and attached the programs (first on the host)
    /// rather than opening existing pins.
    pub fn loaded_here(&self) -> bool {
        self.loaded_here
    }

    /// The directory holding this version's pins.
    pub fn pin_dir(&self) -> PathBuf {
        self.maps().dir.clone()
    }

    fn maps(&self) -> std::sync::MutexGuard<'_, Maps> {
        // A panic while holding the lock leaves the maps themselves intact
        // (they live in the kernel): keep going.
        self.maps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts counting for a cgroup (zeroed, also if it was watched already).
    pub fn watch(&self, cgroup_id: u64) -> Result<(), BpfError> {
        let level = cgroup_level(cgroup_id)?;
        if level >= MAX_LEVELS {
            return Err(BpfError::TooDeep {
                id: cgroup_id,
                level,
            });
        }
        let mut maps = self.maps();
        for _ in 0..3 {
            let misses_base = maps.recursion_misses()?;
            // The level bit goes in first so that tasks of child cgroups are
            // matched from the moment the entry exists.
            let mask = watched_levels(&maps)? | (1 << level);
            maps.levels.set(0, mask, 0).map_err(map_err("levels"))?;
            let value = RawCounters {
                level,
                misses_base,
                ..Default::default()
            };
            let per_cpu = PerCpuValues::try_from(vec![value; possible_cpus()?]).map_err(|e| {
                BpfError::Syscall {
                    op: "per-CPU counters",
                    source: e,
                }
            })?;
            maps.watched
                .insert(cgroup_id, per_cpu, 0)
                .map_err(map_err("watched"))?;
            // A newer shim may have retired these pins while nothing was
            // watched through them (collect_stale_versions: it renames the
            // directory, then checks `watched` is still empty), and the
            // directory may even hold a fresh load by now. Checked after the
            // insert, so one of the two sees the other.
            if pinned_map_id(&maps.dir).ok() == Some(maps.watched_id) {
                info!("inspector: watching cgroup {cgroup_id} (level {level})");
                return Ok(());
            }
            warn!(
                "inspector: pins {} were retired; opening or loading them again",
                maps.dir.display()
            );
            let _ = maps.watched.remove(&cgroup_id);
            *maps = HostProbes::open_or_load_at(&self.root)?
                .maps
                .into_inner()
                .unwrap_or_else(|e| e.into_inner());
        }
        Err(BpfError::Incomplete {
            path: maps.dir.clone(),
            detail: "pins keep disappearing".into(),
        })
    }

    /// Stops counting for a cgroup and removes every entry that belongs to it
    /// (its counters, run counts of its processes).
    /// Not watched is not an error.
    pub fn unwatch(&self, cgroup_id: u64) -> Result<(), BpfError> {
        {
            let mut maps = self.maps();
            match maps.watched.remove(&cgroup_id) {
                Ok(()) => {}
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err("watched")(e)),
            }
            let mask = watched_levels(&maps)?;
            maps.levels.set(0, mask, 0).map_err(map_err("levels"))?;
            sweep(&mut maps, cgroup_id)?;
        }
        // A program that found the entry just before its removal may still
        // insert a run count; programs run for microseconds, so a second
        // sweep a moment later catches it.
        std::thread::sleep(std::time::Duration::from_millis(2));
        sweep(&mut self.maps(), cgroup_id)?;
        info!("inspector: unwatched cgroup {cgroup_id}");
        Ok(())
    }

    /// Counters since [`Self::watch`].
    pub fn counters(&self, cgroup_id: u64) -> Result<CgroupCounters, BpfError> {
        let per_cpu = match self.maps().watched.get(&cgroup_id, 0) {
            Ok(values) => values,
            Err(e) if is_not_found(&e) => return Err(BpfError::NotWatched(cgroup_id)),
            Err(e) => return Err(map_err("watched")(e)),
        };
        let mut total = CgroupCounters::default();
        for cpu in per_cpu.iter() {
            for (sum, n) in total.fs_by_class.iter_mut().zip(cpu.fs_by_class) {
                *sum += n;
            }
            total.shared_writable_mmaps += cpu.shared_writable_mmaps;
            total.forks += cpu.forks;
            total.threads += cpu.threads;
            total.execs += cpu.execs;
            total.exits += cpu.exits;
            total.foreign_mem_writes += cpu.foreign_mem_writes;
            total.errors += cpu.errors;
        }
        total.fs_mutations = total.fs_by_class.iter().sum();
        // Recursion misses are host-wide (any skipped program may have been
        // about this cgroup): charge them to everyone watching.
        let misses_base = per_cpu.first().map_or(0, |c| c.misses_base);
        total.errors += self.recursion_misses()?.saturating_sub(misses_base);
        Ok(total)
    }

    /// How many times the threads of process `pid` (of a watched cgroup) left
    /// a CPU since it was first seen. Contract: if two calls return
    /// `Some(n)` with the same `n`, the process did not run in between (so
    /// its own writes did not change its memory). `None` means "cannot say":
    /// the process is on a CPU right now (its count moves only when it stops),
    /// or it was never scheduled out since its cgroup is watched — treat as
    /// "ran". The count restarts if the pid is reused: compare per
    /// (pid, start time).
    pub fn run_count(&self, pid: u32) -> Result<Option<u64>, BpfError> {
        let maps = self.maps();
        // Order matters: "not on a CPU" first, then the count. A run that
        // overlaps the check either shows here or ends with a switch-out that
        // the count (read after) or the next call sees.
        if running_now(&maps.oncpu, pid)? {
            return Ok(None);
        }
        match maps.runs.get(&pid, 0) {
            Ok(run) => Ok(Some(run.switches_out)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(map_err("runs")(e)),
        }
    }

    /// Ids of all watched cgroups (of every shim on the host).
    pub fn watched(&self) -> Result<Vec<u64>, BpfError> {
        let maps = self.maps();
        let mut ids = Vec::new();
        for key in maps.watched.keys() {
            ids.push(key.map_err(map_err("watched"))?);
        }
        Ok(ids)
    }

    /// Unwatches cgroups that no longer exist: a shim killed with SIGKILL never unwatches its
    /// container, so every new shim sweeps what such shims left. Returns the ids removed.
    pub fn sweep_dead(&self) -> Result<Vec<u64>, BpfError> {
        let (mount, _) = cgroup2_mount().map_err(|source| BpfError::Syscall {
            op: "find the cgroup2 mount",
            source,
        })?;
        let mut removed = Vec::new();
        for id in self.watched()? {
            match cgroup_path_by_id(&mount, id) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESTALE)) => {
                    self.unwatch(id)?;
                    removed.push(id);
                }
                _ => {}
            }
        }
        Ok(removed)
    }

    /// Sum of the kernel's recursion-miss counters of our programs: runs the
    /// kernel skipped, i.e. events nobody counted.
    pub fn recursion_misses(&self) -> Result<u64, BpfError> {
        self.maps().recursion_misses()
    }

    /// Kernel statistics of every inspector program (diagnostics, benchmarks).
    pub fn program_stats(&self) -> Result<Vec<ProgramStats>, BpfError> {
        self.maps().program_stats()
    }

    /// Entries currently in the per-process and per-open maps that belong to
    /// `cgroup_id` (diagnostics and tests: zero after [`Self::unwatch`]).
    pub fn entries_of(&self, cgroup_id: u64) -> Result<usize, BpfError> {
        let maps = self.maps();
        Ok(runs_of(&maps, cgroup_id)?.len())
    }
}

fn open_pinned(dir: &Path) -> Result<Maps, BpfError> {
    check_links(dir)?;
    let open = |name: &'static str| -> Result<Map, BpfError> {
        let path = dir.join("maps").join(name);
        let data = MapData::from_pin(&path).map_err(map_err(name))?;
        Map::from_map_data(data).map_err(map_err(name))
    };
    let watched_id = pinned_map_id(dir).map_err(map_err("watched"))?;
    let mut maps = Maps {
        dir: dir.to_path_buf(),
        watched_id,
        programs: Vec::new(),
        watched: PerCpuHashMap::try_from(open("watched")?).map_err(map_err("watched"))?,
        levels: Array::try_from(open("levels")?).map_err(map_err("levels"))?,
        runs: BpfHashMap::try_from(open("runs")?).map_err(map_err("runs"))?,
        oncpu: PerCpuArray::try_from(open("oncpu")?).map_err(map_err("oncpu"))?,
    };
    for name in program_names() {
        let path = dir.join("progs").join(name);
        maps.programs
            .push(bpf_obj_get(&path).map_err(io_err("opening pinned program", &path))?);
    }
    debug!("inspector: opened pinned BPF programs at {}", dir.display());
    Ok(maps)
}

/// Kernel id of the `watched` map pinned in a version directory.
fn pinned_map_id(dir: &Path) -> Result<u32, MapError> {
    Ok(MapInfo::from_pin(dir.join("maps").join("watched"))?.id())
}

/// Unpins everything under `root` (all versions): programs detach once no
/// process holds them. Only for roots nobody else uses (tests, benchmarks,
/// decommissioning a host) — shims still watching through these pins would
/// go blind.
pub fn remove_pinned(root: &Path) -> Result<(), BpfError> {
    match fs::remove_dir_all(root) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BpfError::Io {
            what: "removing pins",
            path: root.to_path_buf(),
            source: e,
        }),
    }
}

/// Unpins the other versions under `root` that nothing is watched through
/// (left by shims of older builds): attached, they cost every syscall on the
/// host for nothing. Caller holds the root lock.
fn collect_stale_versions_locked(root: &Path) {
    let current = version_dir_name();
    let Ok(entries) = fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let dir = entry.path();
        if name == current || !(name.starts_with('v') || name.starts_with("retired-")) {
            continue;
        }
        if version_in_use(&dir) {
            debug!(
                "inspector: keeping {} (cgroups watched through it)",
                dir.display()
            );
            continue;
        }
        // Parked under another name first: a shim of that version that
        // watches from now on finds its pins gone (HostProbes::watch checks
        // after inserting) and one that inserted before shows up in the
        // second check.
        let parked = if name.starts_with("retired-") {
            dir.clone()
        } else {
            root.join(format!("retired-{name}"))
        };
        if fs::rename(&dir, &parked).is_err() {
            continue;
        }
        if version_in_use(&parked) {
            let _ = fs::rename(&parked, &dir);
            continue;
        }
        info!("inspector: removing unused BPF programs {}", dir.display());
        if let Err(e) = fs::remove_dir_all(&parked) {
            warn!("inspector: removing {}: {e}", parked.display());
        }
    }
}

/// Does the `watched` map of a version directory have any entry? Anything
/// unreadable counts as in use.
fn version_in_use(dir: &Path) -> bool {
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    #[repr(C)]
    struct NextKeyAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
        flags: u64,
    }
    let Ok(fd) = bpf_obj_get(&dir.join("maps").join("watched")) else {
        return true;
    };
    let mut next = [0u8; 64];
    let attr = NextKeyAttr {
        map_fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: 0, // NULL: the first key
        next_key: next.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: attr is a valid bpf_attr prefix; next has room for any key.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_GET_NEXT_KEY,
            &attr as *const NextKeyAttr,
            std::mem::size_of::<NextKeyAttr>(),
        )
    };
    !(ret < 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ENOENT))
}

/// Name of the version directory under the pin root.
pub fn version_dir_name() -> String {
    format!("v{ABI_VERSION}-{:016x}", fnv1a64(OBJECT))
}

fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    })
}

fn program_names() -> impl Iterator<Item = &'static str> {
    SYSCALL_PROGRAMS
        .iter()
        .map(|(p, _)| *p)
        .chain(BTF_TRACEPOINTS.iter().map(|(p, _)| *p))
}

fn tracefs_events() -> PathBuf {
    Path::new(TRACEFS_MOUNT).join("events")
}

fn syscall_tracepoint_exists(name: &str) -> bool {
    tracefs_events().join("syscalls").join(name).is_dir()
}

/// File names of the link pins a complete load has on this kernel.
fn expected_links() -> Result<BTreeSet<String>, BpfError> {
    let mut names = BTreeSet::new();
    for tp in REQUIRED_SYSCALL_TPS {
        if !syscall_tracepoint_exists(tp) {
            return Err(BpfError::MissingTracepoint(tp));
        }
    }
    for (_, tps) in SYSCALL_PROGRAMS {
        for tp in tps.iter().filter(|tp| syscall_tracepoint_exists(tp)) {
            names.insert(format!("syscalls:{tp}"));
        }
    }
    for (_, tp) in BTF_TRACEPOINTS {
        names.insert(format!("btf:{tp}"));
    }
    Ok(names)
}

fn check_links(dir: &Path) -> Result<(), BpfError> {
    let links_dir = dir.join("links");
    let mut present = BTreeSet::new();
    for entry in fs::read_dir(&links_dir).map_err(io_err("listing", &links_dir))? {
        let entry = entry.map_err(io_err("listing", &links_dir))?;
        present.insert(entry.file_name().to_string_lossy().into_owned());
    }
    let expected = expected_links()?;
    let missing: Vec<_> = expected.difference(&present).cloned().collect();
    if !missing.is_empty() {
        return Err(BpfError::Incomplete {
            path: dir.to_path_buf(),
            detail: format!("missing links {missing:?}"),
        });
    }
    Ok(())
}

/// Loads, attaches and pins everything into a temporary directory, then
/// publishes it as `dir` with one rename. Caller holds the root lock.
fn load_and_pin(root: &Path, dir: &Path) -> Result<(), BpfError> {
    // Leftovers of a loader that died mid-way hold attached links: drop them.
    if let Ok(entries) = fs::read_dir(root) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with("tmp-") {
                warn!(
                    "inspector: removing unfinished BPF pins {}",
                    entry.path().display()
                );
                let _ = fs::remove_dir_all(entry.path());
            }
        }
    }
    let tmp = root.join(format!("tmp-{}", std::process::id()));
    let result =
        pin_into(&tmp).and_then(|()| fs::rename(&tmp, dir).map_err(io_err("publishing", dir)));
    if result.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    result?;
    info!(
        "inspector: loaded and pinned BPF programs at {}",
        dir.display()
    );
    Ok(())
}

fn pin_into(tmp: &Path) -> Result<(), BpfError> {
    let expected = expected_links()?;
    for sub in ["maps", "progs", "links"] {
        let path = tmp.join(sub);
        fs::create_dir_all(&path).map_err(io_err("creating", &path))?;
    }
    let btf = Btf::from_sys_fs()?;
    let mut ebpf = EbpfLoader::new().btf(Some(&btf)).load(OBJECT)?;

    for (name, tps) in SYSCALL_PROGRAMS {
        let prog = tracepoint(&mut ebpf, name)?;
        for tp in tps
            .iter()
            .filter(|tp| expected.contains(&format!("syscalls:{tp}")))
        {
            let id = prog
                .attach("syscalls", tp)
                .map_err(|source| BpfError::Program { name, source })?;
            let link = prog
                .take_link(id)
                .map_err(|source| BpfError::Program { name, source })?;
            pin_link(
                FdLink::try_from(link).map_err(|source| BpfError::Link { name, source })?,
                &tmp.join("links").join(format!("syscalls:{tp}")),
            )?;
        }
        pin_program(prog.pin(tmp.join("progs").join(name)), tmp, name)?;
    }
    for (name, tp) in BTF_TRACEPOINTS {
        let prog: &mut BtfTracePoint = ebpf
            .program_mut(name)
            .ok_or(BpfError::MissingProgram(name))?
            .try_into()
            .map_err(|source| BpfError::Program { name, source })?;
        prog.load(tp, &btf)
            .map_err(|source| BpfError::Program { name, source })?;
        let id = prog
            .attach()
            .map_err(|source| BpfError::Program { name, source })?;
        let link = prog
            .take_link(id)
            .map_err(|source| BpfError::Program { name, source })?;
        pin_link(
            FdLink::from(link),
            &tmp.join("links").join(format!("btf:{tp}")),
        )?;
        pin_program(prog.pin(tmp.join("progs").join(name)), tmp, name)?;
    }
    for name in MAP_NAMES {
        let path = tmp.join("maps").join(name);
        let map = ebpf.map(name).ok_or_else(|| BpfError::Incomplete {
            path: tmp.to_path_buf(),
            detail: format!("object has no map {name}"),
        })?;
        map.pin(&path)
            .map_err(|source| BpfError::Pin { path, source })?;
    }
    Ok(())
}

fn tracepoint<'a>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut TracePoint, BpfError> {
    let prog: &mut TracePoint = ebpf
        .program_mut(name)
        .ok_or(BpfError::MissingProgram(name))?
        .try_into()
        .map_err(|source| BpfError::Program { name, source })?;
    prog.load()
        .map_err(|source| BpfError::Program { name, source })?;
    Ok(prog)
}

fn pin_link(link: FdLink, path: &Path) -> Result<(), BpfError> {
    link.pin(path).map_err(|source| BpfError::Pin {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(())
}

fn pin_program(
    result: Result<(), aya::pin::PinError>,
    tmp: &Path,
    name: &str,
) -> Result<(), BpfError> {
    result.map_err(|source| BpfError::Pin {
        path: tmp.join("progs").join(name),
        source,
    })
}

/// A key that is not (or no longer) there; aya reports it several ways.
fn is_not_found(e: &MapError) -> bool {
    match e {
        MapError::KeyNotFound | MapError::ElementNotFound => true,
        MapError::SyscallError(e) => e.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// Number of possible CPUs: the length of every per-CPU value.
fn possible_cpus() -> Result<usize, BpfError> {
    aya::util::nr_cpus().map_err(|(what, source)| BpfError::Io {
        what: "reading",
        path: PathBuf::from(what),
        source,
    })
}

fn watched_levels(maps: &Maps) -> Result<u64, BpfError> {
    let mut mask = 0u64;
    for item in maps.watched.iter() {
        let (_, per_cpu) = match item {
            Ok(entry) => entry,
            Err(e) if is_not_found(&e) => continue,
            Err(e) => return Err(map_err("watched")(e)),
        };
        if let Some(level) = per_cpu.first().map(|c| c.level).filter(|l| *l < MAX_LEVELS) {
            mask |= 1 << level;
        }
    }
    Ok(mask)
}

fn runs_of(maps: &Maps, cgroup_id: u64) -> Result<Vec<u32>, BpfError> {
    let mut keys = Vec::new();
    for item in maps.runs.iter() {
        match item {
            Ok((pid, run)) if run.cgroup_id == cgroup_id => keys.push(pid),
            Ok(_) => {}
            // Deleted by an exiting process between key and value reads.
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(map_err("runs")(e)),
        }
    }
    Ok(keys)
}

fn sweep(maps: &mut Maps, cgroup_id: u64) -> Result<(), BpfError> {
    for pid in runs_of(maps, cgroup_id)? {
        match maps.runs.remove(&pid) {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(map_err("runs")(e)),
        }
    }
    Ok(())
}

/// Is any thread of `pid` on a CPU (or is some online CPU's slot not yet
/// written, so we cannot tell)?
fn running_now(oncpu: &PerCpuArray<MapData, u64>, pid: u32) -> Result<bool, BpfError> {
    let slots = oncpu.get(&0, 0).map_err(map_err("oncpu"))?;
    let online = fs::read_to_string("/sys/devices/system/cpu/online").map_err(io_err(
        "reading",
        Path::new("/sys/devices/system/cpu/online"),
    ))?;
    for cpu in parse_cpu_list(&online) {
        match slots.get(cpu) {
            Some(slot) if slot & ONCPU_VALID == 0 => return Ok(true),
            Some(slot) if (slot & 0xffff_ffff) as u32 == pid => return Ok(true),
            _ => {}
        }
    }
    Ok(false)
}

/// Parses a kernel CPU list such as "0-3,8,10-11".
fn parse_cpu_list(list: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let mut bounds = part.splitn(2, '-').map(|n| n.trim().parse::<usize>());
        match (bounds.next(), bounds.next()) {
            (Some(Ok(a)), None) => cpus.push(a),
            (Some(Ok(a)), Some(Ok(b))) if a <= b => cpus.extend(a..=b),
            _ => {}
        }
    }
    cpus
}

/// Inode number of a cgroup2 directory == the kernel's cgroup id
/// (`bpf_get_current_cgroup_id()`). Fails for cgroup v1 directories, whose
/// inode numbers mean nothing to BPF.
pub fn cgroup_id(cgroup2_dir: &Path) -> io::Result<u64> {
    if statfs_type(cgroup2_dir)? != CGROUP2_SUPER_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not in a cgroup2 hierarchy", cgroup2_dir.display()),
        ));
    }
    Ok(fs::metadata(cgroup2_dir)?.ino())
}

/// The cgroup2 directory of a process: its "0::/path" line of
/// /proc/PID/cgroup under the cgroup2 mount of /proc/self/mountinfo
/// (/sys/fs/cgroup/unified on hybrid hosts, /sys/fs/cgroup on pure v2).
pub fn cgroup2_dir_of(pid: u32) -> io::Result<PathBuf> {
    let (mount_point, mount_root) = cgroup2_mount()?;
    let cgroup = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    let path = parse_unified_cgroup(&cgroup).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("process {pid} has no cgroup2 entry"),
        )
    })?;
    Ok(join_under_mount(&mount_point, &mount_root, &path))
}

/// Mount point and mounted root of the cgroup2 hierarchy.
pub fn cgroup2_mount() -> io::Result<(PathBuf, PathBuf)> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    parse_cgroup2_mount(&mountinfo).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no cgroup2 mount in /proc/self/mountinfo",
        )
    })
}

fn parse_cgroup2_mount(mountinfo: &str) -> Option<(PathBuf, PathBuf)> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let fields: Vec<&str> = left.split_whitespace().collect();
        Some((
            PathBuf::from(unescape_mountinfo(fields.get(4)?)),
            PathBuf::from(unescape_mountinfo(fields.get(3)?)),
        ))
    })
}

/// mountinfo escapes space, tab, newline and backslash as \ooo.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value =
                (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(value);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_unified_cgroup(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::").map(|p| p.trim_end().to_string()))
}

fn join_under_mount(mount_point: &Path, mount_root: &Path, cgroup_path: &str) -> PathBuf {
    let path = Path::new(cgroup_path);
    let relative = path.strip_prefix(mount_root).unwrap_or(path);
    let relative = relative.strip_prefix("/").unwrap_or(relative);
    mount_point.join(relative)
}

/// Depth of a cgroup in the cgroup2 tree, found from its id through the
/// kernel's file handles (also proves the id names a live cgroup).
fn cgroup_level(cgroup_id: u64) -> Result<u64, BpfError> {
    let (mount_point, mount_root) = cgroup2_mount().map_err(io_err(
        "finding the cgroup2 mount",
        Path::new("/proc/self/mountinfo"),
    ))?;
    let path = cgroup_path_by_id(&mount_point, cgroup_id).map_err(|source| BpfError::Io {
        what: "resolving cgroup id under",
        path: mount_point.clone(),
        source: io::Error::new(source.kind(), format!("cgroup id {cgroup_id}: {source}")),
    })?;
    let below_mount = path.strip_prefix(&mount_point).unwrap_or(&path);
    let root_depth = mount_root
        .components()
        .filter(|c| matches!(c, std::path::Component::Normal(_)))
        .count();
    let depth = below_mount
        .components()
        .filter(|c| matches!(c, std::path::Component::Normal(_)))
        .count();
    Ok((root_depth + depth) as u64)
}

/// Path of the cgroup2 directory with this id: open_by_handle_at with a
/// kernfs file handle (type FILEID_KERNFS, 8 bytes of id), then the fd's path.
pub fn cgroup_path_by_id(cgroup2_mount: &Path, cgroup_id: u64) -> io::Result<PathBuf> {
    const FILEID_KERNFS: i32 = 0xfe;
    #[repr(C)]
    struct KernfsHandle {
        handle_bytes: u32,
        handle_type: i32,
        id: u64,
    }
    let mount = File::open(cgroup2_mount)?;
    let mut handle = KernfsHandle {
        handle_bytes: 8,
        handle_type: FILEID_KERNFS,
        id: cgroup_id,
    };
    // SAFETY: handle is a valid struct file_handle with 8 bytes of payload.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            mount.as_raw_fd(),
            &mut handle as *mut KernfsHandle,
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a new fd we now own.
    let dir = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    fs::read_link(format!("/proc/self/fd/{}", dir.as_raw_fd()))
}

fn statfs_type(path: &Path) -> io::Result<i64> {
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: zeroed statfs is a valid out-parameter.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out pointer.
    if unsafe { libc::statfs(cpath.as_ptr(), &mut buf) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(buf.f_type as i64)
}

/// Mounts `fstype` at `target` unless a filesystem of that type is there.
fn ensure_mounted(target: &str, fstype: &str, magic: i64) -> Result<(), BpfError> {
    let path = Path::new(target);
    if statfs_type(path).ok() == Some(magic) {
        return Ok(());
    }
    fs::create_dir_all(path).map_err(io_err("creating", path))?;
    let (src, tgt, ty) = (
        CString::new(fstype).unwrap(),
        CString::new(target).unwrap(),
        CString::new(fstype).unwrap(),
    );
    // SAFETY: valid C strings; no data argument.
    if unsafe { libc::mount(src.as_ptr(), tgt.as_ptr(), ty.as_ptr(), 0, std::ptr::null()) } != 0 {
        return Err(BpfError::Io {
            what: "mounting",
            path: path.to_path_buf(),
            source: io::Error::last_os_error(),
        });
    }
    info!("inspector: mounted {fstype} at {target}");
    Ok(())
}

/// flock on a directory; released on drop.
struct DirLock(File);

impl DirLock {
    fn exclusive(dir: &Path) -> Result<DirLock, BpfError> {
        let file = File::open(dir).map_err(io_err("opening", dir))?;
        // SAFETY: valid fd.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(BpfError::Io {
                what: "locking",
                path: dir.to_path_buf(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(DirLock(file))
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // SAFETY: valid fd.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

fn bpf_obj_get(path: &Path) -> io::Result<OwnedFd> {
    #[repr(C)]
    #[derive(Default)]
    struct ObjGetAttr {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
        _pad: u32,
    }
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let attr = ObjGetAttr {
        pathname: cpath.as_ptr() as u64,
        ..Default::default()
    };
    // SAFETY: attr is a valid bpf_attr prefix for BPF_OBJ_GET.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET,
            &attr as *const ObjGetAttr,
            std::mem::size_of::<ObjGetAttr>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: new fd owned by us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Kernel statistics of one inspector program (`struct bpf_prog_info`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramStats {
    pub name: String,
    /// Runs and total run time: only counted while the host's
    /// `kernel.bpf_stats_enabled` sysctl is 1 (it costs a clock read per run).
    pub run_count: u64,
    pub run_time_ns: u64,
    /// Runs the kernel skipped (recursion protection): events not counted.
    pub recursion_misses: u64,
}

fn prog_stats(prog_fd: RawFd) -> io::Result<ProgramStats> {
    // Offsets in struct bpf_prog_info (uapi, append-only; the last three
    // since 5.12).
    const INFO_LEN: usize = 232;
    const NAME: usize = 64;
    const RUN_TIME_NS: usize = 192;
    const RUN_CNT: usize = 200;
    const RECURSION_MISSES: usize = 208;
    #[repr(C, align(8))]
    struct Info([u8; INFO_LEN]);
    #[repr(C)]
    struct InfoAttr {
        bpf_fd: u32,
        info_len: u32,
        info: u64,
    }
    let mut info = Info([0; INFO_LEN]);
    let attr = InfoAttr {
        bpf_fd: prog_fd as u32,
        info_len: INFO_LEN as u32,
        info: info.0.as_mut_ptr() as u64,
    };
    // SAFETY: attr points at a buffer of info_len bytes.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_OBJ_GET_INFO_BY_FD,
            &attr as *const InfoAttr,
            std::mem::size_of::<InfoAttr>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let u64_at =
        |offset: usize| u64::from_ne_bytes(info.0[offset..offset + 8].try_into().expect("8 bytes"));
    let name = &info.0[NAME..NAME + 16];
    let name_len = name.iter().position(|b| *b == 0).unwrap_or(name.len());
    Ok(ProgramStats {
        name: String::from_utf8_lossy(&name[..name_len]).into_owned(),
        run_count: u64_at(RUN_CNT),
        run_time_ns: u64_at(RUN_TIME_NS),
        recursion_misses: u64_at(RECURSION_MISSES),
    })
}

#[cfg(test)]
mod tests {
    //! These tests load the real programs into the running kernel: they need
    //! root, bpffs and a cgroup2 hierarchy, and fail (never skip) without.
    //! Each test pins into its own root under /sys/fs/bpf and removes it.

    use super::*;
    use std::io::Write as _;
    use std::process::{Child, Command, Output, Stdio};
    use std::time::{Duration, Instant};

    /// Tests count host-wide programs and links: one at a time, also across
    /// test processes (several checkouts may run them on one host).
    static SERIAL: Mutex<()> = Mutex::new(());

    struct Serial {
        _process: DirLock,
        _thread: std::sync::MutexGuard<'static, ()>,
    }

    fn serial() -> Serial {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "inspector::bpf tests load BPF programs: run them as root"
        );
        let thread = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let path = std::env::temp_dir().join("crab-bpf-tests.lock");
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        Serial {
            _process: DirLock::exclusive(&path).unwrap(),
            _thread: thread,
        }
    }

    struct TestRoot(PathBuf);

    impl TestRoot {
        fn new(tag: &str) -> TestRoot {
            let root = PathBuf::from(format!(
                "{BPFFS_MOUNT}/crab-test-{}-{tag}",
                std::process::id()
            ));
            remove_pinned(&root).unwrap();
            remove_leftovers_of_dead_runs();
            TestRoot(root)
        }
    }

    impl Drop for TestRoot {
        fn drop(&mut self) {
            let ids: BTreeSet<u32> = fs::read_dir(&self.0)
                .into_iter()
                .flatten()
                .flatten()
                .flat_map(|version| pinned_program_ids(&version.path()))
                .collect();
            if let Err(e) = remove_pinned(&self.0) {
                eprintln!("cleaning test pins {}: {e}", self.0.display());
            }
            // The kernel frees programs asynchronously once unpinned; wait, so
            // that the next test counts host-wide programs from a clean slate.
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline
                && aya::programs::loaded_programs()
                    .flatten()
                    .any(|p| ids.contains(&p.id()))
            {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// A killed test run leaves its pins (programs stay attached) and
    /// cgroups behind: remove those whose process is gone.
    fn remove_leftovers_of_dead_runs() {
        let dead = |name: &str, prefix: &str| {
            name.strip_prefix(prefix)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        };
        for entry in fs::read_dir(BPFFS_MOUNT).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if dead(&name, "crab-test-") || dead(&name, "crab-bench-") {
                let _ = remove_pinned(&entry.path());
            }
        }
        if let Ok((mount, _)) = cgroup2_mount() {
            for entry in fs::read_dir(mount).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if dead(&name, "crab-bpf-test-") || dead(&name, "crab-bpf-bench-") {
                    let _ = fs::remove_dir(entry.path().join("nested"));
                    let _ = fs::remove_dir(entry.path());
                }
            }
        }
    }

    struct TestCgroup {
        dir: PathBuf,
        id: u64,
    }

    impl TestCgroup {
        fn new(tag: &str) -> TestCgroup {
            let (mount, _) = cgroup2_mount().expect("cgroup2 mount");
            TestCgroup::at(mount.join(format!("crab-bpf-test-{}-{tag}", std::process::id())))
        }

        fn at(dir: PathBuf) -> TestCgroup {
            let _ = fs::remove_dir(&dir);
            fs::create_dir(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
            let id = cgroup_id(&dir).unwrap();
            TestCgroup { dir, id }
        }

        /// Starts `sh -c script` in this cgroup: the shell waits for a line on
        /// stdin, sent once its pid is in cgroup.procs.
        fn spawn(&self, script: &str) -> Child {
            let mut child = Command::new("/bin/sh")
                .arg("-c")
                .arg(format!("read _go; {script}"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            fs::write(self.dir.join("cgroup.procs"), child.id().to_string()).unwrap();
            let mut stdin = child.stdin.take().unwrap();
            stdin.write_all(b"go\n").unwrap();
            child
        }

        fn run(&self, script: &str) -> Output {
            let out = self.spawn(script).wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{script}: {:?}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            out
        }
    }

    impl Drop for TestCgroup {
        fn drop(&mut self) {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let procs = fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
                for pid in procs
                    .split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: plain kill(2) of a process we put there.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                // Child cgroups first.
                if let Ok(entries) = fs::read_dir(&self.dir) {
                    for e in entries.flatten() {
                        if e.path().is_dir() {
                            let _ = fs::remove_dir(e.path());
                        }
                    }
                }
                if fs::remove_dir(&self.dir).is_ok() || Instant::now() > deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    fn delta(probes: &HostProbes, cg: &TestCgroup, f: impl FnOnce()) -> CgroupCounters {
        let before = probes.counters(cg.id).unwrap();
        f();
        probes.counters(cg.id).unwrap().since(&before)
    }

    fn class(c: &CgroupCounters, class: FsClass) -> u64 {
        c.fs_by_class[class.index()]
    }

    fn explain(c: &CgroupCounters) -> String {
        format!(
            "{c:?} classes={:?}",
            c.fs_classes()
                .map(|(k, n)| (k.name(), n))
                .collect::<Vec<_>>()
        )
    }

    /// Links in the kernel (host-wide) attached to one of these programs.
    fn links_to(programs: &BTreeSet<u32>) -> usize {
        aya::programs::loaded_links()
            .flatten()
            .filter(|l| programs.contains(&l.program_id()))
            .count()
    }

    fn pinned_program_ids(dir: &Path) -> BTreeSet<u32> {
        fs::read_dir(dir.join("progs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| aya::programs::ProgramInfo::from_pin(e.path()).ok())
            .map(|p| p.id())
            .collect()
    }

    #[test]
    fn host_probes_can_be_shared_between_threads() {
        fn check<T: Send + Sync>() {}
        check::<HostProbes>();
    }

    #[test]
    fn parses_cpu_lists() {
        assert_eq!(parse_cpu_list("0-1\n"), vec![0, 1]);
        assert_eq!(parse_cpu_list("0,2-4,7"), vec![0, 2, 3, 4, 7]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
    }

    #[test]
    fn parses_cgroup2_mounts_and_paths() {
        let hybrid = "25 24 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
                      26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:5 - cgroup2 cgroup2 rw\n\
                      27 25 0:24 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let (mount, root) = parse_cgroup2_mount(hybrid).unwrap();
        assert_eq!(mount, Path::new("/sys/fs/cgroup/unified"));
        assert_eq!(root, Path::new("/"));
        let escaped = "30 1 0:26 /sub /mnt/cg\\040v2 rw - cgroup2 none rw\n";
        let (mount, root) = parse_cgroup2_mount(escaped).unwrap();
        assert_eq!(mount, Path::new("/mnt/cg v2"));
        assert_eq!(root, Path::new("/sub"));
        assert_eq!(
            parse_cgroup2_mount("1 0 8:1 / / rw - ext4 /dev/sda rw\n"),
            None
        );

        let proc_cgroup = "4:memory:/x\n1:name=systemd:/\n0::/crab/abc\n";
        let path = parse_unified_cgroup(proc_cgroup).unwrap();
        assert_eq!(
            join_under_mount(Path::new("/sys/fs/cgroup/unified"), Path::new("/"), &path),
            Path::new("/sys/fs/cgroup/unified/crab/abc")
        );
        assert_eq!(
            join_under_mount(Path::new("/mnt/cg v2"), Path::new("/sub"), "/sub/c1"),
            Path::new("/mnt/cg v2/c1")
        );
    }

    #[test]
    fn fs_classes_match_the_c_enum() {
        let header = include_str!("../../../bpf-programs/include/inspector.h");
        let start = header.find("enum fs_class {").unwrap();
        let body = &header[start..start + header[start..].find('}').unwrap()];
        let names: Vec<&str> = body
            .lines()
            .skip(1)
            .map(|l| l.trim().trim_end_matches(','))
            .filter(|l| l.starts_with("FS_"))
            .collect();
        assert_eq!(names.len(), FS_CLASSES + 1, "{names:?}"); // + FS_CLASSES itself
        for (class, c_name) in FsClass::ALL.iter().zip(&names) {
            let rust = format!("FS_{}", class.name().replace('-', "_").to_uppercase());
            let expect = match *class {
                FsClass::MmapShared => "FS_MMAP_SHARED".to_string(),
                _ => rust,
            };
            assert_eq!(&expect, c_name);
        }
        assert_eq!(std::mem::size_of::<RawCounters>(), 8 * (FS_CLASSES + 9));
    }

    #[test]
    fn cgroup_ids_and_dirs() {
        let _serial = serial();
        let cg = TestCgroup::new("ids");
        let (mount, _) = cgroup2_mount().unwrap();
        assert_eq!(cgroup_path_by_id(&mount, cg.id).unwrap(), cg.dir);
        assert_eq!(cgroup_level(cg.id).unwrap(), 1);
        let mut child = cg.spawn("exec sleep 5");
        assert_eq!(cgroup2_dir_of(child.id()).unwrap(), cg.dir);
        child.kill().unwrap();
        child.wait().unwrap();
        // cgroup v1 directories have inode numbers too, but not cgroup ids.
        let v1 = Path::new("/sys/fs/cgroup/memory");
        if v1.is_dir() {
            assert!(cgroup_id(v1).is_err());
        }
    }

    /// Loads in this process, re-opens in this process and in other
    /// processes (some racing on a fresh root): one set of programs and links.
    #[test]
    fn loads_once_and_reuses_pins() {
        let _serial = serial();
        let root = TestRoot::new("pins");
        let n_progs = program_names().count();
        let n_links = expected_links().unwrap().len();

        let started = Instant::now();
        let first = HostProbes::open_or_load_at(&root.0).unwrap();
        let load_time = started.elapsed();
        assert!(first.loaded_here());
        let stats = first.program_stats().unwrap();
        let names: Vec<String> = program_names()
            .map(|n| n.chars().take(15).collect())
            .collect();
        assert_eq!(
            stats.iter().map(|p| p.name.clone()).collect::<Vec<_>>(),
            names
        );
        assert_eq!(first.recursion_misses().unwrap(), 0);
        let ids = pinned_program_ids(&first.pin_dir());
        assert_eq!(ids.len(), n_progs);
        assert_eq!(links_to(&ids), n_links);

        let started = Instant::now();
        let second = HostProbes::open_or_load_at(&root.0).unwrap();
        let open_time = started.elapsed();
        assert!(!second.loaded_here());
        assert_eq!(second.pin_dir(), first.pin_dir());
        assert_eq!(pinned_program_ids(&second.pin_dir()), ids);
        drop((first, second));
        // Pins alone keep everything attached after our handles are gone,
        // and opening did not attach anything more.
        assert_eq!(links_to(&ids), n_links);

        // Other processes: 3 at once on the existing root, then 3 racing on
        // a fresh one: exactly one of those loads, all use its programs.
        let race_root = TestRoot::new("race");
        for (target, loaders) in [(&root.0, 0), (&race_root.0, 1)] {
            let children: Vec<Child> = (0..3)
                .map(|_| {
                    Command::new(std::env::current_exe().unwrap())
                        .args([
                            "--exact",
                            "inspector::bpf::tests::child_opens_pins",
                            "--ignored",
                            "--nocapture",
                            "--test-threads=1",
                        ])
                        .env("CRAB_BPF_CHILD_ROOT", target)
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            let mut reports = BTreeSet::new();
            let mut loaded = 0;
            for child in children {
                let out = child.wait_with_output().unwrap();
                let stdout = String::from_utf8_lossy(&out.stdout);
                let report = stdout
                    .lines()
                    .find_map(|l| l.split_once("child opened ").map(|(_, r)| r))
                    .unwrap_or_else(|| {
                        panic!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr))
                    });
                assert!(out.status.success());
                loaded += usize::from(report.starts_with("loaded "));
                reports.insert(report.trim_start_matches("loaded ").to_string());
            }
            assert_eq!(
                loaded, loaders,
                "processes that loaded programs into {target:?}"
            );
            assert_eq!(
                reports.len(),
                1,
                "processes used different programs: {reports:?}"
            );
            let dir = fs::read_dir(target)
                .unwrap()
                .next()
                .unwrap()
                .unwrap()
                .path();
            let target_ids = pinned_program_ids(&dir);
            assert_eq!(links_to(&target_ids), n_links);
            assert_eq!(
                reports.into_iter().next().unwrap(),
                format!("{target_ids:?}")
            );
        }
        assert_eq!(links_to(&ids), n_links);
        assert_eq!(
            fs::read_dir(&race_root.0).unwrap().count(),
            1,
            "leftover temporary pins"
        );
        eprintln!("first load+attach+pin {load_time:?}, open of pins {open_time:?}, {n_progs} programs, {n_links} links");

        drop(race_root);
        drop(root);
        // TestRoot::drop waited for the kernel to free the programs.
        let still_loaded = aya::programs::loaded_programs()
            .flatten()
            .filter(|p| ids.contains(&p.id()))
            .count();
        assert_eq!(
            still_loaded, 0,
            "removing the pins detaches and frees everything"
        );
    }

    /// A static i386 program: creat(path, 0644) via int 0x80, then exit(0).
    fn elf32_creat(path: &str) -> Vec<u8> {
        const BASE: u32 = 0x0804_8000;
        const CODE_AT: u32 = 52 + 32;
        let mut code = Vec::new();
        let path_addr = BASE + CODE_AT + 26;
        code.extend([0xb8, 8, 0, 0, 0]); // mov eax, 8 (creat)
        code.push(0xbb); // mov ebx, path
        code.extend(path_addr.to_le_bytes());
        code.extend([0xb9, 0xa4, 0x01, 0, 0]); // mov ecx, 0644
        code.extend([0xcd, 0x80]); // int 0x80
        code.extend([0xb8, 1, 0, 0, 0]); // mov eax, 1 (exit)
        code.extend([0x31, 0xdb]); // xor ebx, ebx
        code.extend([0xcd, 0x80]); // int 0x80
        assert_eq!(code.len(), 26);
        code.extend(path.as_bytes());
        code.push(0);
        let total = CODE_AT + code.len() as u32;
        let mut elf = vec![0x7f, b'E', b'L', b'F', 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        for v in [2u16, 3] {
            elf.extend(v.to_le_bytes()); // ET_EXEC, EM_386
        }
        for v in [1u32, BASE + CODE_AT, 52, 0, 0] {
            elf.extend(v.to_le_bytes()); // version, entry, phoff, shoff, flags
        }
        for v in [52u16, 32, 1, 0, 0, 0] {
            elf.extend(v.to_le_bytes()); // ehsize, phentsize, phnum, shentsize, shnum, shstrndx
        }
        for v in [1u32, 0, BASE, BASE, total, total, 5, 0x1000] {
            elf.extend(v.to_le_bytes()); // PT_LOAD r-x
        }
        assert_eq!(elf.len() as u32, CODE_AT);
        elf.extend(code);
        elf
    }

    /// 32-bit programs' syscalls bypass the syscall tracepoints: running one
    /// must show up as errors, never as a quiet turn.
    #[test]
    fn thirty_two_bit_programs_are_errors() {
        use std::os::unix::fs::PermissionsExt;
        let _serial = serial();
        let root = TestRoot::new("compat");
        let probes = HostProbes::open_or_load_at(&root.0).unwrap();
        let cg = TestCgroup::new("compat");
        probes.watch(cg.id).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let created = tmp.path().join("made-by-i386");
        let exe = tmp.path().join("creat32");
        fs::write(&exe, elf32_creat(created.to_str().unwrap())).unwrap();
        fs::set_permissions(&exe, fs::Permissions::from_mode(0o755)).unwrap();

        let c = delta(&probes, &cg, || {
            cg.run(&exe.display().to_string());
        });
        assert!(created.exists(), "the i386 program did not run");
        assert_eq!(
            c.fs_mutations,
            0,
            "tracepoints saw the compat creat after all? {}",
            explain(&c)
        );
        assert!(
            c.errors >= 1,
            "a 32-bit program ran unnoticed: {}",
            explain(&c)
        );
        eprintln!("i386 creat: {}", explain(&c));
        probes.unwatch(cg.id).unwrap();
    }

    /// Pins of other builds: removed when nothing is watched through them,
    /// kept otherwise; a handle whose pins were retired recovers on watch.
    #[test]
    fn retires_unused_versions() {
        let _serial = serial();
        let root = TestRoot::new("gc");
        let current = root.0.join(version_dir_name());
        let n_links = expected_links().unwrap().len();

        let stale = HostProbes::open_or_load_at(&root.0).unwrap();
        let in_use = root.0.join("v0-inuse");
        fs::rename(&current, &in_use).unwrap();
        let in_use_ids = pinned_program_ids(&in_use);
        let values = vec![RawCounters::default(); possible_cpus().unwrap()];
        open_pinned(&in_use)
            .unwrap()
            .watched
            .insert(12345, PerCpuValues::try_from(values).unwrap(), 0)
            .unwrap();

        let second = HostProbes::open_or_load_at(&root.0).unwrap();
        assert!(second.loaded_here());
        assert!(
            in_use.exists(),
            "a version with watched cgroups was removed"
        );
        let unused = root.0.join("v0-unused");
        fs::rename(&current, &unused).unwrap();
        let unused_ids = pinned_program_ids(&unused);

        let third = HostProbes::open_or_load_at(&root.0).unwrap();
        assert!(third.loaded_here());
        assert!(!unused.exists(), "an unused version was kept");
        assert!(in_use.exists());
        assert_eq!(links_to(&unused_ids), 0);
        assert_eq!(links_to(&in_use_ids), n_links);
        assert_eq!(fs::read_dir(&root.0).unwrap().count(), 2);

        // `stale` and `second` hold maps whose pins moved or went: watching
        // through them reopens the current pins, and counting works.
        let cg = TestCgroup::new("gc");
        for probes in [&stale, &second] {
            probes.watch(cg.id).unwrap();
            assert_eq!(probes.pin_dir(), current);
            let c = delta(probes, &cg, || {
                cg.run("mkdir -p /tmp/crab-bpf-gc-test && rmdir /tmp/crab-bpf-gc-test");
            });
            assert_eq!(class(&c, FsClass::Rmdir), 1, "{}", explain(&c));
            assert_eq!(
                third.counters(cg.id).unwrap(),
                probes.counters(cg.id).unwrap()
            );
            probes.unwatch(cg.id).unwrap();
        }
        assert_eq!(links_to(&pinned_program_ids(&current)), n_links);
        assert_eq!(fs::read_dir(&root.0).unwrap().count(), 2);
    }

    /// Helper for `loads_once_and_reuses_pins`, run in a child process.
    #[test]
    #[ignore = "run by loads_once_and_reuses_pins in a child process"]
    fn child_opens_pins() {
        let Some(root) = std::env::var_os("CRAB_BPF_CHILD_ROOT") else {
            println!("nothing to do: only meaningful as a child of loads_once_and_reuses_pins");
            return;
        };
        let probes = HostProbes::open_or_load_at(Path::new(&root)).unwrap();
        probes.watched().unwrap();
        println!(
            "child opened {}{:?}",
            if probes.loaded_here() { "loaded " } else { "" },
            pinned_program_ids(&probes.pin_dir())
        );
    }

    #[test]
    fn counts_filesystem_mutations_by_class() {
        let _serial = serial();
        let root = TestRoot::new("fs");
        let probes = HostProbes::open_or_load_at(&root.0).unwrap();
        let cg = TestCgroup::new("fs");
        probes.watch(cg.id).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().display();
        fs::write(tmp.path().join("existing"), "x").unwrap();

        let read_only = delta(&probes, &cg, || {
            let out = cg.run(&format!(
                "cat /etc/hostname; ls / >/dev/null; cat /etc/passwd > /dev/null 2>&1; grep -c root /etc/passwd; \
                 find {d} -name existing; ls -la {d} >/dev/null; echo to-stdout; echo piped | cat; echo err >&2; \
                 stat {d}/existing >/dev/null; head -c 10 /dev/zero >/dev/null"
            ));
            assert!(String::from_utf8_lossy(&out.stdout).contains("to-stdout"));
        });
        assert_eq!(
            read_only.fs_mutations,
            0,
            "read-only workload: {}",
            explain(&read_only)
        );
        assert!(
            read_only.forks >= 5 && read_only.execs >= 5 && read_only.exits >= 5,
            "{}",
            explain(&read_only)
        );

        let write = delta(&probes, &cg, || {
            cg.run(&format!("echo hello > {d}/f"));
        });
        assert_eq!(class(&write, FsClass::OpenWrite), 1, "{}", explain(&write));
        assert_eq!(class(&write, FsClass::Write), 1, "{}", explain(&write));
        assert_eq!(write.fs_mutations, 2, "{}", explain(&write));

        let append = delta(&probes, &cg, || {
            cg.run(&format!("echo more >> {d}/f"));
        });
        assert!(
            class(&append, FsClass::OpenWrite) == 1 && class(&append, FsClass::Write) == 1,
            "{}",
            explain(&append)
        );

        let tree = delta(&probes, &cg, || {
            cg.run(&format!(
                "mkdir {d}/dir && mv {d}/f {d}/g && chmod 600 {d}/g && ln -s g {d}/sym && ln {d}/g {d}/hard && \
                 rm {d}/sym {d}/hard && rmdir {d}/dir && touch -d @0 {d}/g && truncate -s 0 {d}/g && mkfifo {d}/fifo && \
                 chown 0:0 {d}/g && rm {d}/g {d}/fifo"
            ));
        });
        for (k, n) in [
            (FsClass::Mkdir, 1),
            (FsClass::Rename, 1),
            (FsClass::Chmod, 1),
            (FsClass::Symlink, 1),
            (FsClass::Link, 1),
            (FsClass::Unlink, 4),
            (FsClass::Rmdir, 1),
            (FsClass::Utimes, 1),
            (FsClass::Truncate, 1),
            (FsClass::Mknod, 1),
            (FsClass::Chown, 1),
        ] {
            assert!(class(&tree, k) >= n, "{}: {}", k.name(), explain(&tree));
        }

        // Shared writable file mapping (mmap, or mprotect adding write) counts;
        // a private one does not.
        let py = |flags: &str, body: &str| {
            format!(
                "/usr/bin/python3 -B -c 'import ctypes,os\nlibc=ctypes.CDLL(None,use_errno=True)\nlibc.mmap.restype=ctypes.c_void_p\n\
                 libc.mmap.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int,ctypes.c_int,ctypes.c_int,ctypes.c_long]\n\
                 libc.mprotect.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int]\n\
                 fd=os.open(\"{d}/existing\",os.{flags})\n{body}\n'"
            )
        };
        let shared_rw = delta(&probes, &cg, || {
            cg.run(&py(
                "O_RDWR",
                "a=libc.mmap(None,4096,3,1,fd,0)\nassert a!=ctypes.c_void_p(-1).value",
            ));
        });
        let shared_upgrade = delta(&probes, &cg, || {
            cg.run(&py(
                "O_RDWR",
                "a=libc.mmap(None,4096,1,1,fd,0)\nassert libc.mprotect(a,4096,3)==0",
            ));
        });
        let private_upgrade = delta(&probes, &cg, || {
            cg.run(&py(
                "O_RDONLY",
                "a=libc.mmap(None,4096,1,2,fd,0)\nassert libc.mprotect(a,4096,3)==0",
            ));
        });
        assert_eq!(
            shared_rw.shared_writable_mmaps,
            1,
            "{}",
            explain(&shared_rw)
        );
        assert_eq!(
            shared_upgrade.shared_writable_mmaps,
            1,
            "{}",
            explain(&shared_upgrade)
        );
        assert_eq!(
            private_upgrade.shared_writable_mmaps,
            0,
            "{}",
            explain(&private_upgrade)
        );
        assert_eq!(
            private_upgrade.fs_mutations,
            0,
            "python with a private mapping only: {}",
            explain(&private_upgrade)
        );

        // Opens that change nothing: create of an existing file with O_EXCL,
        // write mode on a device, read-only; O_RDONLY|O_TRUNC truncates.
        let quiet_opens = delta(&probes, &cg, || {
            cg.run(&format!(
                "/usr/bin/python3 -B -c 'import os\ntry:\n  os.open(\"{d}/existing\",os.O_CREAT|os.O_EXCL|os.O_WRONLY)\n\
                 except FileExistsError:\n  pass\nos.open(\"/dev/null\",os.O_WRONLY|os.O_TRUNC)\n\
                 os.open(\"{d}/existing\",os.O_RDONLY)\nos.open(\"{d}/missing\",os.O_WRONLY)\n' 2>/dev/null; true"
            ));
        });
        assert_eq!(quiet_opens.fs_mutations, 0, "{}", explain(&quiet_opens));
        let rdonly_trunc = delta(&probes, &cg, || {
            cg.run(&format!(
                "/usr/bin/python3 -B -c 'import os\nos.open(\"{d}/existing\",os.O_RDONLY|os.O_TRUNC)'"
            ));
        });
        assert_eq!(
            class(&rdonly_trunc, FsClass::OpenWrite),
            1,
            "{}",
            explain(&rdonly_trunc)
        );
        assert_eq!(fs::metadata(tmp.path().join("existing")).unwrap().len(), 0);

        // Creating a unix socket file is a mknod; an abstract one is nothing.
        let sockets = delta(&probes, &cg, || {
            cg.run(&format!(
                "/usr/bin/python3 -B -c 'import socket\ns=socket.socket(socket.AF_UNIX)\ns.bind(\"{d}/sock\")\n\
                 t=socket.socket(socket.AF_UNIX)\nt.bind(\"\\0crab-abstract-test\")\n'"
            ));
        });
        assert_eq!(class(&sockets, FsClass::Mknod), 1, "{}", explain(&sockets));

        // An unwatched cgroup next door sees nothing counted for it.
        let other = TestCgroup::new("fs-other");
        let before = probes.counters(cg.id).unwrap();
        other.run(&format!("echo x > {d}/other; mkdir {d}/otherdir"));
        assert_eq!(probes.counters(cg.id).unwrap(), before);
        assert!(matches!(
            probes.counters(other.id),
            Err(BpfError::NotWatched(_))
        ));

        // Tasks in a child cgroup of a watched one count for it.
        let nested = TestCgroup::at(cg.dir.join("nested"));
        let via_child = delta(&probes, &cg, || {
            nested.run(&format!("echo x > {d}/nested"));
        });
        assert_eq!(
            class(&via_child, FsClass::OpenWrite),
            1,
            "{}",
            explain(&via_child)
        );
        drop(nested);

        for (name, c) in [
            ("read-only", &read_only),
            ("write", &write),
            ("append", &append),
            ("tree ops", &tree),
            ("mmap shared rw", &shared_rw),
            ("mprotect shared", &shared_upgrade),
            ("mprotect private", &private_upgrade),
            ("unix sockets", &sockets),
            ("quiet opens", &quiet_opens),
            ("O_RDONLY|O_TRUNC", &rdonly_trunc),
            ("child cgroup", &via_child),
        ] {
            eprintln!("{name}: {}", explain(c));
        }
        let all = probes.counters(cg.id).unwrap();
        assert_eq!(all.errors, 0, "{}", explain(&all));
        probes.unwatch(cg.id).unwrap();
    }

    #[test]
    fn counts_processes_and_run_counts() {
        let _serial = serial();
        let root = TestRoot::new("procs");
        let probes = HostProbes::open_or_load_at(&root.0).unwrap();
        let cg = TestCgroup::new("procs");
        probes.watch(cg.id).unwrap();

        let procs = delta(&probes, &cg, || {
            cg.run("for i in 1 2 3; do /bin/true; done; (exit 0) & wait");
        });
        // 3 × /bin/true + 1 subshell, each forked and exited; the shell itself
        // exits too. exec: the 3 /bin/true.
        assert_eq!(procs.forks, 4, "{}", explain(&procs));
        assert_eq!(procs.execs, 3, "{}", explain(&procs));
        assert_eq!(procs.exits, 5, "{}", explain(&procs));

        let threads = delta(&probes, &cg, || {
            cg.run("/usr/bin/python3 -B -c 'import threading\nt=threading.Thread(target=lambda: None)\nt.start()\nt.join()'");
        });
        assert_eq!(threads.threads, 1, "{}", explain(&threads));

        // A sleeping process does not run: same count, reported as Some.
        let mut sleeper = cg.spawn("exec sleep 30");
        let pid = sleeper.id();
        std::thread::sleep(Duration::from_millis(500));
        let r1 = probes.run_count(pid).unwrap();
        std::thread::sleep(Duration::from_secs(2));
        let r2 = probes.run_count(pid).unwrap();
        assert!(
            r1.is_some() && r1 == r2,
            "sleeping process: {r1:?} then {r2:?}"
        );

        // A busy process runs: never two equal Some values.
        let mut busy = cg.spawn("while :; do :; done");
        let busy_pid = busy.id();
        let mut samples = Vec::new();
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(100));
            samples.push(probes.run_count(busy_pid).unwrap());
        }
        for pair in samples.windows(2) {
            assert!(
                !(pair[0].is_some() && pair[0] == pair[1]),
                "busy process looked idle: {samples:?}"
            );
        }
        // Waking the sleeper moves its count.
        // SAFETY: plain kill(2) of our child.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        std::thread::sleep(Duration::from_millis(100));
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        std::thread::sleep(Duration::from_millis(100));
        let r3 = probes.run_count(pid).unwrap();
        assert!(r3.is_none() || r3 > r2, "woken process: {r2:?} then {r3:?}");

        busy.kill().unwrap();
        busy.wait().unwrap();
        sleeper.kill().unwrap();
        sleeper.wait().unwrap();
        // Exited processes leave no run entry behind, even while watched.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(probes.run_count(pid).unwrap(), None);
        assert_eq!(probes.entries_of(cg.id).unwrap(), 0);
        eprintln!("sleeper {r1:?} {r2:?} {r3:?}; busy samples {samples:?}");
        assert_eq!(probes.counters(cg.id).unwrap().errors, 0);
        probes.unwatch(cg.id).unwrap();
    }

    #[test]
    fn sweep_dead_unwatches_only_removed_cgroups() {
        let _serial = serial();
        let root = TestRoot::new("sweep");
        let probes = HostProbes::open_or_load_at(&root.0).unwrap();
        let live = TestCgroup::new("sweep-live");
        let dead = TestCgroup::new("sweep-dead");
        probes.watch(live.id).unwrap();
        probes.watch(dead.id).unwrap();
        fs::remove_dir(&dead.dir).unwrap();
        let dead_id = dead.id;
        // Already removed: nothing for its guard to clean up (it would wait for the directory).
        std::mem::forget(dead);
        assert_eq!(probes.sweep_dead().unwrap(), vec![dead_id]);
        let watched = probes.watched().unwrap();
        assert!(
            watched.contains(&live.id) && !watched.contains(&dead_id),
            "{watched:?}"
        );
        assert_eq!(probes.sweep_dead().unwrap(), Vec::<u64>::new());
        probes.unwatch(live.id).unwrap();
    }

    #[test]
    fn unwatch_leaves_no_entries() {
        let _serial = serial();
        let root = TestRoot::new("unwatch");
        let probes = HostProbes::open_or_load_at(&root.0).unwrap();
        let cg = TestCgroup::new("unwatch");
        let bystander = TestCgroup::new("unwatch-bystander");
        probes.watch(cg.id).unwrap();
        probes.watch(bystander.id).unwrap();
        let mut bystander_proc = bystander.spawn("while :; do sleep 0.02; done");
        // Live processes with run entries, still running at unwatch time.
        let mut children: Vec<Child> = (0..4)
            .map(|_| cg.spawn("while :; do sleep 0.01; echo x > /dev/null; done"))
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        assert!(probes.entries_of(cg.id).unwrap() >= 4);
        assert!(probes.watched().unwrap().contains(&cg.id));

        probes.unwatch(cg.id).unwrap();
        assert_eq!(probes.entries_of(cg.id).unwrap(), 0);
        assert!(!probes.watched().unwrap().contains(&cg.id));
        assert!(matches!(
            probes.counters(cg.id),
            Err(BpfError::NotWatched(_))
        ));
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(
            probes.entries_of(cg.id).unwrap(),
            0,
            "entries came back after unwatch"
        );
        for pid in children.iter().map(Child::id) {
            assert_eq!(probes.run_count(pid).unwrap(), None);
        }
        // The other watched cgroup is untouched.
        assert!(probes.entries_of(bystander.id).unwrap() >= 1);
        assert!(probes.counters(bystander.id).unwrap().forks > 0);
        // Unwatching twice is fine.
        probes.unwatch(cg.id).unwrap();
        probes.unwatch(bystander.id).unwrap();
        assert_eq!(probes.entries_of(bystander.id).unwrap(), 0);
        assert!(probes.watched().unwrap().is_empty());
        let maps = probes.maps();
        assert_eq!(watched_levels(&maps).unwrap(), 0);
        assert_eq!(maps.levels.get(&0, 0).unwrap(), 0);
        drop(maps);
        for c in &mut children {
            c.kill().unwrap();
            c.wait().unwrap();
        }
        bystander_proc.kill().unwrap();
        bystander_proc.wait().unwrap();
    }
}

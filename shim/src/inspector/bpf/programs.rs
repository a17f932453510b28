//! The programs and maps of the embedded BPF object (`bpf-programs/inspector.bpf.c`, built by
//! `build.rs`): which tracepoint each program attaches to, the layout of the map values, and
//! loading, attaching and pinning them all into a directory.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use aya::programs::links::FdLink;
use aya::programs::{BtfTracePoint, TracePoint};
use aya::{Btf, Ebpf, EbpfLoader, Pod};

use super::{io_err, BpfError, ABI_VERSION, FS_CLASSES, STATE_CLASSES};

/// Where tracefs is mounted: the tracepoints the programs attach to are listed below it.
pub(super) const TRACEFS_MOUNT: &str = "/sys/kernel/tracing";

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/inspector.bpf.o"));

/// Syscall tracepoints (`syscalls/<name>`) per program. A tracepoint missing
/// from the running kernel is a syscall it does not have (arm64 has no
/// open/creat/rename/mkdir...), so it is skipped; [`REQUIRED_SYSCALL_TPS`]
/// must exist everywhere.
pub(super) const SYSCALL_PROGRAMS: &[(&str, &[&str])] = &[
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
    ("crab_rseq", &["sys_enter_rseq"]),
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
    ("crab_ptrace", &["sys_enter_ptrace"]),
    ("crab_foreign", &["sys_enter_process_vm_writev"]),
    ("crab_pidfd_getfd", &["sys_enter_pidfd_getfd"]),
    (
        "crab_sysv_ipc",
        &[
            "sys_enter_msgget",
            "sys_enter_msgsnd",
            "sys_enter_msgrcv",
            "sys_enter_msgctl",
            "sys_enter_semget",
            "sys_enter_semop",
            "sys_enter_semtimedop",
            "sys_enter_semctl",
            "sys_enter_shmget",
            "sys_enter_shmat",
            "sys_enter_shmctl",
        ],
    ),
    (
        "crab_uts",
        &["sys_enter_sethostname", "sys_enter_setdomainname"],
    ),
    ("crab_prlimit", &["sys_enter_prlimit64"]),
    (
        "crab_set_who",
        &["sys_enter_setpriority", "sys_enter_ioprio_set"],
    ),
    (
        "crab_set_pid",
        &[
            "sys_enter_sched_setscheduler",
            "sys_enter_sched_setparam",
            "sys_enter_sched_setattr",
            "sys_enter_sched_setaffinity",
        ],
    ),
];

/// Without these the kernel has no syscall tracepoints worth the name.
pub(super) const REQUIRED_SYSCALL_TPS: &[&str] = &[
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
pub(super) const BTF_TRACEPOINTS: &[(&str, &str)] = &[
    ("crab_exec", "sched_process_exec"),
    ("crab_fork", "sched_process_fork"),
    ("crab_exit", "sched_process_exit"),
    ("crab_sched_switch", "sched_switch"),
    ("crab_signal", "signal_generate"),
];

/// The program that counts the interactions of watched processes (`struct run`), on every
/// syscall's return on the host: loaded and pinned with the others, attached only once a shim
/// asks for it ([`super::HostProbes::track_interactions`]), since it costs every syscall on the
/// host something.
pub(super) const QUIET_PROGRAM: (&str, &str) = ("crab_quiet", "sys_exit");

/// File name of the quiet program's link pin.
pub(super) fn quiet_link_name() -> String {
    format!("btf:{}", QUIET_PROGRAM.1)
}

pub(super) const MAP_NAMES: &[&str] = &[
    "watched",
    "levels",
    "runs",
    "oncpu",
    "quotas",
    "rootfs",
    "rootfs_any",
];

/// `struct counters` of inspector.h.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RawCounters {
    pub(super) fs_by_class: [u64; FS_CLASSES],
    pub(super) shared_writable_mmaps: u64,
    pub(super) forks: u64,
    pub(super) threads: u64,
    pub(super) execs: u64,
    pub(super) exits: u64,
    pub(super) foreign_mem_writes: u64,
    pub(super) state_by_class: [u64; STATE_CLASSES],
    pub(super) errors: u64,
    pub(super) over_quota: u64,
    pub(super) level: u64,
    pub(super) misses_base: u64,
}

// SAFETY: plain old data: repr(C), only u64 fields (no padding), every bit pattern valid.
unsafe impl Pod for RawCounters {}

/// `struct run` of inspector.h.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(super) struct RawRun {
    pub(super) switches_out: u64,
    pub(super) cgroup_id: u64,
    pub(super) flags: u64,
    pub(super) charged: u64,
    pub(super) signals: u64,
    pub(super) interactions: u64,
    pub(super) rseq: [u64; RUN_RSEQ_MAX],
}

/// `struct quota` of inspector.h.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RawQuota {
    pub(super) used: i64,
    pub(super) max: i64,
}

// SAFETY: plain old data: repr(C), only 64-bit integer fields (no padding), every bit pattern
// valid.
unsafe impl Pod for RawQuota {}

/// `RUN_RSEQ_MAX` of inspector.h.
pub(super) const RUN_RSEQ_MAX: usize = 8;
/// `RUN_RSEQ_MORE` of inspector.h.
pub(super) const RUN_RSEQ_MORE: u64 = 2;

// SAFETY: plain old data: repr(C), only u64 fields (no padding), every bit pattern valid.
unsafe impl Pod for RawRun {}

/// Name of the version directory under the pin root.
pub fn version_dir_name() -> String {
    format!("v{ABI_VERSION}-{:016x}", fnv1a64(OBJECT))
}

fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    })
}

pub(super) fn program_names() -> impl Iterator<Item = &'static str> {
    SYSCALL_PROGRAMS
        .iter()
        .map(|(p, _)| *p)
        .chain(BTF_TRACEPOINTS.iter().map(|(p, _)| *p))
        .chain(std::iter::once(QUIET_PROGRAM.0))
}

fn tracefs_events() -> PathBuf {
    Path::new(TRACEFS_MOUNT).join("events")
}

fn syscall_tracepoint_exists(name: &str) -> bool {
    tracefs_events().join("syscalls").join(name).is_dir()
}

/// File names of the link pins a complete load has on this kernel.
pub(super) fn expected_links() -> Result<BTreeSet<String>, BpfError> {
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

pub(super) fn pin_into(tmp: &Path) -> Result<(), BpfError> {
    let expected = expected_links()?;
    for sub in ["maps", "progs", "links"] {
        let path = tmp.join(sub);
        fs::create_dir_all(&path).map_err(io_err("creating", &path))?;
    }
    let btf = Btf::from_sys_fs()?;
    // `runs` is task storage, which the library creates and pins but has no type for.
    let mut ebpf = EbpfLoader::new()
        .btf(Some(&btf))
        .allow_unsupported_maps()
        .load(OBJECT)?;

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
        let prog = btf_tracepoint(&mut ebpf, name)?;
        prog.load(tp, &btf)
            .map_err(|source| BpfError::Program { name, source })?;
        attach_and_pin(prog, name, &tmp.join("links").join(format!("btf:{tp}")))?;
        pin_program(prog.pin(tmp.join("progs").join(name)), tmp, name)?;
    }
    // Loaded (so that a kernel that refuses it refuses the whole load, not a shim later) and
    // pinned, not attached.
    {
        let (name, tp) = QUIET_PROGRAM;
        let prog = btf_tracepoint(&mut ebpf, name)?;
        prog.load(tp, &btf)
            .map_err(|source| BpfError::Program { name, source })?;
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

/// Attaches the pinned quiet program of version directory `dir` and pins its link (the caller
/// holds the root lock and saw no link pinned).
pub(super) fn attach_quiet(dir: &Path) -> Result<(), BpfError> {
    let name = QUIET_PROGRAM.0;
    let mut prog = BtfTracePoint::from_pin(dir.join("progs").join(name))
        .map_err(|source| BpfError::Program { name, source })?;
    attach_and_pin(&mut prog, name, &dir.join("links").join(quiet_link_name()))
}

/// Attaches the loaded BTF tracepoint program `prog` (named `name`) and pins its link at `link`.
fn attach_and_pin(
    prog: &mut BtfTracePoint,
    name: &'static str,
    link: &Path,
) -> Result<(), BpfError> {
    let id = prog
        .attach()
        .map_err(|source| BpfError::Program { name, source })?;
    let taken = prog
        .take_link(id)
        .map_err(|source| BpfError::Program { name, source })?;
    pin_link(FdLink::from(taken), link)
}

fn btf_tracepoint<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut BtfTracePoint, BpfError> {
    ebpf.program_mut(name)
        .ok_or(BpfError::MissingProgram(name))?
        .try_into()
        .map_err(|source| BpfError::Program { name, source })
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

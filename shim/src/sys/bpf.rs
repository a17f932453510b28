//! The few `bpf(2)` commands crab issues itself (the eBPF library covers loading, attaching and
//! map access): opening a pinned object, a program's kernel statistics, whether a map has
//! any key, and the elements of task storage (keyed by a pidfd, which the library cannot do).

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// `bpf(cmd, attr, size_of::<A>())`.
///
/// # Safety
/// `attr` must be the `union bpf_attr` layout the kernel expects for `cmd`, and every pointer
/// it carries must be valid for what the kernel does with it (read a path, write a buffer of
/// the length given) for the duration of the call.
unsafe fn bpf<A>(cmd: libc::c_long, attr: &A) -> io::Result<libc::c_long> {
    // SAFETY: the caller guarantees `attr` is a valid attribute block for `cmd` whose pointers
    // stay valid; its size is passed along, and the kernel reads at most that many bytes.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *const A,
            std::mem::size_of::<A>(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret)
}

/// A descriptor of the object (map, program, link) pinned at `path` in a bpf filesystem.
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
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
    // SAFETY: `attr` is the BPF_OBJ_GET prefix of `union bpf_attr`; its only pointer is the
    // NUL-terminated `cpath`, which outlives the call.
    let fd = unsafe { bpf(BPF_OBJ_GET, &attr)? };
    // SAFETY: BPF_OBJ_GET succeeded: `fd` is a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Whether the map `map` has no key at all (`BPF_MAP_GET_NEXT_KEY` from no key says `ENOENT`).
pub fn map_is_empty(map: BorrowedFd<'_>) -> io::Result<bool> {
    #[repr(C)]
    struct NextKeyAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
        flags: u64,
    }
    // Room for any key size a map can have here.
    let mut next = [0u8; 64];
    let attr = NextKeyAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: 0, // NULL: the first key
        next_key: next.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `attr` is the BPF_MAP_GET_NEXT_KEY prefix of `union bpf_attr`; `key` is NULL and
    // `next_key` points at `next`, which lives across the call and has room for the keys of
    // the maps this is used on (at most 8 bytes).
    match unsafe { bpf(BPF_MAP_GET_NEXT_KEY, &attr) } {
        Ok(_) => Ok(false),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(true),
        Err(e) => Err(e),
    }
}

/// The `BPF_MAP_*_ELEM` prefix of `union bpf_attr`.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// The element of task storage `map` (a map whose keys are 4-byte fds and whose values are
/// exactly `size_of::<V>()` bytes: checked by the caller when it opened the map) for the
/// process `pidfd` holds: `None` when it has none, or has exited.
///
/// # Safety
/// `map` must be a `BPF_MAP_TYPE_TASK_STORAGE` map whose value size is `size_of::<V>()`, and
/// every bit pattern must be a valid `V` (the kernel writes the value's bytes as they are).
pub unsafe fn task_storage_get<V: Copy>(
    map: BorrowedFd<'_>,
    pidfd: BorrowedFd<'_>,
) -> io::Result<Option<V>> {
    let key: i32 = pidfd.as_raw_fd();
    let mut value = std::mem::MaybeUninit::<V>::zeroed();
    let attr = ElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: &key as *const i32 as u64,
        value: value.as_mut_ptr() as u64,
        flags: 0,
    };
    // SAFETY: `attr` is the BPF_MAP_LOOKUP_ELEM prefix of `union bpf_attr`; `key` points at a
    // 4-byte fd and `value` at `size_of::<V>()` bytes, which the caller guarantees is the map's
    // value size; both live across the call.
    match unsafe { bpf(BPF_MAP_LOOKUP_ELEM, &attr) } {
        // SAFETY: the kernel wrote the whole value, and any bit pattern is a valid V (caller).
        Ok(_) => Ok(Some(unsafe { value.assume_init() })),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Removes the element of task storage `map` for the process `pidfd` holds; whether there was
/// one.
pub fn task_storage_delete(map: BorrowedFd<'_>, pidfd: BorrowedFd<'_>) -> io::Result<bool> {
    let key: i32 = pidfd.as_raw_fd();
    let attr = ElemAttr {
        map_fd: map.as_raw_fd() as u32,
        _pad: 0,
        key: &key as *const i32 as u64,
        value: 0,
        flags: 0,
    };
    // SAFETY: `attr` is the BPF_MAP_DELETE_ELEM prefix of `union bpf_attr`; `key` points at a
    // 4-byte fd (a task storage map's key size, which the kernel checks against the map) that
    // lives across the call.
    match unsafe { bpf(BPF_MAP_DELETE_ELEM, &attr) } {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Kernel statistics of one loaded program (`struct bpf_prog_info`).
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

/// The statistics of the program `prog` (`BPF_OBJ_GET_INFO_BY_FD`).
pub fn prog_stats(prog: BorrowedFd<'_>) -> io::Result<ProgramStats> {
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
        bpf_fd: prog.as_raw_fd() as u32,
        info_len: INFO_LEN as u32,
        info: info.0.as_mut_ptr() as u64,
    };
    // SAFETY: `attr` is the BPF_OBJ_GET_INFO_BY_FD prefix of `union bpf_attr`; `info` points at
    // a buffer of exactly `info_len` bytes that lives across the call.
    unsafe { bpf(BPF_OBJ_GET_INFO_BY_FD, &attr)? };
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

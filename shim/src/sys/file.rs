//! Opening files relative to directory descriptors, and the file calls `nix` lacks.
//!
//! nix 0.29's `open`, `openat` and `openat2` hand back raw descriptors; the wrappers here take
//! ownership of them at once, so the rest of crab only ever holds [`OwnedFd`]s (closed exactly
//! once, never leaked on an error path). Everything else crab needs from the kernel goes
//! through nix directly, except what it does not have: `sync_file_range` (here), extended
//! attributes ([`super::xattr`]), `open_by_handle_at` ([`super::cgroup`]) and the `bpf(2)`
//! commands ([`super::bpf`]).

use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
};

use nix::{
    dir::Dir,
    fcntl::{OFlag, OpenHow},
    sys::stat::Mode,
    NixPath,
};

/// Takes ownership of a descriptor a successful open call just returned.
fn own(fd: RawFd) -> OwnedFd {
    // SAFETY: only called with the result of a successful open/openat/openat2 in this module: a
    // new, valid descriptor that nothing else owns or will close.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// `open(2)`; no mode (never creates a file).
pub fn open<P: ?Sized + NixPath>(path: &P, flags: OFlag) -> nix::Result<OwnedFd> {
    nix::fcntl::open(path, flags, Mode::empty()).map(own)
}

/// `openat(2)` relative to `dir`; no mode (never creates a file).
pub fn openat<P: ?Sized + NixPath>(
    dir: impl AsRawFd,
    name: &P,
    flags: OFlag,
) -> nix::Result<OwnedFd> {
    nix::fcntl::openat(Some(dir.as_raw_fd()), name, flags, Mode::empty()).map(own)
}

/// `openat(2)` relative to `dir` with the `mode` a file it creates gets (`O_CREAT`).
pub fn create_at<P: ?Sized + NixPath>(
    dir: impl AsRawFd,
    name: &P,
    flags: OFlag,
    mode: Mode,
) -> nix::Result<OwnedFd> {
    nix::fcntl::openat(Some(dir.as_raw_fd()), name, flags, mode).map(own)
}

/// `openat2(2)` relative to `dir`.
pub fn openat2<P: ?Sized + NixPath>(
    dir: impl AsRawFd,
    name: &P,
    how: OpenHow,
) -> nix::Result<OwnedFd> {
    nix::fcntl::openat2(dir.as_raw_fd(), name, how).map(own)
}

/// The names of a directory (without `.` and `..`), or `None` once there are more than `max`.
pub fn names_bounded(dir: &mut Dir, max: u64) -> nix::Result<Option<Vec<CString>>> {
    let mut names = Vec::new();
    for entry in dir.iter() {
        let entry = entry?;
        let name = entry.file_name();
        let b = name.to_bytes();
        if b != b"." && b != b".." {
            if names.len() as u64 >= max {
                return Ok(None);
            }
            names.push(name.to_owned());
        }
    }
    Ok(Some(names))
}

/// [`names_bounded`] of the open directory `dir`, read through a duplicate descriptor (closed
/// before returning), so the caller keeps `dir` as the base of `*at` calls on the names.
pub fn dir_names_bounded(dir: BorrowedFd<'_>, max: u64) -> io::Result<Option<Vec<CString>>> {
    let mut stream = Dir::from(dir.try_clone_to_owned()?)?;
    Ok(names_bounded(&mut stream, max)?)
}

/// `sync_file_range(2)` over the whole file with `flags` (`SYNC_FILE_RANGE_*`).
pub fn sync_file_range(fd: BorrowedFd<'_>, flags: libc::c_uint) -> io::Result<()> {
    // SAFETY: sync_file_range takes no pointers; `fd` is a descriptor borrowed for the call.
    let rc = unsafe { libc::sync_file_range(fd.as_raw_fd(), 0, 0, flags) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Why [`read_regular_bounded`] read nothing.
#[derive(Debug)]
pub enum BoundedReadError {
    /// Not a regular file (a directory, a FIFO, a device), or a symlink (not followed).
    NotRegular,
    /// Larger than the bound.
    TooLarge(u64),
    Io(io::Error),
}

impl std::fmt::Display for BoundedReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BoundedReadError::NotRegular => f.write_str("not a regular file"),
            BoundedReadError::TooLarge(max) => write!(f, "larger than {max} bytes"),
            BoundedReadError::Io(e) => e.fmt(f),
        }
    }
}

/// The contents of the regular file at `path`, read as untrusted input: its last component not
/// followed if it is a symlink (`ELOOP`, reported as not regular), never blocking on a FIFO,
/// at most `max` bytes. `Ok(None)`: there is no such file.
pub fn read_regular_bounded(
    path: &std::path::Path,
    max: u64,
) -> Result<Option<Vec<u8>>, BoundedReadError> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(BoundedReadError::NotRegular)
        }
        Err(e) => return Err(BoundedReadError::Io(e)),
    };
    if !file.metadata().map_err(BoundedReadError::Io)?.is_file() {
        return Err(BoundedReadError::NotRegular);
    }
    let mut bytes = Vec::new();
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(BoundedReadError::Io)?;
    if bytes.len() as u64 > max {
        return Err(BoundedReadError::TooLarge(max));
    }
    Ok(Some(bytes))
}

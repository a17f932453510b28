//! Extended attributes of a file, read and written through an open descriptor or a path that
//! is never followed if it is a symlink (nix 0.29 has no xattr calls).

use std::{ffi::CStr, io, os::fd::RawFd};

use nix::errno::Errno;

/// The file whose attributes are read or written.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// An open descriptor (`flistxattr`, `fgetxattr`, `fsetxattr`, `fremovexattr`).
    Fd(RawFd),
    /// A path; a symlink there is the link itself (`llistxattr`, `lgetxattr`, `lsetxattr`,
    /// `lremovexattr`).
    Path(&'a CStr),
}

impl Target<'_> {
    /// Attribute names, NUL-separated as the kernel returns them. A filesystem without xattrs
    /// (`EOPNOTSUPP`) has none.
    pub fn list(&self) -> io::Result<Vec<u8>> {
        let res = read_sized(|buf, len| match *self {
            // SAFETY: `buf` is null with `len` 0 (a size probe) or valid for `len` bytes
            // (read_sized's contract); the kernel writes at most `len` bytes there. A bad
            // descriptor is an error, not undefined behaviour.
            Target::Fd(fd) => unsafe { libc::flistxattr(fd, buf, len) },
            // SAFETY: as above; `p` is a NUL-terminated string that outlives the call.
            Target::Path(p) => unsafe { libc::llistxattr(p.as_ptr(), buf, len) },
        });
        match res {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(Vec::new()),
            r => r,
        }
    }

    /// The value of attribute `name`; `None` if it is not there (or was removed since it was
    /// listed).
    pub fn get(&self, name: &CStr) -> io::Result<Option<Vec<u8>>> {
        let res = read_sized(|buf, len| match *self {
            // SAFETY: `buf` is null with `len` 0 or valid for `len` bytes (read_sized's
            // contract); `name` is NUL-terminated and outlives the call.
            Target::Fd(fd) => unsafe { libc::fgetxattr(fd, name.as_ptr(), buf.cast(), len) },
            // SAFETY: as above; `p` is NUL-terminated and outlives the call.
            Target::Path(p) => unsafe {
                libc::lgetxattr(p.as_ptr(), name.as_ptr(), buf.cast(), len)
            },
        });
        match res {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Sets attribute `name` to `value` (created or replaced: no flags).
    pub fn set(&self, name: &CStr, value: &[u8]) -> io::Result<()> {
        let (v, len) = (value.as_ptr().cast(), value.len());
        let rc = match *self {
            // SAFETY: `name` is NUL-terminated and `value` valid for `len` bytes; both outlive
            // the call, and the kernel only reads them. A bad descriptor is an error.
            Target::Fd(fd) => unsafe { libc::fsetxattr(fd, name.as_ptr(), v, len, 0) },
            // SAFETY: as above; `p` is NUL-terminated and outlives the call.
            Target::Path(p) => unsafe { libc::lsetxattr(p.as_ptr(), name.as_ptr(), v, len, 0) },
        };
        Errno::result(rc).map(drop).map_err(io::Error::from)
    }

    /// Removes attribute `name`; an error (`ENODATA`) if it is not there.
    pub fn remove(&self, name: &CStr) -> io::Result<()> {
        let rc = match *self {
            // SAFETY: `name` is NUL-terminated and outlives the call. A bad descriptor is an
            // error.
            Target::Fd(fd) => unsafe { libc::fremovexattr(fd, name.as_ptr()) },
            // SAFETY: as above; `p` is NUL-terminated and outlives the call.
            Target::Path(p) => unsafe { libc::lremovexattr(p.as_ptr(), name.as_ptr()) },
        };
        Errno::result(rc).map(drop).map_err(io::Error::from)
    }
}

/// Calls a size-probing syscall (listxattr, getxattr style: the length written, or -1 with
/// `ERANGE` when the buffer is too small, or the size needed when called with a null buffer and
/// length 0) with a growing buffer. `f` gets either a null pointer and 0, or a pointer valid for
/// writes of the length it is given.
fn read_sized(f: impl Fn(*mut libc::c_char, usize) -> isize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        let n = f(buf.as_mut_ptr().cast(), buf.len());
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) {
            return Err(e);
        }
        let need = f(std::ptr::null_mut(), 0);
        if need < 0 {
            return Err(io::Error::last_os_error());
        }
        buf.resize((need as usize).max(buf.len() * 2), 0);
    }
}

/// Sets attribute `name` of `path` (a symlink is the link itself), for tests that build trees.
#[cfg(test)]
pub(crate) fn lset(path: &std::path::Path, name: &str, value: &[u8]) -> io::Result<()> {
    use std::{ffi::CString, os::unix::ffi::OsStrExt};
    let c = CString::new(path.as_os_str().as_bytes())?;
    Target::Path(&c).set(&CString::new(name)?, value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{ffi::CString, os::unix::ffi::OsStrExt};

    #[test]
    fn lists_and_reads_values_of_any_size_on_fds_and_unfollowed_paths() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, "x").unwrap();
        let c = CString::new(file.as_os_str().as_bytes()).unwrap();
        // A value longer than the first buffer, to go through the ERANGE path.
        let big = vec![b'v'; 3000];
        if let Err(e) = lset(&file, "user.crab.big", &big) {
            assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}");
            eprintln!(
                "no user xattrs on {}: only the absent case is checked",
                dir.path().display()
            );
            assert_eq!(Target::Path(&c).get(c"user.crab.big").unwrap(), None);
            return;
        }
        let f = std::fs::File::open(&file).unwrap();
        use std::os::fd::AsRawFd;
        for target in [Target::Path(&c), Target::Fd(f.as_raw_fd())] {
            let names = target.list().unwrap();
            assert!(
                names.split(|b| *b == 0).any(|n| n == b"user.crab.big"),
                "{names:?}"
            );
            assert_eq!(target.get(c"user.crab.big").unwrap(), Some(big.clone()));
            assert_eq!(target.get(c"user.crab.none").unwrap(), None);
        }
        // A symlink is not followed: the link has no user xattrs (and cannot have any).
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let cl = CString::new(link.as_os_str().as_bytes()).unwrap();
        assert_eq!(Target::Path(&cl).get(c"user.crab.big").unwrap(), None);
    }
}

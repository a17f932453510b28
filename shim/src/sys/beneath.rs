//! Opening files that a container controls, as host root, without being led anywhere else.
//!
//! Everything a sandbox can name is hostile: paths printed in
//! `/proc/PID/maps` and `/proc/PID/fd` (a memfd's name is any string, slashes and `..`
//! included), the entries of its upperdir, volumes and rootfs. A path joined onto a host
//! directory and handed to `open(2)` can leave that directory through a symlink in any
//! component or through `..`, and `O_NOFOLLOW` guards only the last component. Even a path
//! that stays inside can name a device node (`mknod` is allowed in containers; opening a
//! hardware watchdog reboots the host) or a FIFO (opening one blocks).
//!
//! So every such open goes through here, in two steps:
//! 1. [`resolve_beneath`]: `openat2(2)` with `O_PATH` and `RESOLVE_BENEATH |
//!    RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS` relative to a directory fd that stands for the
//!    container's root (an upperdir, a volume, `/proc/PID/root`): no component may be a symlink,
//!    `..` may not climb above the root, absolute paths are refused. An `O_PATH` open calls no
//!    driver or filesystem `open` method, so resolving a device or a FIFO has no effect.
//! 2. [`reopen_regular`]: `fstat` on that handle, refuse anything but a regular file, then open
//!    the very same inode for I/O through `/proc/self/fd/N` (the handle, not the path again, so
//!    nothing can be swapped in between). `O_NONBLOCK` keeps a file lease held by the container
//!    from stalling the open (`EWOULDBLOCK` instead of waiting for the lease break).
//!
//! Checking the type *after* an ordinary open would be too late: a device's `open` has already
//! run by then.
//!
//! Walks that read or write a whole tree another party may be changing (the refill of a tracked
//! volume) go one component at a time, relative to the parent's descriptor, with
//! [`open_dir_beneath`] and [`create_file_beneath`]: the same resolution, and never across a
//! mount point either (`RESOLVE_NO_XDEV`).

use std::{
    ffi::CString,
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Component, Path},
};

use nix::{
    errno::Errno,
    fcntl::{OFlag, OpenHow, ResolveFlag},
};

use super::file;

/// The resolution flags every lookup uses.
const RESOLVE: ResolveFlag = ResolveFlag::RESOLVE_BENEATH
    .union(ResolveFlag::RESOLVE_NO_SYMLINKS)
    .union(ResolveFlag::RESOLVE_NO_MAGICLINKS);

/// The error for a path that resolved to something other than a regular file. `EFTYPE` does
/// not exist on Linux; `ENXIO` ("no such device or address") is what `open(2)` itself returns
/// for special files it will not open (a socket, a FIFO without a reader), and no lookup here
/// can produce it otherwise.
pub fn not_regular() -> io::Error {
    io::Error::from_raw_os_error(libc::ENXIO)
}

/// Whether `e` is [`not_regular`]'s error (or the kernel refusing a symlink on the way).
pub fn is_refused(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ENXIO) | Some(libc::ELOOP) | Some(libc::EXDEV)
    )
}

/// `rel` made relative: the leading `/` of a container path stands for `root`. Empty means
/// `root` itself.
fn relative(rel: &Path) -> io::Result<CString> {
    let mut out = Vec::with_capacity(rel.as_os_str().len());
    for c in rel.components() {
        let part = match c {
            Component::RootDir | Component::CurDir => continue,
            // Kept: the kernel decides, and RESOLVE_BENEATH refuses climbing above the root.
            Component::ParentDir => "..".as_ref(),
            Component::Normal(n) => n,
            Component::Prefix(_) => unreachable!("no path prefixes on Unix"),
        };
        if !out.is_empty() {
            out.push(b'/');
        }
        out.extend_from_slice(part.as_bytes());
    }
    if out.is_empty() {
        out.push(b'.');
    }
    CString::new(out).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// An `O_PATH` handle on `rel` beneath `root` (see the module docs). A symlink as the last
/// component is returned as itself (`O_NOFOLLOW`), never followed; one in any other component,
/// `..` above `root`, or an absolute symlink fails with `ELOOP` or `EXDEV`.
pub fn resolve_beneath(root: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(RESOLVE);
    openat2_beneath(root, rel, how)
}

/// A directory beneath `root` open for reading (to list it, and as the base of `*at` calls on
/// its entries), resolved as [`resolve_beneath`] resolves and, besides, never across a mount
/// point (`RESOLVE_NO_XDEV`): a directory replaced by another mount (a bind mount included)
/// fails with `EXDEV`, a symlink in any component (the last one included) with `ELOOP`.
/// `O_DIRECTORY` makes anything but a directory fail (`ENOTDIR`) at the lookup, before any
/// driver's `open` could run. An empty `rel` reopens `root` itself (an `O_PATH` handle becomes
/// a descriptor that can be read).
pub fn open_dir_beneath(root: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
        .resolve(RESOLVE.union(ResolveFlag::RESOLVE_NO_XDEV));
    openat2_beneath(root, rel, how)
}

/// A new regular file `rel` beneath `root`, open for writing, resolved as [`open_dir_beneath`]
/// resolves: `O_CREAT | O_EXCL`, so never an existing file, and never through a symlink, even
/// as the last component (an existing symlink there fails with `EEXIST`). `mode` is the new
/// file's (less the umask) until the caller changes it.
pub fn create_file_beneath(root: BorrowedFd<'_>, rel: &Path, mode: u32) -> io::Result<File> {
    let how = OpenHow::new()
        .flags(
            OFlag::O_WRONLY
                | OFlag::O_CREAT
                | OFlag::O_EXCL
                | OFlag::O_NOFOLLOW
                | OFlag::O_NOCTTY
                | OFlag::O_CLOEXEC,
        )
        .mode(nix::sys::stat::Mode::from_bits_retain(mode))
        .resolve(RESOLVE.union(ResolveFlag::RESOLVE_NO_XDEV));
    openat2_beneath(root, rel, how).map(File::from)
}

/// `openat2(2)` of `rel` (made relative) beneath `root` with `how`, retried while the kernel
/// cannot tell.
fn openat2_beneath(root: BorrowedFd<'_>, rel: &Path, how: OpenHow) -> io::Result<OwnedFd> {
    let c = relative(rel)?;
    loop {
        match file::openat2(root, c.as_c_str(), how) {
            Ok(fd) => return Ok(fd),
            // EAGAIN: a concurrent rename made RESOLVE_BENEATH's check inconclusive; retry.
            Err(Errno::EAGAIN | Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// `fstat` of any descriptor, `O_PATH` ones included.
pub fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    Ok(nix::sys::stat::fstat(fd.as_raw_fd())?)
}

pub fn is_regular(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG
}

/// Opens the inode behind the `O_PATH` handle `path` for I/O with `flags` (access mode plus
/// e.g. `O_NOATIME`), if and only if it is a regular file; [`not_regular`] otherwise. The
/// handle, not a path, is reopened, so this is the inode that was checked.
pub fn reopen_regular(path: BorrowedFd<'_>, flags: libc::c_int) -> io::Result<File> {
    if !is_regular(&fstat(path)?) {
        return Err(not_regular());
    }
    let via = format!("/proc/self/fd/{}", path.as_raw_fd());
    let flags = flags | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    loop {
        match file::open(via.as_str(), OFlag::from_bits_retain(flags)) {
            Ok(fd) => return Ok(File::from(fd)),
            // O_NOATIME is refused (EPERM) on files the caller does not own without CAP_FOWNER.
            Err(Errno::EPERM) if flags & libc::O_NOATIME != 0 => {
                return reopen_regular(path, flags & !libc::O_NOATIME);
            }
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// [`resolve_beneath`] then [`reopen_regular`]: a regular file beneath `root`, open for I/O.
pub fn open_regular_beneath(
    root: BorrowedFd<'_>,
    rel: &Path,
    flags: libc::c_int,
) -> io::Result<File> {
    let handle = resolve_beneath(root, rel)?;
    reopen_regular(handle.as_fd(), flags)
}

/// A regular file at `path` open for reading, never through a symlink in its last component,
/// and never opened at all unless regular (the handle is checked before any driver's `open`
/// could run): for files of untrusted trees whose directory the caller already trusts (a
/// private copy, a checkpoint directory containerd unpacked).
pub fn open_regular_nofollow(path: &Path) -> io::Result<File> {
    let handle = open_path(path, libc::O_NOFOLLOW)?;
    reopen_regular(handle.as_fd(), libc::O_RDONLY)
}

/// An `O_PATH` handle on a host directory that stands for a root (an upperdir, a volume, a
/// rootfs). The host path is trusted; what lies beneath it is not.
pub fn open_root(dir: &Path) -> io::Result<OwnedFd> {
    open_path(dir, libc::O_DIRECTORY)
}

/// [`open_root`] for a host directory whose path is trusted but must not itself be a symlink
/// (`O_NOFOLLOW`): a volume's host directory, which the refill of a tracked volume empties.
pub fn open_root_nofollow(dir: &Path) -> io::Result<OwnedFd> {
    open_path(dir, libc::O_DIRECTORY | libc::O_NOFOLLOW)
}

/// An `O_PATH` handle on what a trusted host path refers to, magic links followed: for
/// `/proc/PID/map_files/<range>` and `/proc/PID/fd/N`, which stand for the mapped or open
/// file itself rather than for a name. Nothing is opened for I/O.
pub fn open_handle(path: &Path) -> io::Result<OwnedFd> {
    open_path(path, 0)
}

fn open_path(path: &Path, extra: libc::c_int) -> io::Result<OwnedFd> {
    let flags = OFlag::O_PATH | OFlag::O_CLOEXEC | OFlag::from_bits_retain(extra);
    Ok(file::open(path, flags)?)
}

/// The root directory of process `pid` as its paths (`/proc/PID/maps`, `fd`) are printed
/// relative to: an `O_PATH` handle through the `/proc/PID/root` magic link, which the shim
/// follows on purpose (it is the kernel's own answer, not a name the container chose).
pub fn process_root(pid: u32) -> io::Result<OwnedFd> {
    open_root(Path::new(&format!("/proc/{pid}/root")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        io::{Read, Write},
        os::unix::fs::symlink,
    };

    /// A host directory outside the "container" root with a file the container must not reach.
    struct Scene {
        _dir: tempfile::TempDir,
        root: std::path::PathBuf,
        host: std::path::PathBuf,
    }

    fn scene() -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let host = dir.path().join("host");
        std::fs::create_dir_all(root.join("app/sub")).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        std::fs::write(host.join("secret"), "host secret").unwrap();
        std::fs::write(root.join("app/data"), "container data").unwrap();
        Scene {
            _dir: dir,
            root,
            host,
        }
    }

    fn open(s: &Scene, rel: &str) -> io::Result<File> {
        let root = open_root(&s.root).unwrap();
        open_regular_beneath(root.as_fd(), Path::new(rel), libc::O_RDONLY)
    }

    #[test]
    fn a_regular_file_beneath_opens_with_or_without_a_leading_slash() {
        let s = scene();
        for rel in ["/app/data", "app/data", "app/./sub/../data", "//app//data"] {
            let mut text = String::new();
            open(&s, rel).unwrap().read_to_string(&mut text).unwrap();
            assert_eq!(text, "container data", "{rel}");
        }
    }

    #[test]
    fn symlinks_in_any_component_are_refused() {
        let s = scene();
        // Absolute and relative symlinks to the host file, as the last component and as a
        // directory on the way, and one through /proc/self (a magic link to the shim's root).
        symlink(s.host.join("secret"), s.root.join("abs")).unwrap();
        symlink("../../host/secret", s.root.join("app/rel")).unwrap();
        symlink(&s.host, s.root.join("hostdir")).unwrap();
        symlink("/proc/self/root", s.root.join("procroot")).unwrap();
        symlink("data", s.root.join("app/inside")).unwrap();
        let secret = s.host.join("secret");
        let via_proc = format!("procroot/{}", secret.strip_prefix("/").unwrap().display());
        for rel in ["abs", "app/rel", "hostdir/secret", &via_proc, "app/inside"] {
            let e = open(&s, rel).expect_err(rel);
            assert!(is_refused(&e), "{rel}: {e}");
        }
        // The last-component symlink itself resolves (as a link, O_NOFOLLOW), but is no file.
        let root = open_root(&s.root).unwrap();
        let h = resolve_beneath(root.as_fd(), Path::new("abs")).unwrap();
        assert_eq!(
            fstat(h.as_fd()).unwrap().st_mode & libc::S_IFMT,
            libc::S_IFLNK
        );
    }

    #[test]
    fn dot_dot_cannot_climb_out_and_absolute_roots_stay_inside() {
        let s = scene();
        let e = open(&s, "app/../../host/secret").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EXDEV), "{e}");
        // A memfd may be called anything: "/memfd:x/../../../<host path> (deleted)".
        let rel = format!("memfd:x/../../..{}", s.host.join("secret").display());
        std::fs::create_dir(s.root.join("memfd:x")).unwrap();
        assert!(open(&s, &rel).is_err());
        // A host path given as a container path names the container's own file (or nothing).
        assert_eq!(
            open(&s, &s.host.join("secret").display().to_string())
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn the_reopened_file_is_the_inode_that_was_checked() {
        let s = scene();
        let root = open_root(&s.root).unwrap();
        let handle = resolve_beneath(root.as_fd(), Path::new("app/data")).unwrap();
        // The container swaps the name for a FIFO after the lookup: the handle still holds the file.
        std::fs::rename(s.root.join("app/data"), s.root.join("app/old")).unwrap();
        nix::unistd::mkfifo(
            &s.root.join("app/data"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let mut f = reopen_regular(handle.as_fd(), libc::O_RDWR).unwrap();
        f.write_all(b"C").unwrap();
        assert_eq!(
            std::fs::read_to_string(s.root.join("app/old")).unwrap(),
            "Container data"
        );
    }

    #[test]
    fn directories_open_beneath_only_as_directories_and_never_through_a_symlink() {
        let s = scene();
        symlink(&s.host, s.root.join("hostdir")).unwrap();
        symlink("app", s.root.join("inside")).unwrap();
        let root = open_root(&s.root).unwrap();
        // The root itself (an O_PATH handle becomes a readable descriptor) and a subdirectory.
        for rel in ["", "app", "app/sub"] {
            let d = open_dir_beneath(root.as_fd(), Path::new(rel)).expect(rel);
            assert_eq!(
                fstat(d.as_fd()).unwrap().st_mode & libc::S_IFMT,
                libc::S_IFDIR
            );
        }
        // A symlink, as the last component or on the way, in or out of the root: refused.
        for rel in ["hostdir", "inside", "inside/sub", "app/../../host"] {
            let e = open_dir_beneath(root.as_fd(), Path::new(rel)).expect_err(rel);
            assert!(
                matches!(
                    e.raw_os_error(),
                    Some(libc::ELOOP | libc::ENOTDIR | libc::EXDEV)
                ),
                "{rel}: {e}"
            );
        }
        let e = open_dir_beneath(root.as_fd(), Path::new("app/data")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR), "{e}");
    }

    #[test]
    fn new_files_beneath_are_new_and_never_made_through_a_symlink() {
        let s = scene();
        symlink(s.host.join("new"), s.root.join("dangling")).unwrap();
        symlink(s.host.join("secret"), s.root.join("secret")).unwrap();
        let root = open_root(&s.root).unwrap();
        for rel in ["dangling", "secret", "app/data"] {
            let e = create_file_beneath(root.as_fd(), Path::new(rel), 0o600).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EEXIST), "{rel}: {e}");
        }
        assert!(!s.host.join("new").exists());
        assert_eq!(
            std::fs::read_to_string(s.host.join("secret")).unwrap(),
            "host secret"
        );
        let e = create_file_beneath(root.as_fd(), Path::new("hostdir/x"), 0o600);
        assert!(e.is_err());
        let mut f = create_file_beneath(root.as_fd(), Path::new("app/new"), 0o600).unwrap();
        f.write_all(b"made").unwrap();
        assert_eq!(
            std::fs::read_to_string(s.root.join("app/new")).unwrap(),
            "made"
        );
    }

    #[test]
    fn process_root_resolves_inside_the_process_view() {
        // Our own root is the host's: /etc/hostname (or another file) is reachable, a symlink
        // component (/proc/self) is not.
        let root = process_root(std::process::id()).unwrap();
        assert!(resolve_beneath(root.as_fd(), Path::new("/proc/self/status")).is_err());
        assert!(resolve_beneath(root.as_fd(), Path::new("/proc")).is_ok());
    }
}

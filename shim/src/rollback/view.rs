//! Changing a container's files through its own view: its root as its init sees it
//! (`/proc/<init>/root`, in its mount namespace), never the overlay's upperdir behind
//! overlayfs' back. overlayfs then does what it does for any write: copies up, makes whiteouts
//! for deleted image files, marks directories opaque.
//!
//! Everything here is hostile ground, even with the container frozen: the container planted
//! what is there. So:
//! - a path's parent is resolved with `openat2(2)` and `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS |
//!   RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV` from the root of the tree it belongs to (the
//!   rootfs, or a tracked volume's mount, checked to be that volume's host directory): no
//!   symlink is followed, nothing outside is reached, and no other mount is crossed (a bind
//!   mount of a host file, `/proc`, an untracked volume: refused with `EXDEV`);
//! - the last component is only ever acted on with `*at` calls that do not follow it
//!   (`fstatat(AT_SYMLINK_NOFOLLOW)`, `unlinkat`, `mkdirat`, `symlinkat`, `mknodat`, `linkat`
//!   without `AT_SYMLINK_FOLLOW`); new files are created with `O_CREAT | O_EXCL | O_NOFOLLOW`
//!   (an existing entry is removed first), so nothing the container left is ever opened for
//!   writing, and nothing but directories is opened at all (a FIFO or a device never is);
//! - removing a tree is iterative, holds one descriptor per level and is bounded in depth and
//!   entries.

use std::{
    ffi::{CStr, CString, OsStr},
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::{ffi::OsStrExt, fs::FileExt},
    },
    path::{Path, PathBuf},
};

use nix::{
    dir::Dir,
    errno::Errno,
    fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag},
    sys::{
        stat::{self, FchmodatFlags, Mode, SFlag, UtimensatFlags},
        time::TimeSpec,
    },
    unistd::{unlinkat, Gid, Uid, UnlinkatFlags},
};

use crate::sys::{beneath, file, xattr};

const RESOLVE: ResolveFlag = ResolveFlag::RESOLVE_BENEATH
    .union(ResolveFlag::RESOLVE_NO_SYMLINKS)
    .union(ResolveFlag::RESOLVE_NO_MAGICLINKS)
    .union(ResolveFlag::RESOLVE_NO_XDEV);

/// Ownership, permissions, time and xattrs to give an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: (i64, i64),
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

/// What kind of special file to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    Char(u32, u32),
    Block(u32, u32),
    Fifo,
}

/// A container's files as its init sees them.
pub struct View {
    root: OwnedFd,
    /// Tracked volumes: (path relative to the root, the volume's mount root).
    volumes: Vec<(PathBuf, OwnedFd)>,
    max_depth: usize,
    max_entries: u64,
    /// Entries removed so far (bounded by `max_entries`).
    removed: u64,
}

fn cname(n: &OsStr) -> io::Result<CString> {
    CString::new(n.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn rel_c(rel: &Path) -> io::Result<CString> {
    match rel.as_os_str().is_empty() {
        true => Ok(CString::new(".").expect("no NUL")),
        false => cname(rel.as_os_str()),
    }
}

fn fstatat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::stat> {
    Ok(stat::fstatat(
        Some(dir.as_raw_fd()),
        name,
        AtFlags::AT_SYMLINK_NOFOLLOW,
    )?)
}

pub fn is_dir(st: &libc::stat) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

fn gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR))
}

impl View {
    /// The view of the container whose init is `pid`, with its tracked volumes (path in the
    /// container, host directory): each is opened in the view and must be that very directory.
    pub fn open(
        pid: u32,
        volumes: &[(PathBuf, PathBuf)],
        max_depth: u32,
        max_entries: u64,
    ) -> io::Result<View> {
        let root = beneath::process_root(pid)?;
        let mut out = View {
            root,
            volumes: Vec::new(),
            max_depth: max_depth as usize,
            max_entries,
            removed: 0,
        };
        for (at, host) in volumes {
            let rel = at.strip_prefix("/").unwrap_or(at).to_path_buf();
            // Reaching the mount root crosses into it: no RESOLVE_NO_XDEV for this one.
            let how = OpenHow::new()
                .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                .resolve(
                    ResolveFlag::RESOLVE_BENEATH
                        | ResolveFlag::RESOLVE_NO_SYMLINKS
                        | ResolveFlag::RESOLVE_NO_MAGICLINKS,
                );
            let fd = file::openat2(out.root.as_raw_fd(), rel_c(&rel)?.as_c_str(), how)?;
            let (a, b) = (
                beneath::fstat(fd.as_fd())?,
                nix::sys::stat::stat(host.as_path())?,
            );
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) {
                return Err(io::Error::other(format!(
                    "{} in the container is not the tracked volume {}",
                    at.display(),
                    host.display()
                )));
            }
            out.volumes.push((rel, fd));
        }
        // The longest first: a volume inside another is its own tree.
        out.volumes
            .sort_by_key(|(p, _)| std::cmp::Reverse(p.components().count()));
        Ok(out)
    }

    /// The view of a container's rootfs at `root` on the host, before anything runs in it
    /// (a resume at Create), without tracked volumes: their content goes into the rootfs,
    /// whence Create refills their host directories.
    pub fn open_dir(root: &Path, max_depth: u32, max_entries: u64) -> io::Result<View> {
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(root)?;
        Ok(View {
            root: OwnedFd::from(dir),
            volumes: Vec::new(),
            max_depth: max_depth as usize,
            max_entries,
            removed: 0,
        })
    }

    /// The tree `rel` belongs to and its path in it.
    fn base<'a>(&'a self, rel: &'a Path) -> (BorrowedFd<'a>, &'a Path) {
        for (at, fd) in &self.volumes {
            if let Ok(inside) = rel.strip_prefix(at) {
                return (fd.as_fd(), inside);
            }
        }
        (self.root.as_fd(), rel)
    }

    /// `meta` as the entry `rel` (not a directory) gets it: in a tracked volume, whose host
    /// directory other containers may mount, without set-uid and set-gid bits (as a restore
    /// refills volumes, `restore::volumes`); elsewhere as it is.
    pub fn file_meta(&self, rel: &Path, meta: &Meta) -> Meta {
        let in_volume = self
            .volumes
            .iter()
            .any(|(at, _)| rel != at && rel.starts_with(at));
        match in_volume {
            true => Meta {
                mode: meta.mode & !(libc::S_ISUID | libc::S_ISGID),
                ..meta.clone()
            },
            false => meta.clone(),
        }
    }

    /// Whether `rel` is a tracked volume's mount point.
    pub fn is_volume_root(&self, rel: &Path) -> bool {
        self.volumes.iter().any(|(at, _)| at == rel)
    }

    /// The directory `rel` of its tree, as an `O_PATH` handle.
    fn dir_handle(&self, rel: &Path) -> io::Result<OwnedFd> {
        let (base, inside) = self.base(rel);
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC)
            .resolve(RESOLVE);
        loop {
            match file::openat2(base, rel_c(inside)?.as_c_str(), how) {
                Ok(fd) => return Ok(fd),
                Err(Errno::EAGAIN | Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// The parent directory of `rel` (resolved safely) and its last component.
    fn parent(&self, rel: &Path) -> io::Result<(OwnedFd, CString)> {
        let name = rel
            .file_name()
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        let parent = rel.parent().unwrap_or(Path::new(""));
        Ok((self.dir_handle(parent)?, cname(name)?))
    }

    /// `lstat` of `rel`; `None` if it (or a directory above it) is not there.
    pub fn lstat(&self, rel: &Path) -> io::Result<Option<libc::stat>> {
        if rel.as_os_str().is_empty() || self.is_volume_root(rel) {
            return Ok(Some(beneath::fstat(self.dir_handle(rel)?.as_fd())?));
        }
        let (dir, name) = match self.parent(rel) {
            Ok(p) => p,
            Err(e) if gone(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        match fstatat(dir.as_fd(), &name) {
            Ok(st) => Ok(Some(st)),
            Err(e) if gone(&e) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The names in directory `rel`, as paths below it.
    pub fn children(&self, rel: &Path) -> io::Result<Vec<PathBuf>> {
        let h = self.dir_handle(rel)?;
        let mut dir = Dir::openat(
            Some(h.as_raw_fd()),
            ".",
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        let mut out = Vec::new();
        for e in dir.iter() {
            let e = e?;
            let n = e.file_name().to_bytes();
            if n == b"." || n == b".." {
                continue;
            }
            if out.len() as u64 >= self.max_entries {
                return Err(io::Error::other(format!(
                    "{} holds more than {} entries",
                    rel.display(),
                    self.max_entries
                )));
            }
            out.push(rel.join(OsStr::from_bytes(n)));
        }
        out.sort();
        Ok(out)
    }

    /// Removes `rel` whatever it is (a directory with everything below it); nothing if absent.
    pub fn remove(&mut self, rel: &Path) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        let st = match fstatat(dir.as_fd(), &name) {
            Ok(st) => st,
            Err(e) if gone(&e) => return Ok(()),
            Err(e) => return Err(e),
        };
        self.count_removed(rel)?;
        if !is_dir(&st) {
            return Ok(unlinkat(
                Some(dir.as_raw_fd()),
                name.as_c_str(),
                UnlinkatFlags::NoRemoveDir,
            )?);
        }
        self.remove_tree(dir.as_fd(), &name, rel)
    }

    fn count_removed(&mut self, rel: &Path) -> io::Result<()> {
        self.removed += 1;
        if self.removed > self.max_entries {
            return Err(io::Error::other(format!(
                "more than {} entries to remove (at {})",
                self.max_entries,
                rel.display()
            )));
        }
        Ok(())
    }

    /// Removes directory `name` of `parent` and its content: depth first with an explicit
    /// stack, one descriptor per level.
    fn remove_tree(&mut self, parent: BorrowedFd<'_>, name: &CStr, rel: &Path) -> io::Result<()> {
        struct Frame {
            dir: OwnedFd,
            name: CString,
            names: std::vec::IntoIter<CString>,
        }
        let open = |at: BorrowedFd<'_>, n: &CStr| -> io::Result<Frame> {
            let how = OpenHow::new()
                .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                .resolve(RESOLVE);
            let fd = file::openat2(at, n, how)?;
            // The stream gets its own descriptor (it closes it); `fd` stays the frame's base.
            let mut d = Dir::from_fd(nix::unistd::dup(fd.as_raw_fd())?)?;
            let mut names = Vec::new();
            for e in d.iter() {
                let e = e?;
                let b = e.file_name().to_bytes();
                if b != b"." && b != b".." {
                    names.push(e.file_name().to_owned());
                }
            }
            Ok(Frame {
                dir: fd,
                name: n.to_owned(),
                names: names.into_iter(),
            })
        };
        let mut stack = vec![open(parent, name)?];
        loop {
            let depth = stack.len();
            let Some(top) = stack.last_mut() else {
                return Ok(());
            };
            match top.names.next() {
                Some(n) => {
                    let st = match fstatat(top.dir.as_fd(), &n) {
                        Ok(st) => st,
                        Err(e) if gone(&e) => continue,
                        Err(e) => return Err(e),
                    };
                    self.count_removed(rel)?;
                    if is_dir(&st) {
                        if depth >= self.max_depth {
                            return Err(io::Error::other(format!(
                                "{} is nested deeper than {} levels",
                                rel.display(),
                                self.max_depth
                            )));
                        }
                        let child = open(top.dir.as_fd(), &n)?;
                        stack.push(child);
                    } else {
                        unlinkat(
                            Some(top.dir.as_raw_fd()),
                            n.as_c_str(),
                            UnlinkatFlags::NoRemoveDir,
                        )?;
                    }
                }
                None => {
                    let done = stack.pop().expect("a frame");
                    let at = stack.last().map_or(parent, |f| f.dir.as_fd());
                    unlinkat(
                        Some(at.as_raw_fd()),
                        done.name.as_c_str(),
                        UnlinkatFlags::RemoveDir,
                    )?;
                }
            }
        }
    }

    /// Makes directory `rel` (its parent must be there) with `meta`.
    pub fn mkdir(&self, rel: &Path, meta: &Meta) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        stat::mkdirat(Some(dir.as_raw_fd()), name.as_c_str(), Mode::S_IRWXU)?;
        self.set_dir_meta(rel, meta)
    }

    /// Gives the existing directory `rel` the owner, mode and xattrs of `meta` (its other
    /// xattrs are removed). A tracked volume's mount point is left as it is.
    pub fn set_dir_meta(&self, rel: &Path, meta: &Meta) -> io::Result<()> {
        if self.is_volume_root(rel) {
            return Ok(());
        }
        let (base, inside) = self.base(rel);
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(RESOLVE);
        let fd = file::openat2(base, rel_c(inside)?.as_c_str(), how)?;
        let f = File::from(fd);
        set_fd_meta(&f, meta, true)
    }

    /// Creates the regular file `rel` (nothing may be there) for writing its data; then
    /// [`finish_file`] gives it `meta`.
    pub fn create_file(&self, rel: &Path) -> io::Result<File> {
        let (dir, name) = self.parent(rel)?;
        let flags =
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_WRONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let mode = Mode::S_IRUSR | Mode::S_IWUSR;
        Ok(File::from(file::create_at(
            dir,
            name.as_c_str(),
            flags,
            mode,
        )?))
    }

    /// Makes symlink `rel` to `target` with `meta`'s owner, time and xattrs.
    pub fn symlink(&self, rel: &Path, target: &Path, meta: &Meta) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        let t = cname(target.as_os_str())?;
        nix::unistd::symlinkat(t.as_c_str(), Some(dir.as_raw_fd()), name.as_c_str())?;
        self.set_nofollow_meta(dir.as_fd(), &name, meta, false)
    }

    /// Makes the device node or FIFO `rel` with `meta`.
    pub fn mknod(&self, rel: &Path, kind: Special, meta: &Meta) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        let (fmt, dev) = match kind {
            Special::Char(ma, mi) => (SFlag::S_IFCHR, libc::makedev(ma, mi)),
            Special::Block(ma, mi) => (SFlag::S_IFBLK, libc::makedev(ma, mi)),
            Special::Fifo => (SFlag::S_IFIFO, 0),
        };
        let mode = Mode::S_IRUSR | Mode::S_IWUSR;
        stat::mknodat(Some(dir.as_raw_fd()), name.as_c_str(), fmt, mode, dev)?;
        self.set_nofollow_meta(dir.as_fd(), &name, meta, true)
    }

    /// Makes `rel` a hard link of `to` (both in the same tree).
    pub fn link(&self, rel: &Path, to: &Path) -> io::Result<()> {
        let (dir, name) = self.parent(rel)?;
        let (tdir, tname) = self.parent(to)?;
        // No AT_SYMLINK_FOLLOW: a symlink `to` is linked itself.
        Ok(nix::unistd::linkat(
            Some(tdir.as_raw_fd()),
            tname.as_c_str(),
            Some(dir.as_raw_fd()),
            name.as_c_str(),
            AtFlags::empty(),
        )?)
    }

    /// Owner, mode (not for symlinks), xattrs and time of entry `name` of `dir`, which the
    /// rollback just made (the container is frozen: it cannot have swapped it).
    fn set_nofollow_meta(
        &self,
        dir: BorrowedFd<'_>,
        name: &CStr,
        meta: &Meta,
        chmod: bool,
    ) -> io::Result<()> {
        let (uid, gid) = owner(meta);
        nix::unistd::fchownat(
            Some(dir.as_raw_fd()),
            name,
            Some(uid),
            Some(gid),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )?;
        if chmod {
            // fchmodat follows a symlink, and this entry is none.
            let follow = FchmodatFlags::FollowSymlink;
            stat::fchmodat(Some(dir.as_raw_fd()), name, perms(meta), follow)?;
        }
        let mut via = format!("/proc/self/fd/{}/", dir.as_raw_fd()).into_bytes();
        via.extend_from_slice(name.to_bytes());
        let via = CString::new(via).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        for (k, v) in &meta.xattrs {
            let k = CString::new(k.as_slice())
                .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            xattr::Target::Path(&via).set(&k, v)?;
        }
        let t = time(meta);
        let nofollow = UtimensatFlags::NoFollowSymlink;
        Ok(stat::utimensat(
            Some(dir.as_raw_fd()),
            name,
            &t,
            &t,
            nofollow,
        )?)
    }
}

/// The access and modification time an entry gets: `meta`'s mtime.
fn time(meta: &Meta) -> TimeSpec {
    TimeSpec::new(meta.mtime.0, meta.mtime.1)
}

fn owner(meta: &Meta) -> (Uid, Gid) {
    (Uid::from_raw(meta.uid), Gid::from_raw(meta.gid))
}

/// The permission bits of `meta`'s mode (set-uid, set-gid and sticky included).
fn perms(meta: &Meta) -> Mode {
    Mode::from_bits_truncate(meta.mode & 0o7777)
}

/// Gives the open file or directory `f` the owner, mode, xattrs and time of `meta`; with
/// `exact`, xattrs it has and `meta` does not are removed.
fn set_fd_meta(f: &File, meta: &Meta, exact: bool) -> io::Result<()> {
    let fd = f.as_raw_fd();
    let (uid, gid) = owner(meta);
    nix::unistd::fchown(fd, Some(uid), Some(gid))?;
    stat::fchmod(fd, perms(meta))?;
    let target = xattr::Target::Fd(fd);
    if exact {
        let have = target.list()?;
        for name in have.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            if meta.xattrs.iter().any(|(k, _)| k == name) {
                continue;
            }
            let Ok(c) = CString::new(name) else { continue };
            match target.remove(&c) {
                Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
                r => r?,
            }
        }
    }
    for (k, v) in &meta.xattrs {
        let k =
            CString::new(k.as_slice()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        target.set(&k, v)?;
    }
    let t = time(meta);
    Ok(stat::futimens(fd, &t, &t)?)
}

/// Gives a file made by [`View::create_file`], its data written, its `meta` (owner and mode
/// after the data: writing would drop a capability, chown the setuid bit).
pub fn finish_file(f: &File, meta: &Meta) -> io::Result<()> {
    set_fd_meta(f, meta, false)
}

/// Writes a sparse file's extents (`data` their bytes one after the other) and sets its size.
pub fn write_sparse(
    f: &File,
    size: u64,
    extents: &[(u64, u64)],
    data: &mut impl io::Read,
) -> io::Result<()> {
    f.set_len(size)?;
    let mut buf = vec![0u8; 1 << 16];
    for &(mut off, mut len) in extents {
        while len > 0 {
            let n = len.min(buf.len() as u64) as usize;
            data.read_exact(&mut buf[..n])?;
            f.write_all_at(&buf[..n], off)?;
            off += n as u64;
            len -= n as u64;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{FileExt, MetadataExt};

    use super::*;

    fn meta(mode: u32, xattrs: &[(&str, &str)]) -> Meta {
        Meta {
            mode,
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            mtime: (1_000_000, 5),
            xattrs: xattrs
                .iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect(),
        }
    }

    /// Every kind of entry the rollback makes, made through a view of a directory, reads back
    /// with its type, mode bits, time and xattrs; an existing name is never reused by a create;
    /// a tree goes with one remove, and what is absent is `None`.
    #[test]
    fn entries_made_through_the_view_read_back_and_a_tree_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        // xattrs only where the filesystem keeps user ones.
        let xattrs = xattr::lset(&root, "user.crab.old", b"o").is_ok();
        let x: &[(&str, &str)] = if xattrs { &[("user.crab", "v")] } else { &[] };
        let mut view = View::open_dir(&root, 8, 100).unwrap();
        let p = Path::new;

        view.mkdir(p("d"), &meta(0o1750, x)).unwrap();
        let mut f = view.create_file(p("d/f")).unwrap();
        io::Write::write_all(&mut f, b"data").unwrap();
        finish_file(&f, &meta(0o640, x)).unwrap();
        drop(f);
        let again = view.create_file(p("d/f")).map(drop).unwrap_err();
        assert_eq!(again.raw_os_error(), Some(libc::EEXIST), "{again}");
        view.symlink(p("d/l"), p("f"), &meta(0o777, &[])).unwrap();
        view.mknod(p("d/p"), Special::Fifo, &meta(0o604, &[]))
            .unwrap();
        view.link(p("d/h"), p("d/f")).unwrap();
        view.set_dir_meta(p(""), &meta(0o755, x)).unwrap();

        let st = |rel: &str| view.lstat(p(rel)).unwrap().unwrap();
        let (d, f, l, fifo) = (st("d"), st("d/f"), st("d/l"), st("d/p"));
        assert!(is_dir(&d));
        assert_eq!(d.st_mode & 0o7777, 0o1750);
        assert_eq!(f.st_mode & libc::S_IFMT, libc::S_IFREG);
        assert_eq!((f.st_mode & 0o7777, f.st_size, f.st_nlink), (0o640, 4, 2));
        assert_eq!(l.st_mode & libc::S_IFMT, libc::S_IFLNK);
        assert_eq!(std::fs::read_link(root.join("d/l")).unwrap(), p("f"));
        assert_eq!(
            (fifo.st_mode & libc::S_IFMT, fifo.st_mode & 0o7777),
            (libc::S_IFIFO, 0o604)
        );
        for s in [&f, &l, &fifo] {
            assert_eq!((s.st_mtime, s.st_mtime_nsec), (1_000_000, 5));
        }
        if xattrs {
            let c = CString::new(root.as_os_str().as_bytes()).unwrap();
            let top = xattr::Target::Path(&c);
            assert_eq!(top.get(c"user.crab.old").unwrap(), None, "exact: removed");
            assert_eq!(top.get(c"user.crab").unwrap(), Some(b"v".to_vec()));
            let c = CString::new(root.join("d/f").as_os_str().as_bytes()).unwrap();
            let file = xattr::Target::Path(&c);
            assert_eq!(file.get(c"user.crab").unwrap(), Some(b"v".to_vec()));
        }
        assert_eq!(
            view.children(p("d")).unwrap(),
            ["d/f", "d/h", "d/l", "d/p"].map(PathBuf::from)
        );
        assert!(view.lstat(p("d/none")).unwrap().is_none());
        assert!(view.lstat(p("none/x")).unwrap().is_none());

        view.remove(p("d")).unwrap();
        assert!(view.lstat(p("d")).unwrap().is_none());
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
        view.remove(p("d")).unwrap();
    }

    /// An in-place rollback writes a sparse file's extents only: a terabyte with a few bytes
    /// of data stays a few blocks on disk (unlike containerd's differ, which writes the holes
    /// as zeros), with the same size and bytes.
    #[test]
    fn sparse_files_are_written_with_their_holes() {
        const TB: u64 = 1 << 40;
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join("huge"))
            .unwrap();
        let extents = [(0, 4), (300 << 30, 6), (TB - 4, 4)];
        let mut data: &[u8] = b"headmiddletail";
        write_sparse(&f, TB, &extents, &mut data).unwrap();
        assert!(data.is_empty(), "every byte of data was written");
        let md = f.metadata().unwrap();
        assert_eq!(md.len(), TB);
        assert!(md.blocks() * 512 < 1 << 20, "{} blocks", md.blocks());
        let at = |off: u64, n: usize| {
            let mut buf = vec![0u8; n];
            f.read_exact_at(&mut buf, off).unwrap();
            buf
        };
        assert_eq!(at(0, 4), b"head");
        assert_eq!(at(300 << 30, 6), b"middle");
        assert_eq!(at(TB - 4, 4), b"tail");
        assert_eq!(at(1 << 30, 8), [0u8; 8]);
    }
}

//! Tracked volumes brought back from a checkpoint: a container started from a checkpoint whose
//! layers hold a tracked volume's contents (below the volume's path in the rootfs) gets them
//! in the volume's host directory before its processes run, so that the bind mount shows the
//! volume as it was at that checkpoint (rollback, recovery, fork and `run` of an exported
//! image all start containers this way).
//!
//! Both sides are hostile. The rootfs comes from a checkpoint image. The host directory may be
//! shared with running containers (a volume two containers mount), which can create, rename,
//! swap and replace entries while the refill runs. So both are walked through directory
//! descriptors only, never through a path string resolved again from a root:
//! - The host directory is opened once (`O_PATH | O_DIRECTORY | O_NOFOLLOW`, then a descriptor
//!   that can be read); the rootfs likewise, and the volume's path is resolved beneath it with
//!   no symlink in any component (the image's `/workspace -> /etc` would otherwise copy the
//!   host's `/etc` into the volume); what does not resolve that way restores as empty.
//! - Every entry is made relative to its parent's descriptor: `mkdirat`, then the new
//!   directory opened with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)`
//!   ([`crate::sys::beneath::open_dir_beneath`]) and checked with `fstat` to be the directory
//!   just made (a directory, on the volume's device, owned by the shim); files with
//!   `O_CREAT | O_EXCL | O_NOFOLLOW` the same way; owners, modes and times set through the
//!   new entry's descriptor (`fchown`, `fchmod`, `futimens`; a symlink's owner through an
//!   `O_PATH` handle checked to be that link). The emptying removes entries with `unlinkat`
//!   relative to their parent's descriptor and descends only through directories opened the
//!   same way, so it never follows a symlink or enters another mount.
//! - An entry swapped for a symlink or replaced by another mount fails with an error naming
//!   it ([`VolumeRestoreError::Replaced`]); nothing is ever written outside the volume's
//!   directory. Whatever a concurrent writer moves around stays where its own mount lets it:
//!   inside the volume (`rename(2)` does not cross mounts), or, for a container that mounts a
//!   parent directory of the volume, inside that directory, which it can write anyway.
//!
//! What is copied: directories, regular files and symlinks (as links, never followed), with
//! their owners, permission bits and modification times. Devices, FIFOs and sockets are left
//! out (a device node in a host directory would outlive the container's device rules), and so
//! are extended attributes (file capabilities included) and hard links (each name becomes a
//! file of its own). The host directory outlives the container, so the set-uid and set-gid
//! bits of files are dropped; directories keep set-gid (new files there take the directory's
//! group, which gives no privilege) and the sticky bit. The walk is bounded in depth and in
//! entries, emptying and refill alike, by the limits of a tracked volume's manifest (`[limits]
//! max_walk_depth`, `max_manifest_entries`): a volume a checkpoint could hold fits.
//!
//! On failure the directory holds what was refilled so far (directories not finished are
//! left `0700` and owned by the shim), all of it inside the directory; the container is not
//! created, and the next refill empties it again.
//!
//! Refilling a directory another running container has mounted is not refused: its mounts live
//! in its own mount namespace, which the shim cannot list cheaply or without a race (a
//! container may mount the directory right after a check), and a process may hold the
//! directory open without any mount. What that container can do to the refill is make it fail
//! (Create fails naming the entry) or interleave its own writes with it; what it cannot do is
//! make the shim write outside the directory, or find set-uid or set-gid files in it.

use std::{
    ffi::{CString, OsStr},
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use nix::{
    errno::Errno,
    fcntl::{readlinkat, AtFlags},
    sys::{
        stat::{fchmod, fstatat, futimens, mkdirat, utimensat, Mode, UtimensatFlags},
        time::TimeSpec,
    },
    unistd::{fchown, fchownat, symlinkat, unlinkat, Gid, Uid, UnlinkatFlags},
};

use crate::sys::{beneath, file};

/// How far a refill may go (`[limits]` in crab's config, the bounds of a tracked volume's
/// manifest at capture).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeLimits {
    /// Entries copied into the directory, and entries removed from it, each.
    pub max_entries: u64,
    /// Directory levels below the volume's root; the walk holds two descriptors per level.
    pub max_depth: u32,
}

impl VolumeLimits {
    pub fn from_config(c: &crab_runtime_config::LimitsConfig) -> VolumeLimits {
        VolumeLimits {
            max_entries: c.max_manifest_entries,
            max_depth: c.max_walk_depth,
        }
    }
}

impl Default for VolumeLimits {
    fn default() -> Self {
        VolumeLimits::from_config(&crab_runtime_config::LimitsConfig::default())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum VolumeRestoreError {
    /// A call on one entry failed; `entry` is its path in the container (`/workspace/a.py`).
    #[error("restoring volume {at} into {dir}: {what} {entry}: {source}")]
    Io {
        at: PathBuf,
        dir: PathBuf,
        what: &'static str,
        entry: PathBuf,
        #[source]
        source: io::Error,
    },
    /// An entry of the host directory changed under the refill: something else (a container
    /// sharing the volume) writes into it. The refill stops there.
    #[error(
        "restoring volume {at} into {dir}: {entry} {why}: something else is writing into the \
         volume's directory (another container sharing it?); the refill stopped there"
    )]
    Replaced {
        at: PathBuf,
        dir: PathBuf,
        entry: PathBuf,
        why: String,
    },
    #[error(
        "restoring volume {at} into {dir}: {what} (at {entry}) exceed the limit of {limit} \
         ([limits] {key})"
    )]
    Limit {
        at: PathBuf,
        dir: PathBuf,
        entry: PathBuf,
        what: String,
        limit: u64,
        key: &'static str,
    },
}

/// What a restore copied.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Copied {
    pub files: u64,
    pub bytes: u64,
    /// Entries left out (devices, FIFOs, sockets).
    pub skipped: u64,
}

/// Makes host directory `dir` (the source of the bind mount at `at`) hold exactly what `at`
/// holds in the restored rootfs `root`: its entries are removed, then those are copied in with
/// their modes (less set-uid and set-gid on files), owners and modification times, as the
/// module docs describe. `at` is resolved beneath `root` with no symlink in any component;
/// what does not resolve that way restores as empty.
pub fn restore_volume(
    at: &Path,
    root: &Path,
    dir: &Path,
    limits: VolumeLimits,
) -> Result<Copied, VolumeRestoreError> {
    let mut r = Refill {
        at,
        dir,
        limits,
        entries: 0,
        dev: 0,
        euid: nix::unistd::geteuid().as_raw(),
        copied: Copied::default(),
    };
    let here = Path::new("");
    // The host directory: its path resolved this once, everything below through descriptors.
    let handle = beneath::open_root_nofollow(dir).map_err(r.io("opening", here))?;
    let volume = beneath::open_dir_beneath(handle.as_fd(), here).map_err(r.io("opening", here))?;
    r.dev = beneath::fstat(volume.as_fd())
        .map_err(r.io("reading", here))?
        .st_dev;
    // The source is opened before anything is removed: a rootfs that cannot be read empties
    // nothing.
    let rootfs = beneath::open_root(root).map_err(r.io("opening the rootfs for", here))?;
    let rel = at.strip_prefix("/").unwrap_or(at);
    let source = match beneath::open_dir_beneath(rootfs.as_fd(), rel) {
        Ok(fd) => Some(fd),
        // The layers hold nothing there (an empty volume whose directory the image lacks).
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            log::warn!(
                "restoring volume {}: not a directory beneath the rootfs {} with no symlink \
                 on the way ({e}): the volume restores as empty",
                at.display(),
                root.display()
            );
            None
        }
    };
    r.empty(beneath::open_dir_beneath(handle.as_fd(), here).map_err(r.io("opening", here))?)?;
    r.entries = 0;
    if let Some(source) = source {
        r.copy(source, volume)?;
    }
    Ok(r.copied)
}

/// One refill: the volume, its bounds, and what was done so far.
struct Refill<'a> {
    at: &'a Path,
    dir: &'a Path,
    limits: VolumeLimits,
    /// Entries seen by the current walk (emptying, then copying).
    entries: u64,
    /// The device of the volume's directory: every directory the refill makes is on it.
    dev: u64,
    /// Who owns what the refill makes until it sets the image's owner.
    euid: u32,
    copied: Copied,
}

/// A directory being emptied: its descriptor (the base of `*at` calls), the names left, its
/// path below the volume's root and its name in its parent (none for the root).
struct Emptying {
    dir: OwnedFd,
    names: std::vec::IntoIter<CString>,
    rel: PathBuf,
    name: Option<CString>,
}

/// A directory being copied: both descriptors, the names left, its path below the volume's
/// root and the source directory's attributes (set on the copy once it is complete).
struct Copying {
    from: OwnedFd,
    to: OwnedFd,
    names: std::vec::IntoIter<CString>,
    rel: PathBuf,
    st: libc::stat,
}

fn as_path(name: &CString) -> &Path {
    Path::new(OsStr::from_bytes(name.to_bytes()))
}

impl Refill<'_> {
    /// `rel` (below the volume's root) as the container sees it.
    fn entry(&self, rel: &Path) -> PathBuf {
        if rel.as_os_str().is_empty() {
            self.at.to_path_buf()
        } else {
            self.at.join(rel)
        }
    }

    fn io(&self, what: &'static str, rel: &Path) -> impl FnOnce(io::Error) -> VolumeRestoreError {
        let (at, dir, entry) = (
            self.at.to_path_buf(),
            self.dir.to_path_buf(),
            self.entry(rel),
        );
        move |source| VolumeRestoreError::Io {
            at,
            dir,
            what,
            entry,
            source,
        }
    }

    fn replaced(&self, rel: &Path, why: impl Into<String>) -> VolumeRestoreError {
        VolumeRestoreError::Replaced {
            at: self.at.to_path_buf(),
            dir: self.dir.to_path_buf(),
            entry: self.entry(rel),
            why: why.into(),
        }
    }

    /// The error of opening `rel` of the host directory beneath its parent: a symlink or
    /// another mount in its place, or anything but a directory, means it was replaced.
    fn open_failed(
        &self,
        what: &'static str,
        rel: &Path,
    ) -> impl FnOnce(io::Error) -> VolumeRestoreError + '_ {
        let rel = rel.to_path_buf();
        move |e| match e.raw_os_error() {
            Some(libc::ELOOP) => self.replaced(&rel, "was replaced by a symlink"),
            Some(libc::EXDEV) => self.replaced(&rel, "is another mount"),
            Some(libc::ENOTDIR) => self.replaced(
                &rel,
                "was replaced by something not a directory (a symlink, a file)",
            ),
            Some(libc::ENOENT) => self.replaced(&rel, "or its directory was removed"),
            Some(libc::EEXIST) => self.replaced(&rel, "was made by something else first"),
            _ => self.io(what, &rel)(e),
        }
    }

    fn limit(&self, rel: &Path, what: String, limit: u64, key: &'static str) -> VolumeRestoreError {
        VolumeRestoreError::Limit {
            at: self.at.to_path_buf(),
            dir: self.dir.to_path_buf(),
            entry: self.entry(rel),
            what,
            limit,
            key,
        }
    }

    fn too_many(&self, rel: &Path) -> VolumeRestoreError {
        let max = self.limits.max_entries;
        self.limit(
            rel,
            format!("more than {max} entries"),
            max,
            "max_manifest_entries",
        )
    }

    /// The names in `dir` (the directory `rel`), counted against the entry bound.
    fn names(
        &mut self,
        dir: BorrowedFd<'_>,
        rel: &Path,
    ) -> Result<std::vec::IntoIter<CString>, VolumeRestoreError> {
        let room = self.limits.max_entries.saturating_sub(self.entries);
        let mut names = file::dir_names_bounded(dir, room)
            .map_err(self.io("listing", rel))?
            .ok_or_else(|| self.too_many(rel))?;
        self.entries += names.len() as u64;
        names.sort_unstable();
        Ok(names.into_iter())
    }

    /// Fails unless a directory below `depth` levels may be entered.
    fn descend(&self, depth: usize, rel: &Path) -> Result<(), VolumeRestoreError> {
        let max = self.limits.max_depth;
        if depth > max as usize {
            return Err(self.limit(
                rel,
                format!("directories nested deeper than {max} levels"),
                max.into(),
                "max_walk_depth",
            ));
        }
        Ok(())
    }

    /// Removes everything in the directory `root` (the volume's), depth first in name order.
    fn empty(&mut self, root: OwnedFd) -> Result<(), VolumeRestoreError> {
        let names = self.names(root.as_fd(), Path::new(""))?;
        let mut stack = vec![Emptying {
            dir: root,
            names,
            rel: PathBuf::new(),
            name: None,
        }];
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.names.next() else {
                let done = stack.pop().expect("the stack is not empty");
                let (Some(name), Some(parent)) = (done.name, stack.last()) else {
                    continue;
                };
                drop(done.dir);
                match unlinkat(
                    Some(parent.dir.as_raw_fd()),
                    name.as_c_str(),
                    UnlinkatFlags::RemoveDir,
                ) {
                    Ok(()) | Err(Errno::ENOENT) => {}
                    Err(e) => return Err(self.io("removing directory", &done.rel)(e.into())),
                }
                continue;
            };
            let rel = top.rel.join(as_path(&name));
            // Anything but a directory goes at once (a symlink as itself); EISDIR says it is one.
            match unlinkat(
                Some(top.dir.as_raw_fd()),
                name.as_c_str(),
                UnlinkatFlags::NoRemoveDir,
            ) {
                Ok(()) | Err(Errno::ENOENT) => continue,
                Err(Errno::EISDIR) => {}
                Err(e) => return Err(self.io("removing", &rel)(e.into())),
            }
            let depth = stack.len();
            self.descend(depth, &rel)?;
            let top = stack.last().expect("the stack is not empty");
            let dir = match beneath::open_dir_beneath(top.dir.as_fd(), as_path(&name)) {
                Ok(dir) => dir,
                // Gone already: so much the better.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(self.open_failed("opening", &rel)(e)),
            };
            let names = self.names(dir.as_fd(), &rel)?;
            stack.push(Emptying {
                dir,
                names,
                rel,
                name: Some(name),
            });
        }
        Ok(())
    }

    /// Copies the directory `from` (of the rootfs) into `to` (the volume's), depth first in
    /// name order; `to` takes `from`'s attributes last.
    fn copy(&mut self, from: OwnedFd, to: OwnedFd) -> Result<(), VolumeRestoreError> {
        let here = Path::new("");
        let st = beneath::fstat(from.as_fd()).map_err(self.io("reading", here))?;
        let names = self.names(from.as_fd(), here)?;
        let mut stack = vec![Copying {
            from,
            to,
            names,
            rel: PathBuf::new(),
            st,
        }];
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.names.next() else {
                let done = stack.pop().expect("the stack is not empty");
                set_attrs(done.to.as_fd(), &done.st, true)
                    .map_err(self.io("setting the owner, mode and times of", &done.rel))?;
                continue;
            };
            let rel = top.rel.join(as_path(&name));
            let from = top.from.as_raw_fd();
            let st = fstatat(Some(from), name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
                .map_err(|e| self.io("reading", &rel)(e.into()))?;
            match st.st_mode & libc::S_IFMT {
                libc::S_IFDIR => {
                    self.descend(stack.len(), &rel)?;
                    let top = stack.last().expect("the stack is not empty");
                    let child = self.make_dir(top.from.as_fd(), top.to.as_fd(), &name, &rel)?;
                    let (from, to) = child;
                    let names = self.names(from.as_fd(), &rel)?;
                    stack.push(Copying {
                        from,
                        to,
                        names,
                        rel,
                        st,
                    });
                }
                libc::S_IFREG => {
                    let top = stack.last().expect("the stack is not empty");
                    let bytes =
                        self.copy_file(top.from.as_fd(), top.to.as_fd(), &name, &st, &rel)?;
                    self.copied.files += 1;
                    self.copied.bytes += bytes;
                }
                libc::S_IFLNK => {
                    let top = stack.last().expect("the stack is not empty");
                    self.copy_symlink(top.from.as_fd(), top.to.as_fd(), &name, &st, &rel)?;
                }
                _ => {
                    log::warn!(
                        "restoring volume {}: {} is not a file, directory or symlink: left out",
                        self.at.display(),
                        self.entry(&rel).display()
                    );
                    self.copied.skipped += 1;
                }
            }
        }
        Ok(())
    }

    /// Makes directory `name` in `to` for the one in `from`: both come back open, the new one
    /// checked to be the directory just made.
    fn make_dir(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        name: &CString,
        rel: &Path,
    ) -> Result<(OwnedFd, OwnedFd), VolumeRestoreError> {
        let source =
            beneath::open_dir_beneath(from, as_path(name)).map_err(self.io("opening", rel))?;
        mkdirat(Some(to.as_raw_fd()), name.as_c_str(), Mode::S_IRWXU)
            .map_err(|e| self.open_failed("creating directory", rel)(e.into()))?;
        let made = beneath::open_dir_beneath(to, as_path(name))
            .map_err(self.open_failed("opening the new directory", rel))?;
        let st = beneath::fstat(made.as_fd()).map_err(self.io("reading", rel))?;
        if st.st_dev != self.dev {
            return Err(self.replaced(rel, "is on another filesystem than the volume"));
        }
        if st.st_uid != self.euid {
            return Err(self.replaced(
                rel,
                format!(
                    "is owned by uid {}: not the directory the refill made",
                    st.st_uid
                ),
            ));
        }
        Ok((source, made))
    }

    /// Copies regular file `name` of `from` into a new file of `to`; returns the bytes copied.
    fn copy_file(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        name: &CString,
        st: &libc::stat,
        rel: &Path,
    ) -> Result<u64, VolumeRestoreError> {
        let mut input = beneath::open_regular_beneath(from, as_path(name), libc::O_RDONLY)
            .map_err(self.io("opening", rel))?;
        let mut out = beneath::create_file_beneath(to, as_path(name), 0o600)
            .map_err(self.open_failed("creating", rel))?;
        let bytes = io::copy(&mut input, &mut out).map_err(self.io("copying", rel))?;
        set_attrs(out.as_fd(), st, false)
            .map_err(self.io("setting the owner, mode and times of", rel))?;
        Ok(bytes)
    }

    /// Makes symlink `name` in `to` as the one in `from` (its target as it is, never followed).
    fn copy_symlink(
        &self,
        from: BorrowedFd<'_>,
        to: BorrowedFd<'_>,
        name: &CString,
        st: &libc::stat,
        rel: &Path,
    ) -> Result<(), VolumeRestoreError> {
        let target = readlinkat(Some(from.as_raw_fd()), name.as_c_str())
            .map_err(|e| self.io("reading", rel)(e.into()))?;
        symlinkat(target.as_os_str(), Some(to.as_raw_fd()), name.as_c_str())
            .map_err(|e| self.open_failed("creating symlink", rel)(e.into()))?;
        // Its owner is set through a handle on the link itself, checked to be the one just made.
        let link = beneath::resolve_beneath(to, as_path(name))
            .map_err(self.open_failed("opening", rel))?;
        let made = beneath::fstat(link.as_fd()).map_err(self.io("reading", rel))?;
        if made.st_mode & libc::S_IFMT != libc::S_IFLNK
            || made.st_uid != self.euid
            || made.st_nlink != 1
        {
            return Err(self.replaced(rel, "is no longer the symlink the refill made"));
        }
        fchownat(
            Some(link.as_raw_fd()),
            "",
            Some(Uid::from_raw(st.st_uid)),
            Some(Gid::from_raw(st.st_gid)),
            AtFlags::AT_EMPTY_PATH | AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io("setting the owner of", rel)(e.into()))?;
        // Times: by name in the parent, never following (at worst another entry of the volume's).
        utimensat(
            Some(to.as_raw_fd()),
            name.as_c_str(),
            &TimeSpec::UTIME_OMIT,
            &mtime(st),
            UtimensatFlags::NoFollowSymlink,
        )
        .map_err(|e| self.io("setting the times of", rel)(e.into()))?;
        Ok(())
    }
}

fn mtime(st: &libc::stat) -> TimeSpec {
    TimeSpec::new(st.st_mtime, st.st_mtime_nsec)
}

/// The permission bits a copy keeps: set-uid never, set-gid on directories only.
fn kept_mode(st: &libc::stat, dir: bool) -> u32 {
    let drop = if dir {
        libc::S_ISUID
    } else {
        libc::S_ISUID | libc::S_ISGID
    };
    st.st_mode & 0o7777 & !drop
}

/// Gives the new entry open at `fd` the owner, kept mode and modification time of `st`: owner
/// first (a change of owner clears set-id bits), then the mode.
fn set_attrs(fd: BorrowedFd<'_>, st: &libc::stat, dir: bool) -> io::Result<()> {
    let fd = fd.as_raw_fd();
    fchown(
        fd,
        Some(Uid::from_raw(st.st_uid)),
        Some(Gid::from_raw(st.st_gid)),
    )?;
    fchmod(fd, Mode::from_bits_retain(kept_mode(st, dir)))?;
    futimens(fd, &TimeSpec::UTIME_OMIT, &mtime(st))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{
        fs,
        os::unix::fs::{symlink, MetadataExt, PermissionsExt},
    };

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn files_lose_set_uid_and_set_gid_directories_keep_set_gid_and_sticky() {
        let t = tempfile::tempdir().unwrap();
        let (from, dir) = (t.path().join("root/w"), t.path().join("dir"));
        fs::create_dir_all(from.join("shared")).unwrap();
        fs::create_dir_all(&dir).unwrap();
        for (name, m) in [
            ("suid", 0o4755),
            ("sgid", 0o2755),
            ("both", 0o6711),
            ("plain", 0o640),
        ] {
            fs::write(from.join(name), name).unwrap();
            fs::set_permissions(from.join(name), fs::Permissions::from_mode(m)).unwrap();
        }
        fs::set_permissions(from.join("shared"), fs::Permissions::from_mode(0o3775)).unwrap();
        // The volume's own root takes the mode of the image's directory, set-gid and sticky kept.
        fs::set_permissions(&from, fs::Permissions::from_mode(0o3777)).unwrap();
        let c = restore_volume(
            Path::new("/w"),
            &t.path().join("root"),
            &dir,
            VolumeLimits::default(),
        )
        .unwrap();
        assert_eq!(c.files, 4);
        assert_eq!(mode(&dir.join("suid")), 0o755);
        assert_eq!(mode(&dir.join("sgid")), 0o755);
        assert_eq!(mode(&dir.join("both")), 0o711);
        assert_eq!(mode(&dir.join("plain")), 0o640);
        assert_eq!(fs::read(dir.join("both")).unwrap(), b"both");
        assert_eq!(mode(&dir.join("shared")), 0o3775);
        assert_eq!(mode(&dir), 0o3777);
    }

    #[test]
    fn fifos_and_sockets_are_left_out_and_links_out_stay_links() {
        let t = tempfile::tempdir().unwrap();
        let (root, dir, outside) = (
            t.path().join("root"),
            t.path().join("dir"),
            t.path().join("outside"),
        );
        let from = root.join("w");
        fs::create_dir_all(from.join("d")).unwrap();
        fs::create_dir_all(&dir).unwrap();
        fs::create_dir_all(&outside).unwrap();
        fs::write(outside.join("host-file"), b"host").unwrap();
        nix::unistd::mkfifo(&from.join("d/fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let _socket = std::os::unix::net::UnixListener::bind(from.join("sock")).unwrap();
        symlink(&outside, from.join("out")).unwrap();
        symlink(outside.join("host-file"), from.join("d/out-file")).unwrap();
        // Symlinks as the rootfs holds them are copied as links, and never entered: a link
        // to a directory is no directory to the walk.
        let c = restore_volume(Path::new("/w"), &root, &dir, VolumeLimits::default()).unwrap();
        assert_eq!(
            c,
            Copied {
                files: 0,
                bytes: 0,
                skipped: 2
            }
        );
        assert_eq!(names(&dir), ["d", "out"]);
        assert_eq!(names(&dir.join("d")), ["out-file"]);
        assert_eq!(fs::read_link(dir.join("out")).unwrap(), outside);
        assert_eq!(names(&outside), ["host-file"]);
        assert_eq!(fs::read(outside.join("host-file")).unwrap(), b"host");
    }

    #[test]
    fn emptying_removes_links_as_links_and_never_enters_them() {
        let t = tempfile::tempdir().unwrap();
        let (dir, outside) = (t.path().join("dir"), t.path().join("outside"));
        fs::create_dir_all(outside.join("sub")).unwrap();
        fs::write(outside.join("sub/keep"), b"host").unwrap();
        // What a co-tenant left in the volume: links to a host directory at the top and deep
        // down, and a deep tree of its own.
        let deep = dir.join("a/b/c/d/e");
        fs::create_dir_all(&deep).unwrap();
        fs::write(deep.join("f"), b"x").unwrap();
        symlink(&outside, dir.join("link")).unwrap();
        symlink(&outside, deep.join("link")).unwrap();
        symlink("../../../../../../outside/sub", dir.join("a/b/rel")).unwrap();
        let c = restore_volume(Path::new("/w"), t.path(), &dir, VolumeLimits::default()).unwrap();
        assert_eq!(c, Copied::default());
        assert!(names(&dir).is_empty());
        assert_eq!(names(&outside), ["sub"]);
        assert_eq!(names(&outside.join("sub")), ["keep"]);
    }

    #[test]
    fn deep_and_wide_trees_are_bounded_and_the_error_names_the_entry() {
        let t = tempfile::tempdir().unwrap();
        let (root, dir) = (t.path().join("root"), t.path().join("dir"));
        let deep: PathBuf = (0..12).map(|i| format!("l{i}")).collect();
        fs::create_dir_all(root.join("w").join(&deep)).unwrap();
        fs::create_dir_all(&dir).unwrap();
        let limits = VolumeLimits {
            max_entries: 1000,
            max_depth: 8,
        };
        // Refill: the ninth level is refused, named.
        let e = restore_volume(Path::new("/w"), &root, &dir, limits).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("deeper than 8 levels"), "{e}");
        assert!(e.contains("/w/l0/l1/l2/l3/l4/l5/l6/l7/l8"), "{e}");
        assert!(e.contains("[limits] max_walk_depth"), "{e}");
        // What was made stays inside the directory: the first eight levels.
        assert!(dir.join("l0/l1/l2/l3/l4/l5/l6/l7").is_dir());
        assert!(!dir.join("l0/l1/l2/l3/l4/l5/l6/l7/l8").exists());
        // Emptying is bounded the same way.
        fs::create_dir_all(dir.join(&deep)).unwrap();
        let e = restore_volume(Path::new("/none"), &root, &dir, limits).unwrap_err();
        assert!(e.to_string().contains("deeper than 8 levels"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
        fs::create_dir_all(&dir).unwrap();
        // Entries: 1000 fit, 1001 do not (refill and emptying alike).
        let wide = root.join("wide");
        fs::create_dir_all(wide.join("sub")).unwrap();
        for i in 0..999 {
            fs::write(wide.join("sub").join(i.to_string()), b"").unwrap();
        }
        let c = restore_volume(Path::new("/wide"), &root, &dir, limits).unwrap();
        assert_eq!(c.files, 999);
        fs::write(wide.join("one-more"), b"").unwrap();
        let e = restore_volume(Path::new("/wide"), &root, &dir, limits).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("more than 1000 entries"), "{e}");
        assert!(e.contains("[limits] max_manifest_entries"), "{e}");
        // The failed refill left "one-more" and an empty "sub": 999 more make 1001.
        assert_eq!(names(&dir), ["one-more", "sub"]);
        for i in 0..999 {
            fs::write(dir.join("sub").join(i.to_string()), b"").unwrap();
        }
        let e = restore_volume(Path::new("/none"), &root, &dir, limits).unwrap_err();
        assert!(e.to_string().contains("more than 1000 entries"), "{e}");
        // It stopped at "sub" (listed after "one-more", which went): 1000 entries left fit.
        assert_eq!(names(&dir), ["sub"]);
        restore_volume(Path::new("/none"), &root, &dir, limits).unwrap();
        assert!(names(&dir).is_empty());
    }

    #[test]
    fn the_directory_ends_up_holding_exactly_the_checkpoints_tree() {
        let t = tempfile::tempdir().unwrap();
        let (from, dir) = (t.path().join("root/workspace"), t.path().join("dir"));
        fs::create_dir_all(from.join("src/deep")).unwrap();
        fs::write(from.join("src/deep/a.py"), b"print(1)\n").unwrap();
        fs::set_permissions(
            from.join("src/deep/a.py"),
            fs::Permissions::from_mode(0o751),
        )
        .unwrap();
        symlink("deep/a.py", from.join("src/link")).unwrap();
        // A link out of the tree stays a link: never followed.
        symlink("/etc/shadow", from.join("shadow")).unwrap();
        nix::unistd::mkfifo(&from.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        fs::create_dir_all(dir.join("later/x")).unwrap();
        fs::write(dir.join("after-the-checkpoint"), b"gone").unwrap();
        symlink("/", dir.join("root-link")).unwrap();

        let c = restore_volume(
            Path::new("/workspace"),
            &t.path().join("root"),
            &dir,
            VolumeLimits::default(),
        )
        .unwrap();
        assert_eq!(
            c,
            Copied {
                files: 1,
                bytes: 9,
                skipped: 1
            }
        );
        let mut names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["shadow", "src"]);
        assert_eq!(fs::read(dir.join("src/deep/a.py")).unwrap(), b"print(1)\n");
        let mode = fs::metadata(dir.join("src/deep/a.py")).unwrap().mode() & 0o7777;
        assert_eq!(mode, 0o751);
        assert_eq!(
            fs::read_link(dir.join("src/link")).unwrap(),
            Path::new("deep/a.py")
        );
        assert_eq!(
            fs::read_link(dir.join("shadow")).unwrap(),
            Path::new("/etc/shadow")
        );
        // The old link to / was removed as a link, not followed.
        assert!(Path::new("/etc").is_dir());
    }

    #[test]
    fn a_volume_path_through_a_symlink_in_the_image_is_never_followed() {
        // The image makes /workspace (or a parent of it) a link to a host directory: nothing
        // of that directory may reach the volume.
        let t = tempfile::tempdir().unwrap();
        let (root, outside, dir) = (
            t.path().join("root"),
            t.path().join("outside"),
            t.path().join("dir"),
        );
        fs::create_dir_all(outside.join("workspace")).unwrap();
        fs::write(outside.join("secret"), b"host").unwrap();
        fs::write(outside.join("workspace/secret"), b"host").unwrap();
        fs::create_dir_all(&root).unwrap();
        fs::create_dir_all(&dir).unwrap();
        symlink(&outside, root.join("workspace")).unwrap();
        symlink(&outside, root.join("parent")).unwrap();
        for at in ["/workspace", "/parent/workspace"] {
            let c = restore_volume(Path::new(at), &root, &dir, VolumeLimits::default()).unwrap();
            assert_eq!(c, Copied::default(), "{at}");
            assert_eq!(fs::read_dir(&dir).unwrap().count(), 0, "{at}");
        }
    }

    #[test]
    fn nothing_in_the_checkpoint_empties_the_directory() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("dir");
        fs::create_dir_all(dir.join("a")).unwrap();
        let c = restore_volume(Path::new("/w"), t.path(), &dir, VolumeLimits::default()).unwrap();
        assert_eq!(c, Copied::default());
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 0);
        // A file where the host directory should be is refused.
        fs::write(t.path().join("file"), b"").unwrap();
        let e = restore_volume(
            Path::new("/dir"),
            t.path(),
            &t.path().join("file"),
            VolumeLimits::default(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("Not a directory"), "{e}");
    }

    /// A container sharing the volume (here a thread) that, as soon as the refill makes a
    /// directory, swaps it for a symlink to a host directory outside every volume (an atomic
    /// `RENAME_EXCHANGE`, watched with inotify): nothing may ever be created in that directory.
    /// The refill either fails naming a swapped entry or completes inside the volume.
    #[test]
    fn a_co_tenant_swapping_new_directories_for_symlinks_gets_nothing_written_outside() {
        use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
        use std::sync::{
            atomic::{AtomicBool, Ordering},
            Arc, Mutex,
        };
        const DIRS: usize = 2000;
        let t = tempfile::tempdir().unwrap();
        let (root, dir, outside) = (
            t.path().join("root"),
            t.path().join("dir"),
            t.path().join("outside"),
        );
        let from = root.join("workspace");
        for i in 0..DIRS {
            let d = from.join(format!("d{i:04}"));
            fs::create_dir_all(d.join("sub")).unwrap();
            for f in 0..4 {
                fs::write(d.join(format!("f{f}")), b"x").unwrap();
            }
            fs::set_permissions(d.join("f0"), fs::Permissions::from_mode(0o4755)).unwrap();
            fs::write(d.join("sub/g"), b"y").unwrap();
        }
        fs::create_dir(&dir).unwrap();
        // Laid out as the image's directories are, so that a write through a swapped parent
        // at any depth lands (the path-based refill this module had before wrote 1 to 3 files
        // here in each of 21 runs, then failed).
        fs::create_dir_all(outside.join("sub")).unwrap();

        for round in 0..3 {
            let stop = Arc::new(AtomicBool::new(false));
            let swapped = Arc::new(Mutex::new(Vec::<String>::new()));
            let inotify = Inotify::init(InitFlags::IN_CLOEXEC).unwrap();
            inotify.add_watch(&dir, AddWatchFlags::IN_CREATE).unwrap();
            let co_tenant = {
                let (stop, swapped, dir, outside) =
                    (stop.clone(), swapped.clone(), dir.clone(), outside.clone());
                std::thread::spawn(move || {
                    let mut n = 0;
                    while !stop.load(Ordering::SeqCst) {
                        for ev in inotify.read_events().unwrap() {
                            let Some(name) = ev.name.and_then(|n| n.into_string().ok()) else {
                                continue;
                            };
                            // Only while the refill runs: every swap counted raced it.
                            if !ev.mask.contains(AddWatchFlags::IN_ISDIR)
                                || !name.starts_with('d')
                                || stop.load(Ordering::SeqCst)
                            {
                                continue;
                            }
                            let link = dir.join(format!(".link{n}"));
                            n += 1;
                            symlink(&outside, &link).unwrap();
                            let swap = nix::fcntl::renameat2(
                                None,
                                &link,
                                None,
                                &dir.join(&name),
                                nix::fcntl::RenameFlags::RENAME_EXCHANGE,
                            );
                            if swap.is_ok() {
                                swapped.lock().unwrap().push(name);
                            }
                        }
                    }
                })
            };
            let r = restore_volume(
                Path::new("/workspace"),
                &root,
                &dir,
                VolumeLimits::default(),
            );
            stop.store(true, Ordering::SeqCst);
            // Wakes the co-tenant's read (a file: never swapped).
            fs::write(dir.join(".wake"), b"").unwrap();
            co_tenant.join().unwrap();
            let swapped = swapped.lock().unwrap().clone();
            assert!(
                !swapped.is_empty(),
                "round {round}: the co-tenant never won a race"
            );
            let leaked: Vec<_> = walk_names(&outside)
                .into_iter()
                .filter(|p| p != &outside.join("sub"))
                .collect();
            assert!(
                leaked.is_empty(),
                "round {round}: {} entries created outside the volume (after {} swaps), e.g. \
                 {:?}",
                leaked.len(),
                swapped.len(),
                &leaked[..leaked.len().min(5)]
            );
            let mut top: Vec<_> = fs::read_dir(t.path())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            top.sort();
            assert_eq!(top, ["dir", "outside", "root"], "round {round}");
            match r {
                Ok(c) => {
                    // Every file landed in the volume (some below the names the co-tenant
                    // gave the directories it swapped out), besides the wake-up file.
                    let files = walk_names(&dir)
                        .iter()
                        .filter(|p| fs::symlink_metadata(p).unwrap().is_file())
                        .count();
                    assert_eq!(c.files, 5 * DIRS as u64, "round {round}");
                    assert_eq!(files as u64, c.files + 1, "round {round}");
                    eprintln!(
                        "round {round}: completed after {} swaps: {c:?}",
                        swapped.len()
                    );
                }
                Err(e) => {
                    let e = e.to_string();
                    assert!(
                        swapped.iter().any(|s| e.contains(&format!("/{s}"))),
                        "round {round}: the error names no swapped entry: {e}"
                    );
                    eprintln!("round {round}: failed after {} swaps: {e}", swapped.len());
                }
            }
        }
    }

    /// Every path below `dir` (not following symlinks).
    fn walk_names(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if fs::symlink_metadata(&p).unwrap().is_dir() {
                out.extend(walk_names(&p));
            }
            out.push(p);
        }
        out
    }
}

//! What an observation scans beside the processes: the upperdir, the tracked volumes and the
//! tmpfs mounts, and the shared writable mappings of files it arms before a scan.

use std::{
    ffi::OsStr,
    os::{
        fd::{AsFd, BorrowedFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

use crate::sys::beneath;

use super::{
    fs::{self, TreeManifest},
    procs::{self, ProcInfo},
    InspectError, Inspection, MAX_TMPFS_MOUNTS,
};

impl Inspection {
    /// Manifests of the container's tmpfs mounts (as the first of `processes` sees them), by
    /// mount point. Files created, written or truncated there are counted by the probes (the
    /// `tmpfs` class); entries only renamed, linked, removed, made as directories or nodes, or
    /// changed in their metadata go through syscalls that name a path the probes do not
    /// resolve: a turn with such a syscall compares these manifests. Each mount is opened
    /// beneath the process's root (no symlink followed, nothing above the root) and walked
    /// without entering the mounts below it; a mount point that is no directory (a file bind
    /// mount) or that is gone is left out.
    pub(super) fn scan_tmpfs(
        &self,
        processes: &[ProcInfo],
    ) -> Result<Vec<(PathBuf, TreeManifest)>, InspectError> {
        use std::os::fd::AsFd;
        let Some(p) = processes.first() else {
            return Ok(Vec::new());
        };
        let mounts =
            match crate::sys::mountinfo::read(Path::new(&format!("/proc/{}/mountinfo", p.pid))) {
                Ok(m) => m,
                // Gone meanwhile: the process comparison says so.
                Err(_) => return Ok(Vec::new()),
            };
        let mut points: Vec<PathBuf> = mounts
            .into_iter()
            .filter(|m| m.fstype == "tmpfs" && m.mount_point != Path::new("/"))
            .map(|m| m.mount_point)
            .collect();
        points.sort();
        points.dedup();
        if points.is_empty() {
            return Ok(Vec::new());
        }
        // A container allowed to mount could make any number: past the bound the turn is
        // unobserved (degraded, answered full), never a long walk.
        if points.len() > MAX_TMPFS_MOUNTS {
            return Err(InspectError::TooManyTmpfs(points.len()));
        }
        let root_path = format!("/proc/{}/root", p.pid);
        let flags = nix::fcntl::OFlag::O_PATH
            | nix::fcntl::OFlag::O_DIRECTORY
            | nix::fcntl::OFlag::O_CLOEXEC;
        let root = match crate::sys::file::open(root_path.as_str(), flags) {
            Ok(fd) => fd,
            Err(_) => return Ok(Vec::new()),
        };
        let limits: fs::ScanLimits = (&self.target.limits).into();
        let mut out = Vec::with_capacity(points.len());
        for at in points {
            let rel = at.strip_prefix("/").unwrap_or(&at);
            let dir = crate::sys::beneath::resolve_beneath(root.as_fd(), rel)
                .and_then(|p| crate::sys::beneath::open_dir_beneath(p.as_fd(), Path::new("")));
            let dir = match dir {
                Ok(d) => d,
                Err(e) => {
                    log::debug!(
                        "inspector for {}: tmpfs mount {} left out: {e}",
                        self.target.container_id,
                        at.display()
                    );
                    continue;
                }
            };
            let manifest = TreeManifest::scan_one_fs(dir, &at, &limits).map_err(|source| {
                InspectError::ScanTmpfs {
                    at: at.clone(),
                    source,
                }
            })?;
            out.push((at, manifest));
        }
        Ok(out)
    }

    pub(super) fn scan_volumes(&self) -> Result<Vec<TreeManifest>, InspectError> {
        self.target
            .volumes
            .iter()
            .map(|(at, dir)| {
                TreeManifest::scan_with(
                    dir,
                    &(&self.target.limits).into(),
                    fs::OverlayXattrs::Trusted,
                )
                .map_err(|source| InspectError::ScanVolume {
                    at: at.clone(),
                    dir: dir.clone(),
                    source,
                })
            })
            .collect()
    }

    pub(super) fn scan_upper(&self) -> Result<TreeManifest, InspectError> {
        match &self.target.upperdir {
            Some(upper) => TreeManifest::scan_with(
                upper,
                &(&self.target.limits).into(),
                self.target.overlay_xattrs,
            )
            .map_err(|source| InspectError::ScanUpper {
                upper: upper.clone(),
                source,
            }),
            None => Err(InspectError::NotOverlay),
        }
    }

    /// Stores into a page that is already dirty in a shared writable mapping leave no trace
    /// in the file's times until writeback; writing those pages back now makes the next store
    /// fault and move mtime, so the scan after this (and the next turn's) sees it.
    ///
    /// Returns why the turn cannot be fully observed: a shared writable mapping of a file on a
    /// tree crab tracks (the rootfs overlay, a tracked volume) that could not be armed, so that
    /// stores into it may leave no trace. Those make the answer `full`, never a missed change.
    ///
    /// The path a process's maps print is the container's to choose (a memfd is named by its
    /// creator, slashes and `..` included, and the container can plant anything at that name in
    /// its upperdir: a device node, a FIFO, a symlink to a host file). So:
    /// - which file is mapped is decided by identity, not by name: the name must lead, in the
    ///   process's own view (`/proc/PID/root`, no symlinks, nothing opened), to the very inode the
    ///   maps line names (device and inode number). A memfd, SysV or tmpfs object (its memory is
    ///   hashed by [`memory`] through `/proc/PID/map_files`, the object itself) or a file on an
    ///   untracked mount is not armed; a file on a tracked tree whose name leads elsewhere
    ///   (unlinked, renamed, replaced) cannot be armed and is reported.
    /// - the host file is then opened beneath the upperdir or volume with
    ///   [`fs::arm_shared_mapping`]: no symlinks, no `..` above it, regular files only.
    ///
    /// Why not arm through `/proc/PID/map_files/<range>`, which is the mapped file itself? On
    /// an overlay it is the overlay's file, whose page cache is empty (the pages live in the
    /// upper file's): `sync_file_range` on it writes nothing back. The upper file has to be
    /// found by its path beneath the upperdir; the identity check above is what makes that
    /// path trustworthy.
    pub(super) fn arm_shared_mappings(&self) -> Vec<String> {
        let Some(upper) = &self.target.upperdir else {
            return Vec::new();
        };
        // Tracked trees: (path in the container, host root handle, device in the container's view).
        let mut roots: Vec<(PathBuf, OwnedFd)> = Vec::new();
        for (at, dir) in std::iter::once((Path::new("/"), upper.as_path())).chain(
            self.target
                .volumes
                .iter()
                .map(|(a, d)| (a.as_path(), d.as_path())),
        ) {
            match beneath::open_root(dir) {
                Ok(fd) => roots.push((at.to_path_buf(), fd)),
                Err(e) => log::debug!("arm shared mappings: cannot open {}: {e}", dir.display()),
            }
        }
        let Ok(processes) = self.processes() else {
            return Vec::new();
        };
        // Reasons are kept for the first few mappings only: the count of mappings is the
        // container's to choose, the size of an answer is not.
        const SAID: usize = 8;
        let mut unseen = Vec::new();
        let mut more = 0usize;
        let mut note = |why: String| {
            if unseen.len() < SAID {
                unseen.push(why)
            } else {
                more += 1
            }
        };
        for p in processes {
            let Ok(maps) = procs::read_maps(p.pid) else {
                continue;
            };
            let mut shared = maps
                .iter()
                .filter(|m| {
                    m.perms[3] == b's'
                        && m.perms[1] == b'w'
                        && m.inode != 0
                        && m.path.starts_with(b"/")
                })
                .peekable();
            if shared.peek().is_none() {
                continue;
            }
            // The process's view; if it is gone, so are its mappings.
            let Ok(view) = beneath::process_root(p.pid) else {
                continue;
            };
            let tracked: Vec<(&Path, BorrowedFd<'_>, Option<u64>)> = roots
                .iter()
                .map(|(at, fd)| {
                    (
                        at.as_path(),
                        fd.as_fd(),
                        procs::identity_in_view(view.as_fd(), at)
                            .ok()
                            .map(|(dev, _)| dev),
                    )
                })
                .collect();
            for m in shared {
                let path = PathBuf::from(OsStr::from_bytes(&procs::unescape_maps_path(&m.path)));
                match locate_mapping(view.as_fd(), &path, procs::maps_dev(m), m.inode, &tracked) {
                    Mapped::Tracked(root, rel) => {
                        if let Err(e) = fs::arm_shared_mapping(root, &rel) {
                            note(format!("pid {} maps {} shared and writable, and it cannot be armed: {e}", p.pid, path.display()));
                        }
                    }
                    Mapped::Untracked => {}
                    Mapped::Unreachable => note(format!(
                        "pid {} maps a file shared and writable whose name {:?} no longer leads to it (unlinked, renamed or replaced): its stores may leave no trace",
                        p.pid,
                        path.display()
                    )),
                }
            }
        }
        if more > 0 {
            unseen.push(format!(
                "{more} more shared writable mappings that cannot be armed"
            ));
        }
        unseen
    }
}

/// Where the file of a shared writable mapping lives, as far as arming is concerned.
#[derive(Debug)]
pub(super) enum Mapped<'a> {
    /// On a tracked tree: the host root it lies beneath and its path relative to it.
    Tracked(BorrowedFd<'a>, PathBuf),
    /// Not on a tracked tree (shared memory objects, other mounts): nothing to arm.
    Untracked,
    /// On a tracked tree, but its printed name does not lead to it.
    Unreachable,
}

/// Decides [`Mapped`] for the mapping of inode `(dev, ino)` printed as `path`, in the process
/// view `view`, given the tracked trees `(path in the container, host root, device in the view)`.
/// A tree mounted inside another (a volume under `/`) wins by the longer prefix.
pub(super) fn locate_mapping<'a>(
    view: BorrowedFd<'_>,
    path: &Path,
    dev: Option<u64>,
    ino: u64,
    tracked: &[(&Path, BorrowedFd<'a>, Option<u64>)],
) -> Mapped<'a> {
    let Some(dev) = dev else {
        return Mapped::Untracked;
    };
    let on_tracked_device = tracked.iter().any(|t| t.2 == Some(dev));
    if procs::identity_in_view(view, path).ok() != Some((dev, ino)) {
        return if on_tracked_device {
            Mapped::Unreachable
        } else {
            Mapped::Untracked
        };
    }
    let tree = tracked
        .iter()
        .filter(|t| path.starts_with(t.0))
        .max_by_key(|t| t.0.components().count());
    match tree {
        Some(&(at, root, Some(tree_dev))) if tree_dev == dev => {
            Mapped::Tracked(root, path.strip_prefix(at).unwrap_or(path).to_path_buf())
        }
        _ => Mapped::Untracked,
    }
}

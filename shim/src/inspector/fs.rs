//! Net filesystem change of a container since the last mark.
//!
//! Everything a container writes lands in its overlay upperdir, so a [`TreeManifest`] of the upperdir
//! (one walk, `lstat` per entry, xattrs only where overlayfs keeps its state) taken at each mark,
//! and a [`diff`] of two manifests, gives the exact net change: a temp file that came and went
//! between two marks is simply absent from both.
//!
//! Rules of [`diff`] (zero false negatives; a rare false positive is acceptable):
//! - Non-directories are compared on kind, mode, owner, size, mtime, ctime, inode, rdev and
//!   symlink target. ctime moves on every write, truncate, chmod, chown, xattr change, touch and
//!   link-count change, and a rename-over (`sed -i`) brings a new inode.
//! - Directories are compared on kind, mode, owner, inode, opaqueness, redirect and their xattrs
//!   (read for every directory: a directory's ctime also moves when an entry is created or
//!   removed in it, so ctime cannot tell `setfattr` apart from a temp file). Directory
//!   timestamps and sizes are ignored.
//! - A directory new in the upperdir that equals the directory the lower layers show at that
//!   path (kind, mode, owner, xattrs; not opaque, no redirect) was only copied up because
//!   something happened below it: not a change by itself.
//! - Whiteouts (char 0:0, or a zero-size regular file with an `overlay.whiteout` xattr) mean the
//!   lower path was deleted; two whiteouts at the same path are always equal (overlayfs may
//!   hard-link all whiteouts to one shared inode, so their ino/nlink/ctime move).
//! - Paths in [`FsDiff`] are container paths (`/etc/x`), sorted, parents before children.
//!   A deleted directory is reported once (its whiteout); its lower content is implied.
//!
//! Limits, for whoever takes the marks:
//! - Scan a quiescent container (frozen, or between turns): a rename racing the walk can hide
//!   an entry from it. Entries that vanish mid-walk are skipped, never an error.
//! - Stores through a `MAP_SHARED` mapping into a page already dirty at the mark move no
//!   timestamp until writeback: arm such files at the mark with [`arm_shared_mapping`].
//! - Directory timestamps are not state here (`touch` on a directory alone is not a change).
//! - Same-size rewrites rely on mtime/ctime moving; kernels with multigrain timestamps (6.13+,
//!   ext4/xfs/btrfs/tmpfs) guarantee that right after a `stat`, older ones only per tick.

use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr, OsString};
use std::fmt::Write as _;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{readlinkat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, lstat};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::sys::{file, xattr};

/// Errors of a manifest scan. Any of them means the upperdir could not be observed: the caller
/// must treat the turn as "everything changed".
#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("path contains a NUL byte: {0}")]
    NulInPath(PathBuf),
    /// The tree is bigger than the shim may hold for one container ([`ScanLimits`]).
    #[error(
        "{root}: {what} exceed the limit of {limit} ([limits] {key}); the tree is not captured"
    )]
    Limit {
        root: PathBuf,
        what: String,
        limit: u64,
        key: &'static str,
    },
}

/// Bounds on one manifest walk (`[limits]` in crab's config): the walk is iterative, so these,
/// not the thread's stack or `RLIMIT_NOFILE`, bound what a container's tree costs the shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanLimits {
    pub max_entries: u64,
    /// Bytes of all entry paths (relative to the root), summed.
    pub max_path_bytes: u64,
    /// Directory levels below the root; the walk holds one fd per level.
    pub max_depth: u32,
}

impl Default for ScanLimits {
    fn default() -> Self {
        let c = crab_runtime_config::LimitsConfig::default();
        ScanLimits::from(&c)
    }
}

impl From<&crab_runtime_config::LimitsConfig> for ScanLimits {
    fn from(c: &crab_runtime_config::LimitsConfig) -> Self {
        ScanLimits {
            max_entries: c.max_manifest_entries,
            max_path_bytes: c.max_manifest_path_bytes,
            max_depth: c.max_walk_depth,
        }
    }
}

/// Where overlayfs keeps its own state on a mount: `trusted.overlay.*`, or `user.overlay.*`
/// when mounted with `userxattr`. Only that prefix is overlay state; the other one is an
/// ordinary xattr the container set (without `userxattr` a container can set
/// `user.overlay.opaque` on its own files, and overlayfs ignores it: so must crab).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OverlayXattrs {
    #[default]
    Trusted,
    User,
}

impl OverlayXattrs {
    /// From the overlay mount's options.
    pub fn of_mount(mount_options: &[String]) -> OverlayXattrs {
        if mount_options.iter().any(|o| o == "userxattr") {
            OverlayXattrs::User
        } else {
            OverlayXattrs::Trusted
        }
    }

    pub fn prefix(self) -> &'static [u8] {
        match self {
            OverlayXattrs::Trusted => b"trusted.overlay.",
            OverlayXattrs::User => b"user.overlay.",
        }
    }

    /// The overlay attribute `name` stands for (`opaque` for `trusted.overlay.opaque`), if it
    /// is overlay state on this mount; `*.overlay.overlay.*` is an escaped container xattr.
    pub fn overlay_name(self, name: &[u8]) -> Option<&[u8]> {
        name.strip_prefix(self.prefix())
            .filter(|rest| !rest.starts_with(b"overlay."))
    }
}

impl FsError {
    fn io(op: &'static str, path: &Path, source: io::Error) -> FsError {
        FsError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What an upperdir entry is. Whiteouts get their own kind so that their device number and
/// shared inode never count as a change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    CharDev,
    BlockDev,
    Fifo,
    Socket,
    Whiteout,
}

/// Metadata of one upperdir entry, as `lstat` sees it on the upper filesystem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntryMeta {
    pub kind: EntryKind,
    /// Permission bits including setuid/setgid/sticky (`st_mode & 0o7777`).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub ino: u64,
    pub nlink: u64,
    pub rdev: u64,
    #[serde(
        default,
        with = "escaped_opt_path",
        skip_serializing_if = "Option::is_none"
    )]
    pub symlink: Option<PathBuf>,
    /// Directory with `overlay.opaque` = `y`: the lower content at this path is hidden.
    #[serde(default, skip_serializing_if = "is_false")]
    pub opaque: bool,
    /// Directory with an `overlay.redirect` xattr (a lower directory renamed with redirect_dir).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redirect: Option<Vec<u8>>,
    /// Directories only: xattrs other than overlayfs' own bookkeeping, sorted by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Relative path (`""` is the upperdir itself) -> metadata, for every entry of an upperdir (or
/// a tracked volume), sorted in `Path` order (component-wise: parents first, then each subtree
/// in name order). The state of one tree at a mark; not a checkpoint's manifest (that is
/// `checkpoint::store::Manifest`).
///
/// Serialises as a sequence of `(path, meta)`; paths are strings with `%` and bytes that are not
/// UTF-8 percent-escaped, so non-UTF-8 names survive any serde format.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeManifest {
    // A depth-first walk that visits siblings in byte order produces exactly `Path` order, so
    // a sorted Vec costs no comparisons to build (a BTreeMap's component-wise compares did).
    entries: Vec<(PathBuf, EntryMeta)>,
    /// Which xattrs were overlay state when it was scanned (not stored: a stored manifest is
    /// read as `trusted`, which a container cannot set).
    xattrs: OverlayXattrs,
}

impl TreeManifest {
    /// Walks `upperdir` once. Directories are opened relative to their parent with `O_NOFOLLOW`,
    /// so a container swapping a directory for a symlink mid-scan cannot lead the walk outside.
    /// Entries that vanish during the walk are skipped (the container may be running).
    pub fn scan(upperdir: &Path) -> Result<TreeManifest, FsError> {
        TreeManifest::scan_with(upperdir, &ScanLimits::default(), OverlayXattrs::Trusted)
    }

    /// [`TreeManifest::scan`] within `limits`, reading overlay state from `xattrs`' prefix.
    pub fn scan_with(
        upperdir: &Path,
        limits: &ScanLimits,
        xattrs: OverlayXattrs,
    ) -> Result<TreeManifest, FsError> {
        let c_root = cstring(upperdir.as_os_str())?;
        let fd = file::open(c_root.as_c_str(), DIR_FLAGS)
            .map_err(|e| FsError::io("open", upperdir, e.into()))?;
        let root = Dir::from(fd).map_err(|e| FsError::io("opendir", upperdir, e.into()))?;
        TreeManifest::scan_root(root, upperdir, limits, xattrs, false)
    }

    /// The manifest of the directory open at `dir` (`label` names it in errors), as
    /// [`TreeManifest::scan_with`] walks, but not into directories of another filesystem:
    /// mount points below it are left out whole (for a container's tmpfs mounts, whose
    /// mounts inside, such as `/dev/pts` in `/dev`, are their own business).
    pub fn scan_one_fs(
        dir: std::os::fd::OwnedFd,
        label: &Path,
        limits: &ScanLimits,
    ) -> Result<TreeManifest, FsError> {
        let root = Dir::from(dir).map_err(|e| FsError::io("opendir", label, e.into()))?;
        TreeManifest::scan_root(root, label, limits, OverlayXattrs::Trusted, true)
    }

    fn scan_root(
        root: Dir,
        upperdir: &Path,
        limits: &ScanLimits,
        xattrs: OverlayXattrs,
        one_fs: bool,
    ) -> Result<TreeManifest, FsError> {
        let st = fstat(root.as_raw_fd()).map_err(|e| FsError::io("stat", upperdir, e.into()))?;
        let dx = dir_xattrs(&xattr::Target::Fd(root.as_raw_fd()), xattrs)
            .map_err(|e| FsError::io("listxattr", upperdir, e))?;
        let mut manifest = TreeManifest {
            xattrs,
            ..TreeManifest::default()
        };
        manifest
            .entries
            .push((PathBuf::new(), EntryMeta::from_stat(&st, None, dx)));
        let mut walker = Walker {
            upperdir,
            entries: &mut manifest.entries,
            limits,
            xattrs,
            path_bytes: 0,
            one_dev: one_fs.then_some(st.st_dev),
        };
        walker.walk(root)?;
        Ok(manifest)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entry at `rel` (relative to the upperdir, `""` for its root).
    pub fn get(&self, rel: &Path) -> Option<&EntryMeta> {
        self.entries
            .binary_search_by(|(p, _)| p.as_path().cmp(rel))
            .ok()
            .map(|i| &self.entries[i].1)
    }

    /// All entries in path order (parents before their children).
    pub fn iter(&self) -> impl Iterator<Item = (&Path, &EntryMeta)> {
        self.entries.iter().map(|(p, m)| (p.as_path(), m))
    }
}

impl Serialize for TreeManifest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(
            self.entries
                .iter()
                .map(|(p, m)| (escape_bytes(p.as_os_str().as_bytes()), m)),
        )
    }
}

impl<'de> Deserialize<'de> for TreeManifest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let list: Vec<(String, EntryMeta)> = Vec::deserialize(d)?;
        let mut entries = Vec::with_capacity(list.len());
        for (path, meta) in list {
            let bytes = unescape_bytes(&path).map_err(serde::de::Error::custom)?;
            entries.push((PathBuf::from(OsString::from_vec(bytes)), meta));
        }
        // Stored manifests are written sorted; sorting again keeps `get` and `diff` correct
        // whatever wrote them.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries.dedup_by(|a, b| a.0 == b.0);
        Ok(TreeManifest {
            entries,
            xattrs: OverlayXattrs::Trusted,
        })
    }
}

/// Net change between two manifests, as container paths.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FsDiff {
    pub added: Vec<PathBuf>,
    pub modified: Vec<PathBuf>,
    pub deleted: Vec<PathBuf>,
}

impl FsDiff {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.modified.is_empty() && self.deleted.is_empty()
    }

    pub fn len(&self) -> usize {
        self.added.len() + self.modified.len() + self.deleted.len()
    }

    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.added
            .iter()
            .chain(&self.modified)
            .chain(&self.deleted)
            .map(PathBuf::as_path)
    }
}

/// Net change of the container's filesystem from `prev` to `now` (manifests of the same
/// upperdir). `lowerdirs` (top first) decide whether a newly copied-up directory differs from
/// what the image showed, and whether a new path is `added` (not in the image) or `modified`.
/// Without lowers (a tracked volume) every new path is `added`.
pub fn diff(prev: &TreeManifest, now: &TreeManifest, lowerdirs: &[PathBuf]) -> FsDiff {
    let mut lower = LowerView::new(lowerdirs, now, now.xattrs);
    let mut out = FsDiff::default();
    let mut p_it = prev.entries.iter().peekable();
    let mut n_it = now.entries.iter().peekable();
    loop {
        let order = match (p_it.peek(), n_it.peek()) {
            (None, None) => break,
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (Some((pp, _)), Some((np, _))) => pp.cmp(np),
        };
        match order {
            std::cmp::Ordering::Less => {
                let (path, p) = p_it.next().unwrap();
                if p.kind == EntryKind::Whiteout {
                    // The whiteout is gone: whatever the image has there is visible again.
                    if lower.lookup(path).is_some() {
                        out.added.push(container_path(path));
                    }
                } else if lower.lookup(path).is_some() {
                    // The upper copy is gone without a whiteout: the image version shows again.
                    out.modified.push(container_path(path));
                } else {
                    out.deleted.push(container_path(path));
                }
            }
            std::cmp::Ordering::Greater => {
                let (path, n) = n_it.next().unwrap();
                match n.kind {
                    EntryKind::Whiteout => out.deleted.push(container_path(path)),
                    EntryKind::Dir => match lower.lookup(path) {
                        Some(LowerEntry::Dir(l)) if l.is_copy_of(n) => {}
                        Some(_) => out.modified.push(container_path(path)),
                        // The root always exists: with no lowers (a volume) it is not news.
                        None if path.as_os_str().is_empty() => {}
                        None => out.added.push(container_path(path)),
                    },
                    _ => match lower.lookup(path) {
                        Some(_) => out.modified.push(container_path(path)),
                        None => out.added.push(container_path(path)),
                    },
                }
            }
            std::cmp::Ordering::Equal => {
                let (path, p) = p_it.next().unwrap();
                let (_, n) = n_it.next().unwrap();
                if same_state(p, n) {
                    continue;
                }
                if n.kind == EntryKind::Whiteout {
                    out.deleted.push(container_path(path));
                } else if p.kind == EntryKind::Whiteout {
                    out.added.push(container_path(path));
                } else {
                    out.modified.push(container_path(path));
                }
            }
        }
    }
    out
}

/// Writes back the dirty pages of the file `rel` beneath `root` (an upperdir or a volume, see
/// [`crate::sys::beneath::open_root`]) and waits, which makes the kernel write-protect them in every
/// shared mapping: the next store through a mapping faults and moves the file's mtime/ctime,
/// which [`diff`] sees.
///
/// Why it is needed: a store into a page that is already dirty and writable in a `MAP_SHARED`
/// mapping causes no fault, so it changes neither mtime nor ctime until writeback happens
/// (seconds later, or never before the next mark). For files some process maps shared and
/// writable (`rw-s` in /proc/PID/maps), call this at the mark, with the container frozen, before
/// [`TreeManifest::scan`]. Cost: one writeback of that file's dirty pages.
///
/// `rel` comes from the container (a path printed in its maps): it is resolved beneath `root`
/// without following any symlink or climbing out with `..`, and only a regular file is opened
/// (never a device, FIFO or socket); anything else is refused with
/// [`crate::sys::beneath::not_regular`]'s error or `ELOOP`/`EXDEV`.
pub fn arm_shared_mapping(root: BorrowedFd<'_>, rel: &Path) -> Result<(), FsError> {
    // Opened read-only: sync_file_range needs no write access. O_NOATIME: arming is no access.
    let file =
        crate::sys::beneath::open_regular_beneath(root, rel, libc::O_RDONLY | libc::O_NOATIME)
            .map_err(|e| FsError::io("open", rel, e))?;
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    file::sync_file_range(file.as_fd(), flags).map_err(|e| FsError::io("sync_file_range", rel, e))
}

/// Upper and lower directories of an overlay mount, from its options as containerd passes them
/// in a rootfs mount (`lowerdir=top:...:bottom`, `upperdir=`, `workdir=`; also `lowerdir+=`,
/// one layer each). Returns `None` when there is no `upperdir` (a read-only rootfs) or a lower
/// cannot be placed.
///
/// - Backslash escapes in `lowerdir` are honoured (`\:` is a colon inside a path), as overlayfs
///   does; data-only layers (after `::`, or `datadir+=`) are not visible and left out.
/// - Relative lowers exist only after containerd's mount code compacts a too-long option string
///   (it chdirs to the common parent of the lowers, `<root>/snapshots/`); the options the
///   snapshotter hands to the shim are absolute. A relative lower is resolved against the
///   upperdir's grandparent (`<root>/snapshots/<id>/fs` -> `<root>/snapshots`), which is that
///   parent for containerd's overlayfs snapshotter; if the upperdir is relative too, `None`.
///   A wrong lower can only cause false positives (an unchanged copied-up directory looks new).
pub fn overlay_dirs(mount_options: &[String]) -> Option<(PathBuf, Vec<PathBuf>)> {
    let upper = mount_options
        .iter()
        .rev()
        .find_map(|o| o.strip_prefix("upperdir="))
        .map(PathBuf::from)?;
    let lowers = lowerdirs(mount_options);
    let mut resolved = Vec::with_capacity(lowers.len());
    for lower in lowers {
        if lower.is_absolute() {
            resolved.push(lower);
            continue;
        }
        let base = upper
            .parent()
            .and_then(Path::parent)
            .filter(|b| b.is_absolute());
        let Some(base) = base else {
            log::warn!(
                "overlay lowerdir {} is relative and upperdir {} gives no base",
                lower.display(),
                upper.display()
            );
            return None;
        };
        log::debug!(
            "relative overlay lowerdir {} resolved against {}",
            lower.display(),
            base.display()
        );
        resolved.push(base.join(lower));
    }
    Some((upper, resolved))
}

/// The lower directories an overlay mount's options name, topmost first, as written (a
/// relative one unresolved): `lowerdir=a:b` (escapes and data-only layers as overlayfs reads
/// them) or containerd 2.1's one `lowerdir+=` per layer.
pub fn lowerdirs(mount_options: &[String]) -> Vec<PathBuf> {
    let mut lowers = Vec::new();
    for opt in mount_options {
        if let Some(v) = opt.strip_prefix("lowerdir=") {
            lowers.extend(split_lowerdir(v).into_iter().map(PathBuf::from));
        } else if let Some(v) = opt.strip_prefix("lowerdir+=") {
            lowers.push(PathBuf::from(v));
        }
    }
    lowers
}

/// Splits overlayfs' `lowerdir=` value: `:` separates layers, `\` escapes the next character,
/// and `::` starts the data-only layers (not part of the visible tree).
fn split_lowerdir(value: &str) -> Vec<String> {
    let mut layers = Vec::new();
    let mut cur = String::new();
    let mut chars = value.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    cur.push(next);
                }
            }
            ':' => {
                if !cur.is_empty() {
                    layers.push(std::mem::take(&mut cur));
                }
                if chars.peek() == Some(&':') {
                    return layers;
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        layers.push(cur);
    }
    layers
}

fn container_path(rel: &Path) -> PathBuf {
    Path::new("/").join(rel)
}

fn same_state(a: &EntryMeta, b: &EntryMeta) -> bool {
    if a.kind != b.kind {
        return false;
    }
    match a.kind {
        EntryKind::Whiteout => true,
        EntryKind::Dir => {
            a.mode == b.mode
                && a.uid == b.uid
                && a.gid == b.gid
                && a.ino == b.ino
                && a.opaque == b.opaque
                && a.redirect == b.redirect
                && a.xattrs == b.xattrs
        }
        _ => {
            a.mode == b.mode
                && a.uid == b.uid
                && a.gid == b.gid
                && a.size == b.size
                && a.mtime_ns == b.mtime_ns
                && a.ctime_ns == b.ctime_ns
                && a.ino == b.ino
                && a.rdev == b.rdev
                && a.symlink == b.symlink
        }
    }
}

impl EntryMeta {
    fn from_stat(st: &libc::stat, symlink: Option<PathBuf>, dx: DirXattrs) -> EntryMeta {
        let fmt = st.st_mode & libc::S_IFMT;
        let kind = match fmt {
            libc::S_IFDIR => EntryKind::Dir,
            libc::S_IFLNK => EntryKind::Symlink,
            libc::S_IFCHR if st.st_rdev == 0 => EntryKind::Whiteout,
            libc::S_IFCHR => EntryKind::CharDev,
            libc::S_IFBLK => EntryKind::BlockDev,
            libc::S_IFIFO => EntryKind::Fifo,
            libc::S_IFSOCK => EntryKind::Socket,
            _ => EntryKind::File,
        };
        EntryMeta {
            kind,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            size: st.st_size as u64,
            mtime_ns: nanos(st.st_mtime, st.st_mtime_nsec),
            ctime_ns: nanos(st.st_ctime, st.st_ctime_nsec),
            ino: st.st_ino,
            nlink: st.st_nlink,
            rdev: st.st_rdev,
            symlink,
            opaque: dx.opaque,
            redirect: dx.redirect,
            xattrs: dx.other,
        }
    }
}

/// Saturates outside ±292 years of 1970 (`touch -d` can set any mtime); such a change still
/// shows in ctime, which the kernel always sets to the current time.
fn nanos(sec: i64, nsec: i64) -> i64 {
    sec.saturating_mul(1_000_000_000).saturating_add(nsec)
}

struct Walker<'a> {
    upperdir: &'a Path,
    entries: &'a mut Vec<(PathBuf, EntryMeta)>,
    limits: &'a ScanLimits,
    xattrs: OverlayXattrs,
    path_bytes: u64,
    /// Directories on another device than this one are mount points, left out whole.
    one_dev: Option<u64>,
}

/// One directory being walked: its stream (the base for `*at` calls) and its names left.
struct Level {
    dir: Dir,
    names: std::vec::IntoIter<CString>,
}

impl Walker<'_> {
    fn limit(&self, what: String, limit: u64, key: &'static str) -> FsError {
        FsError::Limit {
            root: self.upperdir.to_path_buf(),
            what,
            limit,
            key,
        }
    }

    /// Depth-first in name order, with an explicit stack (never the thread's): one fd per
    /// level, at most `max_depth` levels.
    fn walk(&mut self, root: Dir) -> Result<(), FsError> {
        let mut rel = PathBuf::new();
        let mut stack = vec![self.level(root, &rel)?];
        while let Some(top) = stack.last_mut() {
            let Some(name) = top.names.next() else {
                stack.pop();
                rel.pop();
                continue;
            };
            let fd = top.dir.as_raw_fd();
            rel.push(OsStr::from_bytes(name.to_bytes()));
            match self.visit(fd, &name, &rel)? {
                Some(child) => {
                    if stack.len() > self.limits.max_depth as usize {
                        return Err(self.limit(
                            format!(
                                "directories nested deeper than {} levels (at {})",
                                self.limits.max_depth,
                                rel.display()
                            ),
                            self.limits.max_depth.into(),
                            "max_walk_depth",
                        ));
                    }
                    let level = self.level(child, &rel)?;
                    stack.push(level);
                }
                None => {
                    rel.pop();
                }
            }
        }
        Ok(())
    }

    fn level(&self, mut dir: Dir, rel: &Path) -> Result<Level, FsError> {
        let room = self
            .limits
            .max_entries
            .saturating_sub(self.entries.len() as u64);
        let mut names = file::names_bounded(&mut dir, room)
            .map_err(|e| FsError::io("readdir", &self.upperdir.join(rel), e.into()))?
            .ok_or_else(|| {
                self.limit(
                    format!("more than {} entries", self.limits.max_entries),
                    self.limits.max_entries,
                    "max_manifest_entries",
                )
            })?;
        names.sort_unstable();
        Ok(Level {
            dir,
            names: names.into_iter(),
        })
    }

    fn push(&mut self, rel: &Path, meta: EntryMeta) -> Result<(), FsError> {
        if self.entries.len() as u64 >= self.limits.max_entries {
            return Err(self.limit(
                format!("more than {} entries", self.limits.max_entries),
                self.limits.max_entries,
                "max_manifest_entries",
            ));
        }
        self.path_bytes += rel.as_os_str().len() as u64;
        if self.path_bytes > self.limits.max_path_bytes {
            return Err(self.limit(
                format!(
                    "paths of more than {} bytes in all",
                    self.limits.max_path_bytes
                ),
                self.limits.max_path_bytes,
                "max_manifest_path_bytes",
            ));
        }
        self.entries.push((rel.to_path_buf(), meta));
        Ok(())
    }

    /// Records the entry `name` of `dirfd`; a directory comes back open, to be walked next.
    fn visit(&mut self, dirfd: RawFd, name: &CStr, rel: &Path) -> Result<Option<Dir>, FsError> {
        let st = match fstatat(Some(dirfd), name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(e) if vanished(e) => return Ok(None),
            Err(e) => return Err(FsError::io("lstat", &self.upperdir.join(rel), e.into())),
        };
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR if self.one_dev.is_some_and(|dev| dev != st.st_dev) => Ok(None),
            libc::S_IFDIR => {
                let child = match open_dir_at(dirfd, name) {
                    Ok(d) => d,
                    Err(e) if vanished(e) => return Ok(None),
                    Err(e) => return Err(FsError::io("open", &self.upperdir.join(rel), e.into())),
                };
                let xattrs = dir_xattrs(&xattr::Target::Fd(child.as_raw_fd()), self.xattrs)
                    .map_err(|e| FsError::io("listxattr", &self.upperdir.join(rel), e))?;
                self.push(rel, EntryMeta::from_stat(&st, None, xattrs))?;
                Ok(Some(child))
            }
            libc::S_IFLNK => {
                let target = match readlinkat(Some(dirfd), name) {
                    Ok(t) => PathBuf::from(t),
                    Err(e) if vanished(e) => return Ok(None),
                    Err(e) => {
                        return Err(FsError::io("readlink", &self.upperdir.join(rel), e.into()))
                    }
                };
                self.push(
                    rel,
                    EntryMeta::from_stat(&st, Some(target), DirXattrs::default()),
                )?;
                Ok(None)
            }
            fmt => {
                let mut meta = EntryMeta::from_stat(&st, None, DirXattrs::default());
                // The xattr form of a whiteout is always an empty regular file: only those pay
                // for an xattr read.
                // There is no listxattrat(): go through the pinned parent directory rather than a
                // full path, which a running container could redirect with a symlink.
                if fmt == libc::S_IFREG && st.st_size == 0 {
                    let mut via_fd = format!("/proc/self/fd/{dirfd}/").into_bytes();
                    via_fd.extend_from_slice(name.to_bytes());
                    let c = CString::new(via_fd).expect("no NUL in a file name");
                    match is_xwhiteout(&xattr::Target::Path(&c), self.xattrs) {
                        Ok(true) => meta.kind = EntryKind::Whiteout,
                        Ok(false) => {}
                        Err(e)
                            if e.raw_os_error()
                                .is_some_and(|n| vanished(Errno::from_raw(n))) =>
                        {
                            return Ok(None)
                        }
                        Err(e) => {
                            return Err(FsError::io("listxattr", &self.upperdir.join(rel), e))
                        }
                    }
                }
                self.push(rel, meta)?;
                Ok(None)
            }
        }
    }
}

fn vanished(e: Errno) -> bool {
    matches!(e, Errno::ENOENT | Errno::ENOTDIR)
}

/// What the lower layers show at a path (ignoring the upperdir entry itself).
enum LowerEntry {
    Dir(LowerDir),
    Other,
}

struct LowerDir {
    mode: u32,
    uid: u32,
    gid: u32,
    /// `None` if they could not be read: then no upper directory counts as a copy of it.
    xattrs: Option<DirXattrs>,
}

impl LowerDir {
    /// An upper directory that is a pure copy-up of this one: what overlayfs copies up
    /// (mode, owner, xattrs) is unchanged and it hides nothing. A lower directory's own
    /// opaqueness is not copied up, and overlayfs keeps honouring it in the lower stack.
    fn is_copy_of(&self, upper: &EntryMeta) -> bool {
        let Some(x) = &self.xattrs else {
            return false;
        };
        self.mode == upper.mode
            && self.uid == upper.uid
            && self.gid == upper.gid
            && !upper.opaque
            && upper.redirect.is_none()
            // A lower redirect is followed by lookups below it; not worth modelling.
            && x.redirect.is_none()
            && x.other == upper.xattrs
    }
}

struct Resolved {
    top: Option<LowerEntry>,
    /// Lower layers (indices) whose directory at this path is merged into the view, top first.
    dirs: Vec<usize>,
}

/// overlayfs' lookup over the lower layers, memoised per directory: a name is looked up only in
/// the layers where its parent is a merged directory; a whiteout or a non-directory ends the
/// descent, as does an opaque directory (after itself). Upper directories that are opaque,
/// redirected or not directories hide everything below them.
struct LowerView<'a> {
    lowers: &'a [PathBuf],
    upper: &'a TreeManifest,
    cache: HashMap<PathBuf, Resolved>,
    xattrs: OverlayXattrs,
}

impl<'a> LowerView<'a> {
    fn new(lowers: &'a [PathBuf], upper: &'a TreeManifest, xattrs: OverlayXattrs) -> LowerView<'a> {
        LowerView {
            lowers,
            upper,
            cache: HashMap::new(),
            xattrs,
        }
    }

    fn lookup(&mut self, rel: &Path) -> Option<&LowerEntry> {
        self.resolve(rel);
        self.cache.get(rel).and_then(|r| r.top.as_ref())
    }

    /// Layers in which children of `rel` are looked up.
    fn child_layers(&mut self, rel: &Path) -> Vec<usize> {
        if let Some(u) = self.upper.get(rel) {
            if u.kind != EntryKind::Dir || u.opaque || u.redirect.is_some() {
                return Vec::new();
            }
        }
        self.resolve(rel);
        self.cache[rel].dirs.clone()
    }

    fn resolve(&mut self, rel: &Path) {
        if self.cache.contains_key(rel) {
            return;
        }
        let layers = match rel.parent() {
            Some(parent) => self.child_layers(parent),
            // The root of every lower is a merged directory.
            None => (0..self.lowers.len()).collect(),
        };
        let resolved = self.resolve_in(&layers, rel);
        self.cache.insert(rel.to_path_buf(), resolved);
    }

    fn resolve_in(&self, layers: &[usize], rel: &Path) -> Resolved {
        let mut out = Resolved {
            top: None,
            dirs: Vec::new(),
        };
        for &i in layers {
            let full = self.lowers[i].join(rel);
            let Ok(c) = cstring(full.as_os_str()) else {
                break;
            };
            let st = match lstat(c.as_c_str()) {
                Ok(st) => st,
                Err(e) if vanished(e) => continue,
                Err(e) => {
                    // Unreadable lower: assume nothing is there, which can only make a
                    // copied-up directory look new (a false positive).
                    log::warn!("lstat {}: {e}", full.display());
                    break;
                }
            };
            let fmt = st.st_mode & libc::S_IFMT;
            let target = xattr::Target::Path(&c);
            if (fmt == libc::S_IFCHR && st.st_rdev == 0)
                || (fmt == libc::S_IFREG
                    && st.st_size == 0
                    && is_xwhiteout(&target, self.xattrs).unwrap_or(false))
            {
                break;
            }
            if fmt != libc::S_IFDIR {
                if out.top.is_none() {
                    out.top = Some(LowerEntry::Other);
                }
                break;
            }
            let xattrs = dir_xattrs(&target, self.xattrs)
                .inspect_err(|e| log::warn!("listxattr {}: {e}", full.display()))
                .ok();
            let opaque = xattrs.as_ref().is_some_and(|x| x.opaque);
            if out.top.is_none() {
                out.top = Some(LowerEntry::Dir(LowerDir {
                    mode: st.st_mode & 0o7777,
                    uid: st.st_uid,
                    gid: st.st_gid,
                    xattrs,
                }));
            }
            out.dirs.push(i);
            if opaque {
                break;
            }
        }
        out
    }
}

// ---- syscalls ----

/// Flags of every directory the walk opens (relative ones add `O_NOFOLLOW`).
const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_CLOEXEC);

fn cstring(s: &OsStr) -> Result<CString, FsError> {
    CString::new(s.as_bytes()).map_err(|_| FsError::NulInPath(PathBuf::from(s)))
}

/// The directory `name` of `parent` as a stream (its fd doubles as the base for `*at` calls on
/// its entries), never through a symlink.
fn open_dir_at(parent: RawFd, name: &CStr) -> nix::Result<Dir> {
    Dir::from(file::openat(parent, name, DIR_FLAGS | OFlag::O_NOFOLLOW)?)
}

/// Overlay xattrs on directories that say nothing about the container's view beyond what is
/// tracked elsewhere: copy-up/lookup bookkeeping, and the markers of directories holding xattr
/// whiteouts (`opaque` other than `y`, `whiteouts`; the whiteouts themselves are entries).
/// Overlay never copies its xattrs up, so they must not take part in the copy-up comparison.
/// Anything else (e.g. `protattr`, which holds chattr +i/+a) is compared as container state.
const OVERLAY_BOOKKEEPING: &[&[u8]] = &[
    b"impure",
    b"origin",
    b"nlink",
    b"uuid",
    b"upper",
    b"whiteouts",
];

#[derive(Debug, Default)]
struct DirXattrs {
    opaque: bool,
    redirect: Option<Vec<u8>>,
    other: Vec<(Vec<u8>, Vec<u8>)>,
}

fn dir_xattrs(target: &xattr::Target, xattrs: OverlayXattrs) -> io::Result<DirXattrs> {
    let list = target.list()?;
    let mut out = DirXattrs::default();
    for name in list.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let ovl = xattrs.overlay_name(name);
        if ovl.is_some_and(|n| OVERLAY_BOOKKEEPING.contains(&n)) {
            continue;
        }
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        let Some(value) = target.get(&cname)? else {
            continue;
        };
        match ovl {
            Some(b"opaque") => out.opaque = value == b"y",
            Some(b"redirect") => out.redirect = Some(value),
            _ => out.other.push((name.to_vec(), value)),
        }
    }
    out.other.sort();
    Ok(out)
}

/// overlayfs only honours this form inside a directory marked `overlay.opaque=x` (6.8+) or
/// `overlay.whiteouts` (6.7); it is recognised regardless here, which can only change how a
/// path is reported (deleted instead of added), never whether it is.
fn is_xwhiteout(target: &xattr::Target, xattrs: OverlayXattrs) -> io::Result<bool> {
    let list = target.list()?;
    Ok(list
        .split(|b| *b == 0)
        .any(|n| xattrs.overlay_name(n) == Some(b"whiteout".as_slice())))
}

// ---- path escaping for serde ----

/// `%` and bytes that are not UTF-8 become `%XX`; everything else is kept.
fn escape_bytes(bytes: &[u8]) -> String {
    fn push_str(out: &mut String, s: &str) {
        for c in s.chars() {
            if c == '%' {
                out.push_str("%25");
            } else {
                out.push(c);
            }
        }
    }
    let mut out = String::with_capacity(bytes.len());
    let mut rest = bytes;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                push_str(&mut out, s);
                return out;
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                push_str(&mut out, std::str::from_utf8(valid).unwrap_or_default());
                let bad = e.error_len().unwrap_or(after.len());
                for b in &after[..bad] {
                    let _ = write!(out, "%{b:02X}");
                }
                rest = &after[bad..];
            }
        }
    }
}

/// A stored path whose `%` is not followed by two hex digits.
#[derive(Debug, thiserror::Error)]
#[error("bad escape in path {0:?}")]
struct BadEscape(String);

fn unescape_bytes(s: &str) -> Result<Vec<u8>, BadEscape> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| BadEscape(s.to_owned()))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

mod escaped_opt_path {
    use super::*;

    pub fn serialize<S: Serializer>(p: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
        p.as_ref()
            .map(|p| escape_bytes(p.as_os_str().as_bytes()))
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<PathBuf>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| {
                unescape_bytes(&s)
                    .map(|b| PathBuf::from(OsString::from_vec(b)))
                    .map_err(serde::de::Error::custom)
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests;

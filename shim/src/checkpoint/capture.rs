//! Reading an overlay upperdir into a layer's tar while the container is frozen: the listed
//! paths, whiteouts for what is gone, opaque directories written whole (with an explicit stack
//! bounded by `max_walk_depth`), hard links within the layer, sparse files with their holes,
//! and only the mount's own overlay xattrs taken as overlay state.
//!
//! The upperdir is read without following symlinks at any component (every directory is
//! opened relative to its parent with `O_NOFOLLOW`), so a container that plants symlinks cannot
//! make the layer read host files.
//!
//! A layer's bounds ([`LayerOptions`]) and its errors ([`LayerError`]) are defined here, below
//! the layer writer ([`super::layer`]) that drives the capture and re-exports them.
//!
//! A capture stops when its [`Cancel`] is set (its job passed its deadline): it checks before
//! every entry and every chunk of file data ([`COPY_CHUNK`]), and returns
//! [`LayerError::Cancelled`].

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    ffi::{CStr, CString, OsString},
    io,
    os::{
        fd::{AsRawFd, OwnedFd, RawFd},
        unix::ffi::{OsStrExt, OsStringExt},
    },
    path::{Path, PathBuf},
};

use nix::{
    errno::Errno,
    fcntl::{copy_file_range, readlinkat, AtFlags, OFlag},
    sys::stat::{fstat, fstatat},
    unistd::{lseek, read, Whence},
};

use super::deadline::Cancel;
use super::store::StoreError;
use super::tar::{child_name, sparse_map, tar_name, TarEntry, TarWriter, OPAQUE_MARKER};
use crate::inspector::fs::OverlayXattrs;
use crate::sys::{file, xattr};

/// Bounds on one layer (`[limits]` in crab's config) and the mount's overlay xattr prefix.
#[derive(Debug, Clone, Copy)]
pub struct LayerOptions {
    /// Bytes of file data (holes excluded), uncompressed.
    pub max_bytes: u64,
    /// Apparent (logical) bytes of the regular files of the layer, holes included: what
    /// unpacking it writes (containerd's differ writes holes as zeros).
    pub max_apparent_bytes: u64,
    /// Directory levels of an opaque subtree written whole.
    pub max_depth: u32,
    pub xattrs: OverlayXattrs,
    /// The owners the layer records: a container in a user namespace writes its upper dir as
    /// host ids, which the layer turns back into the container's own (what an image holds, so
    /// that it unpacks right under any mapping).
    pub ids: super::tar::IdShift,
}

impl Default for LayerOptions {
    fn default() -> Self {
        let c = crab_runtime_config::LimitsConfig::default();
        LayerOptions {
            max_bytes: c.max_layer_bytes,
            max_apparent_bytes: c.max_layer_apparent_bytes,
            max_depth: c.max_walk_depth,
            xattrs: OverlayXattrs::Trusted,
            ids: super::tar::IdShift::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("upperdir entry {path}: {op}: {source}")]
    Upper {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot freeze the container: {0}")]
    Freeze(#[source] io::Error),
    #[error("cannot thaw the container, it may still be frozen: {0}")]
    Thaw(#[source] io::Error),
    #[error(
        "upperdir entry {path}: {reason}; such an entry cannot be captured from the upperdir alone"
    )]
    Unsupported { path: PathBuf, reason: String },
    #[error("upperdir entry {path} changed while the container was frozen: {reason}")]
    Changed { path: PathBuf, reason: String },
    #[error("diff path {0:?} is not an absolute container path")]
    InvalidPath(PathBuf),
    /// The layer would be bigger than one container's checkpoint may be.
    #[error("{what} exceed the limit of {limit} ([limits] {key}); the layer is not stored")]
    Limit {
        what: String,
        limit: u64,
        key: &'static str,
    },
    /// The capture was told to stop ([`Cancel`]): its job passed its deadline.
    #[error(
        "the fs capture was stopped after writing {written} bytes of its layer; nothing of it \
         is stored"
    )]
    Cancelled { written: u64 },
}

impl LayerError {
    /// The store's filesystem is full: nothing was published and no temporary file is left.
    pub fn is_no_space(&self) -> bool {
        matches!(self, LayerError::Store(e) if e.is_no_space())
    }

    pub(super) fn upper(op: &'static str, path: &Path, source: io::Error) -> LayerError {
        LayerError::Upper {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// File data copied between two looks at the [`Cancel`] flag: at ~200 MB/s (a slow disk under
/// writeback) a chunk takes ~40 ms, so a cancelled capture stops within about that.
pub(super) const COPY_CHUNK: usize = 8 << 20;

/// Data extents of one sparse file kept apart; beyond this, the closest extents are merged
/// (the zeros between them are stored) so that a file of a million tiny holes stays bounded.
const MAX_SPARSE_EXTENTS: usize = 4096;

/// Reads upperdir entries into the temporary tar (while the container is frozen).
pub(super) struct Capture<'a> {
    upper: OwnedFd,
    upperdir: &'a Path,
    tar: TarWriter,
    /// (dev, ino) of regular files with several links -> the tar name they were first written as.
    links: HashMap<(u64, u64), Vec<u8>>,
    /// The directory fd of the last parent looked up (siblings come together in path order).
    parent: Option<(PathBuf, OwnedFd)>,
    buf: Vec<u8>,
    /// Cleared once the kernel refuses copy_file_range between the two filesystems.
    copy_file_range: bool,
    opts: LayerOptions,
    /// File data written so far (holes excluded), against `opts.max_bytes`.
    data_bytes: u64,
    /// Apparent bytes of the regular files written so far, against `opts.max_apparent_bytes`
    /// (carried from one tree of a layer to the next: [`Capture::apparent_bytes`]).
    apparent_bytes: u64,
    cancel: Cancel,
}

/// The upperdir itself, opened for a [`Capture`].
pub(super) fn open_upper(upperdir: &Path) -> Result<OwnedFd, LayerError> {
    file::open(upperdir, DIR_FLAGS).map_err(|e| LayerError::upper("open", upperdir, e.into()))
}

/// Whether the entries below a captured path still need visiting.
enum Below {
    /// A plain directory: its listed children come next.
    Listed,
    /// Not a directory, a whiteout, or a directory whose subtree was written whole.
    Covered,
    /// A directory inside a subtree being written whole: its children are to be written too
    /// (by the caller's walk, which holds the stack).
    Whole(OwnedFd),
}

impl<'a> Capture<'a> {
    /// Reads the upperdir `upperdir`, open as `upper` ([`open_upper`]), into `tar`, within
    /// `opts`, until `cancel` is set.
    pub fn new(
        upper: OwnedFd,
        upperdir: &'a Path,
        tar: TarWriter,
        opts: LayerOptions,
        cancel: Cancel,
    ) -> Capture<'a> {
        let mut tar = tar;
        tar.set_ids(opts.ids);
        Capture {
            upper,
            upperdir,
            tar,
            links: HashMap::new(),
            parent: None,
            buf: vec![0; 1 << 20],
            copy_file_range: true,
            opts,
            data_bytes: 0,
            apparent_bytes: 0,
            cancel,
        }
    }

    /// The tar written so far, to finish once the container is thawed.
    pub fn into_tar(self) -> TarWriter {
        self.tar
    }

    /// Apparent bytes of the files captured so far; a later tree of the same layer starts
    /// from them (`with_apparent_bytes`), so the bound holds for the whole layer.
    pub fn apparent_bytes(&self) -> u64 {
        self.apparent_bytes
    }

    pub fn with_apparent_bytes(mut self, bytes: u64) -> Self {
        self.apparent_bytes = bytes;
        self
    }

    /// [`LayerError::Cancelled`] once the capture was told to stop.
    fn check_cancel(&self) -> Result<(), LayerError> {
        match self.cancel.is_cancelled() {
            true => Err(LayerError::Cancelled {
                written: self.tar.bytes(),
            }),
            false => Ok(()),
        }
    }

    /// Captures the whole tree (a tracked volume's base): its root directory, an opaque
    /// marker (nothing of lower layers shows through) and everything below it.
    pub fn run_whole(&mut self) -> Result<(), LayerError> {
        let fd = self
            .upper
            .try_clone()
            .map_err(|e| LayerError::upper("dup", self.upperdir, e))?;
        let st = fstat(fd.as_raw_fd())
            .map_err(|e| LayerError::upper("stat", self.upperdir, e.into()))?;
        let root = Path::new("");
        self.tar
            .append(&TarEntry::from_stat(&tar_name(root, true), b'5', &st))?;
        self.tar
            .append(&TarEntry::whiteout(&child_name(root, OPAQUE_MARKER)))?;
        self.whole_subtree(fd, root)
    }

    /// Captures the upperdir-relative `paths` (in path order: parents first, each subtree
    /// contiguous).
    pub fn run(&mut self, paths: &BTreeSet<PathBuf>) -> Result<(), LayerError> {
        let mut covered: Option<&Path> = None;
        // Directories whose entry is in the tar already.
        let mut written: HashSet<PathBuf> = HashSet::new();
        for rel in paths {
            self.check_cancel()?;
            if covered.is_some_and(|c| rel.starts_with(c)) {
                continue;
            }
            covered = None;
            let below = if rel.as_os_str().is_empty() {
                let fd = self
                    .upper
                    .try_clone()
                    .map_err(|e| LayerError::upper("dup", self.upperdir, e))?;
                let st = fstat(fd.as_raw_fd())
                    .map_err(|e| LayerError::upper("stat", self.upperdir, e.into()))?;
                self.dir(fd, &st, rel, false)?
            } else {
                let parent = rel.parent().unwrap_or(Path::new(""));
                let name = rel.file_name().expect("a normal last component");
                let ancestors = self.ancestors(parent, &mut written)?;
                let pfd = match ancestors {
                    true => self.parent_fd(parent)?,
                    false => None,
                };
                let Some(pfd) = pfd else {
                    // The parent is gone or no longer a directory: its own change covers this
                    // path (in this diff, or in the next one if it happened after the diff).
                    log::debug!(
                        "layer: {} has no parent directory in the upperdir any more",
                        rel.display()
                    );
                    covered = Some(rel);
                    continue;
                };
                self.entry(pfd, name.as_bytes(), rel, false)?
            };
            written.insert(rel.clone());
            if !matches!(below, Below::Listed) {
                covered = Some(rel);
            }
        }
        Ok(())
    }

    /// Captures the whole tree (an overlay layer directory: whiteouts and opaque directories
    /// as an upperdir holds them), without an entry for the root itself; an opaque root
    /// becomes `.wh..wh..opq` at the top.
    pub fn run_tree(&mut self) -> Result<(), LayerError> {
        let fd = self
            .upper
            .try_clone()
            .map_err(|e| LayerError::upper("dup", self.upperdir, e))?;
        let xattrs = Xattrs::read(&xattr::Target::Fd(fd.as_raw_fd()), self.opts.xattrs)
            .map_err(|e| LayerError::upper("xattrs", self.upperdir, e))?;
        if xattrs.opaque {
            self.tar.append(&TarEntry::whiteout(&child_name(
                Path::new(""),
                OPAQUE_MARKER,
            )))?;
        }
        self.whole_subtree(fd, Path::new(""))
    }

    /// Writes an entry for each directory above a changed path (`parent` and its ancestors,
    /// the root left out) that has none in the tar yet: its mode, owner, times and xattrs as
    /// the upperdir holds them (overlayfs copied them up from the image, or the container
    /// changed them). A layer applied where one is missing would otherwise have it made with
    /// the applier's defaults (0755 by Docker's layer store), masking the image's own (a 1777
    /// `/tmp`), which `docker commit`'s layers never do. `false` if some directory is gone or
    /// no longer one (the change that did it covers the path).
    fn ancestors(
        &mut self,
        parent: &Path,
        written: &mut HashSet<PathBuf>,
    ) -> Result<bool, LayerError> {
        let mut dir = PathBuf::new();
        for comp in parent.components() {
            dir.push(comp);
            if written.contains(&dir) {
                continue;
            }
            let Some(fd) = self.parent_fd(&dir)? else {
                return Ok(false);
            };
            let st = fstat(fd)
                .map_err(|e| LayerError::upper("stat", &self.upperdir.join(&dir), e.into()))?;
            self.dir_entry(fd, &st, &dir)?;
            written.insert(dir.clone());
        }
        Ok(true)
    }

    /// Directory fd of upperdir-relative `parent`, opened component by component without
    /// following symlinks; `None` if some component is missing or not a directory.
    fn parent_fd(&mut self, parent: &Path) -> Result<Option<RawFd>, LayerError> {
        if let Some((p, fd)) = &self.parent {
            if p == parent {
                return Ok(Some(fd.as_raw_fd()));
            }
        }
        let (mut cur, rest): (Option<OwnedFd>, &Path) = match self.parent.take() {
            Some((p, fd)) if parent.starts_with(&p) => {
                let rest = parent.strip_prefix(&p).unwrap_or(parent);
                (Some(fd), rest)
            }
            _ => (None, parent),
        };
        let mut done = parent.to_path_buf();
        for _ in rest.components() {
            done.pop();
        }
        for comp in rest.components() {
            let name = comp.as_os_str();
            done.push(name);
            let at = cur
                .as_ref()
                .map_or(self.upper.as_raw_fd(), |f| f.as_raw_fd());
            let c = cstring(name.as_bytes(), &done)?;
            match file::openat(at, c.as_c_str(), DIR_FLAGS | OFlag::O_NOFOLLOW) {
                Ok(fd) => cur = Some(fd),
                Err(Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP) => return Ok(None),
                Err(e) => {
                    return Err(LayerError::upper(
                        "open",
                        &self.upperdir.join(&done),
                        e.into(),
                    ))
                }
            }
        }
        let fd = match cur {
            Some(fd) => fd,
            None => self
                .upper
                .try_clone()
                .map_err(|e| LayerError::upper("dup", self.upperdir, e))?,
        };
        let raw = fd.as_raw_fd();
        self.parent = Some((parent.to_path_buf(), fd));
        Ok(Some(raw))
    }

    /// Captures the entry `name` of directory `pfd` (upperdir-relative `rel`); `whole` when it
    /// lies in an opaque directory being written whole.
    fn entry(
        &mut self,
        pfd: RawFd,
        name: &[u8],
        rel: &Path,
        whole: bool,
    ) -> Result<Below, LayerError> {
        let path = || self.upperdir.join(rel);
        let cname = cstring(name, rel)?;
        let st = match fstatat(Some(pfd), cname.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => {
                // Deleted, or gone since the diff (a deletion of an image path leaves a
                // whiteout, so a path gone without one was never in the image).
                self.tar.whiteout(rel)?;
                return Ok(Below::Covered);
            }
            Err(e) => return Err(LayerError::upper("stat", &path(), e.into())),
        };
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                let fd = file::openat(pfd, cname.as_c_str(), DIR_FLAGS | OFlag::O_NOFOLLOW)
                    .map_err(|e| LayerError::upper("open", &path(), e.into()))?;
                let fst = fstat(fd.as_raw_fd())
                    .map_err(|e| LayerError::upper("stat", &path(), e.into()))?;
                if fst.st_ino != st.st_ino {
                    return Err(LayerError::Changed {
                        path: path(),
                        reason: "replaced while being read".into(),
                    });
                }
                self.dir(fd, &fst, rel, whole)
            }
            libc::S_IFREG => self.file(pfd, &cname, &st, rel),
            libc::S_IFCHR if st.st_rdev == 0 => {
                self.tar.whiteout(rel)?;
                Ok(Below::Covered)
            }
            libc::S_IFLNK => {
                let target = readlinkat(Some(pfd), cname.as_c_str())
                    .map_err(|e| LayerError::upper("readlink", &path(), e.into()))?
                    .into_vec();
                let xattrs = self.path_xattrs(pfd, name, rel)?;
                let name = tar_name(rel, false);
                self.tar.append(&TarEntry {
                    link: &target,
                    xattrs: &xattrs.other,
                    ..TarEntry::from_stat(&name, b'2', &st)
                })?;
                Ok(Below::Covered)
            }
            fmt @ (libc::S_IFCHR | libc::S_IFBLK | libc::S_IFIFO) => {
                let kind = match fmt {
                    libc::S_IFCHR => b'3',
                    libc::S_IFBLK => b'4',
                    _ => b'6',
                };
                let xattrs = self.path_xattrs(pfd, name, rel)?;
                let name = tar_name(rel, false);
                let dev = if kind == b'6' {
                    (0, 0)
                } else {
                    (libc::major(st.st_rdev), libc::minor(st.st_rdev))
                };
                self.tar.append(&TarEntry {
                    dev,
                    xattrs: &xattrs.other,
                    ..TarEntry::from_stat(&name, kind, &st)
                })?;
                Ok(Below::Covered)
            }
            _ => {
                // A tar cannot hold a socket; whoever listens on it recreates it.
                log::warn!("layer: skipping socket {}", path().display());
                Ok(Below::Covered)
            }
        }
    }

    /// Writes the entry of directory `fd` (upperdir-relative `rel`, `st` its stat) with its
    /// xattrs; returns them. A directory overlayfs renamed (`redirect_dir`) is refused.
    fn dir_entry(&mut self, fd: RawFd, st: &libc::stat, rel: &Path) -> Result<Xattrs, LayerError> {
        let path = self.upperdir.join(rel);
        let xattrs = Xattrs::read(&xattr::Target::Fd(fd), self.opts.xattrs)
            .map_err(|e| LayerError::upper("xattrs", &path, e))?;
        if let Some(r) = &xattrs.redirect {
            return Err(LayerError::Unsupported {
                path,
                reason: format!(
                    "a directory renamed with overlay redirect_dir (redirect {:?})",
                    String::from_utf8_lossy(r)
                ),
            });
        }
        self.tar.append(&TarEntry {
            xattrs: &xattrs.other,
            ..TarEntry::from_stat(&tar_name(rel, true), b'5', st)
        })?;
        Ok(xattrs)
    }

    fn dir(
        &mut self,
        fd: OwnedFd,
        st: &libc::stat,
        rel: &Path,
        whole: bool,
    ) -> Result<Below, LayerError> {
        let xattrs = self.dir_entry(fd.as_raw_fd(), st, rel)?;
        if !(xattrs.opaque || whole) {
            return Ok(Below::Listed);
        }
        if xattrs.opaque {
            self.tar
                .append(&TarEntry::whiteout(&child_name(rel, OPAQUE_MARKER)))?;
        }
        if whole {
            // Inside a subtree being written whole: the caller's stack walks this one too.
            return Ok(Below::Whole(fd));
        }
        self.whole_subtree(fd, rel)?;
        Ok(Below::Covered)
    }

    /// Writes everything below directory `fd` (upperdir-relative `rel`), depth-first with an
    /// explicit stack of at most `max_depth` levels (one fd and one name list per level).
    fn whole_subtree(&mut self, fd: OwnedFd, rel: &Path) -> Result<(), LayerError> {
        let mut stack = vec![self.whole_level(fd, rel.to_path_buf())?];
        while let Some((dir, names, dir_rel)) = stack.last_mut() {
            self.check_cancel()?;
            let Some(child) = names.next() else {
                stack.pop();
                continue;
            };
            let child_rel = dir_rel.join(OsString::from_vec(child.clone()));
            let pfd = dir.as_raw_fd();
            if let Below::Whole(cfd) = self.entry(pfd, &child, &child_rel, true)? {
                if stack.len() > self.opts.max_depth as usize {
                    return Err(LayerError::Limit {
                        what: format!(
                            "directories nested deeper than {} levels (at {})",
                            self.opts.max_depth,
                            self.upperdir.join(&child_rel).display()
                        ),
                        limit: self.opts.max_depth.into(),
                        key: "max_walk_depth",
                    });
                }
                let level = self.whole_level(cfd, child_rel)?;
                stack.push(level);
            }
        }
        Ok(())
    }

    #[allow(clippy::type_complexity)]
    fn whole_level(
        &self,
        fd: OwnedFd,
        rel: PathBuf,
    ) -> Result<(OwnedFd, std::vec::IntoIter<Vec<u8>>, PathBuf), LayerError> {
        let mut names = list_dir(fd.as_raw_fd())
            .map_err(|e| LayerError::upper("readdir", &self.upperdir.join(&rel), e))?;
        names.sort();
        Ok((fd, names.into_iter(), rel))
    }

    fn file(
        &mut self,
        pfd: RawFd,
        cname: &CStr,
        st: &libc::stat,
        rel: &Path,
    ) -> Result<Below, LayerError> {
        let path = || self.upperdir.join(rel);
        let fd =
            open_file_at(pfd, cname).map_err(|e| LayerError::upper("open", &path(), e.into()))?;
        let fst =
            fstat(fd.as_raw_fd()).map_err(|e| LayerError::upper("stat", &path(), e.into()))?;
        if fst.st_mode & libc::S_IFMT != libc::S_IFREG || fst.st_ino != st.st_ino {
            return Err(LayerError::Changed {
                path: path(),
                reason: "replaced while being read".into(),
            });
        }
        let xattrs = Xattrs::read(&xattr::Target::Fd(fd.as_raw_fd()), self.opts.xattrs)
            .map_err(|e| LayerError::upper("xattrs", &path(), e))?;
        if xattrs.whiteout && fst.st_size == 0 {
            self.tar.whiteout(rel)?;
            return Ok(Below::Covered);
        }
        if xattrs.metacopy {
            return Err(LayerError::Unsupported {
                path: path(),
                reason: "an overlay metacopy file (its data is in a lower layer)".into(),
            });
        }
        let name = tar_name(rel, false);
        if fst.st_nlink > 1 {
            let key = (fst.st_dev, fst.st_ino);
            if let Some(first) = self.links.get(&key) {
                let first = first.clone();
                self.tar.append(&TarEntry {
                    link: &first,
                    size: 0,
                    ..TarEntry::from_stat(&name, b'1', &fst)
                })?;
                return Ok(Below::Covered);
            }
            self.links.insert(key, name.clone());
        }
        let size = fst.st_size as u64;
        self.charge_apparent(size, rel)?;
        let extents = data_extents(fd.as_raw_fd(), size, MAX_SPARSE_EXTENTS, &self.cancel)
            .map_err(|e| match self.cancel.is_cancelled() {
                true => LayerError::Cancelled {
                    written: self.tar.bytes(),
                },
                false => LayerError::upper("seek", &path(), e),
            })?;
        let data: u64 = extents.iter().map(|e| e.1).sum();
        self.charge(data, rel)?;
        if size == 0 || (extents.len() == 1 && extents[0] == (0, size)) {
            // SEEK_DATA/SEEK_HOLE moved the offset the copy reads from.
            lseek(fd.as_raw_fd(), 0, Whence::SeekSet)
                .map_err(|e| LayerError::upper("seek", &path(), e.into()))?;
            self.tar.append(&TarEntry {
                size,
                xattrs: &xattrs.other,
                ..TarEntry::from_stat(&name, b'0', &fst)
            })?;
            self.copy_data(&fd, size, rel)?;
            self.tar.pad(size)?;
            return Ok(Below::Covered);
        }
        let map = sparse_map(&extents);
        let stored = map.len() as u64 + data;
        self.tar.append(&TarEntry {
            size: stored,
            xattrs: &xattrs.other,
            sparse_size: Some(size),
            ..TarEntry::from_stat(&name, b'0', &fst)
        })?;
        self.tar.write_raw(&map)?;
        for &(offset, len) in &extents {
            lseek(fd.as_raw_fd(), offset as libc::off_t, Whence::SeekSet)
                .map_err(|e| LayerError::upper("seek", &path(), e.into()))?;
            self.copy_data(&fd, len, rel)?;
        }
        self.tar.pad(stored)?;
        Ok(Below::Covered)
    }

    /// Counts `bytes` of file data against the layer's bound, before they are copied.
    fn charge(&mut self, bytes: u64, rel: &Path) -> Result<(), LayerError> {
        self.data_bytes = self.data_bytes.saturating_add(bytes);
        if self.data_bytes > self.opts.max_bytes {
            return Err(LayerError::Limit {
                what: format!(
                    "file data of more than {} bytes (reached at {}, {bytes} bytes of data)",
                    self.opts.max_bytes,
                    self.upperdir.join(rel).display()
                ),
                limit: self.opts.max_bytes,
                key: "max_layer_bytes",
            });
        }
        Ok(())
    }

    /// Counts the apparent size of a regular file (holes included) against the layer's bound,
    /// before anything of it is read: containerd's differ writes a sparse file's holes as zeros
    /// when it unpacks the layer, so this is what a restore writes.
    fn charge_apparent(&mut self, size: u64, rel: &Path) -> Result<(), LayerError> {
        self.apparent_bytes = self.apparent_bytes.saturating_add(size);
        if self.apparent_bytes > self.opts.max_apparent_bytes {
            return Err(LayerError::Limit {
                what: format!(
                    "files of more than {} bytes in apparent size, holes included, which \
                     unpacking the layer would write (reached at {}, {size} bytes)",
                    self.opts.max_apparent_bytes,
                    self.upperdir.join(rel).display()
                ),
                limit: self.opts.max_apparent_bytes,
                key: "max_layer_apparent_bytes",
            });
        }
        Ok(())
    }

    /// Copies exactly `size` bytes of `src` into the tar: in the kernel where both files'
    /// filesystems allow it, through a buffer otherwise; [`COPY_CHUNK`] at a time at most, the
    /// [`Cancel`] flag checked before each.
    fn copy_data(&mut self, src: &OwnedFd, size: u64, rel: &Path) -> Result<(), LayerError> {
        let shrank = || LayerError::Changed {
            path: self.upperdir.join(rel),
            reason: "the file shrank while being read".into(),
        };
        let mut left = size;
        if self.copy_file_range && left > 0 {
            self.tar.flush()?;
            while left > 0 {
                self.check_cancel()?;
                let chunk = left.min(COPY_CHUNK as u64) as usize;
                match copy_file_range(src, None, self.tar.file(), None, chunk) {
                    Ok(0) => return Err(shrank()),
                    Ok(n) => {
                        left -= n as u64;
                        self.tar.copied(n as u64);
                    }
                    Err(Errno::EXDEV | Errno::EINVAL | Errno::ENOSYS | Errno::EOPNOTSUPP) => {
                        self.copy_file_range = false;
                        break;
                    }
                    Err(Errno::EINTR) => continue,
                    Err(e) => {
                        let e = io::Error::from(e);
                        if super::store::is_no_space(&e) {
                            return Err(self.tar.err(e).into());
                        }
                        return Err(LayerError::upper("copy", &self.upperdir.join(rel), e));
                    }
                }
            }
        }
        while left > 0 {
            self.check_cancel()?;
            let chunk = left.min(self.buf.len() as u64) as usize;
            let n = match read(src.as_raw_fd(), &mut self.buf[..chunk]) {
                Ok(0) => return Err(shrank()),
                Ok(n) => n,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    return Err(LayerError::upper(
                        "read",
                        &self.upperdir.join(rel),
                        e.into(),
                    ))
                }
            };
            self.tar.write_raw(&self.buf[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Xattrs of a symlink or device node (never opened: opening a device has side effects),
    /// through its parent's fd.
    fn path_xattrs(&self, pfd: RawFd, name: &[u8], rel: &Path) -> Result<Xattrs, LayerError> {
        let mut p = format!("/proc/self/fd/{pfd}/").into_bytes();
        p.extend_from_slice(name);
        let c = cstring(&p, rel)?;
        Xattrs::read(&xattr::Target::Path(&c), self.opts.xattrs)
            .map_err(|e| LayerError::upper("xattrs", &self.upperdir.join(rel), e))
    }
}

/// An entry's xattrs as a layer carries them, and the overlayfs state among them.
#[derive(Debug, Default)]
pub(super) struct Xattrs {
    pub other: Vec<(Vec<u8>, Vec<u8>)>,
    opaque: bool,
    redirect: Option<Vec<u8>>,
    metacopy: bool,
    whiteout: bool,
}

impl Xattrs {
    pub fn read(src: &xattr::Target, overlay: OverlayXattrs) -> io::Result<Xattrs> {
        let names = src.list()?;
        let mut out = Xattrs::default();
        for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            let Ok(cname) = CString::new(name) else {
                continue;
            };
            let Some(value) = src.get(&cname)? else {
                continue;
            };
            match classify_xattr(name, overlay) {
                // A pax key ends at its first `=`: such a name cannot be recorded.
                XattrClass::Plain(n) if n.contains(&b'=') => {
                    log::warn!(
                        "layer: skipping xattr {:?}: its name contains '='",
                        String::from_utf8_lossy(&n)
                    );
                }
                XattrClass::Plain(n) => out.other.push((n, value)),
                XattrClass::Overlay(b"opaque") => out.opaque = value == b"y",
                XattrClass::Overlay(b"redirect") => out.redirect = Some(value),
                XattrClass::Overlay(b"metacopy") => out.metacopy = true,
                XattrClass::Overlay(b"whiteout") => out.whiteout = true,
                XattrClass::Overlay(_) => {}
            }
        }
        out.other.sort();
        Ok(out)
    }
}

pub(super) enum XattrClass<'a> {
    /// An xattr of the container's file, under the name the container sees.
    Plain(Vec<u8>),
    /// overlayfs' own state (`trusted.overlay.X` or, with `userxattr`, `user.overlay.X`).
    Overlay(&'a [u8]),
}

/// Only the mount's own prefix is overlay state: without `userxattr`, `user.overlay.opaque` is
/// an ordinary xattr the container set, which overlayfs ignores and the layer keeps as such.
pub(super) fn classify_xattr(name: &[u8], overlay: OverlayXattrs) -> XattrClass<'_> {
    let prefix = overlay.prefix();
    if let Some(rest) = name.strip_prefix(prefix) {
        // overlayfs stores the container's own `*.overlay.X` xattrs escaped as `*.overlay.overlay.X`.
        return match rest.strip_prefix(b"overlay.".as_slice()) {
            Some(escaped) => XattrClass::Plain([prefix, escaped].concat()),
            None => XattrClass::Overlay(rest),
        };
    }
    XattrClass::Plain(name.to_vec())
}

/// The data extents `(offset, length)` of a file of `size` bytes, from `SEEK_DATA`/`SEEK_HOLE`
/// (a filesystem without them reports the whole file as data). At most `max` extents: beyond
/// that the extents separated by the smallest holes are merged. A file of millions of extents
/// takes a while: `cancel` ends the search ([`io::ErrorKind::Interrupted`]).
pub(super) fn data_extents(
    fd: RawFd,
    size: u64,
    max: usize,
    cancel: &Cancel,
) -> io::Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut min_gap = 0u64;
    let mut pos = 0u64;
    while pos < size {
        if cancel.is_cancelled() {
            return Err(io::Error::new(io::ErrorKind::Interrupted, "cancelled"));
        }
        let data = match lseek(fd, pos as libc::off_t, Whence::SeekData) {
            Ok(data) => data,
            // No data after `pos`: the rest is a hole.
            Err(Errno::ENXIO) => break,
            Err(Errno::EINVAL | Errno::EOPNOTSUPP) if pos == 0 => return Ok(vec![(0, size)]),
            Err(e) => return Err(e.into()),
        };
        let data = (data as u64).min(size);
        let hole = lseek(fd, data as libc::off_t, Whence::SeekHole)?;
        let hole = (hole as u64).clamp(data, size);
        if hole == data {
            break;
        }
        match out.last_mut() {
            Some(last) if data - (last.0 + last.1) <= min_gap => last.1 = hole - last.0,
            _ => out.push((data, hole - data)),
        }
        while out.len() > max {
            min_gap = min_gap.max(1) * 2;
            out = merge_extents(&out, min_gap);
        }
        pos = hole;
    }
    if size > 0 && out.last().is_none_or(|&(off, len)| off + len < size) {
        // Ending in a hole: an empty extent at the end says how long the file is (GNU tar
        // takes the size from the map, not from GNU.sparse.realsize).
        out.push((size, 0));
    }
    Ok(out)
}

/// Merges extents separated by holes of at most `gap` bytes.
pub(super) fn merge_extents(extents: &[(u64, u64)], gap: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(extents.len());
    for &(off, len) in extents {
        match out.last_mut() {
            Some(last) if off - (last.0 + last.1) <= gap => last.1 = off + len - last.0,
            _ => out.push((off, len)),
        }
    }
    out
}

/// Flags of every directory the capture opens (relative ones add `O_NOFOLLOW`).
const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_CLOEXEC);

fn cstring(bytes: &[u8], for_path: &Path) -> Result<CString, LayerError> {
    CString::new(bytes).map_err(|_| LayerError::InvalidPath(for_path.to_path_buf()))
}

fn open_file_at(at: RawFd, name: &CStr) -> nix::Result<OwnedFd> {
    // O_NONBLOCK: never wait on a file that turned into a fifo; O_NOATIME: reading is no access.
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_NOCTTY
        | OFlag::O_CLOEXEC;
    match file::openat(at, name, flags | OFlag::O_NOATIME) {
        Err(Errno::EPERM) => file::openat(at, name, flags),
        r => r,
    }
}

/// Names in directory `fd` (without `.` and `..`).
fn list_dir(fd: RawFd) -> io::Result<Vec<Vec<u8>>> {
    // The magic link resolves to exactly the directory `fd` holds, whatever its path now.
    std::fs::read_dir(format!("/proc/self/fd/{fd}"))?
        .map(|e| e.map(|e| e.file_name().into_vec()))
        .collect()
}

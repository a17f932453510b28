//! Filesystem checkpoints: the net change of a turn as an OCI image layer.
//!
//! [`write_fs_layer`] turns the inspector's diff (container paths added, modified, deleted) into
//! a tar layer (POSIX pax, numeric owners, modes, mtimes with nanoseconds, xattrs including
//! `security.capability`, hardlinks within the layer, symlinks, device nodes, fifos), compressed
//! with zstd (`application/vnd.oci.image.layer.v1.tar+zstd`):
//! - an added or modified path is copied from the upperdir as it is while the container is
//!   frozen (a directory as its own metadata entry; its children are listed by the diff);
//! - a path that is a whiteout in the upperdir, or gone from it, becomes `<dir>/.wh.<name>`;
//! - an opaque upper directory (`overlay.opaque=y`: the image's content there is hidden)
//!   becomes its entry, `<dir>/.wh..wh..opq` and its *whole* upper subtree: the marker hides
//!   every older layer's content of that directory, including crab's own earlier layers, so
//!   the layer must carry everything the directory holds.
//!
//! The upperdir is read without following symlinks at any component (every directory is
//! opened relative to its parent with `O_NOFOLLOW`), so a container that plants symlinks cannot
//! make the layer read host files.
//!
//! The container is frozen only while the changed entries are copied into an uncompressed
//! temporary tar in the store; it is thawed (on every path, errors included) before the tar is
//! compressed, hashed and moved into `blobs/`.
//!
//! For the caller: the layer holds the listed paths as they are at the freeze. Whatever changed
//! after the diff was computed shows up in the next diff, as long as the next diff is taken
//! against the manifest the current diff was computed from; to make a checkpoint an exact
//! instant, scan and diff while frozen ([`CgroupFreezer`] nests: freeze, scan, diff, call this
//! with the same freezer, thaw).

use std::{
    collections::{BTreeSet, HashMap},
    ffi::{CStr, CString, OsString},
    fs::File,
    io::{self, BufWriter, Read, Seek, Write},
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
        unix::ffi::{OsStrExt, OsStringExt},
    },
    path::{Component, Path, PathBuf},
    sync::Mutex,
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};

use super::store::{digest_string, Descriptor, Store, StoreError, MEDIA_TYPE_LAYER_ZSTD};
use crate::inspector::{fs::FsDiff, FsFinding};

/// zstd level: fast enough to keep up with a disk, off the critical path anyway (after the thaw).
const ZSTD_LEVEL: i32 = 3;
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

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
    #[error("upperdir entry {path}: {reason}; such an entry cannot be captured from the upperdir alone")]
    Unsupported { path: PathBuf, reason: String },
    #[error("upperdir entry {path} changed while the container was frozen: {reason}")]
    Changed { path: PathBuf, reason: String },
    #[error("diff path {0:?} is not an absolute container path")]
    InvalidPath(PathBuf),
}

impl LayerError {
    /// The store's filesystem is full: nothing was published and no temporary file is left.
    pub fn is_no_space(&self) -> bool {
        matches!(self, LayerError::Store(e) if e.is_no_space())
    }

    fn upper(op: &'static str, path: &Path, source: io::Error) -> LayerError {
        LayerError::Upper { op, path: path.to_path_buf(), source }
    }
}

/// The container paths of a net filesystem change (the inspector's [`FsDiff`] or the `fs`
/// part of a turn's answer).
#[derive(Debug, Clone, Copy)]
pub struct FsDiffPaths<'a> {
    pub added: &'a [PathBuf],
    pub modified: &'a [PathBuf],
    pub deleted: &'a [PathBuf],
}

impl<'a> From<&'a FsDiff> for FsDiffPaths<'a> {
    fn from(d: &'a FsDiff) -> Self {
        FsDiffPaths { added: &d.added, modified: &d.modified, deleted: &d.deleted }
    }
}

impl<'a> From<&'a FsFinding> for FsDiffPaths<'a> {
    fn from(f: &'a FsFinding) -> Self {
        FsDiffPaths { added: &f.added, modified: &f.modified, deleted: &f.deleted }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Tar entries, whiteouts included.
    pub entries: u64,
    /// Bytes of the uncompressed tar.
    pub bytes: u64,
    /// Bytes of the stored (compressed) blob.
    pub compressed: u64,
    /// How long the container was stopped: freeze request to thaw done.
    pub freeze: Duration,
    /// The part of `freeze` spent copying entries into the temporary tar.
    pub capture: Duration,
    pub total: Duration,
}

/// Stops and resumes every process of a container.
pub trait Freezer {
    /// Returns once every process is stopped.
    fn freeze(&self) -> io::Result<()>;
    fn thaw(&self) -> io::Result<()>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The v1 `freezer` controller: `freezer.state`.
    V1,
    /// cgroup2's core freezer: `cgroup.freeze`, `cgroup.events`.
    V2,
}

/// The cgroup freezer of a container. Nests: while frozen, `freeze` only counts and the
/// matching `thaw` resumes at the outermost level; a cgroup that was already frozen by someone
/// else (a user's pause) is left frozen.
#[derive(Debug)]
pub struct CgroupFreezer {
    dir: PathBuf,
    version: CgroupVersion,
    timeout: Duration,
    state: Mutex<FreezeState>,
}

#[derive(Debug, Default)]
struct FreezeState {
    depth: u32,
    /// Frozen before our outermost freeze: not ours to thaw.
    external: bool,
}

impl CgroupFreezer {
    /// The freezer of `pid`'s cgroup: the v1 `freezer` controller where it is mounted (hybrid
    /// hosts), cgroup2's otherwise.
    pub fn for_pid(pid: u32) -> io::Result<CgroupFreezer> {
        let cgroups = crate::cgroup::Cgroups::of(pid).map_err(|e| io::Error::other(e.to_string()))?;
        if let Some(dir) = cgroups.v1("freezer") {
            return Ok(CgroupFreezer::new(dir.clone(), CgroupVersion::V1));
        }
        match cgroups.unified {
            Some(dir) if dir.join("cgroup.freeze").exists() => Ok(CgroupFreezer::new(dir, CgroupVersion::V2)),
            Some(dir) => Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("pid {pid}: cgroup {} has no cgroup.freeze (the root cgroup, or a kernel before 5.2)", dir.display()),
            )),
            None => Err(io::Error::new(io::ErrorKind::NotFound, format!("pid {pid}: no freezer cgroup (neither v1 freezer nor cgroup2)"))),
        }
    }

    pub fn new(dir: PathBuf, version: CgroupVersion) -> CgroupFreezer {
        CgroupFreezer { dir, version, timeout: Duration::from_secs(5), state: Mutex::default() }
    }

    /// How long `freeze` waits for every task to stop before giving up (and thawing).
    pub fn with_timeout(mut self, timeout: Duration) -> CgroupFreezer {
        self.timeout = timeout;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    fn control_file(&self) -> PathBuf {
        self.dir.join(match self.version {
            CgroupVersion::V1 => "freezer.state",
            CgroupVersion::V2 => "cgroup.freeze",
        })
    }

    fn request(&self, frozen: bool) -> io::Result<()> {
        let value = match (self.version, frozen) {
            (CgroupVersion::V1, true) => "FROZEN",
            (CgroupVersion::V1, false) => "THAWED",
            (CgroupVersion::V2, true) => "1",
            (CgroupVersion::V2, false) => "0",
        };
        let path = self.control_file();
        std::fs::write(&path, value).map_err(|e| io::Error::new(e.kind(), format!("write {value} to {}: {e}", path.display())))
    }

    fn is_frozen(&self) -> io::Result<bool> {
        let (path, frozen) = match self.version {
            CgroupVersion::V1 => (self.dir.join("freezer.state"), "FROZEN"),
            CgroupVersion::V2 => (self.dir.join("cgroup.events"), "frozen 1"),
        };
        let text = std::fs::read_to_string(&path).map_err(|e| io::Error::new(e.kind(), format!("read {}: {e}", path.display())))?;
        Ok(text.lines().any(|l| l.trim() == frozen))
    }

    fn wait_frozen(&self) -> io::Result<()> {
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        let mut last_request = start;
        loop {
            if self.is_frozen()? {
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{} did not freeze within {:?} (a task in uninterruptible sleep?)", self.dir.display(), self.timeout),
                ));
            }
            // v1 can stay FREEZING when tasks fork while it freezes; asking again moves it on.
            if self.version == CgroupVersion::V1 && last_request.elapsed() > Duration::from_millis(10) {
                self.request(true)?;
                last_request = Instant::now();
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

impl Freezer for CgroupFreezer {
    fn freeze(&self) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.depth > 0 {
            st.depth += 1;
            return Ok(());
        }
        if self.is_frozen()? {
            log::debug!("{} is already frozen: leaving it frozen after the checkpoint", self.dir.display());
            *st = FreezeState { depth: 1, external: true };
            return Ok(());
        }
        self.request(true)?;
        if let Err(e) = self.wait_frozen() {
            if let Err(t) = self.request(false) {
                log::error!("thawing {} after a failed freeze: {t}", self.dir.display());
            }
            return Err(e);
        }
        *st = FreezeState { depth: 1, external: false };
        Ok(())
    }

    fn thaw(&self) -> io::Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.depth == 0 {
            return Ok(());
        }
        st.depth -= 1;
        if st.depth > 0 {
            return Ok(());
        }
        if std::mem::take(&mut st.external) {
            return Ok(());
        }
        self.request(false)
    }
}

/// Thaws on drop unless thawed explicitly: every error path between freeze and thaw resumes
/// the container.
struct Frozen<'a> {
    freezer: &'a dyn Freezer,
    armed: bool,
}

impl<'a> Frozen<'a> {
    fn new(freezer: &'a dyn Freezer) -> Result<Frozen<'a>, LayerError> {
        freezer.freeze().map_err(LayerError::Freeze)?;
        Ok(Frozen { freezer, armed: true })
    }

    fn thaw(mut self) -> io::Result<()> {
        self.armed = false;
        self.freezer.thaw()
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.freezer.thaw() {
                log::error!("thawing the container after a failed capture: {e}");
            }
        }
    }
}

/// Writes the layer of `diff` (paths of the container whose overlay upperdir is `upperdir`)
/// into `store`, freezing the container with `freezer` only while the entries are read.
pub fn write_fs_layer(
    store: &Store,
    upperdir: &Path,
    diff: &FsDiffPaths<'_>,
    freezer: &dyn Freezer,
) -> Result<(Descriptor, LayerStats), LayerError> {
    let start = Instant::now();
    let paths = plan(diff)?;
    let upper = open_dir_at(libc::AT_FDCWD, &cstring(upperdir.as_os_str().as_bytes(), upperdir)?, false)
        .map_err(|e| LayerError::upper("open", upperdir, e))?;
    let tar_tmp = store.temp_file("layer.tar")?;
    let tar_file = tar_tmp.file.try_clone().map_err(|e| StoreError::io("dup", tar_tmp.path(), e))?;
    let mut capture = Capture {
        upper,
        upperdir,
        tar: TarWriter::new(BufWriter::with_capacity(1 << 20, tar_file), tar_tmp.path().to_path_buf()),
        links: HashMap::new(),
        parent: None,
        buf: vec![0; 1 << 20],
        copy_file_range: true,
    };

    let freeze_start = Instant::now();
    let frozen = Frozen::new(freezer)?;
    let capture_start = Instant::now();
    let captured = capture.run(&paths);
    let capture_time = capture_start.elapsed();
    let thawed = frozen.thaw();
    let freeze_time = freeze_start.elapsed();
    match (captured, thawed) {
        (Ok(()), Ok(())) => {}
        (Err(e), Ok(())) => return Err(e),
        (Ok(()), Err(t)) => return Err(LayerError::Thaw(t)),
        (Err(e), Err(t)) => {
            log::error!("thawing the container after a failed capture: {t}");
            return Err(e);
        }
    }

    let entries = capture.tar.entries;
    let bytes = capture.tar.finish()?;
    let desc = compress(store, tar_tmp, bytes)?;
    let stats = LayerStats {
        entries,
        bytes,
        compressed: desc.size,
        freeze: freeze_time,
        capture: capture_time,
        total: start.elapsed(),
    };
    log::debug!(
        "fs layer {}: {} entries, {} bytes ({} compressed), frozen {:?}, total {:?}",
        desc.digest,
        stats.entries,
        stats.bytes,
        stats.compressed,
        stats.freeze,
        stats.total
    );
    Ok((desc, stats))
}

/// Upperdir-relative paths to capture, in path order (parents first, each subtree contiguous).
fn plan(diff: &FsDiffPaths<'_>) -> Result<BTreeSet<PathBuf>, LayerError> {
    let mut out = BTreeSet::new();
    for p in diff.added.iter().chain(diff.modified).chain(diff.deleted) {
        let mut comps = p.components();
        if comps.next() != Some(Component::RootDir) {
            return Err(LayerError::InvalidPath(p.clone()));
        }
        let mut rel = PathBuf::new();
        for c in comps {
            match c {
                Component::Normal(n) => rel.push(n),
                Component::CurDir => {}
                _ => return Err(LayerError::InvalidPath(p.clone())),
            }
        }
        out.insert(rel);
    }
    Ok(out)
}

/// Compresses the finished temporary tar into a blob, hashing both, and stores it.
fn compress(store: &Store, tar_tmp: super::store::TempFile, tar_len: u64) -> Result<Descriptor, LayerError> {
    let tar_path = tar_tmp.path().to_path_buf();
    let mut tar = tar_tmp;
    tar.file().rewind().map_err(|e| StoreError::io("seek", &tar_path, e))?;
    let mut blob = store.temp_file("layer.tar.zst")?;
    let blob_path = blob.path().to_path_buf();
    let out = HashingWriter { inner: BufWriter::with_capacity(1 << 20, blob.file()), hash: Sha256::new(), len: 0 };
    let write_err = |e: io::Error| StoreError::io("write", &blob_path, e);
    let mut enc = zstd::stream::write::Encoder::new(out, ZSTD_LEVEL).map_err(write_err)?;
    enc.include_checksum(true).map_err(write_err)?;
    enc.set_pledged_src_size(Some(tar_len)).map_err(write_err)?;
    let mut diff_hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match tar.file().read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(StoreError::io("read", &tar_path, e).into()),
        };
        diff_hash.update(&buf[..n]);
        enc.write_all(&buf[..n]).map_err(write_err)?;
    }
    let mut out = enc.finish().map_err(write_err)?;
    out.inner.flush().map_err(write_err)?;
    let desc = Descriptor {
        digest: digest_string(out.hash),
        diff_id: digest_string(diff_hash),
        size: out.len,
        media_type: MEDIA_TYPE_LAYER_ZSTD.to_owned(),
    };
    drop(tar);
    store.put_blob_hashed(&blob_path, &desc)?;
    Ok(desc)
}

struct HashingWriter<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// Reads upperdir entries into the temporary tar (while the container is frozen).
struct Capture<'a> {
    upper: OwnedFd,
    upperdir: &'a Path,
    tar: TarWriter<BufWriter<File>>,
    /// (dev, ino) of regular files with several links -> the tar name they were first written as.
    links: HashMap<(u64, u64), Vec<u8>>,
    /// The directory fd of the last parent looked up (siblings come together in path order).
    parent: Option<(PathBuf, OwnedFd)>,
    buf: Vec<u8>,
    /// Cleared once the kernel refuses copy_file_range between the two filesystems.
    copy_file_range: bool,
}

/// Whether the entries below a captured path still need visiting.
#[derive(PartialEq, Eq)]
enum Below {
    /// A plain directory: its listed children come next.
    Listed,
    /// Not a directory, a whiteout, or a directory whose subtree was written whole.
    Covered,
}

impl Capture<'_> {
    fn run(&mut self, paths: &BTreeSet<PathBuf>) -> Result<(), LayerError> {
        let mut covered: Option<&Path> = None;
        for rel in paths {
            if covered.is_some_and(|c| rel.starts_with(c)) {
                continue;
            }
            covered = None;
            let below = if rel.as_os_str().is_empty() {
                let fd = dup(self.upper.as_raw_fd()).map_err(|e| LayerError::upper("dup", self.upperdir, e))?;
                let st = fstat(fd.as_raw_fd()).map_err(|e| LayerError::upper("stat", self.upperdir, e))?;
                self.dir(fd, &st, rel, false)?
            } else {
                let parent = rel.parent().unwrap_or(Path::new(""));
                let name = rel.file_name().expect("a normal last component");
                let Some(pfd) = self.parent_fd(parent)? else {
                    // The parent is gone or no longer a directory: its own change covers this
                    // path (in this diff, or in the next one if it happened after the diff).
                    log::debug!("layer: {} has no parent directory in the upperdir any more", rel.display());
                    covered = Some(rel);
                    continue;
                };
                self.entry(pfd, name.as_bytes(), rel, false)?
            };
            if below == Below::Covered {
                covered = Some(rel);
            }
        }
        Ok(())
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
            let at = cur.as_ref().map_or(self.upper.as_raw_fd(), |f| f.as_raw_fd());
            let c = cstring(name.as_bytes(), &done)?;
            match open_dir_at(at, &c, true) {
                Ok(fd) => cur = Some(fd),
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP)) => return Ok(None),
                Err(e) => return Err(LayerError::upper("open", &self.upperdir.join(&done), e)),
            }
        }
        let fd = match cur {
            Some(fd) => fd,
            None => dup(self.upper.as_raw_fd()).map_err(|e| LayerError::upper("dup", self.upperdir, e))?,
        };
        let raw = fd.as_raw_fd();
        self.parent = Some((parent.to_path_buf(), fd));
        Ok(Some(raw))
    }

    /// Captures the entry `name` of directory `pfd` (upperdir-relative `rel`); `whole` when it
    /// lies in an opaque directory being written whole.
    fn entry(&mut self, pfd: RawFd, name: &[u8], rel: &Path, whole: bool) -> Result<Below, LayerError> {
        let path = || self.upperdir.join(rel);
        let cname = cstring(name, rel)?;
        let st = match fstatat(pfd, &cname) {
            Ok(st) => st,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                // Deleted, or gone since the diff (a deletion of an image path leaves a
                // whiteout, so a path gone without one was never in the image).
                self.tar.whiteout(rel)?;
                return Ok(Below::Covered);
            }
            Err(e) => return Err(LayerError::upper("stat", &path(), e)),
        };
        match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                let fd = open_dir_at(pfd, &cname, true).map_err(|e| LayerError::upper("open", &path(), e))?;
                let fst = fstat(fd.as_raw_fd()).map_err(|e| LayerError::upper("stat", &path(), e))?;
                if fst.st_ino != st.st_ino {
                    return Err(LayerError::Changed { path: path(), reason: "replaced while being read".into() });
                }
                self.dir(fd, &fst, rel, whole)
            }
            libc::S_IFREG => self.file(pfd, &cname, &st, rel),
            libc::S_IFCHR if st.st_rdev == 0 => {
                self.tar.whiteout(rel)?;
                Ok(Below::Covered)
            }
            libc::S_IFLNK => {
                let target = readlinkat(pfd, &cname).map_err(|e| LayerError::upper("readlink", &path(), e))?;
                let xattrs = self.path_xattrs(pfd, name, rel)?;
                let name = tar_name(rel, false);
                self.tar.append(&TarEntry { link: &target, xattrs: &xattrs.other, ..TarEntry::from_stat(&name, b'2', &st) })?;
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
                let dev = if kind == b'6' { (0, 0) } else { (libc::major(st.st_rdev), libc::minor(st.st_rdev)) };
                self.tar.append(&TarEntry { dev, xattrs: &xattrs.other, ..TarEntry::from_stat(&name, kind, &st) })?;
                Ok(Below::Covered)
            }
            _ => {
                // A tar cannot hold a socket; whoever listens on it recreates it.
                log::warn!("layer: skipping socket {}", path().display());
                Ok(Below::Covered)
            }
        }
    }

    fn dir(&mut self, fd: OwnedFd, st: &libc::stat, rel: &Path, whole: bool) -> Result<Below, LayerError> {
        let path = self.upperdir.join(rel);
        let xattrs = Xattrs::read(&XattrSource::Fd(fd.as_raw_fd())).map_err(|e| LayerError::upper("xattrs", &path, e))?;
        if let Some(r) = &xattrs.redirect {
            return Err(LayerError::Unsupported {
                path,
                reason: format!("a directory renamed with overlay redirect_dir (redirect {:?})", String::from_utf8_lossy(r)),
            });
        }
        let name = tar_name(rel, true);
        self.tar.append(&TarEntry { xattrs: &xattrs.other, ..TarEntry::from_stat(&name, b'5', st) })?;
        if !(xattrs.opaque || whole) {
            return Ok(Below::Listed);
        }
        if xattrs.opaque {
            self.tar.append(&TarEntry::whiteout(&child_name(rel, OPAQUE_MARKER)))?;
        }
        let mut names = list_dir(fd.as_raw_fd()).map_err(|e| LayerError::upper("readdir", &path, e))?;
        names.sort();
        for child in names {
            let child_rel = rel.join(OsString::from_vec(child.clone()));
            self.entry(fd.as_raw_fd(), &child, &child_rel, true)?;
        }
        Ok(Below::Covered)
    }

    fn file(&mut self, pfd: RawFd, cname: &CStr, st: &libc::stat, rel: &Path) -> Result<Below, LayerError> {
        let path = || self.upperdir.join(rel);
        let fd = open_file_at(pfd, cname).map_err(|e| LayerError::upper("open", &path(), e))?;
        let fst = fstat(fd.as_raw_fd()).map_err(|e| LayerError::upper("stat", &path(), e))?;
        if fst.st_mode & libc::S_IFMT != libc::S_IFREG || fst.st_ino != st.st_ino {
            return Err(LayerError::Changed { path: path(), reason: "replaced while being read".into() });
        }
        let xattrs = Xattrs::read(&XattrSource::Fd(fd.as_raw_fd())).map_err(|e| LayerError::upper("xattrs", &path(), e))?;
        if xattrs.whiteout && fst.st_size == 0 {
            self.tar.whiteout(rel)?;
            return Ok(Below::Covered);
        }
        if xattrs.metacopy {
            return Err(LayerError::Unsupported { path: path(), reason: "an overlay metacopy file (its data is in a lower layer)".into() });
        }
        let name = tar_name(rel, false);
        if fst.st_nlink > 1 {
            let key = (fst.st_dev, fst.st_ino);
            if let Some(first) = self.links.get(&key) {
                let first = first.clone();
                self.tar.append(&TarEntry { link: &first, size: 0, ..TarEntry::from_stat(&name, b'1', &fst) })?;
                return Ok(Below::Covered);
            }
            self.links.insert(key, name.clone());
        }
        let size = fst.st_size as u64;
        self.tar.append(&TarEntry { size, xattrs: &xattrs.other, ..TarEntry::from_stat(&name, b'0', &fst) })?;
        self.copy_data(fd.as_raw_fd(), size, rel)?;
        self.tar.pad(size)?;
        Ok(Below::Covered)
    }

    /// Copies exactly `size` bytes of `src` into the tar: in the kernel where both files'
    /// filesystems allow it, through a buffer otherwise.
    fn copy_data(&mut self, src: RawFd, size: u64, rel: &Path) -> Result<(), LayerError> {
        let shrank = || LayerError::Changed { path: self.upperdir.join(rel), reason: "the file shrank while being read".into() };
        let mut left = size;
        if self.copy_file_range && left > 0 {
            self.tar.flush()?;
            let dst = self.tar.out.get_ref().as_raw_fd();
            while left > 0 {
                let chunk = left.min(1 << 30) as usize;
                let n = unsafe { libc::copy_file_range(src, std::ptr::null_mut(), dst, std::ptr::null_mut(), chunk, 0) };
                if n > 0 {
                    left -= n as u64;
                    self.tar.bytes += n as u64;
                    continue;
                }
                if n == 0 {
                    return Err(shrank());
                }
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EXDEV) | Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => {
                        self.copy_file_range = false;
                        break;
                    }
                    Some(libc::EINTR) => continue,
                    _ if super::store::is_no_space(&e) => return Err(StoreError::io("write", &self.tar.path, e).into()),
                    _ => return Err(LayerError::upper("copy", &self.upperdir.join(rel), e)),
                }
            }
        }
        while left > 0 {
            let chunk = left.min(self.buf.len() as u64) as usize;
            let n = unsafe { libc::read(src, self.buf.as_mut_ptr().cast(), chunk) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(LayerError::upper("read", &self.upperdir.join(rel), e));
            }
            if n == 0 {
                return Err(shrank());
            }
            let n = n as usize;
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
        Xattrs::read(&XattrSource::Path(&c)).map_err(|e| LayerError::upper("xattrs", &self.upperdir.join(rel), e))
    }
}

/// Tar name of an upperdir-relative path (`./` for the root, a trailing `/` for directories).
fn tar_name(rel: &Path, dir: bool) -> Vec<u8> {
    let mut name = rel.as_os_str().as_bytes().to_vec();
    if name.is_empty() {
        return b"./".to_vec();
    }
    if dir {
        name.push(b'/');
    }
    name
}

/// `<rel>/<child>` as a tar name.
fn child_name(rel: &Path, child: &[u8]) -> Vec<u8> {
    let mut name = rel.as_os_str().as_bytes().to_vec();
    if !name.is_empty() {
        name.push(b'/');
    }
    name.extend_from_slice(child);
    name
}

/// `<dir>/.wh.<name>` for upperdir-relative `rel`.
fn whiteout_name(rel: &Path) -> Vec<u8> {
    let parent = rel.parent().unwrap_or(Path::new(""));
    let mut base = WHITEOUT_PREFIX.to_vec();
    base.extend_from_slice(rel.file_name().map(|n| n.as_bytes()).unwrap_or_default());
    child_name(parent, &base)
}

// ---- xattrs ----

enum XattrSource<'a> {
    Fd(RawFd),
    /// Not followed if it is a symlink.
    Path(&'a CStr),
}

/// An entry's xattrs as a layer carries them, and the overlayfs state among them.
#[derive(Debug, Default)]
struct Xattrs {
    other: Vec<(Vec<u8>, Vec<u8>)>,
    opaque: bool,
    redirect: Option<Vec<u8>>,
    metacopy: bool,
    whiteout: bool,
}

impl Xattrs {
    fn read(src: &XattrSource) -> io::Result<Xattrs> {
        let names = match read_sized(|buf, len| unsafe {
            match src {
                XattrSource::Fd(fd) => libc::flistxattr(*fd, buf, len),
                XattrSource::Path(p) => libc::llistxattr(p.as_ptr(), buf, len),
            }
        }) {
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => return Ok(Xattrs::default()),
            Err(e) => return Err(e),
        };
        let mut out = Xattrs::default();
        for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            let Ok(cname) = CString::new(name) else { continue };
            let value = match read_sized(|buf, len| unsafe {
                match src {
                    XattrSource::Fd(fd) => libc::fgetxattr(*fd, cname.as_ptr(), buf.cast(), len),
                    XattrSource::Path(p) => libc::lgetxattr(p.as_ptr(), cname.as_ptr(), buf.cast(), len),
                }
            }) {
                Ok(v) => v,
                Err(e) if e.raw_os_error() == Some(libc::ENODATA) => continue,
                Err(e) => return Err(e),
            };
            match classify_xattr(name) {
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

enum XattrClass<'a> {
    /// An xattr of the container's file, under the name the container sees.
    Plain(Vec<u8>),
    /// overlayfs' own state (`trusted.overlay.X` or, with `userxattr`, `user.overlay.X`).
    Overlay(&'a [u8]),
}

fn classify_xattr(name: &[u8]) -> XattrClass<'_> {
    for prefix in [b"trusted.overlay.".as_slice(), b"user.overlay.".as_slice()] {
        if let Some(rest) = name.strip_prefix(prefix) {
            // overlayfs stores the container's own `*.overlay.X` xattrs escaped as `*.overlay.overlay.X`.
            return match rest.strip_prefix(b"overlay.".as_slice()) {
                Some(escaped) => XattrClass::Plain([prefix, escaped].concat()),
                None => XattrClass::Overlay(rest),
            };
        }
    }
    XattrClass::Plain(name.to_vec())
}

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

// ---- syscalls ----

fn cstring(bytes: &[u8], for_path: &Path) -> Result<CString, LayerError> {
    CString::new(bytes).map_err(|_| LayerError::InvalidPath(for_path.to_path_buf()))
}

fn check_fd(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

fn open_dir_at(at: RawFd, name: &CStr, nofollow: bool) -> io::Result<OwnedFd> {
    let mut flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC;
    if nofollow {
        flags |= libc::O_NOFOLLOW;
    }
    check_fd(unsafe { libc::openat(at, name.as_ptr(), flags) })
}

fn open_file_at(at: RawFd, name: &CStr) -> io::Result<OwnedFd> {
    // O_NONBLOCK: never wait on a file that turned into a fifo; O_NOATIME: reading is no access.
    let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    match check_fd(unsafe { libc::openat(at, name.as_ptr(), flags | libc::O_NOATIME) }) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => check_fd(unsafe { libc::openat(at, name.as_ptr(), flags) }),
        r => r,
    }
}

fn dup(fd: RawFd) -> io::Result<OwnedFd> {
    check_fd(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) })
}

fn fstatat(at: RawFd, name: &CStr) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    if unsafe { libc::fstatat(at, name.as_ptr(), st.as_mut_ptr(), libc::AT_SYMLINK_NOFOLLOW) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { st.assume_init() })
}

fn fstat(fd: RawFd) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(unsafe { st.assume_init() })
}

fn readlinkat(at: RawFd, name: &CStr) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 256];
    loop {
        let n = unsafe { libc::readlinkat(at, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if (n as usize) < buf.len() {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        buf.resize(buf.len() * 4, 0);
    }
}

/// Names in directory `fd` (without `.` and `..`).
fn list_dir(fd: RawFd) -> io::Result<Vec<Vec<u8>>> {
    // The magic link resolves to exactly the directory `fd` holds, whatever its path now.
    std::fs::read_dir(format!("/proc/self/fd/{fd}"))?
        .map(|e| e.map(|e| e.file_name().into_vec()))
        .collect()
}

// ---- tar (POSIX pax) ----

/// One tar entry; the fields a kind does not use stay zero/empty.
struct TarEntry<'a> {
    name: &'a [u8],
    kind: u8,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    mtime: (i64, i64),
    link: &'a [u8],
    dev: (u32, u32),
    xattrs: &'a [(Vec<u8>, Vec<u8>)],
}

impl<'a> TarEntry<'a> {
    fn from_stat(name: &'a [u8], kind: u8, st: &libc::stat) -> TarEntry<'a> {
        TarEntry {
            name,
            kind,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            size: 0,
            mtime: (st.st_mtime, st.st_mtime_nsec),
            link: b"",
            dev: (0, 0),
            xattrs: &[],
        }
    }

    fn whiteout(name: &'a [u8]) -> TarEntry<'a> {
        TarEntry { name, kind: b'0', mode: 0, uid: 0, gid: 0, size: 0, mtime: (0, 0), link: b"", dev: (0, 0), xattrs: &[] }
    }
}

struct TarWriter<W: Write> {
    out: W,
    /// The temporary tar (for errors: a full disk there is the store's).
    path: PathBuf,
    bytes: u64,
    entries: u64,
}

impl TarWriter<BufWriter<File>> {
    fn new(out: BufWriter<File>, path: PathBuf) -> Self {
        TarWriter { out, path, bytes: 0, entries: 0 }
    }

    fn err(&self, e: io::Error) -> LayerError {
        StoreError::io("write", &self.path, e).into()
    }

    fn write_raw(&mut self, data: &[u8]) -> Result<(), LayerError> {
        self.out.write_all(data).map_err(|e| self.err(e))?;
        self.bytes += data.len() as u64;
        Ok(())
    }

    fn flush(&mut self) -> Result<(), LayerError> {
        self.out.flush().map_err(|e| self.err(e))
    }

    fn append(&mut self, e: &TarEntry) -> Result<(), LayerError> {
        let header = encode_header(e);
        self.write_raw(&header)?;
        self.entries += 1;
        Ok(())
    }

    fn whiteout(&mut self, rel: &Path) -> Result<(), LayerError> {
        self.append(&TarEntry::whiteout(&whiteout_name(rel)))
    }

    /// Zeros after `size` bytes of data, up to the next block.
    fn pad(&mut self, size: u64) -> Result<(), LayerError> {
        let rem = (size % 512) as usize;
        if rem != 0 {
            self.write_raw(&[0u8; 512][..512 - rem])?;
        }
        Ok(())
    }

    /// The end-of-archive blocks; returns the tar's length.
    fn finish(&mut self) -> Result<u64, LayerError> {
        self.write_raw(&[0u8; 1024])?;
        self.flush()?;
        Ok(self.bytes)
    }
}

/// The blocks preceding an entry's data: a pax extended header where the ustar header cannot
/// say everything (long names, big numbers, sub-second mtimes, xattrs), then the ustar header.
fn encode_header(e: &TarEntry) -> Vec<u8> {
    let mut pax = Vec::new();
    let mut block = [0u8; 512];
    match split_ustar_name(e.name) {
        Some((prefix, name)) => {
            block[..name.len()].copy_from_slice(name);
            block[345..345 + prefix.len()].copy_from_slice(prefix);
        }
        None => {
            pax_record(&mut pax, b"path", e.name);
            let n = e.name.len().min(100);
            block[..n].copy_from_slice(&e.name[..n]);
        }
    }
    if e.link.len() <= 100 {
        block[157..157 + e.link.len()].copy_from_slice(e.link);
    } else {
        pax_record(&mut pax, b"linkpath", e.link);
        block[157..257].copy_from_slice(&e.link[..100]);
    }
    octal(&mut block[100..108], u64::from(e.mode));
    for (range, key, v) in [(108..116, "uid", e.uid), (116..124, "gid", e.gid)] {
        if !octal(&mut block[range], u64::from(v)) {
            pax_record(&mut pax, key.as_bytes(), v.to_string().as_bytes());
        }
    }
    if !octal(&mut block[124..136], e.size) {
        pax_record(&mut pax, b"size", e.size.to_string().as_bytes());
    }
    let (secs, nsec) = e.mtime;
    // The header keeps whole seconds where they fit (readers without pax still get those).
    let fits = octal(&mut block[136..148], u64::try_from(secs).unwrap_or(u64::MAX));
    if !fits {
        octal(&mut block[136..148], 0);
    }
    if !fits || nsec != 0 {
        pax_record(&mut pax, b"mtime", pax_time(secs, nsec).as_bytes());
    }
    block[156] = e.kind;
    block[257..263].copy_from_slice(b"ustar\0");
    block[263..265].copy_from_slice(b"00");
    if e.kind == b'3' || e.kind == b'4' {
        for (range, key, v) in [(329..337, "SCHILY.devmajor", e.dev.0), (337..345, "SCHILY.devminor", e.dev.1)] {
            if !octal(&mut block[range], u64::from(v)) {
                pax_record(&mut pax, key.as_bytes(), v.to_string().as_bytes());
            }
        }
    }
    for (name, value) in e.xattrs {
        pax_record(&mut pax, &[b"SCHILY.xattr.".as_slice(), name].concat(), value);
    }
    checksum(&mut block);

    let mut out = Vec::with_capacity(if pax.is_empty() { 512 } else { 1024 + pax.len() });
    if !pax.is_empty() {
        let mut xh = [0u8; 512];
        let base = e.name.strip_suffix(b"/").unwrap_or(e.name);
        let base = base.rsplit(|b| *b == b'/').next().unwrap_or(base);
        let xname = [b"PaxHeaders.0/".as_slice(), &base[..base.len().min(87)]].concat();
        xh[..xname.len()].copy_from_slice(&xname);
        octal(&mut xh[100..108], 0o644);
        octal(&mut xh[108..116], 0);
        octal(&mut xh[116..124], 0);
        octal(&mut xh[124..136], pax.len() as u64);
        octal(&mut xh[136..148], 0);
        xh[156] = b'x';
        xh[257..263].copy_from_slice(b"ustar\0");
        xh[263..265].copy_from_slice(b"00");
        checksum(&mut xh);
        out.extend_from_slice(&xh);
        out.extend_from_slice(&pax);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.extend_from_slice(&block);
    out
}

/// ustar's (prefix, name) split of a path, if it fits.
fn split_ustar_name(path: &[u8]) -> Option<(&[u8], &[u8])> {
    if path.len() <= 100 {
        return Some((b"", path));
    }
    (0..path.len().min(156))
        .rev()
        .filter(|&i| path[i] == b'/')
        .map(|i| (&path[..i], &path[i + 1..]))
        .find(|(_, name)| !name.is_empty() && name.len() <= 100)
}

/// Zero-padded octal and a NUL in `field`; false (field zeroed) if `v` does not fit.
fn octal(field: &mut [u8], v: u64) -> bool {
    let digits = field.len() - 1;
    let s = format!("{v:0digits$o}");
    if s.len() > digits {
        field.fill(0);
        return false;
    }
    field[..digits].copy_from_slice(s.as_bytes());
    field[digits] = 0;
    true
}

fn checksum(block: &mut [u8; 512]) {
    block[148..156].fill(b' ');
    let sum: u32 = block.iter().map(|&b| u32::from(b)).sum();
    block[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

/// `<len> <key>=<value>\n`, where `len` counts the whole record including itself.
fn pax_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    let rest = key.len() + value.len() + 3;
    let mut len = rest + 1;
    while len != rest + len.to_string().len() {
        len = rest + len.to_string().len();
    }
    out.extend_from_slice(len.to_string().as_bytes());
    out.push(b' ');
    out.extend_from_slice(key);
    out.push(b'=');
    out.extend_from_slice(value);
    out.push(b'\n');
}

/// A pax time: seconds and a 9-digit fraction (negative times count down from the epoch).
fn pax_time(secs: i64, nsec: i64) -> String {
    if nsec == 0 {
        return secs.to_string();
    }
    if secs >= 0 {
        return format!("{secs}.{nsec:09}");
    }
    // (secs, nsec) means secs + nsec/1e9: -2 s + 0.5 s is -1.5 s.
    format!("-{}.{:09}", -(secs + 1), 1_000_000_000 - nsec)
}


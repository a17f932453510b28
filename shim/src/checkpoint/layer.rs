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
//! - a regular file with holes (`SEEK_DATA`/`SEEK_HOLE`) is stored with its holes, as a PAX
//!   GNU sparse 1.0 entry (the format GNU tar writes with `--sparse --posix`, and that Go's
//!   `archive/tar`, hence containerd's differ, GNU tar and libarchive read back): a sparse map
//!   and the data extents only. A `truncate -s 1T` file costs a few blocks, not a terabyte.
//!   (containerd's differ then writes the holes back as zeros when it unpacks the layer: the
//!   restored file has the same size and data, but is not sparse.)
//!
//! What one layer may cost is bounded ([`LayerOptions`]): file data beyond `max_bytes` fails the
//! layer before anything is copied, and an opaque subtree is walked with an explicit stack at
//! most `max_depth` deep; only the mount's own overlay xattr prefix is overlay state.
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
use crate::inspector::{
    fs::{FsDiff, OverlayXattrs},
    FsFinding,
};

/// zstd level: fast enough to keep up with a disk, off the critical path anyway (after the thaw).
const ZSTD_LEVEL: i32 = 3;
const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";
/// Data extents of one sparse file kept apart; beyond this, the closest extents are merged
/// (the zeros between them are stored) so that a file of a million tiny holes stays bounded.
const MAX_SPARSE_EXTENTS: usize = 4096;

/// Bounds on one layer (`[limits]` in crab's config) and the mount's overlay xattr prefix.
#[derive(Debug, Clone, Copy)]
pub struct LayerOptions {
    /// Bytes of file data (holes excluded), uncompressed.
    pub max_bytes: u64,
    /// Directory levels of an opaque subtree written whole.
    pub max_depth: u32,
    pub xattrs: OverlayXattrs,
}

impl Default for LayerOptions {
    fn default() -> Self {
        let c = crab_runtime_config::LimitsConfig::default();
        LayerOptions {
            max_bytes: c.max_layer_bytes,
            max_depth: c.max_walk_depth,
            xattrs: OverlayXattrs::Trusted,
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
}

impl LayerError {
    /// The store's filesystem is full: nothing was published and no temporary file is left.
    pub fn is_no_space(&self) -> bool {
        matches!(self, LayerError::Store(e) if e.is_no_space())
    }

    fn upper(op: &'static str, path: &Path, source: io::Error) -> LayerError {
        LayerError::Upper {
            op,
            path: path.to_path_buf(),
            source,
        }
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
        FsDiffPaths {
            added: &d.added,
            modified: &d.modified,
            deleted: &d.deleted,
        }
    }
}

impl<'a> From<&'a FsFinding> for FsDiffPaths<'a> {
    fn from(f: &'a FsFinding) -> Self {
        FsDiffPaths {
            added: &f.added,
            modified: &f.modified,
            deleted: &f.deleted,
        }
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
        let cgroups =
            crate::cgroup::Cgroups::of(pid).map_err(|e| io::Error::other(e.to_string()))?;
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
        CgroupFreezer {
            dir,
            version,
            timeout: Duration::from_secs(5),
            state: Mutex::default(),
        }
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
        std::fs::write(&path, value).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("write {value} to {}: {e}", path.display()),
            )
        })
    }

    fn is_frozen(&self) -> io::Result<bool> {
        let (path, frozen) = match self.version {
            CgroupVersion::V1 => (self.dir.join("freezer.state"), "FROZEN"),
            CgroupVersion::V2 => (self.dir.join("cgroup.events"), "frozen 1"),
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| io::Error::new(e.kind(), format!("read {}: {e}", path.display())))?;
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
                    format!(
                        "{} did not freeze within {:?} (a task in uninterruptible sleep?)",
                        self.dir.display(),
                        self.timeout
                    ),
                ));
            }
            // v1 can stay FREEZING when tasks fork while it freezes; asking again moves it on.
            if self.version == CgroupVersion::V1
                && last_request.elapsed() > Duration::from_millis(10)
            {
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
            log::debug!(
                "{} is already frozen: leaving it frozen after the checkpoint",
                self.dir.display()
            );
            *st = FreezeState {
                depth: 1,
                external: true,
            };
            return Ok(());
        }
        self.request(true)?;
        if let Err(e) = self.wait_frozen() {
            if let Err(t) = self.request(false) {
                log::error!("thawing {} after a failed freeze: {t}", self.dir.display());
            }
            return Err(e);
        }
        *st = FreezeState {
            depth: 1,
            external: false,
        };
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
        Ok(Frozen {
            freezer,
            armed: true,
        })
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
    write_fs_layer_with(store, upperdir, diff, freezer, &LayerOptions::default())
}

/// [`write_fs_layer`] within `opts`.
pub fn write_fs_layer_with(
    store: &Store,
    upperdir: &Path,
    diff: &FsDiffPaths<'_>,
    freezer: &dyn Freezer,
    opts: &LayerOptions,
) -> Result<(Descriptor, LayerStats), LayerError> {
    let start = Instant::now();
    let paths = plan(diff)?;
    let upper = open_dir_at(
        libc::AT_FDCWD,
        &cstring(upperdir.as_os_str().as_bytes(), upperdir)?,
        false,
    )
    .map_err(|e| LayerError::upper("open", upperdir, e))?;
    let tar_tmp = store.temp_file("layer.tar")?;
    let tar_file = tar_tmp
        .file
        .try_clone()
        .map_err(|e| StoreError::io("dup", tar_tmp.path(), e))?;
    let mut capture = Capture {
        upper,
        upperdir,
        tar: TarWriter::new(
            BufWriter::with_capacity(1 << 20, tar_file),
            tar_tmp.path().to_path_buf(),
        ),
        links: HashMap::new(),
        parent: None,
        buf: vec![0; 1 << 20],
        copy_file_range: true,
        opts: *opts,
        data_bytes: 0,
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
fn compress(
    store: &Store,
    tar_tmp: super::store::TempFile,
    tar_len: u64,
) -> Result<Descriptor, LayerError> {
    let tar_path = tar_tmp.path().to_path_buf();
    let mut tar = tar_tmp;
    tar.file()
        .rewind()
        .map_err(|e| StoreError::io("seek", &tar_path, e))?;
    let mut blob = store.temp_file("layer.tar.zst")?;
    let blob_path = blob.path().to_path_buf();
    let out = HashingWriter {
        inner: BufWriter::with_capacity(1 << 20, blob.file()),
        hash: Sha256::new(),
        len: 0,
    };
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
    opts: LayerOptions,
    /// File data written so far (holes excluded), against `opts.max_bytes`.
    data_bytes: u64,
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

impl Capture<'_> {
    fn run(&mut self, paths: &BTreeSet<PathBuf>) -> Result<(), LayerError> {
        let mut covered: Option<&Path> = None;
        for rel in paths {
            if covered.is_some_and(|c| rel.starts_with(c)) {
                continue;
            }
            covered = None;
            let below = if rel.as_os_str().is_empty() {
                let fd = dup(self.upper.as_raw_fd())
                    .map_err(|e| LayerError::upper("dup", self.upperdir, e))?;
                let st = fstat(fd.as_raw_fd())
                    .map_err(|e| LayerError::upper("stat", self.upperdir, e))?;
                self.dir(fd, &st, rel, false)?
            } else {
                let parent = rel.parent().unwrap_or(Path::new(""));
                let name = rel.file_name().expect("a normal last component");
                let Some(pfd) = self.parent_fd(parent)? else {
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
            if !matches!(below, Below::Listed) {
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
            let at = cur
                .as_ref()
                .map_or(self.upper.as_raw_fd(), |f| f.as_raw_fd());
            let c = cstring(name.as_bytes(), &done)?;
            match open_dir_at(at, &c, true) {
                Ok(fd) => cur = Some(fd),
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::ENOENT) | Some(libc::ENOTDIR) | Some(libc::ELOOP)
                    ) =>
                {
                    return Ok(None)
                }
                Err(e) => return Err(LayerError::upper("open", &self.upperdir.join(&done), e)),
            }
        }
        let fd = match cur {
            Some(fd) => fd,
            None => dup(self.upper.as_raw_fd())
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
                let fd = open_dir_at(pfd, &cname, true)
                    .map_err(|e| LayerError::upper("open", &path(), e))?;
                let fst =
                    fstat(fd.as_raw_fd()).map_err(|e| LayerError::upper("stat", &path(), e))?;
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
                let target = readlinkat(pfd, &cname)
                    .map_err(|e| LayerError::upper("readlink", &path(), e))?;
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

    fn dir(
        &mut self,
        fd: OwnedFd,
        st: &libc::stat,
        rel: &Path,
        whole: bool,
    ) -> Result<Below, LayerError> {
        let path = self.upperdir.join(rel);
        let xattrs = Xattrs::read(&XattrSource::Fd(fd.as_raw_fd()), self.opts.xattrs)
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
        let name = tar_name(rel, true);
        self.tar.append(&TarEntry {
            xattrs: &xattrs.other,
            ..TarEntry::from_stat(&name, b'5', st)
        })?;
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
        let fd = open_file_at(pfd, cname).map_err(|e| LayerError::upper("open", &path(), e))?;
        let fst = fstat(fd.as_raw_fd()).map_err(|e| LayerError::upper("stat", &path(), e))?;
        if fst.st_mode & libc::S_IFMT != libc::S_IFREG || fst.st_ino != st.st_ino {
            return Err(LayerError::Changed {
                path: path(),
                reason: "replaced while being read".into(),
            });
        }
        let xattrs = Xattrs::read(&XattrSource::Fd(fd.as_raw_fd()), self.opts.xattrs)
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
        let extents = data_extents(fd.as_raw_fd(), size, MAX_SPARSE_EXTENTS)
            .map_err(|e| LayerError::upper("seek", &path(), e))?;
        let data: u64 = extents.iter().map(|e| e.1).sum();
        self.charge(data, rel)?;
        if size == 0 || (extents.len() == 1 && extents[0] == (0, size)) {
            // SEEK_DATA/SEEK_HOLE moved the offset the copy reads from.
            if unsafe { libc::lseek(fd.as_raw_fd(), 0, libc::SEEK_SET) } < 0 {
                return Err(LayerError::upper(
                    "seek",
                    &path(),
                    io::Error::last_os_error(),
                ));
            }
            self.tar.append(&TarEntry {
                size,
                xattrs: &xattrs.other,
                ..TarEntry::from_stat(&name, b'0', &fst)
            })?;
            self.copy_data(fd.as_raw_fd(), size, rel)?;
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
            if unsafe { libc::lseek(fd.as_raw_fd(), offset as libc::off_t, libc::SEEK_SET) } < 0 {
                return Err(LayerError::upper(
                    "seek",
                    &path(),
                    io::Error::last_os_error(),
                ));
            }
            self.copy_data(fd.as_raw_fd(), len, rel)?;
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

    /// Copies exactly `size` bytes of `src` into the tar: in the kernel where both files'
    /// filesystems allow it, through a buffer otherwise.
    fn copy_data(&mut self, src: RawFd, size: u64, rel: &Path) -> Result<(), LayerError> {
        let shrank = || LayerError::Changed {
            path: self.upperdir.join(rel),
            reason: "the file shrank while being read".into(),
        };
        let mut left = size;
        if self.copy_file_range && left > 0 {
            self.tar.flush()?;
            let dst = self.tar.out.get_ref().as_raw_fd();
            while left > 0 {
                let chunk = left.min(1 << 30) as usize;
                let n = unsafe {
                    libc::copy_file_range(
                        src,
                        std::ptr::null_mut(),
                        dst,
                        std::ptr::null_mut(),
                        chunk,
                        0,
                    )
                };
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
                    Some(libc::EXDEV)
                    | Some(libc::EINVAL)
                    | Some(libc::ENOSYS)
                    | Some(libc::EOPNOTSUPP) => {
                        self.copy_file_range = false;
                        break;
                    }
                    Some(libc::EINTR) => continue,
                    _ if super::store::is_no_space(&e) => {
                        return Err(StoreError::io("write", &self.tar.path, e).into())
                    }
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
        Xattrs::read(&XattrSource::Path(&c), self.opts.xattrs)
            .map_err(|e| LayerError::upper("xattrs", &self.upperdir.join(rel), e))
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
    fn read(src: &XattrSource, overlay: OverlayXattrs) -> io::Result<Xattrs> {
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
            let Ok(cname) = CString::new(name) else {
                continue;
            };
            let value = match read_sized(|buf, len| unsafe {
                match src {
                    XattrSource::Fd(fd) => libc::fgetxattr(*fd, cname.as_ptr(), buf.cast(), len),
                    XattrSource::Path(p) => {
                        libc::lgetxattr(p.as_ptr(), cname.as_ptr(), buf.cast(), len)
                    }
                }
            }) {
                Ok(v) => v,
                Err(e) if e.raw_os_error() == Some(libc::ENODATA) => continue,
                Err(e) => return Err(e),
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

enum XattrClass<'a> {
    /// An xattr of the container's file, under the name the container sees.
    Plain(Vec<u8>),
    /// overlayfs' own state (`trusted.overlay.X` or, with `userxattr`, `user.overlay.X`).
    Overlay(&'a [u8]),
}

/// Only the mount's own prefix is overlay state: without `userxattr`, `user.overlay.opaque` is
/// an ordinary xattr the container set, which overlayfs ignores and the layer keeps as such.
fn classify_xattr(name: &[u8], overlay: OverlayXattrs) -> XattrClass<'_> {
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
/// that the extents separated by the smallest holes are merged.
fn data_extents(fd: RawFd, size: u64, max: usize) -> io::Result<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut min_gap = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // No data after `pos`: the rest is a hole.
                Some(libc::ENXIO) => break,
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) if pos == 0 => {
                    return Ok(vec![(0, size)])
                }
                _ => return Err(e),
            }
        }
        let data = (data as u64).min(size);
        let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
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
fn merge_extents(extents: &[(u64, u64)], gap: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(extents.len());
    for &(off, len) in extents {
        match out.last_mut() {
            Some(last) if off - (last.0 + last.1) <= gap => last.1 = off + len - last.0,
            _ => out.push((off, len)),
        }
    }
    out
}

/// The sparse map that starts a GNU sparse 1.0 entry's data: the number of extents, then each
/// extent's offset and length, as decimal lines, padded with NULs to a whole block.
fn sparse_map(extents: &[(u64, u64)]) -> Vec<u8> {
    let mut map = format!("{}\n", extents.len()).into_bytes();
    for (off, len) in extents {
        map.extend_from_slice(format!("{off}\n{len}\n").as_bytes());
    }
    map.resize(map.len().div_ceil(512) * 512, 0);
    map
}

use crate::inspector::fs::read_sized;

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
    let flags =
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC;
    match check_fd(unsafe { libc::openat(at, name.as_ptr(), flags | libc::O_NOATIME) }) {
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
            check_fd(unsafe { libc::openat(at, name.as_ptr(), flags) })
        }
        r => r,
    }
}

fn dup(fd: RawFd) -> io::Result<OwnedFd> {
    check_fd(unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) })
}

fn fstatat(at: RawFd, name: &CStr) -> io::Result<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    if unsafe {
        libc::fstatat(
            at,
            name.as_ptr(),
            st.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    } != 0
    {
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
    /// A GNU sparse 1.0 file of this real size; `size` is then the stored map and data.
    sparse_size: Option<u64>,
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
            sparse_size: None,
        }
    }

    fn whiteout(name: &'a [u8]) -> TarEntry<'a> {
        TarEntry {
            name,
            kind: b'0',
            mode: 0,
            uid: 0,
            gid: 0,
            size: 0,
            mtime: (0, 0),
            link: b"",
            dev: (0, 0),
            xattrs: &[],
            sparse_size: None,
        }
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
        TarWriter {
            out,
            path,
            bytes: 0,
            entries: 0,
        }
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
    // A sparse file's header carries a placeholder name (as GNU tar's): readers that know the
    // format take the real one from GNU.sparse.name, others extract the map and data there.
    let placeholder;
    let header_name = match e.sparse_size {
        Some(real) => {
            pax_record(&mut pax, b"GNU.sparse.major", b"1");
            pax_record(&mut pax, b"GNU.sparse.minor", b"0");
            pax_record(&mut pax, b"GNU.sparse.name", e.name);
            pax_record(
                &mut pax,
                b"GNU.sparse.realsize",
                real.to_string().as_bytes(),
            );
            let base = e.name.rsplit(|b| *b == b'/').next().unwrap_or(e.name);
            placeholder = [b"GNUSparseFile.0/".as_slice(), &base[..base.len().min(80)]].concat();
            placeholder.as_slice()
        }
        None => e.name,
    };
    match split_ustar_name(header_name) {
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
    let fits = octal(
        &mut block[136..148],
        u64::try_from(secs).unwrap_or(u64::MAX),
    );
    if !fits {
        octal(&mut block[136..148], 0);
    }
    if !fits || nsec != 0 {
        pax_record(&mut pax, b"mtime", pax_time(secs, nsec).as_bytes());
    }
    block[156] = e.kind;
    block[257..263].copy_from_slice(b"ustar\0");
    block[263..265].copy_from_slice(b"00");
    for (range, key, v) in [
        (329..337, "SCHILY.devmajor", e.dev.0),
        (337..345, "SCHILY.devminor", e.dev.1),
    ] {
        if !octal(&mut block[range], u64::from(v)) {
            pax_record(&mut pax, key.as_bytes(), v.to_string().as_bytes());
        }
    }
    for (name, value) in e.xattrs {
        pax_record(
            &mut pax,
            &[b"SCHILY.xattr.".as_slice(), name].concat(),
            value,
        );
    }
    checksum(&mut block);

    let mut out = Vec::with_capacity(if pax.is_empty() {
        512
    } else {
        1024 + pax.len()
    });
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
        octal(&mut xh[329..337], 0);
        octal(&mut xh[337..345], 0);
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

#[cfg(test)]
mod tests {
    use std::{
        collections::BTreeMap,
        fs,
        os::unix::fs::{symlink, MetadataExt, PermissionsExt},
        process::{Child, Command, Stdio},
        sync::atomic::{AtomicU32, Ordering},
    };

    use nix::mount::{mount, umount2, MntFlags, MsFlags};

    use super::*;
    use crate::checkpoint::store::test_support::{files_under, noise, Tmpfs};
    use crate::inspector::fs::{diff, Manifest};

    /// A real overlay in a temp dir: lower/upper/work/merged.
    struct Overlay {
        lower: PathBuf,
        upper: PathBuf,
        merged: PathBuf,
        _dir: tempfile::TempDir,
    }

    impl Overlay {
        fn new(populate: impl FnOnce(&Path)) -> Overlay {
            let dir = tempfile::tempdir().unwrap();
            let [lower, upper, work, merged] =
                ["lower", "upper", "work", "merged"].map(|n| dir.path().join(n));
            for d in [&lower, &upper, &work, &merged] {
                fs::create_dir(d).unwrap();
            }
            populate(&lower);
            let opts = format!(
                "lowerdir={},upperdir={},workdir={}",
                lower.display(),
                upper.display(),
                work.display()
            );
            mount(
                Some("overlay"),
                &merged,
                Some("overlay"),
                MsFlags::empty(),
                Some(opts.as_str()),
            )
            .unwrap_or_else(|e| panic!("mount overlay: {e} (tests run as root)"));
            Overlay {
                lower,
                upper,
                merged,
                _dir: dir,
            }
        }

        fn m(&self, p: &str) -> PathBuf {
            self.merged.join(p)
        }

        fn scan(&self) -> Manifest {
            Manifest::scan(&self.upper).unwrap()
        }

        fn diff(&self, prev: &Manifest) -> (Manifest, FsDiff) {
            let now = self.scan();
            let d = diff(prev, &now, std::slice::from_ref(&self.lower));
            (now, d)
        }
    }

    impl Drop for Overlay {
        fn drop(&mut self) {
            let _ = umount2(&self.merged, MntFlags::MNT_DETACH);
        }
    }

    #[derive(Default)]
    struct CountingFreezer {
        freezes: AtomicU32,
        thaws: AtomicU32,
        fail: bool,
    }

    impl Freezer for CountingFreezer {
        fn freeze(&self) -> io::Result<()> {
            if self.fail {
                return Err(io::Error::other("refused"));
            }
            self.freezes.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn thaw(&self) -> io::Result<()> {
            self.thaws.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    impl CountingFreezer {
        fn counts(&self) -> (u32, u32) {
            (
                self.freezes.load(Ordering::SeqCst),
                self.thaws.load(Ordering::SeqCst),
            )
        }
    }

    fn write(p: &Path, data: &[u8], mode: u32) {
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).unwrap();
        }
        fs::write(p, data).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }

    fn setxattr(p: &Path, name: &str, value: &[u8]) {
        let (cp, cn) = (
            CString::new(p.as_os_str().as_bytes()).unwrap(),
            CString::new(name).unwrap(),
        );
        let rc = unsafe {
            libc::lsetxattr(
                cp.as_ptr(),
                cn.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        assert_eq!(
            rc,
            0,
            "setxattr {name} on {}: {}",
            p.display(),
            io::Error::last_os_error()
        );
    }

    fn lxattrs(p: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        Xattrs::read(&XattrSource::Path(&c), OverlayXattrs::Trusted)
            .unwrap()
            .other
    }

    fn mknod(p: &Path, kind: libc::mode_t, mode: u32, dev: libc::dev_t) {
        let c = CString::new(p.as_os_str().as_bytes()).unwrap();
        assert_eq!(
            unsafe { libc::mknod(c.as_ptr(), kind | mode, dev) },
            0,
            "mknod {}: {}",
            p.display(),
            io::Error::last_os_error()
        );
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// CAP_NET_BIND_SERVICE, effective (vfs_cap_data revision 2).
    fn capability() -> Vec<u8> {
        [0x0200_0001u32, 1 << 10, 0, 0, 0]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect()
    }

    #[derive(Debug, Clone, PartialEq)]
    struct TarItem {
        kind: u8,
        mode: u32,
        uid: u64,
        gid: u64,
        data: Vec<u8>,
        link: Option<Vec<u8>>,
        dev: Option<(u32, u32)>,
        /// pax mtime if present, else the header's seconds.
        mtime: String,
        xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    }

    /// Reads a stored layer back (checking its digests) with an independent tar parser:
    /// name -> item, in archive order.
    fn read_layer(store: &Store, d: &Descriptor) -> Vec<(String, TarItem)> {
        let blob = fs::read(store.blob_path(&d.digest)).unwrap();
        assert_eq!(d.digest, format!("sha256:{:x}", Sha256::digest(&blob)));
        assert_eq!(d.size, blob.len() as u64);
        assert_eq!(d.media_type, "application/vnd.oci.image.layer.v1.tar+zstd");
        let tar = zstd::decode_all(&blob[..]).unwrap();
        assert_eq!(d.diff_id, format!("sha256:{:x}", Sha256::digest(&tar)));
        parse_tar(&tar)
    }

    fn parse_tar(tar: &[u8]) -> Vec<(String, TarItem)> {
        let mut ar = tar::Archive::new(tar);
        let mut out = Vec::new();
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let name = String::from_utf8(e.path_bytes().into_owned()).unwrap();
            let h = e.header().clone();
            let mut item = TarItem {
                kind: h.entry_type().as_byte(),
                mode: h.mode().unwrap(),
                uid: h.uid().unwrap(),
                gid: h.gid().unwrap(),
                data: Vec::new(),
                link: e.link_name_bytes().map(|l| l.into_owned()),
                dev: h
                    .device_major()
                    .unwrap()
                    .zip(h.device_minor().unwrap())
                    .filter(|_| matches!(h.entry_type().as_byte(), b'3' | b'4')),
                mtime: h.mtime().unwrap().to_string(),
                xattrs: Vec::new(),
            };
            if let Some(pax) = e.pax_extensions().unwrap() {
                for ext in pax {
                    let ext = ext.unwrap();
                    let key = ext.key().unwrap().to_owned();
                    let value = ext.value_bytes().to_vec();
                    match key.as_str() {
                        "mtime" => item.mtime = String::from_utf8(value).unwrap(),
                        "uid" => item.uid = String::from_utf8(value).unwrap().parse().unwrap(),
                        "gid" => item.gid = String::from_utf8(value).unwrap().parse().unwrap(),
                        k if k.starts_with("SCHILY.xattr.") => item
                            .xattrs
                            .push((k.as_bytes()["SCHILY.xattr.".len()..].to_vec(), value)),
                        _ => {}
                    }
                }
            }
            e.read_to_end(&mut item.data).unwrap();
            out.push((name, item));
        }
        out
    }

    fn names(items: &[(String, TarItem)]) -> Vec<&str> {
        items.iter().map(|(n, _)| n.as_str()).collect()
    }

    fn item<'a>(items: &'a [(String, TarItem)], name: &str) -> &'a TarItem {
        &items
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} not in the layer: {:?}", names(items)))
            .1
    }

    /// A tar item agrees with what the merged view shows at `p`.
    fn assert_matches_merged(items: &[(String, TarItem)], name: &str, p: &Path) {
        let it = item(items, name);
        let md = fs::symlink_metadata(p).unwrap();
        assert_eq!(it.mode, md.mode() & 0o7777, "{name} mode");
        assert_eq!(
            (it.uid, it.gid),
            (u64::from(md.uid()), u64::from(md.gid())),
            "{name} owner"
        );
        if it.kind != b'1' {
            let nsec = md.mtime_nsec();
            let want = if nsec == 0 {
                md.mtime().to_string()
            } else {
                format!("{}.{:09}", md.mtime(), nsec)
            };
            assert_eq!(it.mtime, want, "{name} mtime");
            assert_eq!(it.xattrs, lxattrs(p), "{name} xattrs");
        }
        match it.kind {
            b'0' => assert_eq!(it.data, fs::read(p).unwrap(), "{name} content"),
            b'2' => assert_eq!(
                it.link.as_deref(),
                Some(fs::read_link(p).unwrap().as_os_str().as_bytes()),
                "{name} target"
            ),
            b'3' | b'4' => assert_eq!(
                it.dev,
                Some((libc::major(md.rdev()), libc::minor(md.rdev()))),
                "{name} device"
            ),
            _ => {}
        }
    }

    const LONG_DIR: &str = "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd";
    const LONG_FILE: &str =
        "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff";

    fn deep_path() -> String {
        format!(
            "deep/{}/{}/{}/file",
            "a".repeat(100),
            "b".repeat(100),
            "c".repeat(100)
        )
    }

    fn populate_lower(l: &Path) {
        write(&l.join("etc/a"), b"A\n", 0o644);
        write(&l.join("etc/b"), b"B\n", 0o644);
        write(&l.join("bin/tool"), b"#!/bin/sh\n", 0o755);
        write(&l.join("data/dir/x"), b"x", 0o644);
        write(&l.join("data/dir/y"), b"y", 0o644);
        write(&l.join("data/keep"), b"keep", 0o644);
        write(&l.join("gone/g1"), b"g1", 0o644);
        write(&l.join("gone/sub/g2"), b"g2", 0o644);
        write(&l.join("keep/k"), b"k", 0o600);
        std::os::unix::fs::chown(l.join("keep/k"), Some(1000), Some(1000)).unwrap();
    }

    /// Round one of changes, all through the merged view.
    fn change_round_one(o: &Overlay) {
        write(&o.m("new.txt"), b"hello\n", 0o640);
        setxattr(&o.m("new.txt"), "user.test", b"v1");
        fs::OpenOptions::new()
            .append(true)
            .open(o.m("etc/a"))
            .unwrap()
            .write_all(b"more\n")
            .unwrap();
        fs::set_permissions(o.m("bin/tool"), fs::Permissions::from_mode(0o700)).unwrap();
        setxattr(&o.m("bin/tool"), "security.capability", &capability());
        symlink("etc/a", o.m("link")).unwrap();
        fs::hard_link(o.m("new.txt"), o.m("hard.txt")).unwrap();
        write(&o.m("p/q/r/f"), b"f", 0o644);
        fs::remove_file(o.m("etc/b")).unwrap();
        fs::remove_dir_all(o.m("data/dir")).unwrap();
        fs::create_dir(o.m("data/dir")).unwrap();
        write(&o.m("data/dir/z"), b"z", 0o644);
        fs::remove_dir_all(o.m("gone")).unwrap();
        mknod(&o.m("mydev"), libc::S_IFCHR, 0o600, libc::makedev(1, 3));
        mknod(&o.m("myfifo"), libc::S_IFIFO, 0o644, 0);
        fs::create_dir(o.m("emptydir")).unwrap();
        fs::set_permissions(o.m("emptydir"), fs::Permissions::from_mode(0o751)).unwrap();
        write(
            &o.m(&format!("long/{LONG_DIR}/{LONG_FILE}")),
            b"long",
            0o644,
        );
        write(&o.m(&deep_path()), b"deep", 0o644);
        write(&o.m("bigid"), b"big owner", 0o644);
        std::os::unix::fs::chown(o.m("bigid"), Some(3_000_000), Some(3_000_001)).unwrap();
    }

    #[test]
    fn layer_holds_exactly_the_net_change() {
        let o = Overlay::new(populate_lower);
        let base = o.scan();
        change_round_one(&o);
        let (_, d) = o.diff(&base);
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let freezer = CountingFreezer::default();
        let (desc, stats) =
            write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &freezer).unwrap();
        assert_eq!(freezer.counts(), (1, 1));
        let items = read_layer(&store, &desc);

        let deep = deep_path();
        let deep_dirs: Vec<String> = (1..4)
            .map(|n| deep.split('/').take(n + 1).collect::<Vec<_>>().join("/") + "/")
            .collect();
        let long_dir = format!("long/{LONG_DIR}/");
        let long_file = format!("long/{LONG_DIR}/{LONG_FILE}");
        let mut expect: Vec<&str> = vec![
            ".wh.gone",
            "bigid",
            "bin/tool",
            "data/dir/",
            "data/dir/.wh..wh..opq",
            "data/dir/z",
            "deep/",
            &deep_dirs[0],
            &deep_dirs[1],
            &deep_dirs[2],
            &deep,
            "emptydir/",
            "etc/.wh.b",
            "etc/a",
            "hard.txt",
            "link",
            "long/",
            &long_dir,
            &long_file,
            "mydev",
            "myfifo",
            "new.txt",
            "p/",
            "p/q/",
            "p/q/r/",
            "p/q/r/f",
        ];
        let mut got = names(&items);
        got.sort();
        expect.sort();
        assert_eq!(got, expect, "diff was {d:?}");
        assert_eq!(stats.entries, items.len() as u64);

        // Contents, modes, owners, mtimes and xattrs are the merged view's.
        for (name, it) in &items {
            if it.kind == b'0'
                && it.data.is_empty()
                && name.rsplit('/').next().unwrap().starts_with(".wh.")
            {
                assert_eq!((it.mode, it.uid, it.gid), (0, 0, 0), "{name}");
                continue;
            }
            let rel = name.trim_end_matches('/');
            assert_matches_merged(&items, name, &o.merged.join(rel));
        }
        assert_eq!(item(&items, "etc/a").data, b"A\nmore\n");
        assert_eq!(item(&items, "bin/tool").mode, 0o700);
        assert_eq!(
            item(&items, "bin/tool").xattrs,
            vec![(b"security.capability".to_vec(), capability())]
        );
        assert_eq!(
            item(&items, "hard.txt").xattrs,
            vec![(b"user.test".to_vec(), b"v1".to_vec())]
        );
        assert_eq!(item(&items, "link").link.as_deref(), Some(&b"etc/a"[..]));
        let nt = item(&items, "new.txt");
        assert_eq!(
            (nt.kind, nt.link.as_deref()),
            (b'1', Some(&b"hard.txt"[..])),
            "a hardlink to the first name"
        );
        assert_eq!(item(&items, "mydev").dev, Some((1, 3)));
        assert_eq!(item(&items, "myfifo").kind, b'6');
        assert_eq!(item(&items, "emptydir/").mode, 0o751);
        assert_eq!(
            (item(&items, "bigid").uid, item(&items, "bigid").gid),
            (3_000_000, 3_000_001)
        );
        assert_eq!(item(&items, &deep).data, b"deep");
        // The opaque marker comes right after its directory, before the directory's content.
        let pos = |n: &str| names(&items).iter().position(|x| *x == n).unwrap();
        assert_eq!(pos("data/dir/.wh..wh..opq"), pos("data/dir/") + 1);
        assert!(pos("hard.txt") < pos("new.txt"));
        // Nothing left behind but the blob.
        assert_eq!(
            files_under(store_dir.path()),
            vec![
                PathBuf::from(".lock"),
                Path::new("blobs/sha256").join(desc.hex())
            ]
        );
    }

    #[test]
    fn symlinks_in_the_upperdir_are_never_followed() {
        let host = tempfile::tempdir().unwrap();
        write(&host.path().join("secret.txt"), b"SECRET", 0o600);
        let o = Overlay::new(|l| write(&l.join("etc/passwd"), b"root", 0o644));
        let base = o.scan();
        symlink(host.path(), o.m("esc")).unwrap();
        symlink(host.path().join("secret.txt"), o.m("esc-file")).unwrap();
        let (_, d) = o.diff(&base);
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        // A stale diff that still thinks /esc is a directory with content.
        let stale = [PathBuf::from("/esc/secret.txt"), PathBuf::from("/esc-file")];
        for paths in [
            FsDiffPaths::from(&d),
            FsDiffPaths {
                added: &stale,
                modified: &[],
                deleted: &[],
            },
        ] {
            let (desc, _) =
                write_fs_layer(&store, &o.upper, &paths, &CountingFreezer::default()).unwrap();
            let items = read_layer(&store, &desc);
            assert!(
                items.iter().all(|(_, it)| it.data != b"SECRET"),
                "{items:?}"
            );
            assert!(
                items.iter().all(|(n, _)| !n.starts_with("esc/")),
                "{:?}",
                names(&items)
            );
            assert_eq!(item(&items, "esc-file").kind, b'2');
        }
    }

    #[test]
    fn capture_errors_thaw_and_leave_nothing() {
        let o = Overlay::new(|l| write(&l.join("big"), &[7u8; 100_000], 0o644));
        let base = o.scan();
        fs::set_permissions(o.m("big"), fs::Permissions::from_mode(0o600)).unwrap();
        let (_, d) = o.diff(&base);
        // overlayfs metacopy: the upper file has metadata only, its data is below.
        setxattr(&o.upper.join("big"), "trusted.overlay.metacopy", b"");
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let freezer = CountingFreezer::default();
        let e = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &freezer).unwrap_err();
        assert!(matches!(e, LayerError::Unsupported { .. }), "{e}");
        assert_eq!(freezer.counts(), (1, 1), "thawed after the failed capture");
        assert_eq!(files_under(store_dir.path()), vec![PathBuf::from(".lock")]);

        let refusing = CountingFreezer {
            fail: true,
            ..Default::default()
        };
        let e = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &refusing).unwrap_err();
        assert!(matches!(e, LayerError::Freeze(_)), "{e}");
        assert_eq!(files_under(store_dir.path()), vec![PathBuf::from(".lock")]);

        let bad = [PathBuf::from("/a/../../etc")];
        let e = write_fs_layer(
            &store,
            &o.upper,
            &FsDiffPaths {
                added: &bad,
                modified: &[],
                deleted: &[],
            },
            &freezer,
        )
        .unwrap_err();
        assert!(matches!(e, LayerError::InvalidPath(_)), "{e}");
    }

    #[test]
    fn full_store_gives_a_clear_error_and_no_partial_blob() {
        let o = Overlay::new(|_| {});
        let base = o.scan();
        let root = tempfile::tempdir().unwrap();
        let store_root = root.path().join("store");
        let _tmpfs = Tmpfs::mount(&store_root, "64k");
        let store = Store::open(&store_root).unwrap();
        let free = || {
            nix::sys::statvfs::statvfs(&store_root)
                .unwrap()
                .blocks_available()
        };
        let empty = free();
        // 1 MB does not fit the temporary tar; 40 KB fits the tar but not tar + blob.
        for (size, stage) in [(1 << 20, "layer.tar-"), (40 << 10, "layer.tar.zst-")] {
            // An unlinked temp file's space returns only once every fd of it is closed, and a
            // process that another test forks meanwhile (without exec) holds copies of this
            // process's fds: the 40 KB case needs the tmpfs empty again.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while free() < empty && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            write(&o.m("f"), &noise(size, size as u64), 0o644);
            let (_, d) = o.diff(&base);
            let freezer = CountingFreezer::default();
            let e = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), &freezer).unwrap_err();
            assert!(e.is_no_space(), "{size}: {e}");
            let msg = e.to_string();
            assert!(
                msg.contains("no space left on device") && msg.contains(stage),
                "{size}: {msg}"
            );
            assert_eq!(freezer.counts(), (1, 1), "thawed");
            assert_eq!(
                files_under(&store_root),
                vec![PathBuf::from(".lock")],
                "{size}: nothing partial"
            );
            assert!(store.list().unwrap().is_empty());
        }
        // Small changes still fit.
        write(&o.m("f"), b"small", 0o644);
        let (_, d) = o.diff(&base);
        let (desc, _) = write_fs_layer(
            &store,
            &o.upper,
            &FsDiffPaths::from(&d),
            &CountingFreezer::default(),
        )
        .unwrap();
        assert_eq!(item(&read_layer(&store, &desc), "f").data, b"small");
    }

    // ---- applying the layers with an independent implementation (umoci) ----

    #[derive(Debug, PartialEq)]
    struct Node {
        kind: u32,
        mode: u32,
        uid: u32,
        gid: u32,
        rdev: u64,
        data: Vec<u8>,
        link: Option<PathBuf>,
        mtime: Option<(i64, i64)>,
        xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    }

    /// Everything under `root` but `root` itself (directory mtimes are not state).
    fn tree(root: &Path) -> BTreeMap<PathBuf, Node> {
        let mut out = BTreeMap::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                let md = fs::symlink_metadata(&p).unwrap();
                let kind = md.mode() & libc::S_IFMT;
                if kind == libc::S_IFDIR {
                    stack.push(p.clone());
                }
                let node = Node {
                    kind,
                    mode: md.mode() & 0o7777,
                    uid: md.uid(),
                    gid: md.gid(),
                    rdev: md.rdev(),
                    data: if kind == libc::S_IFREG {
                        fs::read(&p).unwrap()
                    } else {
                        Vec::new()
                    },
                    link: (kind == libc::S_IFLNK).then(|| fs::read_link(&p).unwrap()),
                    mtime: (kind != libc::S_IFDIR).then(|| (md.mtime(), md.mtime_nsec())),
                    xattrs: lxattrs(&p)
                        .into_iter()
                        .filter(|(n, _)| !n.starts_with(b"security.selinux"))
                        .collect(),
                };
                out.insert(p.strip_prefix(root).unwrap().to_path_buf(), node);
            }
        }
        out
    }

    fn sha256_hex(b: &[u8]) -> String {
        format!("{:x}", Sha256::digest(b))
    }

    /// An OCI image layout holding uncompressed `layers` (umoci 0.4 reads no zstd), unpacked
    /// by umoci into `<dir>/bundle/rootfs`.
    fn umoci_unpack(dir: &Path, layers: &[Vec<u8>]) -> PathBuf {
        let layout = dir.join("layout");
        let blobs = layout.join("blobs/sha256");
        fs::create_dir_all(&blobs).unwrap();
        let put = |b: &[u8]| {
            let h = sha256_hex(b);
            fs::write(blobs.join(&h), b).unwrap();
            (format!("sha256:{h}"), b.len())
        };
        let mut descs = Vec::new();
        for l in layers {
            let (digest, size) = put(l);
            descs.push(serde_json::json!({"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": digest, "size": size}));
        }
        let diff_ids: Vec<_> = descs.iter().map(|d| d["digest"].clone()).collect();
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "amd64", "os": "linux", "config": {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .unwrap();
        let (cdigest, csize) = put(&config);
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cdigest, "size": csize},
            "layers": descs,
        }))
        .unwrap();
        let (mdigest, msize) = put(&manifest);
        fs::write(
            layout.join("oci-layout"),
            br#"{"imageLayoutVersion":"1.0.0"}"#,
        )
        .unwrap();
        fs::write(
            layout.join("index.json"),
            serde_json::to_vec(&serde_json::json!({
                "schemaVersion": 2,
                "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": mdigest, "size": msize,
                               "annotations": {"org.opencontainers.image.ref.name": "test"}}],
            }))
            .unwrap(),
        )
        .unwrap();
        let bundle = dir.join("bundle");
        let out = Command::new("umoci")
            .arg("unpack")
            .arg("--image")
            .arg(format!("{}:test", layout.display()))
            .arg(&bundle)
            .output()
            .expect("umoci (installed by hack/install-deps.sh)");
        assert!(
            out.status.success(),
            "umoci unpack: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        bundle.join("rootfs")
    }

    fn base_layer(lower: &Path) -> Vec<u8> {
        let out = Command::new("tar")
            .args([
                "--format=posix",
                "--pax-option=delete=atime,delete=ctime",
                "--numeric-owner",
                "--xattrs",
                "--xattrs-include=*",
                "-C",
            ])
            .arg(lower)
            .args(["-cf", "-", "."])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tar: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    }

    fn plain_tar(store: &Store, d: &Descriptor) -> Vec<u8> {
        zstd::decode_all(&fs::read(store.blob_path(&d.digest)).unwrap()[..]).unwrap()
    }

    /// base image + layer 1 + layer 2 applied by umoci == the merged view, after each turn.
    #[test]
    fn layer_chain_applies_to_the_merged_view() {
        let o = Overlay::new(populate_lower);
        let base = base_layer(&o.lower);
        let m0 = o.scan();
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let freezer = CountingFreezer::default();

        change_round_one(&o);
        let (m1, d1) = o.diff(&m0);
        let (l1, _) = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d1), &freezer).unwrap();
        let work = tempfile::tempdir().unwrap();
        let rootfs = umoci_unpack(
            &work.path().join("one"),
            &[base.clone(), plain_tar(&store, &l1)],
        );
        assert_eq!(tree(&rootfs), tree(&o.merged), "after layer 1");
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        assert_eq!(
            ino(&rootfs.join("new.txt")),
            ino(&rootfs.join("hard.txt")),
            "hardlink kept"
        );

        // Turn two: undo some of turn one, touch the opaque directory again, revive a deleted path.
        fs::remove_file(o.m("new.txt")).unwrap();
        fs::set_permissions(o.m("data/dir"), fs::Permissions::from_mode(0o700)).unwrap();
        fs::remove_dir_all(o.m("p")).unwrap();
        write(&o.m("etc/b"), b"B2\n", 0o644);
        fs::rename(o.m("etc/a"), o.m("etc/a2")).unwrap();
        fs::OpenOptions::new()
            .append(true)
            .open(o.m(&format!("long/{LONG_DIR}/{LONG_FILE}")))
            .unwrap()
            .write_all(b"er")
            .unwrap();
        write(&o.m("keep/k2"), b"k2", 0o644);
        let (_, d2) = o.diff(&m1);
        let (l2, _) = write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d2), &freezer).unwrap();
        let items = read_layer(&store, &l2);
        let mut got = names(&items);
        got.sort();
        let long_file = format!("long/{LONG_DIR}/{LONG_FILE}");
        let mut expect = vec![
            ".wh.new.txt",
            ".wh.p",
            "data/dir/",
            "data/dir/.wh..wh..opq",
            "data/dir/z",
            "etc/.wh.a",
            "etc/a2",
            "etc/b",
            "hard.txt",
            "keep/k2",
            &long_file,
        ];
        expect.sort();
        assert_eq!(got, expect, "diff was {d2:?}");
        let rootfs = umoci_unpack(
            &work.path().join("two"),
            &[base, plain_tar(&store, &l1), plain_tar(&store, &l2)],
        );
        assert_eq!(tree(&rootfs), tree(&o.merged), "after layer 2");
        assert_eq!(freezer.counts(), (2, 2));
    }

    // ---- tar encoding ----

    #[test]
    fn pax_records_and_names() {
        for (key, value) in [
            ("a", "b".repeat(2)),
            ("path", "x".repeat(89)),
            ("path", "x".repeat(90)),
            ("path", "x".repeat(992)),
        ] {
            let mut rec = Vec::new();
            pax_record(&mut rec, key.as_bytes(), value.as_bytes());
            let text = String::from_utf8(rec.clone()).unwrap();
            let (len, _) = text.split_once(' ').unwrap();
            assert_eq!(len.parse::<usize>().unwrap(), rec.len(), "{text:?}");
        }
        assert_eq!(pax_time(5, 1), "5.000000001");
        assert_eq!(pax_time(-2, 500_000_000), "-1.500000000");
        assert_eq!(pax_time(-1, 1), "-0.999999999");
        assert_eq!(pax_time(7, 0), "7");
        let long = format!("{}/{}", "p".repeat(150), "n".repeat(100));
        assert_eq!(
            split_ustar_name(long.as_bytes()),
            Some(("p".repeat(150).as_bytes(), "n".repeat(100).as_bytes()))
        );
        assert_eq!(
            split_ustar_name(format!("{}/", "d".repeat(120)).as_bytes()),
            None
        );
        assert_eq!(
            split_ustar_name(format!("a/{}", "n".repeat(101)).as_bytes()),
            None
        );
        assert_eq!(whiteout_name(Path::new("a/b")), b"a/.wh.b");
        assert_eq!(whiteout_name(Path::new("top")), b".wh.top");
        assert_eq!(tar_name(Path::new(""), true), b"./");
    }

    /// Entries beyond ustar's limits read back the same with two independent readers.
    #[test]
    fn pax_entries_read_back() {
        let long_name = format!("{}/{}", "x".repeat(200), "y".repeat(150));
        let long_link = "t".repeat(300);
        // The tar crate splits pax records at newlines (GNU tar and Go honour the lengths):
        // binary values with a newline are checked with GNU tar below.
        let xattrs = vec![(b"user.bin".to_vec(), vec![0u8, 1, 2, b'=', 255])];
        let mut tar = Vec::new();
        let entries = [
            TarEntry {
                name: long_name.as_bytes(),
                kind: b'0',
                mode: 0o4755,
                uid: 3_000_000,
                gid: 7,
                size: 3,
                mtime: (1_700_000_000, 123_456_789),
                link: b"",
                dev: (0, 0),
                xattrs: &xattrs,
                sparse_size: None,
            },
            TarEntry {
                name: b"l",
                kind: b'2',
                mode: 0o777,
                uid: 0,
                gid: 0,
                size: 0,
                mtime: (-2, 500_000_000),
                link: long_link.as_bytes(),
                dev: (0, 0),
                xattrs: &[],
                sparse_size: None,
            },
            TarEntry {
                name: b"d",
                kind: b'3',
                mode: 0o600,
                uid: 0,
                gid: 0,
                size: 0,
                mtime: (1, 0),
                link: b"",
                dev: (4095, 1_048_575),
                xattrs: &[],
                sparse_size: None,
            },
        ];
        for e in &entries {
            tar.extend_from_slice(&encode_header(e));
            if e.size > 0 {
                tar.extend_from_slice(b"abc");
                tar.resize(tar.len().div_ceil(512) * 512, 0);
            }
        }
        tar.extend_from_slice(&[0u8; 1024]);
        let items = parse_tar(&tar);
        assert_eq!(names(&items), vec![long_name.as_str(), "l", "d"]);
        let f = &items[0].1;
        assert_eq!(
            (f.mode, f.uid, f.gid, f.mtime.as_str(), &f.data[..]),
            (0o4755, 3_000_000, 7, "1700000000.123456789", &b"abc"[..])
        );
        assert_eq!(f.xattrs, xattrs);
        assert_eq!(items[1].1.link.as_deref(), Some(long_link.as_bytes()));
        assert_eq!(items[1].1.mtime, "-1.500000000");
        assert_eq!(items[2].1.dev, Some((4095, 1_048_575)));
        // GNU tar agrees.
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("t.tar"), &tar).unwrap();
        let out = Command::new("tar")
            .args(["--numeric-owner", "-tvf"])
            .arg(dir.path().join("t.tar"))
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            listing.contains(&format!("3000000/7 {:>10}", 3)) || listing.contains("3000000/7"),
            "{listing}"
        );
        assert!(
            listing.contains(&long_name) && listing.contains(&long_link),
            "{listing}"
        );

        let value = vec![b'\n', 0, 10, 255, b' ', b'\n'];
        let cap = [(b"user.nl".to_vec(), value.clone())];
        let mut tar = encode_header(&TarEntry {
            name: b"f",
            kind: b'0',
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: 0,
            mtime: (1, 0),
            link: b"",
            dev: (0, 0),
            xattrs: &cap,
            sparse_size: None,
        });
        tar.extend_from_slice(&[0u8; 1024]);
        fs::write(dir.path().join("nl.tar"), &tar).unwrap();
        let out = Command::new("tar")
            .args(["--xattrs", "--xattrs-include=*", "-xf"])
            .arg(dir.path().join("nl.tar"))
            .arg("-C")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(lxattrs(&dir.path().join("f")), cap.to_vec());
    }

    // ---- bounds: sparse files, the layer's size, depth, overlay xattrs ----

    /// A file of `size` bytes with `chunks` written at their offsets, holes elsewhere.
    fn sparse(p: &Path, size: u64, chunks: &[(u64, &[u8])]) {
        use std::os::unix::fs::FileExt;
        let f = fs::File::create(p).unwrap();
        f.set_len(size).unwrap();
        for (off, data) in chunks {
            f.write_all_at(data, *off).unwrap();
        }
        f.sync_all().unwrap();
    }

    /// Extracts a plain tar with GNU tar (which restores holes) into `dir`.
    fn gnu_extract(tar: &[u8], dir: &Path) {
        fs::write(dir.join("layer.tar"), tar).unwrap();
        fs::create_dir(dir.join("x")).unwrap();
        let out = Command::new("tar")
            .args(["--numeric-owner", "-xf"])
            .arg(dir.join("layer.tar"))
            .arg("-C")
            .arg(dir.join("x"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        fs::remove_file(dir.join("layer.tar")).unwrap();
    }

    fn read_at(p: &Path, off: u64, len: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; len];
        fs::File::open(p)
            .unwrap()
            .read_exact_at(&mut buf, off)
            .unwrap();
        buf
    }

    /// `truncate -s 1T` plus a few bytes: the layer holds the bytes, not the terabyte, and GNU
    /// tar gives back a file of the same size, data and holes.
    #[test]
    fn sparse_files_are_stored_with_their_holes() {
        const TB: u64 = 1 << 40;
        let o = Overlay::new(|l| write(&l.join("keep"), b"k", 0o644));
        let base = o.scan();
        let chunks: [(u64, &[u8]); 3] = [
            (0, b"head"),
            (300 << 30, b"in the middle"),
            (TB - 4, b"tail"),
        ];
        sparse(&o.m("big"), TB, &chunks);
        sparse(&o.m("hole-at-end"), 10 << 20, &[(0, &[7u8; 8192])]);
        sparse(&o.m("all-hole"), 5 << 30, &[]);
        write(&o.m("dense"), &noise(100_000, 3), 0o600);
        let (_, d) = o.diff(&base);
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let t = Instant::now();
        let (desc, stats) = write_fs_layer(
            &store,
            &o.upper,
            &FsDiffPaths::from(&d),
            &CountingFreezer::default(),
        )
        .unwrap();
        eprintln!(
            "1 TB sparse file: layer in {:?}, {} tar bytes, {} stored",
            t.elapsed(),
            stats.bytes,
            desc.size
        );
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert!(stats.bytes < 1 << 20, "{stats:?}");
        let tar = plain_tar(&store, &desc);
        let dir = tempfile::tempdir().unwrap();
        gnu_extract(&tar, dir.path());
        let x = dir.path().join("x");
        let big = fs::metadata(x.join("big")).unwrap();
        assert_eq!(big.len(), TB);
        assert!(
            big.blocks() * 512 < 1 << 20,
            "extracted sparse: {} blocks",
            big.blocks()
        );
        for (off, data) in chunks {
            assert_eq!(read_at(&x.join("big"), off, data.len()), data);
        }
        assert_eq!(read_at(&x.join("big"), 1 << 30, 4), [0u8; 4]);
        assert_eq!(fs::metadata(x.join("hole-at-end")).unwrap().len(), 10 << 20);
        assert_eq!(read_at(&x.join("hole-at-end"), 0, 8192), vec![7u8; 8192]);
        assert_eq!(read_at(&x.join("hole-at-end"), (10 << 20) - 1, 1), [0]);
        assert_eq!(fs::metadata(x.join("all-hole")).unwrap().len(), 5 << 30);
        assert_eq!(fs::read(x.join("dense")).unwrap(), noise(100_000, 3));
        // Modes survive the sparse form too.
        assert_eq!(
            fs::metadata(x.join("big")).unwrap().mode() & 0o7777,
            fs::metadata(o.m("big")).unwrap().mode() & 0o7777
        );
    }

    /// Go's archive/tar (umoci's unpacker, like containerd's differ) reads the sparse entries:
    /// same size and bytes as the merged view.
    #[test]
    fn sparse_layer_applies_with_go_archive_tar() {
        let o = Overlay::new(populate_lower);
        let base = o.scan();
        sparse(
            &o.m("s"),
            64 << 20,
            &[(1 << 20, b"one"), ((40 << 20) + 5, &noise(9000, 1))],
        );
        sparse(&o.m("z"), 3 << 20, &[]);
        let (_, d) = o.diff(&base);
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let (desc, _) = write_fs_layer(
            &store,
            &o.upper,
            &FsDiffPaths::from(&d),
            &CountingFreezer::default(),
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let rootfs = umoci_unpack(
            dir.path(),
            &[base_layer(&o.lower), plain_tar(&store, &desc)],
        );
        for name in ["s", "z"] {
            assert_eq!(
                fs::read(rootfs.join(name)).unwrap(),
                fs::read(o.m(name)).unwrap(),
                "{name}"
            );
        }
    }

    #[test]
    fn sparse_extents_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        // 2000 data blocks, each followed by a hole.
        let chunks: Vec<(u64, Vec<u8>)> = (0..2000u64)
            .map(|i| (i * (1 << 20), vec![1u8; 4096]))
            .collect();
        let refs: Vec<(u64, &[u8])> = chunks.iter().map(|(o, d)| (*o, d.as_slice())).collect();
        sparse(&p, 2000 << 20, &refs);
        let f = fs::File::open(&p).unwrap();
        let all = data_extents(f.as_raw_fd(), 2000 << 20, 4096).unwrap();
        // 2000 data extents and the empty one that marks the end of the file.
        assert_eq!(all.len(), 2001);
        assert_eq!(all[2000], (2000 << 20, 0));
        assert!(
            all[..2000]
                .iter()
                .all(|&(off, len)| off % (1 << 20) == 0 && len >= 4096),
            "{:?}",
            &all[..3]
        );
        let few = data_extents(f.as_raw_fd(), 2000 << 20, 100).unwrap();
        assert!(few.len() <= 100, "{}", few.len());
        // Every data byte is still covered.
        for (off, _) in &chunks {
            assert!(
                few.iter().any(|&(o, l)| o <= *off && off + 4096 <= o + l),
                "{off}"
            );
        }
        assert_eq!(
            merge_extents(&[(0, 10), (15, 5), (100, 1)], 5),
            vec![(0, 20), (100, 1)]
        );
        assert_eq!(sparse_map(&[(0, 4), (8, 2)]).len(), 512);
        assert!(sparse_map(&[(0, 4), (8, 2)]).starts_with(b"2\n0\n4\n8\n2\n\0"));
    }

    #[test]
    fn layer_over_its_byte_bound_fails_before_copying_and_thaws() {
        let o = Overlay::new(|l| write(&l.join("keep"), b"k", 0o644));
        let base = o.scan();
        write(&o.m("a"), &noise(600 << 10, 1), 0o644);
        write(&o.m("b"), &noise(600 << 10, 2), 0o644);
        // Holes are free: a 1 TB sparse file fits in a 1 MiB bound.
        sparse(&o.m("c"), 1 << 40, &[(5, b"x")]);
        let (_, d) = o.diff(&base);
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let freezer = CountingFreezer::default();
        let opts = LayerOptions {
            max_bytes: 1 << 20,
            ..LayerOptions::default()
        };
        let e = write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &opts)
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                LayerError::Limit {
                    key: "max_layer_bytes",
                    ..
                }
            ),
            "{msg}"
        );
        assert!(
            msg.contains("[limits] max_layer_bytes") && msg.contains("1048576"),
            "{msg}"
        );
        assert_eq!(freezer.counts(), (1, 1));
        assert!(
            files_under(store_dir.path())
                .iter()
                .all(|f| !f.to_string_lossy().contains("blobs/sha256/")),
            "{:?}",
            files_under(store_dir.path())
        );
        fs::remove_file(o.m("b")).unwrap();
        let (_, d) = o.diff(&base);
        write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &opts).unwrap();
    }

    /// An opaque directory is written whole with an explicit stack: a tree deeper than the
    /// bound is a clear error (never a stack overflow), within it the layer is complete.
    #[test]
    fn opaque_subtree_walk_is_depth_bounded() {
        let o = Overlay::new(|l| write(&l.join("d/old"), b"o", 0o644));
        let base = o.scan();
        fs::remove_dir_all(o.m("d")).unwrap();
        let mut p = o.m("d");
        for _ in 0..12 {
            p.push("n");
        }
        fs::create_dir_all(&p).unwrap();
        write(&p.join("leaf"), b"l", 0o644);
        let (_, d) = o.diff(&base);
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let freezer = CountingFreezer::default();
        let shallow = LayerOptions {
            max_depth: 8,
            ..LayerOptions::default()
        };
        let e = write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &shallow)
            .unwrap_err();
        assert!(
            matches!(
                e,
                LayerError::Limit {
                    key: "max_walk_depth",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(freezer.counts(), (1, 1));
        let deep = LayerOptions {
            max_depth: 12,
            ..LayerOptions::default()
        };
        let (desc, _) =
            write_fs_layer_with(&store, &o.upper, &FsDiffPaths::from(&d), &freezer, &deep).unwrap();
        let items = read_layer(&store, &desc);
        let leaf = format!("d/{}leaf", "n/".repeat(12));
        assert_eq!(item(&items, &leaf).data, b"l");
        assert!(names(&items).contains(&"d/.wh..wh..opq"));
    }

    /// Without `userxattr`, `user.overlay.*` is the container's own xattr (overlayfs ignores
    /// it): it neither hides the image (opaque on `/` or a directory), nor turns a file into a
    /// whiteout, nor fails the layer (redirect, metacopy); it is kept as a plain xattr. With
    /// `userxattr` it is overlay state.
    #[test]
    fn user_overlay_xattrs_are_overlay_state_only_with_userxattr() {
        let o = Overlay::new(|l| {
            write(&l.join("etc/conf"), b"c", 0o644);
            write(&l.join("lib/x"), b"x", 0o644);
        });
        let base = o.scan();
        setxattr(&o.merged, "user.overlay.opaque", b"y");
        setxattr(&o.m("etc"), "user.overlay.opaque", b"y");
        setxattr(&o.m("lib"), "user.overlay.redirect", b"/elsewhere");
        write(&o.m("w"), b"", 0o644);
        setxattr(&o.m("w"), "user.overlay.whiteout", b"");
        write(&o.m("m"), b"data", 0o644);
        setxattr(&o.m("m"), "user.overlay.metacopy", b"");
        // The overlay itself ignores them: the image is all still there.
        assert_eq!(fs::read(o.m("etc/conf")).unwrap(), b"c");
        assert_eq!(fs::read(o.m("lib/x")).unwrap(), b"x");
        let now = o.scan();
        assert!(!now.get(Path::new("")).unwrap().opaque);
        assert!(!now.get(Path::new("etc")).unwrap().opaque);
        assert!(now.get(Path::new("lib")).unwrap().redirect.is_none());
        assert_eq!(
            now.get(Path::new("w")).unwrap().kind,
            crate::inspector::fs::EntryKind::File
        );
        let (_, d) = o.diff(&base);
        assert!(
            d.added.contains(&PathBuf::from("/w")) && d.deleted.is_empty(),
            "{d:?}"
        );
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let (desc, _) = write_fs_layer(
            &store,
            &o.upper,
            &FsDiffPaths::from(&d),
            &CountingFreezer::default(),
        )
        .unwrap();
        let items = read_layer(&store, &desc);
        let n = names(&items);
        assert!(!n.iter().any(|n| n.contains(".wh.")), "{n:?}");
        assert_eq!(item(&items, "w").kind, b'0');
        assert_eq!(item(&items, "m").data, b"data");
        let opaque_xattr = (b"user.overlay.opaque".to_vec(), b"y".to_vec());
        assert!(
            item(&items, "./").xattrs.contains(&opaque_xattr),
            "{:?}",
            item(&items, "./").xattrs
        );
        assert!(item(&items, "etc/").xattrs.contains(&opaque_xattr));

        // The same names on a `userxattr` mount are overlay state.
        let user = LayerOptions {
            xattrs: OverlayXattrs::User,
            ..LayerOptions::default()
        };
        let e = write_fs_layer_with(
            &store,
            &o.upper,
            &FsDiffPaths::from(&d),
            &CountingFreezer::default(),
            &user,
        )
        .unwrap_err();
        assert!(matches!(e, LayerError::Unsupported { .. }), "{e}");
        let trusted_scan =
            Manifest::scan_with(&o.upper, &Default::default(), OverlayXattrs::User).unwrap();
        assert!(trusted_scan.get(Path::new("etc")).unwrap().opaque);
        assert_eq!(
            trusted_scan.get(Path::new("w")).unwrap().kind,
            crate::inspector::fs::EntryKind::Whiteout
        );
        assert!(matches!(
            classify_xattr(b"user.overlay.opaque", OverlayXattrs::Trusted),
            XattrClass::Plain(_)
        ));
        assert!(matches!(
            classify_xattr(b"trusted.overlay.opaque", OverlayXattrs::Trusted),
            XattrClass::Overlay(b"opaque")
        ));
        assert!(matches!(
            classify_xattr(b"user.overlay.overlay.x", OverlayXattrs::User),
            XattrClass::Plain(n) if n == b"user.overlay.x"
        ));
    }

    // ---- the cgroup freezer ----

    /// A process that counts as fast as it can into `<dir>/f`, in its own cgroup; everything
    /// is undone on drop.
    struct Counter {
        child: Child,
        file: PathBuf,
        cgroup: PathBuf,
        // On tmpfs: ext4 flushes a file truncated by `>` (auto_da_alloc), so the counter there
        // spends its time in open() and reads as empty.
        _tmpfs: Tmpfs,
        _dir: tempfile::TempDir,
    }

    impl Counter {
        /// In a new cgroup `crab-test-<our pid>-<tag>` under `parent`.
        fn start(parent: &Path, tag: &str) -> Option<Counter> {
            remove_stale_cgroups(parent);
            let cgroup = parent.join(format!("crab-test-{}-{tag}", std::process::id()));
            if let Err(e) = fs::create_dir(&cgroup) {
                eprintln!("cannot create cgroup {}: {e}", cgroup.display());
                return None;
            }
            let dir = tempfile::tempdir().unwrap();
            let tmpfs = Tmpfs::mount(dir.path(), "1m");
            let mut cmd = Command::new("sh");
            cmd.args(["-c", "i=0; while :; do i=$((i+1)); echo $i > f; done"])
                .current_dir(dir.path())
                .stdout(Stdio::null());
            // Dies with the test even if the test run is killed.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            let child = cmd.spawn().unwrap();
            while !dir.path().join("f").exists() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let c = Counter {
                file: dir.path().join("f"),
                child,
                cgroup,
                _tmpfs: tmpfs,
                _dir: dir,
            };
            fs::write(c.cgroup.join("cgroup.procs"), c.child.id().to_string()).unwrap();
            Some(c)
        }

        /// The counter file's content and mtime: a freeze may catch the shell between the
        /// truncation and the write, so an empty file is a valid state too.
        fn snapshot(&self) -> (String, i64, i64) {
            let md = fs::metadata(&self.file).unwrap();
            (
                fs::read_to_string(&self.file).unwrap(),
                md.mtime(),
                md.mtime_nsec(),
            )
        }

        fn is_counting(&self) -> bool {
            let a = self.snapshot();
            std::thread::sleep(Duration::from_millis(300));
            self.snapshot() != a
        }
    }

    impl Drop for Counter {
        fn drop(&mut self) {
            let _ = self.child.kill();
            for (file, value) in [("freezer.state", "THAWED"), ("cgroup.freeze", "0")] {
                if self.cgroup.join(file).exists() {
                    let _ = fs::write(self.cgroup.join(file), value);
                }
            }
            let _ = self.child.wait();
            for _ in 0..100 {
                if fs::remove_dir(&self.cgroup).is_ok() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            eprintln!("could not remove {}", self.cgroup.display());
        }
    }

    /// Test cgroups of test runs that were killed (their pid is gone): thawed, emptied, removed.
    fn remove_stale_cgroups(parent: &Path) {
        let Ok(entries) = fs::read_dir(parent) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // Exactly `crab-test-<pid>-<tag>`, never a containerd namespace's cgroup.
            let Some((pid, tag)) = name
                .strip_prefix("crab-test-")
                .and_then(|r| r.split_once('-'))
            else {
                continue;
            };
            if pid.is_empty()
                || !pid.bytes().all(|b| b.is_ascii_digit())
                || !["v1", "v2", "bench"].contains(&tag)
            {
                continue;
            }
            if Path::new("/proc").join(pid).exists() {
                continue;
            }
            let dir = e.path();
            for (file, value) in [("freezer.state", "THAWED"), ("cgroup.freeze", "0")] {
                let _ = fs::write(dir.join(file), value);
            }
            for p in fs::read_to_string(dir.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
            {
                if let Ok(p) = p.parse::<i32>() {
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
            }
            for _ in 0..100 {
                if fs::remove_dir(&dir).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }

    fn exercise(counter: &Counter, f: &CgroupFreezer) {
        assert!(counter.is_counting(), "counts before the freeze");
        let t = Instant::now();
        f.freeze().unwrap();
        eprintln!("{:?} froze in {:?}", f.version(), t.elapsed());
        assert!(!counter.is_counting(), "stopped while frozen");
        // Nested use keeps it frozen until the outermost thaw.
        f.freeze().unwrap();
        f.thaw().unwrap();
        assert!(!counter.is_counting(), "still frozen after a nested thaw");
        f.thaw().unwrap();
        assert!(counter.is_counting(), "counts again after the thaw");
        // Frozen by someone else (a user's pause): left frozen.
        f.request(true).unwrap();
        f.wait_frozen().unwrap();
        f.freeze().unwrap();
        f.thaw().unwrap();
        assert!(
            !counter.is_counting(),
            "a pause from outside survives our thaw"
        );
        f.request(false).unwrap();
        assert!(counter.is_counting());
    }

    #[test]
    fn cgroup_v1_freezer_stops_a_real_process() {
        let root = Path::new("/sys/fs/cgroup/freezer");
        if !root.join("freezer.state").exists() && !root.join("cgroup.procs").exists() {
            eprintln!("no v1 freezer hierarchy here (pure cgroup v2): see the v2 test");
            return;
        }
        let counter = Counter::start(root, "v1").expect("v1 freezer cgroup");
        let f = CgroupFreezer::for_pid(counter.child.id()).unwrap();
        assert_eq!(
            (f.version(), f.dir()),
            (CgroupVersion::V1, counter.cgroup.as_path())
        );
        exercise(&counter, &f);
    }

    #[test]
    fn cgroup_v2_freezer_stops_a_real_process() {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let Some(mp) = mountinfo
            .lines()
            .find(|l| l.contains(" - cgroup2 "))
            .and_then(|l| l.split_whitespace().nth(4))
        else {
            eprintln!("no cgroup2 mount: skipped");
            return;
        };
        let Some(counter) = Counter::start(Path::new(mp), "v2") else {
            panic!("cannot create a cgroup2 cgroup under {mp}");
        };
        let f = CgroupFreezer::new(counter.cgroup.clone(), CgroupVersion::V2);
        exercise(&counter, &f);
    }

    // ---- figures ----

    /// Prints fs checkpoint latency and freeze time against changed bytes (no assertions).
    /// `cargo test -p crab-shim --lib -- --ignored --nocapture fs_checkpoint_figures`
    #[test]
    #[ignore]
    fn fs_checkpoint_figures() {
        let o = Overlay::new(|l| write(&l.join("etc/os-release"), b"ID=test\n", 0o644));
        let store_dir = tempfile::tempdir().unwrap();
        let store = Store::open(store_dir.path()).unwrap();
        let counter = Counter::start(Path::new("/sys/fs/cgroup/freezer"), "bench");
        let freezer = counter
            .as_ref()
            .map(|c| CgroupFreezer::for_pid(c.child.id()).unwrap());
        let counting = CountingFreezer::default();
        let freezer: &dyn Freezer = match &freezer {
            Some(f) => f,
            None => &counting,
        };
        println!("store and upperdir on {}", store_dir.path().display());
        println!(
            "{:>10} {:>6} {:>12} {:>12} {:>10} {:>10} {:>10}",
            "changed", "runs", "tar bytes", "zstd bytes", "freeze ms", "capture ms", "total ms"
        );
        let mut mark = o.scan();
        for (label, size) in [
            ("1 KB", 1usize << 10),
            ("100 KB", 100 << 10),
            ("1 MB", 1 << 20),
            ("10 MB", 10 << 20),
            ("100 MB", 100 << 20),
        ] {
            let mut runs = Vec::new();
            for run in 0..5u64 {
                // Half noise, half text: compressible like real files, not trivially so.
                let mut data = noise(size / 2, run + size as u64);
                data.extend(
                    std::iter::repeat_n(
                        b"the quick brown fox jumps over the lazy dog\n".as_slice(),
                        size / 2 / 44 + 1,
                    )
                    .flatten()
                    .take(size - data.len()),
                );
                write(&o.m("work/blob.bin"), &data, 0o644);
                let (now, d) = o.diff(&mark);
                mark = now;
                let (_, s) =
                    write_fs_layer(&store, &o.upper, &FsDiffPaths::from(&d), freezer).unwrap();
                runs.push(s);
            }
            runs.sort_by_key(|s| s.total);
            let med = &runs[runs.len() / 2];
            let ms = |d: Duration| format!("{:.2}", d.as_secs_f64() * 1000.0);
            println!(
                "{label:>10} {:>6} {:>12} {:>12} {:>10} {:>10} {:>10}",
                runs.len(),
                med.bytes,
                med.compressed,
                ms(med.freeze),
                ms(med.capture),
                ms(med.total)
            );
        }
    }
}

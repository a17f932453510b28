//! The store's errors and file primitives: temporary files persisted by rename, directory
//! syncs, digests and RFC 3339 times.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Read, Write},
    os::unix::{ffi::OsStrExt, fs::OpenOptionsExt},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

use sha2::{Digest, Sha256};

/// The manifest format this crab writes and the newest it reads.
pub const FORMAT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("checkpoint store: no space left on device ({op} {path}); nothing was published")]
    NoSpace { op: &'static str, path: PathBuf },
    #[error("checkpoint store: {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("checkpoint manifest {path} has format {format}, newer than the newest this crab reads ({FORMAT}): upgrade crab to read it")]
    UnknownFormat { path: PathBuf, format: u64 },
    #[error("checkpoint manifest {path} is corrupt: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("no checkpoint {seq} in {root}")]
    NotFound { seq: u64, root: PathBuf },
    #[error("checkpoint {seq} is already published in {root}")]
    Exists { seq: u64, root: PathBuf },
    #[error("checkpoint {seq} cannot be published: {reason}")]
    Invalid { seq: u64, reason: String },
}

impl StoreError {
    /// An I/O error; a full disk (or quota) becomes [`StoreError::NoSpace`].
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> StoreError {
        if is_no_space(&source) {
            StoreError::NoSpace {
                op,
                path: path.to_path_buf(),
            }
        } else {
            StoreError::Io {
                op,
                path: path.to_path_buf(),
                source,
            }
        }
    }

    pub fn is_no_space(&self) -> bool {
        matches!(self, StoreError::NoSpace { .. })
    }
}

pub(crate) fn is_no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// A file under a temporary name, removed when dropped unless persisted.
#[derive(Debug)]
pub struct TempFile {
    path: PathBuf,
    pub(crate) file: File,
    keep: bool,
}

pub(crate) enum PersistError {
    Exists,
    Store(StoreError),
}

impl TempFile {
    pub(super) fn create(path: PathBuf) -> Result<TempFile, StoreError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| StoreError::io("create", &path, e))?;
        Ok(TempFile {
            path,
            file,
            keep: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file(&mut self) -> &mut File {
        &mut self.file
    }

    pub(super) fn write_all(&mut self, data: &[u8]) -> Result<(), StoreError> {
        self.file
            .write_all(data)
            .map_err(|e| StoreError::io("write", &self.path, e))
    }

    /// fsync, rename to `dest` (replacing what is there), fsync the directory.
    pub fn persist(mut self, dest: &Path) -> Result<(), StoreError> {
        self.file
            .sync_all()
            .map_err(|e| StoreError::io("fsync", &self.path, e))?;
        fs::rename(&self.path, dest).map_err(|e| StoreError::io("rename", &self.path, e))?;
        self.keep = true;
        fsync_dir(dest.parent().unwrap_or(Path::new(".")))
    }

    /// fsync, rename to `dest` unless it exists, fsync the directory (with `sync_dir`).
    pub(super) fn persist_noreplace(
        mut self,
        dest: &Path,
        sync_dir: bool,
    ) -> Result<(), PersistError> {
        self.file
            .sync_all()
            .map_err(|e| PersistError::Store(StoreError::io("fsync", &self.path, e)))?;
        match rename_noreplace(&self.path, dest) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(PersistError::Exists),
            Err(e) => return Err(PersistError::Store(StoreError::io("rename", &self.path, e))),
        }
        self.keep = true;
        if !sync_dir {
            return Ok(());
        }
        let dir = dest.parent().unwrap_or(Path::new("."));
        fsync_dir(dir).map_err(PersistError::Store)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            if let Err(e) = fs::remove_file(&self.path) {
                if e.kind() != io::ErrorKind::NotFound {
                    log::warn!(
                        "checkpoint store: cannot remove {}: {e}",
                        self.path.display()
                    );
                }
            }
        }
    }
}

pub(super) fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
    };
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: `f` and `t` are NUL-terminated strings that outlive the call; the kernel only
    // reads them.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::EINVAL) {
        return Err(e);
    }
    // Filesystems without RENAME_NOREPLACE: a link fails on an existing name, then drop the temp name.
    fs::hard_link(from, to)?;
    fs::remove_file(from)
}

pub(crate) fn fsync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("fsync", dir, e))
}

pub(super) fn read_dir(dir: &Path) -> Result<Vec<fs::DirEntry>, StoreError> {
    fs::read_dir(dir)
        .and_then(|it| it.collect::<io::Result<Vec<_>>>())
        .map_err(|e| StoreError::io("read", dir, e))
}

pub(super) fn remove_any(path: &Path) -> Result<(), StoreError> {
    let res = match fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    res.map_err(|e| StoreError::io("remove", path, e))
}

pub(super) fn same_device(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    matches!((fs::metadata(a), fs::metadata(b)), (Ok(x), Ok(y)) if x.dev() == y.dev())
}

/// `sha256:<hex>` and length of everything `r` yields.
/// [`Store::temp_file`] of the store at `root` (for work that holds no [`Store`]).
pub fn temp_file_in(root: &Path, what: &str) -> Result<TempFile, StoreError> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    TempFile::create(
        root.join("blobs")
            .join(format!(".{what}-{}-{n}.tmp", std::process::id())),
    )
}

pub(crate) fn sha256_reader(mut r: impl Read) -> io::Result<(String, u64)> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..n]);
        total += n as u64;
    }
    Ok((digest_string(h), total))
}

/// `sha256:<hex>` of what `h` hashed.
pub fn digest_string(h: Sha256) -> String {
    let d = h.finalize();
    let mut s = String::with_capacity(71);
    s.push_str("sha256:");
    for b in d {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

pub(super) fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// RFC 3339 in UTC with milliseconds (`2026-05-01T12:00:00.123Z`).
pub fn rfc3339(t: SystemTime) -> String {
    utc(
        t,
        time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
        ),
    )
}

/// RFC 3339 in UTC with nanoseconds (`2026-12-03T06:41:33.931792054Z`), as logrus and
/// containerd write times.
pub fn rfc3339_nanos(t: SystemTime) -> String {
    utc(
        t,
        time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:9]Z"
        ),
    )
}

/// `t` (clamped to the epoch .. year 9999) in UTC as `format` says.
fn utc(t: SystemTime, format: &[time::format_description::BorrowedFormatItem<'_>]) -> String {
    let max = UNIX_EPOCH + std::time::Duration::from_secs(253_402_300_799);
    let t = t.clamp(UNIX_EPOCH, max);
    time::OffsetDateTime::from(t)
        .format(format)
        .unwrap_or_else(|e| format!("<time {t:?}: {e}>"))
}

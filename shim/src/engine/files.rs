//! The engine's errors and its file primitives: clocks, locks, private files and names.

use std::{
    fs::{self, File, OpenOptions},
    io,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
    sys::time::TimeSpec,
    time::{clock_gettime, ClockId},
};

/// The mode of every directory and file the engine creates.
pub(super) const DIR_MODE: u32 = 0o700;
pub(super) const FILE_MODE: u32 = 0o600;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("engine {}: {context}: {source}", path.display())]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("engine: the ticket {0} left the queue while its job waited")]
    TicketLost(PathBuf),
    #[error("no slot of the host engine for {waited:?} ([engine] wait_timeout_ms): {holders}")]
    WaitTimeout { waited: Duration, holders: String },
}

pub(super) type Result<T, E = EngineError> = std::result::Result<T, E>;

pub(super) fn io_err(context: &'static str, path: &Path) -> impl FnOnce(io::Error) -> EngineError {
    let path = path.to_path_buf();
    move |source| EngineError::Io {
        context,
        path,
        source,
    }
}

/// The host's monotonic clock, the same for every process.
pub fn mono_ns() -> u64 {
    // CLOCK_MONOTONIC always exists; the zero of an impossible failure is what this returned
    // before (the timespec it started from).
    let ts = clock_gettime(ClockId::CLOCK_MONOTONIC).unwrap_or(TimeSpec::new(0, 0));
    ts.tv_sec() as u64 * 1_000_000_000 + ts.tv_nsec() as u64
}

pub(super) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// `file` locked without waiting (`arg` is one of the `*Nonblock` locks), released when the
/// [`Flock`] is dropped; `Ok(Err(file))` when someone else holds a conflicting lock.
pub(super) fn try_lock(file: File, arg: FlockArg) -> io::Result<Result<Flock<File>, File>> {
    match Flock::lock(file, arg) {
        Ok(locked) => Ok(Ok(locked)),
        Err((file, Errno::EWOULDBLOCK)) => Ok(Err(file)),
        Err((_, e)) => Err(e.into()),
    }
}

/// Whether someone holds a lock on `path` (`None`: no such file).
pub(super) fn is_locked(path: &Path) -> io::Result<Option<bool>> {
    match File::open(path) {
        Ok(f) => try_lock(f, FlockArg::LockSharedNonblock).map(|r| Some(r.is_err())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// `opts` creating files `0600`.
pub(super) fn private_file(opts: &mut OpenOptions) -> &mut OpenOptions {
    opts.mode(FILE_MODE)
}

/// Creates `dir` `0700`, or tightens an existing one (a root an older crab made `0755`).
pub(super) fn ensure_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match fs::DirBuilder::new().mode(DIR_MODE).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let md = fs::metadata(dir).map_err(io_err("stat", dir))?;
            if !md.is_dir() {
                return Err(io_err("create", dir)(io::ErrorKind::NotADirectory.into()));
            }
            if md.permissions().mode() & 0o7777 != DIR_MODE {
                fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE))
                    .map_err(io_err("restrict", dir))?;
            }
            Ok(())
        }
        Err(e) => Err(io_err("create", dir)(e)),
    }
}

/// The key of a sandbox in `usage.json`.
pub(super) fn usage_key(namespace: &str, sandbox: &str) -> String {
    format!("{namespace}/{sandbox}")
}

/// A unique name per process: the ticket names and temp files.
pub(super) fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}{:020}-{}-{}",
        mono_ns(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

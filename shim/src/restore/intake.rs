//! Starting a container from a checkpoint image: the shim's half of "restore = start".
//!
//! A checkpoint image (built by `crabctl export`) is an ordinary OCI image whose last layer
//! holds crab's reserved directory [`RESERVED_DIR`] at the rootfs root:
//!
//! ```text
//! .crab-checkpoint/checkpoint.json   what was checkpointed (format, source, layer chain, processes)
//! .crab-checkpoint/criu/             the CRIU image (pages materialized), only with a process image
//! ```
//!
//! On Create the shim takes it out of the rootfs ([`take_from_rootfs`]): the CRIU image is copied
//! to the restore's own directory in the store (`super::scratch`: on disk, not in the bundle's
//! tmpfs), the reserved directory is removed from the rootfs (a whiteout in the
//! container's upperdir, so the container never sees it), and Start then runs `runc restore`
//! instead of `runc start`, or the image's entrypoint when there is no process image.
//! Everything read from the image is untrusted: only plain files and directories are accepted
//! (a symlink could point anywhere on the host, since the rootfs is mounted there), and a
//! newer format is refused rather than half-understood.

use std::{
    ffi::OsString,
    fs::{self, File},
    io::{self, Read},
    os::{fd::AsFd, unix::fs::OpenOptionsExt},
    path::{Path, PathBuf},
};

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use crab_runtime_config::UnsignedImages;
use serde::{Deserialize, Serialize};

use super::{
    cache::{self as restore_cache, CacheError, RestoreCache},
    privilege::{self, Excess, Granted},
};
use crate::checkpoint::{
    criu_image::{self, CriuImageError},
    pages,
    provenance::{
        self, FileDigest, HashingReader, ProvenanceError, Statement, TrustedKeys, SIGNATURE_FILE,
    },
    store::{
        CheckpointKind, Descriptor, DescriptorError, Manifest, ProcessImage, Store, StoreError,
    },
};

/// The directory at the rootfs root that carries a checkpoint in an image.
pub const RESERVED_DIR: &str = ".crab-checkpoint";
/// `checkpoint.json` inside [`RESERVED_DIR`].
pub const META_FILE: &str = "checkpoint.json";
/// The CRIU image directory inside [`RESERVED_DIR`].
pub const CRIU_DIR: &str = "criu";
/// The metadata format this crab writes and the newest it reads.
pub const META_FORMAT: u32 = 1;
/// `checkpoint.json` is small; anything larger is not ours.
const META_MAX: u64 = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("checkpoint image: {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("checkpoint image: {path} is not a valid checkpoint description: {reason}")]
    BadMeta { path: PathBuf, reason: String },
    #[error("checkpoint image: {path} is not a valid checkpoint description: {source}")]
    BadLayer {
        path: PathBuf,
        #[source]
        source: DescriptorError,
    },
    #[error("checkpoint image has format {format}, newer than the newest this crab reads ({META_FORMAT}): upgrade crab to restore it")]
    NewerFormat { format: u32 },
    #[error("checkpoint image: {path} must be a plain file or directory (found {found}); refusing to follow it")]
    NotPlain { path: PathBuf, found: &'static str },
    #[error("checkpoint image: it names a process image but {path} is missing or incomplete")]
    MissingImage { path: PathBuf },
    #[error("checkpoint store: {0}")]
    Store(#[from] StoreError),
    #[error("checkpoint store: importing the process image: {0}")]
    Pages(#[from] pages::PagesError),
    #[error(transparent)]
    Provenance(#[from] ProvenanceError),
    #[error(transparent)]
    Privilege(#[from] Excess),
    #[error(transparent)]
    CriuImage(#[from] CriuImageError),
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(
        "checkpoint image: {path} holds {what}, more than the {limit} allowed ([restore] {key})"
    )]
    TooLarge {
        path: PathBuf,
        what: String,
        limit: u64,
        key: &'static str,
    },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> RestoreError + '_ {
    move |source| RestoreError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Where a checkpoint came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    pub namespace: String,
    pub container: String,
    pub seq: u64,
    #[serde(default)]
    pub turn_id: String,
}

/// The processes of a checkpoint's CRIU image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessMeta {
    #[serde(default)]
    pub pids: Vec<u32>,
}

/// `.crab-checkpoint/checkpoint.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub format: u32,
    pub source: Source,
    /// The diff layers on top of the base image, oldest first: the image carries them, so a
    /// container restored from it starts its own chain from them.
    #[serde(default)]
    pub fs_layers: Vec<Descriptor>,
    pub process: Option<ProcessMeta>,
    #[serde(default)]
    pub created_at: String,
    /// Tracked volumes (paths in the container) whose whole contents the layers hold below
    /// those paths: a container restored from the image with a tracked volume there gets them
    /// back in its host directory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<PathBuf>,
    /// The source container's crab spec annotations ([`crate::turns::SPEC_ANNOTATIONS`]: its
    /// turn boundary, checkpoint policy and probe commands): a container started from the image
    /// keeps them unless its own spec sets them ([`crate::turns::inherit`]), so a restored
    /// sandbox goes on checkpointing as it did.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl CheckpointMeta {
    /// The description of checkpoint `m` of container `container`'s store in `namespace`
    /// (no annotations: a caller that carries the source's adds them).
    pub fn of_manifest(namespace: &str, container: &str, m: &Manifest) -> CheckpointMeta {
        CheckpointMeta {
            format: META_FORMAT,
            source: Source {
                namespace: namespace.to_string(),
                container: container.to_string(),
                seq: m.seq,
                turn_id: m.turn_id.clone(),
            },
            fs_layers: m.fs_layers.clone(),
            process: m.process.as_ref().map(|p| ProcessMeta {
                pids: p.pids.clone(),
            }),
            created_at: m.created_at.clone(),
            volumes: m.volumes.clone(),
            annotations: Default::default(),
        }
    }

    /// Parses and checks the format first, so a newer image gets the clear "upgrade" error and
    /// not a field error.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<CheckpointMeta, RestoreError> {
        let bad = |reason: String| RestoreError::BadMeta {
            path: path.to_path_buf(),
            reason,
        };
        /// Only the format, read first; the rest of the document is skipped, not built into
        /// a tree (it is untrusted, up to [`META_MAX`] bytes).
        #[derive(Deserialize)]
        struct Head {
            format: Option<u64>,
        }
        let head: Head = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let format = head
            .format
            .ok_or_else(|| bad("no numeric `format`".into()))?;
        if format > u64::from(META_FORMAT) {
            return Err(RestoreError::NewerFormat {
                format: u32::try_from(format).unwrap_or(u32::MAX),
            });
        }
        let meta: CheckpointMeta = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        if meta.format == 0 {
            return Err(bad("format 0".into()));
        }
        for d in &meta.fs_layers {
            d.check().map_err(|source| RestoreError::BadLayer {
                path: path.to_path_buf(),
                source,
            })?;
        }
        Ok(meta)
    }
}

/// A checkpoint taken out of a rootfs.
#[derive(Debug, Clone)]
pub struct Taken {
    pub meta: CheckpointMeta,
    /// The CRIU image, copied out of the rootfs (present exactly when `meta.process` is).
    pub criu_dir: Option<PathBuf>,
    /// The restore cache that holds a verified copy of the CRIU image, and the image's
    /// verified file list (its key): the store imports that copy.
    pub cached: Option<(RestoreCache, BTreeMap<String, FileDigest>)>,
    /// The digests of the CRIU image's page files, being checked while the restore goes on
    /// (`None`: every file was checked before [`take_from_rootfs`] returned).
    pub verification: Option<Verification>,
    /// Not from an image: resumed from a checkpoint of the container's lineage on this node,
    /// its files put into the rootfs by the shim (`containers::resume`).
    pub resumed: Option<Resumed>,
}

/// Where a resumed checkpoint's layers are: the new store links them ([`restored_manifest`]),
/// since no image carries them.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// Each fs layer's blob file (in the store that took it, or another store of the node).
    pub blobs: Vec<(Descriptor, PathBuf)>,
}

/// Kinds of file a checkpoint image may not contain in its reserved directory.
fn kind_name(t: fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_symlink() {
        "a symlink"
    } else if t.is_block_device() || t.is_char_device() {
        "a device"
    } else if t.is_fifo() {
        "a fifo"
    } else if t.is_socket() {
        "a socket"
    } else {
        "something else"
    }
}

fn plain(path: &Path) -> Result<fs::Metadata, RestoreError> {
    let md = fs::symlink_metadata(path).map_err(io_err(path))?;
    if md.is_file() || md.is_dir() {
        Ok(md)
    } else {
        Err(RestoreError::NotPlain {
            path: path.to_path_buf(),
            found: kind_name(md.file_type()),
        })
    }
}

/// Opens a file of a checkpoint image for reading if and only if it is a regular file: the path
/// is resolved to an `O_PATH` handle without following a symlink in its last component, its type
/// checked on that handle, and only then the same inode opened for reading
/// ([`crate::sys::beneath::reopen_regular`]). An ordinary open followed by a type check would already
/// have run a planted device's `open` (a hardware watchdog reboots the host when opened);
/// `O_NONBLOCK` only keeps a FIFO from blocking.
fn open_plain(path: &Path) -> Result<File, RestoreError> {
    let handle = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(io_err(path))?;
    let md = handle.metadata().map_err(io_err(path))?;
    if !md.is_file() {
        return Err(RestoreError::NotPlain {
            path: path.to_path_buf(),
            found: kind_name(md.file_type()),
        });
    }
    crate::sys::beneath::reopen_regular(handle.as_fd(), libc::O_RDONLY).map_err(io_err(path))
}

/// Reads a plain file (see [`open_plain`]) of at most `max` bytes.
fn read_plain(path: &Path, max: u64) -> Result<Vec<u8>, RestoreError> {
    let f = open_plain(path)?;
    let md = f.metadata().map_err(io_err(path))?;
    if !md.is_file() {
        return Err(RestoreError::NotPlain {
            path: path.to_path_buf(),
            found: kind_name(md.file_type()),
        });
    }
    if md.len() > max {
        return Err(RestoreError::BadMeta {
            path: path.to_path_buf(),
            reason: format!("{} bytes", md.len()),
        });
    }
    let mut out = Vec::with_capacity(md.len() as usize);
    f.take(max).read_to_end(&mut out).map_err(io_err(path))?;
    Ok(out)
}

pub use super::trust::ImageLimits;

/// A CRIU image copied: its logical size and each file's digest.
struct Copied {
    bytes: u64,
    /// The digests of the files hashed while copied.
    files: BTreeMap<String, FileDigest>,
    /// Every file copied, with its size.
    sizes: BTreeMap<String, u64>,
    /// The files copied without hashing ([`deferrable`]): a [`Verification`] checks them.
    deferred: BTreeMap<String, u64>,
    /// Of the copy's time, what hashing took.
    hashing: Duration,
}

/// Page files at least this large are verified while CRIU restores rather than before.
pub const DEFER_MIN_BYTES: u64 = 256 << 10;

/// Whether the digest of image file `name` of `len` bytes may be checked while CRIU restores
/// (a [`Verification`]): CRIU's page data, of which only the restored processes' memory is
/// made, and which CRIU has read in full before any restored process runs (its post-restore
/// stage, where the gate waits). Every other file (those the least-privilege check decodes
/// among them) is checked before the restore begins.
pub fn deferrable(name: &str, len: u64) -> bool {
    len >= DEFER_MIN_BYTES && name.starts_with("pages-") && name.ends_with(".img")
}

/// The plain files of CRIU image directory `from` (no subdirectories: a CRIU image is flat)
/// with their sizes, bounded by `limits`; nothing is opened.
fn list_image(from: &Path, limits: ImageLimits) -> Result<Vec<(OsString, u64)>, RestoreError> {
    let md = plain(from)?;
    if !md.is_dir() {
        return Err(RestoreError::MissingImage {
            path: from.to_path_buf(),
        });
    }
    let mut listed = Vec::new();
    let mut total = 0u64;
    for entry in fs::read_dir(from).map_err(io_err(from))? {
        let entry = entry.map_err(io_err(from))?;
        let src = entry.path();
        let md = plain(&src)?;
        if !md.is_file() {
            return Err(RestoreError::NotPlain {
                path: src,
                found: "a directory",
            });
        }
        total = total.saturating_add(md.len());
        listed.push((entry.file_name(), md.len()));
        if listed.len() as u64 > limits.max_files {
            return Err(RestoreError::TooLarge {
                path: from.to_path_buf(),
                what: format!("more than {} files", limits.max_files),
                limit: limits.max_files,
                key: "max_image_files",
            });
        }
        if total > limits.max_bytes {
            return Err(RestoreError::TooLarge {
                path: from.to_path_buf(),
                what: format!("more than {total} bytes"),
                limit: limits.max_bytes,
                key: "max_image_mib",
            });
        }
    }
    Ok(listed)
}

/// Copies the plain files of `from` into a new `to`, hashing each as it passes, except (with
/// `defer`) the page files [`deferrable`] names: those are copied in the kernel and left to a
/// [`Verification`]. The directory is listed and bounded by `limits` ([`list_image`]) before a
/// byte is copied; a file that grows while being copied is an error, not a longer copy.
fn copy_image(
    from: &Path,
    to: &Path,
    limits: ImageLimits,
    defer: bool,
) -> Result<Copied, RestoreError> {
    let listed = list_image(from, limits)?;
    match fs::remove_dir_all(to) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(RestoreError::Io {
                path: to.to_path_buf(),
                source: e,
            })
        }
    }
    fs::create_dir_all(to).map_err(io_err(to))?;
    let mut copied = Copied {
        bytes: 0,
        files: BTreeMap::new(),
        sizes: BTreeMap::new(),
        deferred: BTreeMap::new(),
        hashing: Duration::ZERO,
    };
    for (name, len) in listed {
        let src = from.join(&name);
        let input = open_plain(&src)?;
        let dst = to.join(&name);
        let mut out = File::create(&dst).map_err(io_err(&dst))?;
        let name = name.to_string_lossy().into_owned();
        let n = if defer && deferrable(&name, len) {
            // File to file: `copy_file_range` where the filesystems allow it.
            let n = io::copy(&mut input.take(len + 1), &mut out).map_err(io_err(&dst))?;
            copied.deferred.insert(name.clone(), n);
            n
        } else {
            let mut hashing = HashingReader::new(input.take(len + 1));
            let n = io::copy(&mut hashing, &mut out).map_err(io_err(&dst))?;
            copied.hashing += hashing.hashing_time();
            copied.files.insert(name.clone(), hashing.finish());
            n
        };
        if n != len {
            return Err(RestoreError::Io {
                path: src,
                source: io::Error::other(format!("{n} bytes read, {len} listed")),
            });
        }
        copied.bytes += n;
        copied.sizes.insert(name, n);
    }
    if !to.join("inventory.img").is_file() {
        return Err(RestoreError::MissingImage {
            path: from.to_path_buf(),
        });
    }
    Ok(copied)
}

impl Copied {
    /// Checks what was copied against a verified statement: every file by name and size, and
    /// the digests of those hashed while copied (the rest is left to a [`Verification`]).
    fn check(&self, statement: &Statement) -> Result<(), ProvenanceError> {
        provenance::check_sizes(statement, &self.sizes)?;
        provenance::check_digests(statement, &self.files)
    }
}

/// What a [`Verification`] found.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// `Err`: why the files are not the signed ones (a [`ProvenanceError`]'s text).
    pub result: Result<(), String>,
    /// How long hashing took.
    pub took: Duration,
    /// When the verdict was reached.
    pub at: std::time::SystemTime,
}

#[derive(Debug)]
struct VerificationState {
    verdict: std::sync::Mutex<Option<Verdict>>,
    done: std::sync::Condvar,
    bytes: u64,
}

/// The digests of a restore's page files ([`deferrable`]), checked on a thread of their own
/// from the restore's private copy (in the store's restore directory or the restore cache: root's, out of every
/// container's reach, never changed after the copy) while Start runs runc and CRIU on that
/// same copy. CRIU's post-restore gate ([`super::gate`]) holds every restored process
/// until the verdict: what runs is exactly what was signed, and the hashing, ~30 ms for 50 MB,
/// is off the restore's critical path.
#[derive(Debug, Clone)]
pub struct Verification(std::sync::Arc<VerificationState>);

impl Verification {
    /// Starts checking `files` (name and size) in `dir` against `statement`, then calls
    /// `then` with whether they are the signed ones.
    fn start(
        dir: PathBuf,
        files: BTreeMap<String, u64>,
        statement: &Statement,
        then: impl FnOnce(bool) + Send + 'static,
    ) -> Verification {
        let state = std::sync::Arc::new(VerificationState {
            verdict: std::sync::Mutex::new(None),
            done: std::sync::Condvar::new(),
            bytes: files.values().sum(),
        });
        let signed: BTreeMap<String, FileDigest> = files
            .keys()
            .filter_map(|n| Some((n.clone(), statement.criu.get(n)?.clone())))
            .collect();
        let run = {
            let state = state.clone();
            move || {
                let started = Instant::now();
                let result = Self::hash(&dir, &files, &signed);
                then(result.is_ok());
                *state.verdict.lock().unwrap() = Some(Verdict {
                    result,
                    took: started.elapsed(),
                    at: std::time::SystemTime::now(),
                });
                state.done.notify_all();
            }
        };
        let run = std::sync::Arc::new(std::sync::Mutex::new(Some(run)));
        let spawned = {
            let run = run.clone();
            std::thread::Builder::new()
                .name("crab-verify".into())
                .spawn(move || {
                    if let Some(f) = run.lock().unwrap().take() {
                        f()
                    }
                })
        };
        if spawned.is_err() {
            // No thread to be had: checked here, before the restore.
            if let Some(f) = run.lock().unwrap().take() {
                f()
            }
        }
        Verification(state)
    }

    fn hash(
        dir: &Path,
        files: &BTreeMap<String, u64>,
        signed: &BTreeMap<String, FileDigest>,
    ) -> Result<(), String> {
        let mut found = BTreeMap::new();
        for (name, len) in files {
            let path = dir.join(name);
            let input = open_plain(&path).map_err(|e| e.to_string())?;
            let mut hashing = HashingReader::new(input.take(len + 1));
            io::copy(&mut hashing, &mut io::sink()).map_err(|e| io_err(&path)(e).to_string())?;
            found.insert(name.clone(), hashing.finish());
        }
        let statement = Statement {
            checkpoint_json: String::new(),
            criu: signed.clone(),
            layers: None,
            rootfs: None,
        };
        provenance::check_digests(&statement, &found).map_err(|e| e.to_string())
    }

    /// The bytes being checked.
    pub fn bytes(&self) -> u64 {
        self.0.bytes
    }

    /// The verdict, if it was reached.
    pub fn verdict(&self) -> Option<Verdict> {
        self.0.verdict.lock().unwrap().clone()
    }

    /// Waits for the verdict.
    pub fn wait(&self) -> Verdict {
        let mut v = self.0.verdict.lock().unwrap();
        loop {
            if let Some(d) = v.as_ref() {
                return d.clone();
            }
            v = self.0.done.wait(v).unwrap();
        }
    }
}

/// Who may restore what: the keys whose signatures are trusted, what to do with an image
/// none of them signed, the bounds on its size, and what the new container's spec grants.
pub struct RestoreGuard<'a> {
    /// The container being created (for the log).
    pub container: &'a str,
    /// Loaded only when there is a checkpoint to check (a missing key file must not stop
    /// ordinary containers).
    pub trusted: &'a dyn Fn() -> Result<TrustedKeys, ProvenanceError>,
    pub unsigned: UnsignedImages,
    pub limits: ImageLimits,
    pub granted: &'a Granted,
    /// The host's cache of verified CRIU images ([`RestoreCache`]), if the config keeps one.
    pub cache: Option<&'a RestoreCache>,
    /// Whether the page files' digests may be checked while the restore goes on
    /// ([`Verification`]: the caller must then hold the restored processes until the verdict).
    pub defer_pages: bool,
    /// Which layers the engine unpacked the rootfs from ([`super::layers`]), or why that cannot
    /// be told; checked against the signed layers of a signed image.
    pub unpacked: &'a Result<super::layers::Unpacked, String>,
}

/// A signed image's layers against those the engine unpacked: the signature must name them
/// ([`Statement::layers`]) and the rootfs must be them, topped by the checkpoint layer alone.
fn check_layers(
    statement: &Statement,
    unpacked: &Result<super::layers::Unpacked, String>,
) -> Result<(), ProvenanceError> {
    let Some(signed) = &statement.layers else {
        return Err(ProvenanceError::Layers(
            "its signature names no image layers (signed by a crab that did not bind them): \
             export the checkpoint again"
                .into(),
        ));
    };
    let unpacked = unpacked
        .as_ref()
        .map_err(|why| ProvenanceError::Layers(why.clone()))?;
    super::layers::verify(signed, unpacked)
}

/// Copies a process image of a checkpoint store (`from`: plain files, and page files as
/// recipes of the store's `chunks`) into a new directory `to` for CRIU: plain files copied
/// within `limits`, page files rebuilt from their chunks (each chunk's digest checked), the
/// recipes left out. Returns the bytes of the image. On an error nothing is left at `to`.
pub fn copy_stored_image(
    from: &Path,
    chunks: &Path,
    to: &Path,
    limits: ImageLimits,
) -> Result<u64, RestoreError> {
    let copied = (|| {
        let copied = copy_image(from, to, limits, false)?;
        let pages = pages::materialize(to, chunks)?;
        for entry in fs::read_dir(to).map_err(io_err(to))? {
            let entry = entry.map_err(io_err(to))?;
            if pages::is_recipe(&entry.file_name().to_string_lossy()) {
                fs::remove_file(entry.path()).map_err(io_err(&entry.path()))?;
            }
        }
        Ok::<_, RestoreError>(copied.bytes + pages)
    })();
    if copied.is_err() {
        let _ = fs::remove_dir_all(to);
    }
    copied
}

/// Checks the CRIU image in `dir` (a private copy) against what the container's spec grants.
pub fn check_privilege(dir: &Path, granted: &Granted) -> Result<(), RestoreError> {
    let facts = criu_image::read_facts(dir)?;
    privilege::check(&facts, granted)?;
    Ok(())
}

/// Looks for a checkpoint in `rootfs`. Without one: `None`, nothing touched. With one: its
/// signature is verified against `guard`'s trusted keys, the CRIU image (if any) copied to
/// `criu_dest` (bounded, each file checked against the signed digests) and checked against
/// what the spec grants, and the reserved directory removed from the rootfs. On an error the
/// rootfs is left as it was and nothing is left at `criu_dest`.
///
/// An image no trusted key signed is refused, or (`unsigned_images = "start-fresh"`) its
/// reserved directory is removed and `None` returned: the container starts as an ordinary
/// image. An image altered after signing is always refused.
pub fn take_from_rootfs(
    rootfs: &Path,
    criu_dest: &Path,
    guard: &RestoreGuard<'_>,
) -> Result<Option<Taken>, RestoreError> {
    let dir = rootfs.join(RESERVED_DIR);
    match fs::symlink_metadata(&dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(RestoreError::Io {
                path: dir,
                source: e,
            })
        }
        Ok(md) if !md.is_dir() => {
            return Err(RestoreError::NotPlain {
                path: dir,
                found: kind_name(md.file_type()),
            });
        }
        Ok(_) => {}
    }
    let started = Instant::now();
    let meta_path = dir.join(META_FILE);
    let meta_bytes = read_plain(&meta_path, META_MAX)?;
    let meta = CheckpointMeta::parse(&meta_path, &meta_bytes)?;
    let sig_path = dir.join(SIGNATURE_FILE);
    let verified = match fs::symlink_metadata(&sig_path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ProvenanceError::Untrusted(format!(
            "it carries no signature ({RESERVED_DIR}/{SIGNATURE_FILE})"
        ))),
        _ => (guard.trusted)()?.verify(
            &read_plain(&sig_path, provenance::SIGNATURE_MAX)?,
            &meta_bytes,
        ),
    };
    let statement = match verified.and_then(|s| check_layers(&s, guard.unpacked).map(|()| s)) {
        Ok(s) => s,
        Err(e @ ProvenanceError::Untrusted(_)) if guard.unsigned == UnsignedImages::StartFresh => {
            log::warn!(
                "{e}: starting it as an ordinary image ([restore] unsigned_images = \"start-fresh\"), \
                 without its processes"
            );
            fs::remove_dir_all(&dir).map_err(io_err(&dir))?;
            return Ok(None);
        }
        Err(e @ ProvenanceError::Untrusted(_)) if guard.unsigned == UnsignedImages::KernelCheck => {
            // Vouched for by nobody: the files are taken as they are (their digests as read
            // now stand in for a signed statement) and the kernel check decides.
            log::warn!(
                "{e}: restoring its processes on the kernel check alone ([restore] \
                 unsigned_images = \"kernel-check\")"
            );
            let criu = dir.join(CRIU_DIR);
            let criu_files = match fs::symlink_metadata(&criu) {
                Ok(_) => super::trust::digests(&criu, guard.limits)?,
                Err(_) => BTreeMap::new(),
            };
            Statement {
                checkpoint_json: provenance::sha256(&meta_bytes),
                criu: criu_files,
                layers: None,
                rootfs: None,
            }
        }
        Err(e) => return Err(e.into()),
    };
    let signature_time = started.elapsed();
    let criu = dir.join(CRIU_DIR);
    let mut cached = None;
    let mut verification = None;
    let criu_dir = match (&meta.process, fs::symlink_metadata(&criu).is_ok()) {
        (Some(_), true) => {
            let copy_started = Instant::now();
            let checked = take_image(&criu, criu_dest, &statement, guard).and_then(|taken| {
                let copy_time = copy_started.elapsed();
                let t = Instant::now();
                check_privilege(criu_dest, guard.granted)?;
                Ok((taken, copy_time, t.elapsed()))
            });
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            match checked {
                Ok((taken, copy_time, privileges)) => {
                    let later = match &taken.verification {
                        Some(v) => format!(
                            "; the digests of its page files ({} bytes) are checked while CRIU \
                             restores",
                            v.bytes()
                        ),
                        None => String::new(),
                    };
                    log::info!(
                        "checkpoint image of {} verified in {:.2} ms (description and signature \
                         {:.2}, file digests {:.2}, privileges {:.2}): {} files, {} bytes, {} in \
                         {:.1} ms{later}",
                        guard.container,
                        ms(signature_time + taken.hashing + privileges),
                        ms(signature_time),
                        ms(taken.hashing),
                        ms(privileges),
                        statement.criu.len(),
                        taken.bytes,
                        taken.how,
                        ms(copy_time)
                    );
                    cached = taken.cache.map(|c| (c.clone(), statement.criu.clone()));
                    verification = taken.verification;
                }
                Err(e) => {
                    let _ = fs::remove_dir_all(criu_dest);
                    return Err(e);
                }
            }
            Some(criu_dest.to_path_buf())
        }
        (Some(_), false) => return Err(RestoreError::MissingImage { path: criu }),
        (None, present) => {
            if !statement.criu.is_empty() {
                return Err(ProvenanceError::Altered(
                    "the signature names CRIU files but checkpoint.json names no process image"
                        .into(),
                )
                .into());
            }
            if present {
                log::warn!(
                    "checkpoint image names no process image but carries {}: ignored",
                    criu.display()
                );
            }
            None
        }
    };
    if let Err(e) = fs::remove_dir_all(&dir) {
        if let Some(d) = &criu_dir {
            let _ = fs::remove_dir_all(d);
        }
        return Err(RestoreError::Io {
            path: dir,
            source: e,
        });
    }
    Ok(Some(Taken {
        meta,
        criu_dir,
        cached,
        verification,
        resumed: None,
    }))
}

/// A CRIU image put into a restore's directory.
struct TakenImage<'a> {
    bytes: u64,
    /// Time spent hashing before returning (zero when the verified copy came from the cache).
    hashing: Duration,
    /// How, for the log.
    how: String,
    /// The cache that holds its verified copy.
    cache: Option<&'a RestoreCache>,
    /// The page files' digests, being checked.
    verification: Option<Verification>,
}

/// Puts the CRIU image `criu` of a rootfs into `dest`, verified against `statement`: through
/// the restore cache when there is one (the image's files are then only listed, by name and
/// size, if another restore verified the same image before), else copied and hashed here.
/// With `guard.defer_pages`, the page files' digests are checked by a [`Verification`] that
/// goes on after this returns; a cache entry built here appears only once it passed.
fn take_image<'a>(
    criu: &Path,
    dest: &Path,
    statement: &Statement,
    guard: &RestoreGuard<'a>,
) -> Result<TakenImage<'a>, RestoreError> {
    let bytes: u64 = statement.criu.values().map(|d| d.size).sum();
    if let Some(cache) = guard.cache {
        // Whatever the cache holds, an image whose files are not the signed ones (by name and
        // size) is refused as it would be without it; their bytes are never read from here on.
        let listed: BTreeMap<String, u64> = list_image(criu, guard.limits)?
            .into_iter()
            .map(|(n, len)| (n.to_string_lossy().into_owned(), len))
            .collect();
        provenance::check_sizes(statement, &listed)?;
        let build = |to: &Path| {
            let copied = copy_image(criu, to, guard.limits, guard.defer_pages)?;
            copied.check(statement)?;
            Ok::<_, RestoreError>((copied, to.to_path_buf()))
        };
        match cache.provide(&statement.criu, dest, build) {
            Ok(Some((p, built))) => {
                let how = match p.source {
                    restore_cache::Source::Hit => "the restore cache's verified copy",
                    restore_cache::Source::Built => "verified into the restore cache",
                };
                let mut hashing = Duration::ZERO;
                let mut verification = None;
                if let Some(((copied, image), publish)) = built {
                    hashing = copied.hashing;
                    let publish = move |ok: bool| {
                        if !ok {
                            return; // dropped: nothing enters the cache
                        }
                        if let Err(e) = publish.commit() {
                            log::warn!("{e}: the verified image was not cached");
                        }
                    };
                    if copied.deferred.is_empty() {
                        publish(true);
                    } else {
                        verification = Some(Verification::start(
                            image,
                            copied.deferred,
                            statement,
                            publish,
                        ));
                    }
                }
                return Ok(TakenImage {
                    bytes,
                    hashing,
                    how: format!("{how} ({} files linked, {} copied)", p.linked, p.copied),
                    cache: Some(cache),
                    verification,
                });
            }
            Ok(None) => {}
            Err(RestoreError::Cache(e)) => {
                log::warn!("{e}: copying the image without the cache");
            }
            Err(e) => return Err(e),
        }
    }
    let copied = copy_image(criu, dest, guard.limits, guard.defer_pages)?;
    copied.check(statement)?;
    let verification = (!copied.deferred.is_empty())
        .then(|| Verification::start(dest.to_path_buf(), copied.deferred, statement, |_| {}));
    Ok(TakenImage {
        bytes: copied.bytes,
        hashing: copied.hashing,
        how: "copied out".into(),
        cache: None,
        verification,
    })
}

/// The origin manifest of a container started from an ordinary image: nothing on top of it.
pub fn created_manifest(store: &Store, image_note: &str) -> Result<Manifest, StoreError> {
    let mut m = Manifest::child_of(None, store.next_seq()?, "", CheckpointKind::Created);
    m.explanation =
        format!("container created{image_note}: its rootfs is the image, no process image");
    Ok(m)
}

/// The origin manifest of a container restored from a checkpoint image: the chain the image
/// carries and its process image, imported into `store` (page data deduplicated), unless the
/// checkpoint is this very store's own (a rollback or recovery keeping the container id),
/// whose process image is referenced as it is.
/// The checkpoint of this very store that `taken` was exported from (a rollback or recovery
/// of the container in place), if it is still there.
pub(crate) fn own_source(
    store: &Store,
    namespace: &str,
    container: &str,
    taken: &Taken,
) -> Option<Manifest> {
    let src = &taken.meta.source;
    (src.namespace == namespace && src.container == container)
        .then(|| store.get(src.seq).ok())
        .flatten()
        .filter(|m| m.fs_layers == taken.meta.fs_layers)
}

/// Whether [`restored_manifest`] must import a process image (copy and deduplicate it into the
/// store), rather than reference one the store already holds or have none.
pub fn imports_process_image(
    store: &Store,
    namespace: &str,
    container: &str,
    taken: &Taken,
) -> bool {
    taken.criu_dir.is_some()
        && !own_source(store, namespace, container, taken)
            .and_then(|o| o.process)
            .is_some_and(|p| store.root().join(&p.image).is_dir())
}

pub fn restored_manifest(
    store: &Store,
    namespace: &str,
    container: &str,
    taken: &Taken,
) -> Result<Manifest, RestoreError> {
    let seq = store.next_seq()?;
    let src = &taken.meta.source;
    let own = own_source(store, namespace, container, taken);
    let mut m = Manifest::child_of(None, seq, &src.turn_id, CheckpointKind::Restored);
    m.parent = own.as_ref().map(|o| o.seq);
    m.fs_layers = taken.meta.fs_layers.clone();
    m.image_layers = match &taken.resumed {
        // Resumed: no image carries the layers (they were put into the rootfs): the store
        // holds them, its own or linked from where they were found.
        Some(r) => {
            for (d, path) in &r.blobs {
                store.link_blob(path, d)?;
            }
            0
        }
        None => m.fs_layers.len(),
    };
    m.process = match (
        &taken.criu_dir,
        own.as_ref().and_then(|o| o.process.clone()),
    ) {
        (None, _) => None,
        (Some(_), Some(p)) if store.root().join(&p.image).is_dir() => Some(p),
        (Some(criu), _) => {
            let dir = store.proc_dir(seq);
            // The restore cache's deduplicated form of the verified image, linked; else this
            // restore's own copy, copied and deduplicated.
            let (bytes_logical, bytes_stored) = match cached_import(store, &dir, taken) {
                Some(i) => (i.bytes_logical, i.bytes_stored),
                None => {
                    let bytes_logical = copy_image(criu, &dir, ImageLimits::NONE, false)?.bytes;
                    let dedup = pages::dedup(&dir, &store.chunks_dir())?;
                    let files: u64 = fs::read_dir(&dir)
                        .map_err(io_err(&dir))?
                        .filter_map(|e| e.ok()?.metadata().ok())
                        .filter(|md| md.is_file())
                        .map(|md| md.len())
                        .sum();
                    (bytes_logical, files + dedup.bytes_stored())
                }
            };
            Some(ProcessImage {
                image: format!(
                    "proc/{}",
                    dir.file_name().unwrap_or_default().to_string_lossy()
                ),
                bytes_stored,
                bytes_logical,
                pids: taken
                    .meta
                    .process
                    .as_ref()
                    .map(|p| p.pids.clone())
                    .unwrap_or_default(),
            })
        }
    };
    m.explanation = format!(
        "restored from {}/{} checkpoint {} (turn {:?}): {} layers{}",
        src.namespace,
        src.container,
        src.seq,
        src.turn_id,
        m.fs_layers.len(),
        if m.process.is_some() {
            " and a process image"
        } else {
            ", no process image"
        }
    );
    Ok(m)
}

/// Imports `taken`'s process image into `dir` of `store` from the restore cache, if it holds
/// the verified image; `None` (and nothing left at `dir`) otherwise.
fn cached_import(store: &Store, dir: &Path, taken: &Taken) -> Option<super::cache::Imported> {
    let (cache, files) = taken.cached.as_ref()?;
    let started = Instant::now();
    match cache.import(files, dir, &store.chunks_dir()) {
        Ok(Some(i)) => {
            log::info!(
                "checkpoint store {}: process image imported from the restore cache in {:.1} ms \
                 ({} bytes, {})",
                store.root().display(),
                started.elapsed().as_secs_f64() * 1e3,
                i.bytes_logical,
                if i.built {
                    "deduplicated for the cache now"
                } else {
                    "linked"
                }
            );
            Some(i)
        }
        Ok(None) => None,
        Err(e) => {
            log::warn!("{e}: importing the restored copy instead");
            let _ = fs::remove_dir_all(dir);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::criu_image::testing::with_caps as creds;
    use crate::checkpoint::criu_image::{ns, testing, Creds};
    use crate::checkpoint::provenance::{sign, Statement};
    use ed25519_dalek::SigningKey;

    fn meta_json(format: u32, process: bool) -> String {
        format!(
            r#"{{"format":{format},"source":{{"namespace":"ns","container":"c","seq":3,"turn_id":"t3"}},
            "fs_layers":[{{"digest":"sha256:{h}","diff_id":"sha256:{h}","size":10,"media_type":"application/vnd.oci.image.layer.v1.tar+zstd"}}],
            "process":{p},"created_at":"2026-01-01T00:00:00Z"}}"#,
            h = "ab".repeat(32),
            p = if process { r#"{"pids":[1,7]}"# } else { "null" }
        )
    }

    fn key() -> SigningKey {
        SigningKey::from_bytes(&[7; 32])
    }

    const DEFAULT_CAPS: u64 = 0xa804_25fb;

    fn unprivileged() -> Granted {
        Granted {
            gids: vec![0],
            bounding: DEFAULT_CAPS,
            effective: DEFAULT_CAPS,
            permitted: DEFAULT_CAPS,
            namespaces: ns::PID | ns::NET | ns::MNT,
            ..Granted::default()
        }
    }

    struct Fixture {
        trusted: TrustedKeys,
        granted: Granted,
        unsigned: UnsignedImages,
        limits: ImageLimits,
        cache: Option<RestoreCache>,
        defer: bool,
        /// What the engine says it unpacked (`None`: the rootfs itself is the top layer, a
        /// one-layer image, which is what the signed statements here name).
        unpacked: Option<Result<super::super::layers::Unpacked, String>>,
    }

    impl Fixture {
        fn new() -> Fixture {
            let mut trusted = TrustedKeys::new();
            trusted.add(key().verifying_key(), "test");
            Fixture {
                trusted,
                granted: unprivileged(),
                unsigned: UnsignedImages::Refuse,
                limits: ImageLimits::NONE,
                cache: None,
                defer: false,
                unpacked: None,
            }
        }

        /// With a restore cache at `dir`.
        fn cached(dir: &Path) -> Fixture {
            Fixture {
                cache: Some(RestoreCache::new(dir, 1 << 30)),
                ..Fixture::new()
            }
        }

        fn take(&self, root: &Path, dest: &Path) -> Result<Option<Taken>, RestoreError> {
            let trusted = || Ok(self.trusted.clone());
            let unpacked = self.unpacked.clone().unwrap_or_else(|| {
                Ok(super::super::layers::Unpacked {
                    below_top: None,
                    top_dir: root.to_path_buf(),
                    source: "test rootfs".into(),
                    top: "sha256:test".into(),
                })
            });
            take_from_rootfs(
                root,
                dest,
                &RestoreGuard {
                    container: "test",
                    trusted: &trusted,
                    unsigned: self.unsigned,
                    limits: self.limits,
                    granted: &self.granted,
                    cache: self.cache.as_ref(),
                    defer_pages: self.defer,
                    unpacked: &unpacked,
                },
            )
        }
    }

    /// Signs what `dir` (a reserved directory) holds, as `crabctl export` does.
    fn sign_dir(dir: &Path, key: &SigningKey) {
        let meta = fs::read(dir.join(META_FILE)).unwrap_or_default();
        let mut criu = BTreeMap::new();
        if let Ok(entries) = fs::read_dir(dir.join(CRIU_DIR)) {
            for e in entries {
                let e = e.unwrap();
                let mut r = HashingReader::new(File::open(e.path()).unwrap());
                io::copy(&mut r, &mut io::sink()).unwrap();
                criu.insert(e.file_name().to_string_lossy().into_owned(), r.finish());
            }
        }
        let statement = Statement {
            checkpoint_json: provenance::sha256(&meta),
            criu,
            layers: Some(Vec::new()),
            rootfs: None,
        };
        fs::write(dir.join(SIGNATURE_FILE), sign(key, statement)).unwrap();
    }

    /// A rootfs with a signed checkpoint: `meta`, and with `image_creds` a CRIU image of
    /// init (pid 1) and pid 7 with those credentials, plus `extra` files.
    fn rootfs_with(
        meta: &str,
        image_creds: Option<&Creds>,
        extra: &[(&str, &[u8])],
    ) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(RESERVED_DIR);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(META_FILE), meta).unwrap();
        if let Some(c) = image_creds {
            testing::write_image(&dir.join(CRIU_DIR), &[(1, &[]), (7, &[])], c, ns::USER);
        }
        for (name, data) in extra {
            fs::create_dir_all(dir.join(CRIU_DIR)).unwrap();
            fs::write(dir.join(CRIU_DIR).join(name), data).unwrap();
        }
        sign_dir(&dir, &key());
        root
    }

    #[test]
    fn no_reserved_dir_means_no_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let out = Fixture::new()
            .take(root.path(), &root.path().join("x"))
            .unwrap();
        assert!(out.is_none());
    }

    #[test]
    fn takes_the_image_out_and_hides_the_reserved_dir() {
        let root = rootfs_with(
            &meta_json(1, true),
            Some(&creds(DEFAULT_CAPS)),
            &[("pages-1.img", b"pages")],
        );
        let dest = tempfile::tempdir().unwrap();
        let out = Fixture::new()
            .take(root.path(), &dest.path().join("criu"))
            .unwrap()
            .unwrap();
        assert_eq!(out.meta.source.seq, 3);
        assert_eq!(out.meta.process.unwrap().pids, vec![1, 7]);
        let criu = out.criu_dir.unwrap();
        assert_eq!(fs::read(criu.join("pages-1.img")).unwrap(), b"pages");
        assert!(criu.join("core-7.img").is_file());
        assert!(!root.path().join(RESERVED_DIR).exists());
    }

    #[test]
    fn fs_only_checkpoint_has_no_process_image() {
        let root = rootfs_with(&meta_json(1, false), None, &[]);
        let dest = tempfile::tempdir().unwrap();
        let out = Fixture::new()
            .take(root.path(), &dest.path().join("criu"))
            .unwrap()
            .unwrap();
        assert!(out.criu_dir.is_none());
        assert_eq!(out.meta.fs_layers.len(), 1);
        assert!(!root.path().join(RESERVED_DIR).exists());
    }

    #[test]
    fn the_signed_layers_must_be_the_unpacked_ones() {
        use super::super::layers::{chain_ids, Unpacked};
        let sha = |c: char| format!("sha256:{}", c.to_string().repeat(64));
        // Signed over no layer below the checkpoint layer; the engine unpacked one.
        let root = rootfs_with(&meta_json(1, false), None, &[]);
        let f = Fixture {
            unpacked: Some(Ok(Unpacked {
                below_top: chain_ids(&[sha('a')]).pop(),
                top_dir: root.path().to_path_buf(),
                source: "overlayfs snapshot S".into(),
                top: "sha256:test".into(),
            })),
            ..Fixture::new()
        };
        let err = refused(&f, &root);
        assert!(
            matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("not unpacked from the signed layers"),
            "{err}"
        );
        // The engine cannot tell: refused, with its reason.
        let f = Fixture {
            unpacked: Some(Err("containerd has no record of container c".into())),
            ..Fixture::new()
        };
        let err = refused(&f, &root);
        assert!(
            matches!(err, RestoreError::Provenance(ProvenanceError::Layers(_))),
            "{err}"
        );
        assert!(
            err.to_string().contains("no record of container c"),
            "{err}"
        );
        // A file beside the reserved directory in the top layer.
        fs::write(root.path().join("evil.so"), b"x").unwrap();
        let err = refused(&Fixture::new(), &root);
        assert!(err.to_string().contains("not a checkpoint layer"), "{err}");
        fs::remove_file(root.path().join("evil.so")).unwrap();
        // Signed by an older crab: no layers in the statement.
        let dir = root.path().join(RESERVED_DIR);
        let statement = Statement {
            checkpoint_json: provenance::sha256(&fs::read(dir.join(META_FILE)).unwrap()),
            criu: BTreeMap::new(),
            layers: None,
            rootfs: None,
        };
        fs::write(dir.join(SIGNATURE_FILE), sign(&key(), statement)).unwrap();
        let err = refused(&Fixture::new(), &root);
        assert!(
            err.to_string().contains("export the checkpoint again"),
            "{err}"
        );
        // Unsigned, restored on the kernel check alone: nothing vouched for, no layers asked.
        let unsigned = rootfs_with(&meta_json(1, false), None, &[]);
        fs::remove_file(unsigned.path().join(RESERVED_DIR).join(SIGNATURE_FILE)).unwrap();
        let f = Fixture {
            unsigned: UnsignedImages::KernelCheck,
            unpacked: Some(Err("no engine".into())),
            ..Fixture::new()
        };
        let dest = tempfile::tempdir().unwrap();
        assert!(f
            .take(unsigned.path(), &dest.path().join("criu"))
            .unwrap()
            .is_some());
    }

    /// A refusal leaves the rootfs as it was and nothing at the destination.
    fn refused(f: &Fixture, root: &tempfile::TempDir) -> RestoreError {
        let dest = tempfile::tempdir().unwrap();
        let out = dest.path().join("criu");
        let err = f.take(root.path(), &out).unwrap_err();
        assert!(
            root.path().join(RESERVED_DIR).join(META_FILE).exists(),
            "{err}"
        );
        assert!(!out.exists(), "{err}");
        err
    }

    #[test]
    fn a_newer_format_is_refused_and_nothing_is_removed() {
        let root = rootfs_with(
            &meta_json(2, false).replace("\"source\"", "\"future\":1,\"source\""),
            None,
            &[],
        );
        let err = refused(&Fixture::new(), &root);
        assert!(
            matches!(err, RestoreError::NewerFormat { format: 2 }),
            "{err}"
        );
        assert!(err.to_string().contains("upgrade crab"), "{err}");
    }

    #[test]
    fn malformed_descriptions_are_refused() {
        for bad in [
            "not json".to_string(),
            r#"{"source":{}}"#.to_string(),
            r#"{"format":"1"}"#.to_string(),
            meta_json(1, false).replace("\"digest\":\"sha256:abab", "\"digest\":\"sha256:zzzz"),
            meta_json(1, false).replace("\"diff_id\":\"sha256:", "\"diff_id\":\"md5:"),
            meta_json(1, false).replace("tar+zstd", "tar+evil"),
            meta_json(1, false).replace("\"size\":10", "\"size\":0"),
            r#"{"format":1,"source":{"namespace":"n"},"process":null}"#.to_string(),
        ] {
            let root = rootfs_with(&bad, None, &[]);
            let err = refused(&Fixture::new(), &root);
            assert!(
                matches!(
                    err,
                    RestoreError::BadMeta { .. } | RestoreError::BadLayer { .. }
                ),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn a_named_process_image_must_be_there_and_complete() {
        let root = rootfs_with(&meta_json(1, true), None, &[]);
        let err = refused(&Fixture::new(), &root);
        assert!(matches!(err, RestoreError::MissingImage { .. }), "{err}");
        let root = rootfs_with(&meta_json(1, true), None, &[("pages-1.img", b"p")]);
        let err = refused(&Fixture::new(), &root);
        assert!(matches!(err, RestoreError::MissingImage { .. }), "{err}");
    }

    /// Devices are refused the same way, by the root-only `tests/root_checkpoint.rs`
    /// (`restore_never_opens_a_device`): making one needs root.
    #[test]
    fn symlinks_and_fifos_are_never_followed_or_opened() {
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("inventory.img"), b"host file").unwrap();
        fs::write(outside.path().join("secret"), meta_json(1, true)).unwrap();
        let f = Fixture::new();
        // The image directory is a symlink to a host directory.
        let root = rootfs_with(&meta_json(1, true), None, &[]);
        std::os::unix::fs::symlink(
            outside.path(),
            root.path().join(RESERVED_DIR).join(CRIU_DIR),
        )
        .unwrap();
        let err = refused(&f, &root);
        assert!(
            matches!(
                err,
                RestoreError::NotPlain {
                    found: "a symlink",
                    ..
                }
            ),
            "{err}"
        );
        // A file of the image is a symlink.
        let root = rootfs_with(&meta_json(1, true), Some(&creds(DEFAULT_CAPS)), &[]);
        std::os::unix::fs::symlink(
            outside.path().join("secret"),
            root.path().join(RESERVED_DIR).join(CRIU_DIR).join("x.img"),
        )
        .unwrap();
        let err = refused(&f, &root);
        assert!(matches!(err, RestoreError::NotPlain { .. }), "{err}");
        // The description is a symlink, a FIFO (which would block a plain open forever); so is
        // the signature; so is the reserved directory itself.
        for file in [META_FILE, SIGNATURE_FILE] {
            for kind in ["symlink", "fifo"] {
                let root = rootfs_with(&meta_json(1, false), None, &[]);
                let path = root.path().join(RESERVED_DIR).join(file);
                fs::remove_file(&path).unwrap();
                match kind {
                    "symlink" => {
                        std::os::unix::fs::symlink(outside.path().join("secret"), &path).unwrap()
                    }
                    _ => nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap(),
                }
                // Refused without being opened (a device's `open` would already have run).
                let watch =
                    nix::sys::inotify::Inotify::init(nix::sys::inotify::InitFlags::IN_NONBLOCK)
                        .unwrap();
                watch
                    .add_watch(&path, nix::sys::inotify::AddWatchFlags::IN_OPEN)
                    .unwrap();
                let dest = tempfile::tempdir().unwrap();
                let err = f.take(root.path(), &dest.path().join("criu")).unwrap_err();
                assert!(
                    matches!(err, RestoreError::NotPlain { .. }),
                    "{file} {kind}: {err}"
                );
                if kind != "symlink" {
                    let opened = watch.read_events().unwrap_or_default();
                    assert!(opened.is_empty(), "{file} {kind} was opened: {opened:?}");
                }
                assert!(root.path().join(RESERVED_DIR).exists());
            }
        }
        let root = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join(RESERVED_DIR)).unwrap();
        let err = f.take(root.path(), &root.path().join("out")).unwrap_err();
        assert!(matches!(err, RestoreError::NotPlain { .. }), "{err}");
        assert!(outside.path().join("secret").exists());
    }

    #[test]
    fn an_unsigned_image_is_refused_or_started_fresh_as_configured() {
        let root = rootfs_with(&meta_json(1, true), Some(&creds(DEFAULT_CAPS)), &[]);
        fs::remove_file(root.path().join(RESERVED_DIR).join(SIGNATURE_FILE)).unwrap();
        let mut f = Fixture::new();
        let err = refused(&f, &root);
        assert!(
            err.to_string()
                .contains("checkpoint image not signed by a trusted key: it carries no signature"),
            "{err}"
        );
        // Signed, but by a key this host does not trust.
        sign_dir(
            &root.path().join(RESERVED_DIR),
            &SigningKey::from_bytes(&[8; 32]),
        );
        let err = refused(&f, &root);
        assert!(
            err.to_string().contains("not among the 1 trusted key")
                && err.to_string().contains(" from test")
                && err
                    .to_string()
                    .contains("[restore] trusted_keys in this one"),
            "{err}"
        );
        // start-fresh: the reserved directory goes, the container starts as an ordinary image.
        f.unsigned = UnsignedImages::StartFresh;
        let dest = tempfile::tempdir().unwrap();
        let out = f.take(root.path(), &dest.path().join("criu")).unwrap();
        assert!(out.is_none());
        assert!(!root.path().join(RESERVED_DIR).exists());
        assert!(!dest.path().join("criu").exists());
    }

    #[test]
    fn an_image_altered_after_signing_is_refused_whatever_the_config() {
        let mut f = Fixture::new();
        f.unsigned = UnsignedImages::StartFresh;
        type Alteration = (&'static str, Box<dyn Fn(&Path)>);
        let alter: [Alteration; 4] = [
            (
                "criu/pages-1.img is 5 bytes",
                Box::new(|d: &Path| {
                    fs::write(d.join(CRIU_DIR).join("pages-1.img"), b"PAGES").unwrap()
                }),
            ),
            (
                "not signed",
                Box::new(|d: &Path| fs::write(d.join(CRIU_DIR).join("pages-2.img"), b"x").unwrap()),
            ),
            (
                "missing",
                Box::new(|d: &Path| fs::remove_file(d.join(CRIU_DIR).join("pages-1.img")).unwrap()),
            ),
            (
                "checkpoint.json is",
                Box::new(|d: &Path| {
                    fs::write(d.join(META_FILE), meta_json(1, true).replace("t3", "t4")).unwrap()
                }),
            ),
        ];
        for (want, change) in alter {
            let root = rootfs_with(
                &meta_json(1, true),
                Some(&creds(DEFAULT_CAPS)),
                &[("pages-1.img", b"pages")],
            );
            change(&root.path().join(RESERVED_DIR));
            let err = refused(&f, &root);
            assert!(
                matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
                "{want}: {err}"
            );
            assert!(err.to_string().contains(want), "{want}: {err}");
        }
    }

    /// With the restore cache: the second restore of an image links the verified copy; an image
    /// whose files are not the signed ones by name or size is still refused, one altered in
    /// place (same size) restores the verified bytes, never its own; privileges are checked
    /// on every restore.
    #[test]
    fn with_the_restore_cache_each_image_is_verified_once_and_hostile_ones_still_fail() {
        let cache_dir = tempfile::tempdir().unwrap();
        let f = Fixture::cached(cache_dir.path());
        let image = || {
            rootfs_with(
                &meta_json(1, true),
                Some(&creds(DEFAULT_CAPS)),
                &[("pages-1.img", b"pages")],
            )
        };
        let dest = tempfile::tempdir().unwrap();
        let first = f
            .take(image().path(), &dest.path().join("1"))
            .unwrap()
            .unwrap();
        let (cache, files) = first.cached.clone().unwrap();
        let key = RestoreCache::key(&files);
        let cached = super::super::cache::testing::image_dir(&cache, &key);
        let ino = |p: &Path| {
            use std::os::unix::fs::MetadataExt;
            fs::metadata(p).unwrap().ino()
        };
        let second = f
            .take(image().path(), &dest.path().join("2"))
            .unwrap()
            .unwrap();
        let criu = second.criu_dir.clone().unwrap();
        assert_eq!(
            ino(&criu.join("pages-1.img")),
            ino(&cached.join("pages-1.img"))
        );
        assert!(criu.join("core-7.img").is_file());
        // Altered in place after signing, same size: the verified bytes restore, not these.
        let root = image();
        fs::write(
            root.path()
                .join(RESERVED_DIR)
                .join(CRIU_DIR)
                .join("pages-1.img"),
            b"PAGES",
        )
        .unwrap();
        let taken = f
            .take(root.path(), &dest.path().join("3"))
            .unwrap()
            .unwrap();
        assert_eq!(
            fs::read(taken.criu_dir.unwrap().join("pages-1.img")).unwrap(),
            b"pages"
        );
        // Cut short, planted or missing files are refused, as without the cache.
        type Alteration = (&'static str, Box<dyn Fn(&Path)>);
        let alter: [Alteration; 3] = [
            (
                "criu/pages-1.img is 2 bytes, the signed one 5 bytes",
                Box::new(|d: &Path| {
                    fs::write(d.join(CRIU_DIR).join("pages-1.img"), b"pa").unwrap()
                }),
            ),
            (
                "criu/pages-2.img was not signed",
                Box::new(|d: &Path| fs::write(d.join(CRIU_DIR).join("pages-2.img"), b"x").unwrap()),
            ),
            (
                "criu/pages-1.img was signed but is missing",
                Box::new(|d: &Path| fs::remove_file(d.join(CRIU_DIR).join("pages-1.img")).unwrap()),
            ),
        ];
        for (want, change) in alter {
            let root = image();
            change(&root.path().join(RESERVED_DIR));
            let err = refused(&f, &root);
            assert!(
                matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
                "{want}: {err}"
            );
            assert!(err.to_string().contains(want), "{want}: {err}");
        }
        // Over the bounds: refused before the cache is asked.
        let mut bounded = Fixture::cached(cache_dir.path());
        bounded.limits = ImageLimits {
            max_bytes: 4,
            max_files: 100,
        };
        let err = refused(&bounded, &image());
        assert!(err.to_string().contains("max_image_mib"), "{err}");
        // A privileged image cached by a privileged restore is refused under a spec that does
        // not grant it.
        let privileged = || rootfs_with(&meta_json(1, true), Some(&creds(0x1ff_ffff_ffff)), &[]);
        let mut p = Fixture::cached(cache_dir.path());
        p.granted.bounding = 0x1ff_ffff_ffff;
        p.granted.permitted = 0x1ff_ffff_ffff;
        p.take(privileged().path(), &dest.path().join("4"))
            .unwrap()
            .unwrap();
        let err = refused(&f, &privileged());
        assert!(err.to_string().contains("CAP_SYS_ADMIN"), "{err}");
        // The stores of the restored containers import the cached image: both rebuild it byte
        // for byte, from one pack.
        for (i, ns) in ["a", "b"].iter().enumerate() {
            let store_dir = tempfile::tempdir().unwrap();
            let store = Store::open(store_dir.path()).unwrap();
            let t = if i == 0 { &first } else { &second };
            let m = restored_manifest(&store, ns, "fork", t).unwrap();
            let p = m.process.unwrap();
            let dir = store.root().join(&p.image);
            assert!(dir.join("pages-1.img.recipe").is_file());
            pages::materialize(&dir, &store.chunks_dir()).unwrap();
            assert_eq!(fs::read(dir.join("pages-1.img")).unwrap(), b"pages");
            assert_eq!(p.bytes_logical, files.values().map(|d| d.size).sum::<u64>());
        }
    }

    /// Page data of `n` bytes, different for each `seed`.
    fn page_data(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    #[test]
    fn large_page_files_are_verified_while_the_restore_goes_on() {
        let big = DEFER_MIN_BYTES as usize + 4096;
        assert!(deferrable("pages-1.img", big as u64));
        assert!(!deferrable("pages-1.img", DEFER_MIN_BYTES - 1));
        assert!(!deferrable("core-1.img", big as u64) && !deferrable("pstree.img", big as u64));
        for cached in [false, true] {
            let cache_dir = tempfile::tempdir().unwrap();
            let mut f = match cached {
                true => Fixture::cached(cache_dir.path()),
                false => Fixture::new(),
            };
            f.defer = true;
            // Signed as it is: taken at once, its large page file checked on the side.
            let good = page_data(big, 1);
            let root = rootfs_with(
                &meta_json(1, true),
                Some(&creds(DEFAULT_CAPS)),
                &[("pages-1.img", &good), ("pages-2.img", b"small")],
            );
            let dest = tempfile::tempdir().unwrap();
            let t = f
                .take(root.path(), &dest.path().join("img"))
                .unwrap()
                .unwrap();
            let v = t
                .verification
                .clone()
                .expect("the large page file is deferred");
            assert_eq!(v.bytes(), big as u64);
            assert_eq!(v.wait().result, Ok(()));
            assert_eq!(
                fs::read(dest.path().join("img/pages-1.img")).unwrap(),
                good,
                "copied whole"
            );
            if let Some(cache) = &f.cache {
                // Published once it passed: a second restore takes the cached copy.
                let key = RestoreCache::key(&t.cached.as_ref().unwrap().1);
                let deadline = Instant::now() + Duration::from_secs(10);
                while !restore_cache::testing::image_dir(cache, &key).exists() {
                    assert!(Instant::now() < deadline, "never published");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            // Altered after signing (a rootfs each time: a taken image leaves it).
            let altered = |len: usize| {
                let root = rootfs_with(
                    &meta_json(1, true),
                    Some(&creds(DEFAULT_CAPS)),
                    &[("pages-1.img", &page_data(big, 2))],
                );
                let path = root
                    .path()
                    .join(RESERVED_DIR)
                    .join(CRIU_DIR)
                    .join("pages-1.img");
                fs::write(path, page_data(len, 3)).unwrap();
                root
            };
            // At the same size (what the sizes cannot show): taken, but the verdict refuses
            // it, naming the file; and nothing enters the cache.
            for attempt in 0..2 {
                let dest = tempfile::tempdir().unwrap();
                let t = f
                    .take(altered(big).path(), &dest.path().join("img"))
                    .unwrap()
                    .unwrap();
                let why = t.verification.clone().unwrap().wait().result.unwrap_err();
                assert!(
                    why.contains("altered after signing") && why.contains("criu/pages-1.img"),
                    "{why}"
                );
                if let Some(cache) = &f.cache {
                    // Verified again at the second attempt (and refused again).
                    assert_eq!(
                        t.cached.as_ref().map(|_| ()),
                        Some(()),
                        "attempt {attempt}: built into the cache, not published"
                    );
                    let key = RestoreCache::key(&t.cached.as_ref().unwrap().1);
                    std::thread::sleep(Duration::from_millis(50));
                    assert!(!restore_cache::testing::image_dir(cache, &key).exists());
                }
            }
            // A size that does not match is still refused before anything is taken.
            let err = refused(&f, &altered(big + 1));
            assert!(
                matches!(err, RestoreError::Provenance(ProvenanceError::Altered(_))),
                "{err}"
            );
            // Without deferral, the same altered image is refused at once.
            f.defer = false;
            let err = refused(&f, &altered(big));
            assert!(err.to_string().contains("criu/pages-1.img"), "{err}");
        }
    }

    #[test]
    fn a_signed_image_asking_for_more_than_the_spec_grants_is_refused() {
        // Signed by a trusted key (crab's own export of a privileged container), yet refused.
        let root = rootfs_with(&meta_json(1, true), Some(&creds(0x1ff_ffff_ffff)), &[]);
        let err = refused(&Fixture::new(), &root);
        assert!(matches!(err, RestoreError::Privilege(_)), "{err}");
        assert!(err.to_string().contains("CAP_SYS_ADMIN"), "{err}");
        // Under a privileged spec the same image restores.
        let mut f = Fixture::new();
        f.granted.bounding = 0x1ff_ffff_ffff;
        f.granted.permitted = 0x1ff_ffff_ffff;
        let dest = tempfile::tempdir().unwrap();
        f.take(root.path(), &dest.path().join("criu"))
            .unwrap()
            .unwrap();
    }

    #[test]
    fn image_bounds_are_checked_before_copying() {
        let root = rootfs_with(
            &meta_json(1, true),
            Some(&creds(DEFAULT_CAPS)),
            &[("pages-1.img", &[0u8; 4096])],
        );
        let mut f = Fixture::new();
        f.limits = ImageLimits {
            max_bytes: 4096,
            max_files: 100,
        };
        let err = refused(&f, &root);
        assert!(err.to_string().contains("max_image_mib"), "{err}");
        f.limits = ImageLimits {
            max_bytes: u64::MAX,
            max_files: 3,
        };
        let err = refused(&f, &root);
        assert!(err.to_string().contains("max_image_files"), "{err}");
    }

    #[test]
    fn origin_manifests() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let m = created_manifest(&store, " from image x").unwrap();
        assert_eq!(
            (m.seq, m.kind, m.parent),
            (1, CheckpointKind::Created, None)
        );
        assert!(m.fs_layers.is_empty() && m.process.is_none());
        store.publish(&m).unwrap();

        // Restored from another container: the chain is inherited, the image imported.
        let root = rootfs_with(
            &meta_json(1, true),
            Some(&creds(DEFAULT_CAPS)),
            &[("pages-1.img", &[7u8; 8192])],
        );
        let taken = Fixture::new()
            .take(root.path(), &root.path().join("out"))
            .unwrap()
            .unwrap();
        let r = restored_manifest(&store, "ns", "other", &taken).unwrap();
        assert_eq!(
            (r.seq, r.kind, r.parent),
            (2, CheckpointKind::Restored, None)
        );
        assert_eq!(r.fs_layers, taken.meta.fs_layers);
        let p = r.process.clone().unwrap();
        assert_eq!(p.pids, vec![1, 7]);
        assert!(store.root().join(&p.image).join("inventory.img").is_file());
        assert!(
            r.explanation.contains("ns/c checkpoint 3"),
            "{}",
            r.explanation
        );
    }
}

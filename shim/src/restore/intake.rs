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
    /// `Err`: why the files are not the signed ones (shared: the verdict is handed to
    /// whoever asks).
    pub result: Result<(), std::sync::Arc<RestoreError>>,
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
                let result = Self::hash(&dir, &files, &signed).map_err(std::sync::Arc::new);
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
    ) -> Result<(), RestoreError> {
        let mut found = BTreeMap::new();
        for (name, len) in files {
            let path = dir.join(name);
            let input = open_plain(&path)?;
            let mut hashing = HashingReader::new(input.take(len + 1));
            io::copy(&mut hashing, &mut io::sink()).map_err(io_err(&path))?;
            found.insert(name.clone(), hashing.finish());
        }
        let statement = Statement {
            checkpoint_json: String::new(),
            criu: signed.clone(),
            layers: None,
            rootfs: None,
        };
        Ok(provenance::check_digests(&statement, &found)?)
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
    pub unpacked: &'a Result<super::layers::Unpacked, super::layers::LayersError>,
}

/// A signed image's layers against those the engine unpacked: the signature must name them
/// ([`Statement::layers`]) and the rootfs must be them, topped by the checkpoint layer alone.
fn check_layers(
    statement: &Statement,
    unpacked: &Result<super::layers::Unpacked, super::layers::LayersError>,
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
        .map_err(|why| ProvenanceError::Layers(why.to_string()))?;
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
mod tests;

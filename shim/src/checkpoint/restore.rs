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
//! into the bundle, the reserved directory is removed from the rootfs (a whiteout in the
//! container's upperdir, so the container never sees it), and Start then runs `runc restore`
//! instead of `runc start`, or the image's entrypoint when there is no process image.
//! Everything read from the image is untrusted: only plain files and directories are accepted
//! (a symlink could point anywhere on the host, since the rootfs is mounted there), and a
//! newer format is refused rather than half-understood.

use std::{
    fs::{self, File},
    io::{self, Read},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{
    pages,
    store::{CheckpointKind, Descriptor, Manifest, ProcessImage, Store, StoreError},
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
const META_MAX: u64 = 16 << 20;

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
}

impl CheckpointMeta {
    /// Parses and checks the format first, so a newer image gets the clear "upgrade" error and
    /// not a field error.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<CheckpointMeta, RestoreError> {
        let bad = |reason: String| RestoreError::BadMeta {
            path: path.to_path_buf(),
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let format = value
            .get("format")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| bad("no numeric `format`".into()))?;
        if format > u64::from(META_FORMAT) {
            return Err(RestoreError::NewerFormat {
                format: u32::try_from(format).unwrap_or(u32::MAX),
            });
        }
        let meta: CheckpointMeta = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        if meta.format == 0 {
            return Err(bad("format 0".into()));
        }
        for d in &meta.fs_layers {
            if !d.digest.starts_with("sha256:")
                || d.hex().len() != 64
                || !d.hex().bytes().all(|b| b.is_ascii_hexdigit())
            {
                return Err(bad(format!("layer digest {:?}", d.digest)));
            }
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

/// Reads a plain file without following a symlink in its last component.
fn read_plain(path: &Path, max: u64) -> Result<Vec<u8>, RestoreError> {
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => RestoreError::NotPlain {
                path: path.to_path_buf(),
                found: "a symlink",
            },
            _ => RestoreError::Io {
                path: path.to_path_buf(),
                source: e,
            },
        })?;
    let md = f.metadata().map_err(io_err(path))?;
    if !md.is_file() {
        return Err(RestoreError::NotPlain {
            path: path.to_path_buf(),
            found: "not a regular file",
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

/// Copies the plain files of `from` (no subdirectories: a CRIU image is flat) into a new `to`.
fn copy_image(from: &Path, to: &Path) -> Result<u64, RestoreError> {
    let md = plain(from)?;
    if !md.is_dir() {
        return Err(RestoreError::MissingImage {
            path: from.to_path_buf(),
        });
    }
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
    let mut bytes = 0;
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
        let mut input = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&src)
            .map_err(io_err(&src))?;
        let dst = to.join(entry.file_name());
        let mut out = File::create(&dst).map_err(io_err(&dst))?;
        bytes += io::copy(&mut input, &mut out).map_err(io_err(&dst))?;
    }
    if !to.join("inventory.img").is_file() {
        return Err(RestoreError::MissingImage {
            path: from.to_path_buf(),
        });
    }
    Ok(bytes)
}

/// Looks for a checkpoint in `rootfs`. Without one: `None`, nothing touched. With one: its
/// description is checked, the CRIU image (if any) copied to `criu_dest`, and the reserved
/// directory removed from the rootfs. On an error the rootfs is left as it was.
pub fn take_from_rootfs(rootfs: &Path, criu_dest: &Path) -> Result<Option<Taken>, RestoreError> {
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
    let meta_path = dir.join(META_FILE);
    let meta = CheckpointMeta::parse(&meta_path, &read_plain(&meta_path, META_MAX)?)?;
    let criu = dir.join(CRIU_DIR);
    let criu_dir = match (&meta.process, fs::symlink_metadata(&criu).is_ok()) {
        (Some(_), true) => {
            copy_image(&criu, criu_dest)?;
            Some(criu_dest.to_path_buf())
        }
        (Some(_), false) => return Err(RestoreError::MissingImage { path: criu }),
        (None, present) => {
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
    Ok(Some(Taken { meta, criu_dir }))
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
fn own_source(store: &Store, namespace: &str, container: &str, taken: &Taken) -> Option<Manifest> {
    let src = &taken.meta.source;
    (src.namespace == namespace && src.container == container)
        .then(|| store.get(src.seq).ok())
        .flatten()
        .filter(|m| m.fs_layers == taken.meta.fs_layers)
}

/// Whether [`restored_manifest`] must import a process image (copy and deduplicate it into the
/// store), rather than reference one the store already holds or have none.
pub fn imports_process_image(store: &Store, namespace: &str, container: &str, taken: &Taken) -> bool {
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
    m.image_layers = m.fs_layers.len();
    m.process = match (
        &taken.criu_dir,
        own.as_ref().and_then(|o| o.process.clone()),
    ) {
        (None, _) => None,
        (Some(_), Some(p)) if store.root().join(&p.image).is_dir() => Some(p),
        (Some(criu), _) => {
            let dir = store.proc_dir(seq);
            let bytes_logical = copy_image(criu, &dir)?;
            let dedup = pages::dedup(&dir, &store.chunks_dir())?;
            let files: u64 = fs::read_dir(&dir)
                .map_err(io_err(&dir))?
                .filter_map(|e| e.ok()?.metadata().ok())
                .filter(|md| md.is_file())
                .map(|md| md.len())
                .sum();
            Some(ProcessImage {
                image: format!(
                    "proc/{}",
                    dir.file_name().unwrap_or_default().to_string_lossy()
                ),
                bytes_stored: files + dedup.bytes_stored(),
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

/// Brings the loopback interface of `pid`'s network namespace up. `runc create` does that for
/// a network namespace it creates, `runc restore` does not (CRIU restores into the namespace
/// runc made, and the image holds no network devices of its own), so a restored server would
/// answer nobody on 127.0.0.1. A namespace given by path (a pod's, set up by CNI) is not ours
/// to touch: the caller only asks for namespaces runc created.
pub fn bring_up_loopback(pid: u32) -> io::Result<()> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    // setns(CLONE_NEWNET) affects only the calling thread: a thread of its own, then gone.
    std::thread::spawn(move || -> io::Result<()> {
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
        let sock = nix::sys::socket::socket(
            nix::sys::socket::AddressFamily::Inet,
            nix::sys::socket::SockType::Datagram,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(io::Error::from)?;
        // SAFETY: ifreq is plain old data; the ioctls read and write only it.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        use std::os::fd::AsRawFd;
        let fd = sock.as_raw_fd();
        // SAFETY: see above.
        if unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS as _, &mut req) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the flags member of the union is the one SIOCGIFFLAGS filled.
        unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
        // SAFETY: see above.
        if unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS as _, &req) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    })
    .join()
    .map_err(|_| io::Error::other("loopback thread panicked"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta_json(format: u32, process: bool) -> String {
        format!(
            r#"{{"format":{format},"source":{{"namespace":"ns","container":"c","seq":3,"turn_id":"t3"}},
            "fs_layers":[{{"digest":"sha256:{h}","diff_id":"sha256:{h}","size":10,"media_type":"application/vnd.oci.image.layer.v1.tar+zstd"}}],
            "process":{p},"created_at":"2026-01-01T00:00:00Z"}}"#,
            h = "ab".repeat(32),
            p = if process { r#"{"pids":[1,7]}"# } else { "null" }
        )
    }

    fn rootfs_with(meta: &str, criu_files: &[(&str, &[u8])]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join(RESERVED_DIR);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(META_FILE), meta).unwrap();
        if !criu_files.is_empty() {
            fs::create_dir(dir.join(CRIU_DIR)).unwrap();
            for (name, data) in criu_files {
                fs::write(dir.join(CRIU_DIR).join(name), data).unwrap();
            }
        }
        root
    }

    #[test]
    fn no_reserved_dir_means_no_checkpoint() {
        let root = tempfile::tempdir().unwrap();
        let out = take_from_rootfs(root.path(), &root.path().join("x")).unwrap();
        assert!(out.is_none());
    }

    #[test]
    fn takes_the_image_out_and_hides_the_reserved_dir() {
        let root = rootfs_with(
            &meta_json(1, true),
            &[("inventory.img", b"inv"), ("pages-1.img", b"pages")],
        );
        let dest = tempfile::tempdir().unwrap();
        let out = take_from_rootfs(root.path(), &dest.path().join("criu"))
            .unwrap()
            .unwrap();
        assert_eq!(out.meta.source.seq, 3);
        assert_eq!(out.meta.process.unwrap().pids, vec![1, 7]);
        let criu = out.criu_dir.unwrap();
        assert_eq!(fs::read(criu.join("pages-1.img")).unwrap(), b"pages");
        assert!(!root.path().join(RESERVED_DIR).exists());
    }

    #[test]
    fn fs_only_checkpoint_has_no_process_image() {
        let root = rootfs_with(&meta_json(1, false), &[]);
        let dest = tempfile::tempdir().unwrap();
        let out = take_from_rootfs(root.path(), &dest.path().join("criu"))
            .unwrap()
            .unwrap();
        assert!(out.criu_dir.is_none());
        assert_eq!(out.meta.fs_layers.len(), 1);
        assert!(!root.path().join(RESERVED_DIR).exists());
    }

    #[test]
    fn a_newer_format_is_refused_and_nothing_is_removed() {
        let root = rootfs_with(
            &meta_json(2, false).replace("\"source\"", "\"future\":1,\"source\""),
            &[],
        );
        let dest = tempfile::tempdir().unwrap();
        let err = take_from_rootfs(root.path(), &dest.path().join("criu")).unwrap_err();
        assert!(
            matches!(err, RestoreError::NewerFormat { format: 2 }),
            "{err}"
        );
        assert!(err.to_string().contains("upgrade crab"), "{err}");
        assert!(root.path().join(RESERVED_DIR).join(META_FILE).exists());
    }

    #[test]
    fn malformed_descriptions_are_refused() {
        for bad in [
            "not json".to_string(),
            r#"{"source":{}}"#.to_string(),
            meta_json(1, false).replace("sha256:abab", "sha256:zzzz"),
            r#"{"format":1,"source":{"namespace":"n"},"process":null}"#.to_string(),
        ] {
            let root = rootfs_with(&bad, &[]);
            let err = take_from_rootfs(root.path(), &root.path().join("criu-out")).unwrap_err();
            assert!(matches!(err, RestoreError::BadMeta { .. }), "{bad}: {err}");
            assert!(root.path().join(RESERVED_DIR).exists());
        }
    }

    #[test]
    fn a_named_process_image_must_be_there_and_complete() {
        let root = rootfs_with(&meta_json(1, true), &[]);
        let err = take_from_rootfs(root.path(), &root.path().join("out")).unwrap_err();
        assert!(matches!(err, RestoreError::MissingImage { .. }), "{err}");
        let root = rootfs_with(&meta_json(1, true), &[("pages-1.img", b"p")]);
        let err = take_from_rootfs(root.path(), &root.path().join("out")).unwrap_err();
        assert!(matches!(err, RestoreError::MissingImage { .. }), "{err}");
        assert!(root.path().join(RESERVED_DIR).exists());
    }

    #[test]
    fn symlinks_are_never_followed() {
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("inventory.img"), b"host file").unwrap();
        fs::write(outside.path().join("secret"), meta_json(1, true)).unwrap();
        // The image directory is a symlink to a host directory.
        let root = rootfs_with(&meta_json(1, true), &[]);
        std::os::unix::fs::symlink(
            outside.path(),
            root.path().join(RESERVED_DIR).join(CRIU_DIR),
        )
        .unwrap();
        let err = take_from_rootfs(root.path(), &root.path().join("out")).unwrap_err();
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
        let root = rootfs_with(&meta_json(1, true), &[("inventory.img", b"i")]);
        std::os::unix::fs::symlink(
            outside.path().join("secret"),
            root.path().join(RESERVED_DIR).join(CRIU_DIR).join("x.img"),
        )
        .unwrap();
        let err = take_from_rootfs(root.path(), &root.path().join("out")).unwrap_err();
        assert!(matches!(err, RestoreError::NotPlain { .. }), "{err}");
        // The description is a symlink; so is the reserved directory itself.
        let root = rootfs_with("{}", &[]);
        let meta = root.path().join(RESERVED_DIR).join(META_FILE);
        fs::remove_file(&meta).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), &meta).unwrap();
        let err = take_from_rootfs(root.path(), &root.path().join("out")).unwrap_err();
        assert!(matches!(err, RestoreError::NotPlain { .. }), "{err}");
        let root = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(outside.path(), root.path().join(RESERVED_DIR)).unwrap();
        let err = take_from_rootfs(root.path(), &root.path().join("out")).unwrap_err();
        assert!(matches!(err, RestoreError::NotPlain { .. }), "{err}");
        assert!(outside.path().join("secret").exists());
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
            &[("inventory.img", b"inv"), ("pages-1.img", &[7u8; 8192])],
        );
        let taken = take_from_rootfs(root.path(), &root.path().join("out"))
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

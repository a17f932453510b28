//! Which layers a checkpoint image's rootfs was really unpacked from, against the layers its
//! signature names.
//!
//! A signed checkpoint vouches for its processes, and those processes run on the image's
//! files: CRIU maps their executables and libraries back by path, and everything they load
//! later comes from the same rootfs (the tracked volumes too, which the layers carry). So the
//! signed statement names the layers below the checkpoint layer (their diff_ids, oldest
//! first), and at Create the shim asks the engine that unpacked the rootfs which layers it
//! unpacked. Engines check every layer against its diff_id while they unpack it (containerd's
//! unpacker and differ, `docker load`), and name what they unpacked by chain id, the OCI rule
//! over the diff_ids. Two facts must then hold:
//!
//! 1. the layers below the image's top layer are the signed ones: their chain id is the
//!    signed diff_ids' chain id;
//! 2. the top layer is a checkpoint layer and nothing else: its directory holds the reserved
//!    directory alone, no whiteout, no other file, and its root is not opaque. (Its own
//!    diff_id cannot be signed, the signature is inside it; what it may carry is the reserved
//!    directory, which the signature covers file by file and the shim removes before start.)
//!
//! Where the engine keeps the answer:
//! - containerd (`ctr run`, nerdctl, the CRI, crabctl's fork/rollback/recover): the
//!   container's record names its snapshot; each ancestor snapshot an unpack made is named by
//!   its chain id ([`from_containerd`]). The rootfs mounts containerd sent must be that
//!   snapshot's.
//! - Docker Engine with its overlay2 store: `<data-root>/image/overlay2/layerdb`, written by
//!   dockerd, names each container's mount and its parent chain ([`from_docker_layerdb`]).
//!
//! Anything else (a rootfs no engine describes, a snapshotter whose top layer cannot be
//! looked at on its own) cannot be checked, and a signed process image is then refused on it.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use sha2::{Digest, Sha256};

use crate::checkpoint::provenance::ProvenanceError;
use crate::inspector::fs::lowerdirs;

/// Why the layers a rootfs was unpacked from cannot be told.
#[derive(Debug, thiserror::Error)]
pub enum LayersError {
    /// The engine was asked and could not say.
    #[error(transparent)]
    Engine(#[from] SnapshotError),
    #[error("the engine did not answer in time")]
    EngineTimedOut,
    #[error("its rootfs is not an overlay: its image cannot be told")]
    NotOverlay,
    #[error("the rootfs holds no checkpoint")]
    NoCheckpoint,
    /// Nobody asked (the container neither resumes a lineage nor replicates).
    #[error("not asked")]
    NotAsked,
    #[error(
        "its rootfs is not an overlay of {snapshotter} snapshot {key}: its top layer cannot be looked at"
    )]
    NotOverlayOf { snapshotter: String, key: String },
    #[error("the rootfs mounted is not {snapshotter} snapshot {key}")]
    OtherSnapshot { snapshotter: String, key: String },
    #[error("none of its {0} ancestor snapshot(s) is an image layer")]
    NoImageLayer(usize),
    #[error("snapshot {key} has {lowers} lower directories, fewer than its ancestors")]
    FewerLowers { key: String, lowers: usize },
    #[error("{} is not a rootfs of Docker's overlay2 store: its layers cannot be told", .0.display())]
    NotDocker(PathBuf),
    /// A file of Docker's layer records could not be read.
    #[error("{}: {source}", path.display())]
    Record {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a small regular file", .0.display())]
    NotSmallFile(PathBuf),
    #[error("container id {0:?} is not a Docker one")]
    NotDockerId(String),
    #[error("Docker's layer record of {id} names another mount than {}", rootfs.display())]
    OtherMount { id: String, rootfs: PathBuf },
    #[error("Docker's layer record of {id} names parent {parent:?}")]
    MountParent { id: String, parent: String },
    #[error("Docker's layer {top} names parent {parent:?}")]
    LayerParent { top: String, parent: Option<String> },
    #[error("Docker's layer {top} names cache id {cache_id:?}")]
    CacheId { top: String, cache_id: String },
    #[error(
        "the overlay at {} does not have Docker's layer {top} ({}) below it",
        rootfs.display(),
        top_dir.display()
    )]
    NotBelow {
        rootfs: PathBuf,
        top: String,
        top_dir: PathBuf,
    },
}

/// Why a rootfs's top layer is not a checkpoint layer ([`check_top_layer`]).
#[derive(Debug, thiserror::Error)]
pub enum TopLayerError {
    #[error("cannot list {}: {source}", dir.display())]
    List {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("it holds {0:?} beside /{RESERVED}")]
    Beside(std::ffi::OsString),
    #[error("/{RESERVED} is not a directory")]
    NotDir,
    #[error("it holds no /{RESERVED}")]
    Missing,
    #[error("its root is opaque ({0}): it hides every layer below")]
    Opaque(&'static str),
}

/// Why the engine could not say which snapshot a container runs on ([`SnapshotSource`]).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("containerd at {0} did not answer")]
    NoAnswer(String),
    #[error("cannot reach containerd at {address}: {source}")]
    Unreachable {
        address: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// containerd answered the container's lookup with an error (its message).
    #[error("containerd has no record of container {id}: {message}")]
    Lookup { id: String, message: String },
    #[error("containerd has no record of container {0}")]
    NoRecord(String),
    #[error(
        "containerd's record of {0} names no snapshot: its rootfs was not unpacked by containerd"
    )]
    NoSnapshot(String),
    /// A snapshots call (`Snapshots.Mounts`, `Snapshots.Stat`) of snapshot `key` failed
    /// (containerd's message).
    #[error("{call} {key}: {message}")]
    Call {
        call: &'static str,
        key: String,
        message: String,
    },
}

/// The reserved directory (the only entry a checkpoint layer's root may hold).
const RESERVED: &str = ".crab-checkpoint";
/// Bound on each call to containerd (Create must not hang on an engine that does not answer).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on the ancestors an engine walks (an image has at most a few hundred layers).
pub const MAX_DEPTH: usize = 512;

/// What the engine unpacked: the chain below the image's top layer and where that top layer's
/// files are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unpacked {
    /// Chain id of the layers below the top one (`None`: the top layer is the only one).
    pub below_top: Option<String>,
    /// Chain id of every layer of the image, the top one included.
    pub top: String,
    /// The top layer's own directory (an overlay lower directory).
    pub top_dir: PathBuf,
    /// Who said so, for messages: `containerd snapshot sha256:...`, `Docker layer ...`.
    pub source: String,
}

/// The OCI chain ids of `diff_ids`, one per layer: the first is its diff_id, each next one
/// `sha256(<previous chain id> + " " + <diff_id>)`.
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(prev) => format!(
                "sha256:{:x}",
                Sha256::digest(format!("{prev} {d}").as_bytes())
            ),
        };
        out.push(next);
    }
    out
}

/// Checks `unpacked` against the signed diff_ids of the layers below the checkpoint layer.
pub fn verify(signed: &[String], unpacked: &Unpacked) -> Result<(), ProvenanceError> {
    let want = chain_ids(signed).pop();
    if want != unpacked.below_top {
        let show = |c: &Option<String>| c.clone().unwrap_or_else(|| "no layer".to_string());
        return Err(ProvenanceError::Altered(format!(
            "its rootfs was not unpacked from the signed layers: below its top layer the {} \
             has {}, the signed {} layer(s) make {}",
            unpacked.source,
            show(&unpacked.below_top),
            signed.len(),
            show(&want)
        )));
    }
    check_top_layer(&unpacked.top_dir).map_err(|reason| {
        ProvenanceError::Altered(format!(
            "its top layer ({}) is not a checkpoint layer: {reason}",
            unpacked.source
        ))
    })
}

/// A checkpoint layer holds the reserved directory and nothing else: no other entry (a file,
/// a directory, a whiteout hiding a lower file) and no opaque root.
pub fn check_top_layer(dir: &Path) -> Result<(), TopLayerError> {
    let list = |source| TopLayerError::List {
        dir: dir.to_path_buf(),
        source,
    };
    let entries = fs::read_dir(dir).map_err(list)?;
    let mut found = false;
    for e in entries {
        let e = e.map_err(list)?;
        let name = e.file_name();
        if name != RESERVED {
            return Err(TopLayerError::Beside(name));
        }
        if !e.file_type().map_err(list)?.is_dir() {
            return Err(TopLayerError::NotDir);
        }
        found = true;
    }
    if !found {
        return Err(TopLayerError::Missing);
    }
    for xattr in ["trusted.overlay.opaque", "user.overlay.opaque"] {
        if has_xattr(dir, xattr) {
            return Err(TopLayerError::Opaque(xattr));
        }
    }
    Ok(())
}

fn has_xattr(path: &Path, name: &str) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let (Ok(p), Ok(n)) = (
        std::ffi::CString::new(path.as_os_str().as_bytes()),
        std::ffi::CString::new(name),
    ) else {
        return true;
    };
    let mut buf = [0u8; 8];
    // SAFETY: both strings are NUL-terminated; the buffer is ours and its length given.
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    r >= 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::ERANGE)
}

/// A snapshot name an unpack gives a layer: its chain id.
pub fn is_chain_id(name: &str) -> bool {
    name.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Where the top layer is in the nearest-first list of a snapshot's ancestors: the first one
/// named by a chain id (an engine's own layers above it, Docker's init layer, are not the
/// image's). Returns its index and the name of its parent, if any.
pub fn top_of(ancestors: &[String]) -> Result<(usize, Option<String>), LayersError> {
    let i = ancestors
        .iter()
        .position(|a| is_chain_id(a))
        .ok_or(LayersError::NoImageLayer(ancestors.len()))?;
    Ok((i, ancestors.get(i + 1).cloned()))
}

/// What the engine says of a container's snapshot ([`SnapshotSource`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSnapshot {
    pub snapshotter: String,
    pub key: String,
    /// The options of the snapshot's overlay mount, as the engine would mount it (`None`: not
    /// an overlay).
    pub overlay_options: Option<Vec<String>>,
    /// Its ancestors, nearest first, up to the first one named by a chain id and that one's
    /// parent.
    pub ancestors: Vec<String>,
}

/// The engine's record of the snapshots a container runs on: containerd's API, which the
/// shim's protocol edge speaks (`service::snapshots`); fakes in tests.
#[async_trait::async_trait]
pub trait SnapshotSource: Send + Sync {
    /// Container `id`'s snapshot in `namespace`: the one its record names, else `fallback`
    /// (snapshotter, key) when the record names none.
    async fn snapshot(
        &self,
        namespace: &str,
        id: &str,
        fallback: Option<(String, String)>,
    ) -> Result<EngineSnapshot, SnapshotError>;
}

/// Which layers the engine unpacked the rootfs of container `id` (at `rootfs`) from:
/// containerd's record when containerd sent the rootfs mounts (`by_containerd`), else Docker's
/// (which mounts the rootfs itself). `overlay` is the rootfs overlay's options, if it is one.
pub async fn identify(
    engine: &dyn SnapshotSource,
    namespace: &str,
    id: &str,
    rootfs: &Path,
    by_containerd: bool,
    overlay: Option<&[String]>,
) -> Result<Unpacked, LayersError> {
    let ask = |fallback| async move {
        tokio::time::timeout(4 * CALL_TIMEOUT, engine.snapshot(namespace, id, fallback))
            .await
            .map_err(|_| LayersError::EngineTimedOut)?
            .map_err(LayersError::from)
            .and_then(|snap| from_snapshot(overlay, snap))
    };
    if by_containerd {
        return ask(None).await;
    }
    match (
        from_docker_layerdb(rootfs, id, overlay),
        docker_snapshot(rootfs, id),
    ) {
        (Ok(u), _) => Ok(u),
        (Err(e), None) => Err(e),
        // Docker's containerd image store: the snapshot is the container id's, in the
        // snapshotter the rootfs path names, and Docker mounted it itself.
        (Err(_), Some(snapshot)) => ask(Some(snapshot)).await,
    }
}

/// Docker Engine's containerd image store mounts container `id`'s snapshot itself at
/// `<data-root>/rootfs/<snapshotter>/<id>`: (snapshotter, key).
fn docker_snapshot(rootfs: &Path, id: &str) -> Option<(String, String)> {
    let snapshotter = rootfs.parent()?;
    (rootfs.file_name()? == id && snapshotter.parent()?.file_name()? == "rootfs" && !id.is_empty())
        .then(|| {
            Some((
                snapshotter.file_name()?.to_str()?.to_string(),
                id.to_string(),
            ))
        })
        .flatten()
}

/// The layers under a rootfs whose overlay options are `ours`, if it is the engine's
/// snapshot `snap`: the same lower directories, the top image layer the first ancestor an
/// unpack named.
pub fn from_snapshot(
    ours: Option<&[String]>,
    snap: EngineSnapshot,
) -> Result<Unpacked, LayersError> {
    let EngineSnapshot {
        snapshotter,
        key,
        overlay_options,
        ancestors,
    } = snap;
    let (Some(ours), Some(theirs)) = (ours, overlay_options) else {
        return Err(LayersError::NotOverlayOf { snapshotter, key });
    };
    let canonical = |dirs: Vec<PathBuf>| -> Vec<PathBuf> {
        dirs.into_iter()
            .map(|d| fs::canonicalize(&d).unwrap_or(d))
            .collect()
    };
    let lowers = canonical(lowerdirs(ours));
    if lowers.is_empty() || lowers != canonical(lowerdirs(&theirs)) {
        return Err(LayersError::OtherSnapshot { snapshotter, key });
    }
    let (i, below) = top_of(&ancestors)?;
    let top_dir = lowers
        .get(i)
        .cloned()
        .ok_or_else(|| LayersError::FewerLowers {
            key,
            lowers: lowers.len(),
        })?;
    Ok(Unpacked {
        below_top: below,
        top_dir,
        top: ancestors[i].clone(),
        source: format!("{snapshotter} snapshot {}", ancestors[i]),
    })
}

/// Docker Engine's overlay2 store: the rootfs at `<data-root>/overlay2/<mount-id>/merged`, the
/// container's layer record at `<data-root>/image/overlay2/layerdb/mounts/<id>/`.
pub fn from_docker_layerdb(
    rootfs: &Path,
    id: &str,
    overlay: Option<&[String]>,
) -> Result<Unpacked, LayersError> {
    let not_docker = || LayersError::NotDocker(rootfs.to_path_buf());
    if rootfs.file_name().is_none_or(|n| n != "merged") {
        return Err(not_docker());
    }
    let mount_id = rootfs
        .parent()
        .and_then(Path::file_name)
        .ok_or_else(not_docker)?;
    let store = rootfs
        .parent()
        .and_then(Path::parent)
        .ok_or_else(not_docker)?;
    if store.file_name().is_none_or(|n| n != "overlay2") {
        return Err(not_docker());
    }
    let data_root = store.parent().ok_or_else(not_docker)?;
    let layerdb = data_root.join("image/overlay2/layerdb");
    let record = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LayersError::Record { path, source }
    };
    let read = |p: PathBuf| -> Result<String, LayersError> {
        let md = fs::symlink_metadata(&p).map_err(record(&p))?;
        if !md.is_file() || md.len() > 4096 {
            return Err(LayersError::NotSmallFile(p));
        }
        fs::read_to_string(&p)
            .map(|s| s.trim().to_string())
            .map_err(record(&p))
    };
    if id.contains('/') || id.starts_with('.') {
        return Err(LayersError::NotDockerId(id.to_string()));
    }
    let mount = layerdb.join("mounts").join(id);
    if read(mount.join("mount-id"))? != mount_id.to_string_lossy() {
        return Err(LayersError::OtherMount {
            id: id.to_string(),
            rootfs: rootfs.to_path_buf(),
        });
    }
    let top = read(mount.join("parent"))?;
    if !is_chain_id(&top) {
        return Err(LayersError::MountParent {
            id: id.to_string(),
            parent: top,
        });
    }
    let layer = layerdb.join("sha256").join(&top["sha256:".len()..]);
    let below = match fs::symlink_metadata(layer.join("parent")) {
        Ok(_) => Some(read(layer.join("parent"))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(record(&layer.join("parent"))(e)),
    };
    if below.as_deref().is_some_and(|b| !is_chain_id(b)) {
        return Err(LayersError::LayerParent { top, parent: below });
    }
    let cache_id = read(layer.join("cache-id"))?;
    if cache_id.is_empty() || cache_id.contains('/') || cache_id.starts_with('.') {
        return Err(LayersError::CacheId { top, cache_id });
    }
    let top_dir = store.join(&cache_id).join("diff");
    // The mounted overlay must have that layer among its lower directories.
    let canonical = |p: &Path| fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let want = canonical(&top_dir);
    let in_mount = overlay
        .map(lowerdirs)
        .unwrap_or_default()
        .iter()
        .any(|l| canonical(l) == want);
    if !in_mount {
        return Err(LayersError::NotBelow {
            rootfs: rootfs.to_path_buf(),
            top,
            top_dir,
        });
    }
    Ok(Unpacked {
        below_top: below,
        top_dir,
        source: format!("Docker layer {top}"),
        top,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    #[test]
    fn chain_ids_follow_the_oci_rule() {
        let ids = chain_ids(&[id('a'), id('b')]);
        assert_eq!(ids[0], id('a'));
        assert_eq!(
            ids[1],
            format!(
                "sha256:{:x}",
                Sha256::digest(format!("{} {}", id('a'), id('b')).as_bytes())
            )
        );
        assert!(chain_ids(&[]).is_empty());
    }

    fn checkpoint_layer() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join(RESERVED).join("criu")).unwrap();
        fs::write(d.path().join(RESERVED).join("checkpoint.json"), b"{}").unwrap();
        d
    }

    #[test]
    fn the_signed_chain_and_a_bare_checkpoint_layer_pass() {
        let top = checkpoint_layer();
        let signed = vec![id('a'), id('b')];
        let u = Unpacked {
            below_top: chain_ids(&signed).pop(),
            top_dir: top.path().to_path_buf(),
            source: "test".into(),
            top: "sha256:test".into(),
        };
        verify(&signed, &u).unwrap();
        // One layer only: nothing below it, nothing signed.
        let alone = Unpacked {
            below_top: None,
            ..u.clone()
        };
        verify(&[], &alone).unwrap();
        assert!(verify(&signed, &alone).is_err());
    }

    #[test]
    fn other_layers_below_are_refused_by_chain() {
        let top = checkpoint_layer();
        let u = Unpacked {
            below_top: chain_ids(&[id('a'), id('c')]).pop(),
            top_dir: top.path().to_path_buf(),
            source: "overlayfs snapshot X".into(),
            top: "sha256:test".into(),
        };
        let e = verify(&[id('a'), id('b')], &u).unwrap_err().to_string();
        assert!(e.contains("altered after signing"), "{e}");
        assert!(e.contains("not unpacked from the signed layers"), "{e}");
        assert!(e.contains("overlayfs snapshot X"), "{e}");
        // A layer added below, or one left out.
        assert!(verify(&[id('a')], &u).is_err());
        assert!(verify(&[id('a'), id('c'), id('d')], &u).is_err());
    }

    #[test]
    fn a_top_layer_with_more_than_the_checkpoint_is_refused() {
        let signed = vec![id('a')];
        let unpacked = |dir: &Path| Unpacked {
            below_top: Some(id('a')),
            top_dir: dir.to_path_buf(),
            source: "t".into(),
            top: "sha256:test".into(),
        };
        // A file beside the reserved directory (a library the restored processes would map).
        let top = checkpoint_layer();
        fs::create_dir_all(top.path().join("usr/lib")).unwrap();
        let e = verify(&signed, &unpacked(top.path()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a checkpoint layer"), "{e}");
        assert!(e.contains("\"usr\""), "{e}");
        // A whiteout (a character device) hiding a lower file.
        let top = checkpoint_layer();
        nix::sys::stat::mknod(
            &top.path().join("etc"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .unwrap();
        assert!(verify(&signed, &unpacked(top.path())).is_err());
        // No reserved directory; the reserved name as a file.
        let empty = tempfile::tempdir().unwrap();
        assert!(verify(&signed, &unpacked(empty.path()))
            .unwrap_err()
            .to_string()
            .contains("no /.crab-checkpoint"));
        fs::write(empty.path().join(RESERVED), b"x").unwrap();
        assert!(verify(&signed, &unpacked(empty.path())).is_err());
        // An opaque root hides every layer below.
        let top = checkpoint_layer();
        let p = std::ffi::CString::new(top.path().to_str().unwrap()).unwrap();
        let n = std::ffi::CString::new("trusted.overlay.opaque").unwrap();
        // SAFETY: NUL-terminated strings, a one-byte value.
        let r = unsafe { libc::setxattr(p.as_ptr(), n.as_ptr(), b"y".as_ptr().cast(), 1, 0) };
        // trusted.* needs CAP_SYS_ADMIN: as root (make test) the case always runs.
        assert!(
            r == 0 || !nix::unistd::geteuid().is_root(),
            "setxattr failed as root"
        );
        if r == 0 {
            let e = verify(&signed, &unpacked(top.path()))
                .unwrap_err()
                .to_string();
            assert!(e.contains("opaque"), "{e}");
        }
    }

    #[test]
    fn the_top_layer_is_the_first_ancestor_an_unpack_named() {
        assert_eq!(top_of(&[id('a'), id('b')]).unwrap(), (0, Some(id('b'))));
        assert_eq!(top_of(&[id('a')]).unwrap(), (0, None));
        // Docker's init layer sits between the container and the image.
        assert_eq!(
            top_of(&["c1-init".into(), id('a'), id('b')]).unwrap(),
            (1, Some(id('b')))
        );
        assert!(top_of(&["c1-init".into()]).is_err());
        assert!(top_of(&[]).is_err());
        assert!(!is_chain_id("sha256:abc"));
        assert!(!is_chain_id(&format!("sha512:{}", "a".repeat(64))));
    }

    #[test]
    fn docker_s_containerd_store_names_the_snapshot_in_the_rootfs_path() {
        assert_eq!(
            docker_snapshot(Path::new("/var/lib/docker/rootfs/overlayfs/c1"), "c1"),
            Some(("overlayfs".into(), "c1".into()))
        );
        assert_eq!(
            docker_snapshot(Path::new("/var/lib/docker/rootfs/overlayfs/c2"), "c1"),
            None
        );
        assert_eq!(
            docker_snapshot(Path::new("/var/lib/docker/x/overlayfs/c1"), "c1"),
            None
        );
        assert_eq!(docker_snapshot(Path::new("/c1"), "c1"), None);
    }

    #[test]
    fn lower_directories_come_in_both_forms() {
        let m =
            |options: &[&str]| -> Vec<String> { options.iter().map(|s| s.to_string()).collect() };
        assert_eq!(
            lowerdirs(&m(&["index=off", "lowerdir=/a:/b", "upperdir=/u"])),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert_eq!(
            lowerdirs(&m(&["lowerdir+=/a", "lowerdir+=/b", "upperdir=/u"])),
            vec![PathBuf::from("/a"), PathBuf::from("/b")]
        );
        assert!(lowerdirs(&m(&["upperdir=/u"])).is_empty());
        // As overlayfs reads the value: an escaped `:` is part of a name, and the data-only
        // layers after `::` are not part of the tree.
        assert_eq!(
            lowerdirs(&m(&[r"lowerdir=/a\:x:/b::/data"])),
            vec![PathBuf::from("/a:x"), PathBuf::from("/b")]
        );
    }

    /// A Docker overlay2 store laid out as dockerd writes it.
    fn docker_store(
        parent_of_top: Option<&str>,
    ) -> (tempfile::TempDir, PathBuf, Vec<String>, String) {
        let root = tempfile::tempdir().unwrap();
        let store = root.path().join("overlay2");
        let rootfs = store.join("m1").join("merged");
        fs::create_dir_all(&rootfs).unwrap();
        let top = id('e');
        let layerdb = root.path().join("image/overlay2/layerdb");
        let mount = layerdb.join("mounts/c1");
        fs::create_dir_all(&mount).unwrap();
        fs::write(mount.join("mount-id"), "m1").unwrap();
        fs::write(mount.join("parent"), &top).unwrap();
        let layer = layerdb.join("sha256").join("e".repeat(64));
        fs::create_dir_all(&layer).unwrap();
        fs::write(layer.join("cache-id"), "k1").unwrap();
        if let Some(p) = parent_of_top {
            fs::write(layer.join("parent"), p).unwrap();
        }
        fs::create_dir_all(store.join("k1/diff")).unwrap();
        fs::create_dir_all(store.join("l")).unwrap();
        std::os::unix::fs::symlink("../k1/diff", store.join("l/SHORT")).unwrap();
        let overlay = vec![format!(
            "lowerdir={}:{}",
            store.join("m1-init/diff").display(),
            store.join("l/SHORT").display()
        )];
        (root, rootfs, overlay, top)
    }

    #[test]
    fn docker_s_layer_records_name_the_chain() {
        let below = id('d');
        let (root, rootfs, overlay, top) = docker_store(Some(&below));
        let u = from_docker_layerdb(&rootfs, "c1", Some(&overlay)).unwrap();
        assert_eq!(u.below_top, Some(below));
        assert_eq!(u.top_dir, root.path().join("overlay2/k1/diff"));
        assert!(u.source.contains(&top));
        // Another container's id, a path-like id, a rootfs outside the store.
        assert!(from_docker_layerdb(&rootfs, "c2", Some(&overlay)).is_err());
        assert!(from_docker_layerdb(&rootfs, "../c1", Some(&overlay)).is_err());
        assert!(from_docker_layerdb(root.path(), "c1", Some(&overlay)).is_err());
        // An overlay without that layer below it.
        let other = vec!["lowerdir=/nowhere".to_string()];
        assert!(from_docker_layerdb(&rootfs, "c1", Some(&other)).is_err());
        assert!(from_docker_layerdb(&rootfs, "c1", None).is_err());
        // A one-layer image: nothing below its top.
        let (_root, rootfs, overlay, _) = docker_store(None);
        assert_eq!(
            from_docker_layerdb(&rootfs, "c1", Some(&overlay))
                .unwrap()
                .below_top,
            None
        );
        // A record that names no chain id.
        let (_root, rootfs, overlay, _) = docker_store(Some("../../x"));
        assert!(from_docker_layerdb(&rootfs, "c1", Some(&overlay)).is_err());
    }

    /// An engine that answers `snap`, or has no record of the container (`None`), and
    /// records the fallback it was asked with.
    struct Fake(
        Option<EngineSnapshot>,
        std::sync::Mutex<Vec<Option<(String, String)>>>,
    );

    #[async_trait::async_trait]
    impl SnapshotSource for Fake {
        async fn snapshot(
            &self,
            _namespace: &str,
            _id: &str,
            fallback: Option<(String, String)>,
        ) -> Result<EngineSnapshot, SnapshotError> {
            self.1.lock().unwrap().push(fallback);
            self.0
                .clone()
                .ok_or_else(|| SnapshotError::NoRecord("c1".into()))
        }
    }

    #[tokio::test]
    async fn the_engine_s_snapshot_must_be_the_rootfs_mounted() {
        let (top, base) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let options = vec![format!(
            "lowerdir={}:{}",
            top.path().display(),
            base.path().display()
        )];
        let snap = EngineSnapshot {
            snapshotter: "overlayfs".into(),
            key: "c1".into(),
            overlay_options: Some(options.clone()),
            ancestors: vec![id('f'), id('b')],
        };
        let u = from_snapshot(Some(&options), snap.clone()).unwrap();
        assert_eq!(u.top_dir, fs::canonicalize(top.path()).unwrap());
        assert_eq!(u.below_top, Some(id('b')));
        assert!(u.source.contains(&id('f')));
        // Docker's init layer above the image: the top image layer is the second lower dir.
        let with_init = EngineSnapshot {
            ancestors: vec!["c1-init".into(), id('f'), id('b')],
            ..snap.clone()
        };
        let u = from_snapshot(Some(&options), with_init).unwrap();
        assert_eq!(u.top_dir, fs::canonicalize(base.path()).unwrap());
        // Other mounts than the snapshot's, or none an overlay.
        let other = vec![format!("lowerdir={}", base.path().display())];
        let e = from_snapshot(Some(&other), snap.clone()).unwrap_err();
        assert!(
            matches!(&e, LayersError::OtherSnapshot { key, .. } if key == "c1"),
            "{e}"
        );
        assert!(e.to_string().contains("not overlayfs snapshot c1"), "{e}");
        assert!(from_snapshot(None, snap.clone()).is_err());
        let no_overlay = EngineSnapshot {
            overlay_options: None,
            ..snap.clone()
        };
        assert!(from_snapshot(Some(&options), no_overlay).is_err());

        // Through identify: containerd's own mounts ask with no fallback; Docker's containerd
        // store with the snapshot its rootfs path names; an engine error is the reason.
        let fake = Fake(Some(snap.clone()), Default::default());
        let u = identify(
            &fake,
            "ns",
            "c1",
            Path::new("/x/rootfs"),
            true,
            Some(&options),
        )
        .await
        .unwrap();
        assert_eq!(u.below_top, Some(id('b')));
        let docker_root = Path::new("/var/lib/docker/rootfs/overlayfs/c1");
        identify(&fake, "ns", "c1", docker_root, false, Some(&options))
            .await
            .unwrap();
        assert_eq!(
            *fake.1.lock().unwrap(),
            vec![None, Some(("overlayfs".to_string(), "c1".to_string()))]
        );
        let refusing = Fake(None, Default::default());
        let e = identify(&refusing, "ns", "c1", Path::new("/r"), true, Some(&options))
            .await
            .unwrap_err();
        assert!(
            matches!(e, LayersError::Engine(SnapshotError::NoRecord(_))),
            "{e}"
        );
        assert_eq!(e.to_string(), "containerd has no record of container c1");
        // Neither Docker store nor containerd's: not asked, refused.
        let e = identify(
            &refusing,
            "ns",
            "c1",
            Path::new("/somewhere/c1"),
            false,
            Some(&options),
        )
        .await
        .unwrap_err();
        assert!(matches!(e, LayersError::NotDocker(_)), "{e}");
        assert!(e.to_string().contains("Docker's overlay2 store"), "{e}");
    }
}

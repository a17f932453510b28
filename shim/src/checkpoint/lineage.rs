//! Lineages on disk: each checkpoint store records the lineage its container belongs to
//! (`lineage.json` at its root, [`LineageRecord`]), so that a later container of the same
//! lineage (the kubelet's next attempt of a crashed container, Docker's restart of the same
//! container, a container created after a node reboot) finds the newest durable checkpoint
//! of it among the stores of its namespace ([`newest`]): set-aside stores (`.replaced-*`) and
//! those of removed containers included.
//!
//! The name itself is the spec's (`crate::turns::lineage`); here it is only compared. Store
//! directories are root's (0700) and written by crab alone; still, a record is read as
//! untrusted bytes (bounded, a plain file, never followed through a symlink) and a store that
//! cannot be read is skipped with a warning, never the reason a container cannot start.

use std::{
    fs,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::store::{Manifest, Store, StoreError, SET_ASIDE_PREFIX};

/// The record's file at a store's root.
pub const RECORD: &str = "lineage.json";
/// The record format this crab writes and reads.
pub const FORMAT: u32 = 1;
/// A record is a name and an image id: anything larger is not one.
const RECORD_MAX: u64 = 4096;
/// At most this many stores of a namespace are looked at for one resume.
pub const MAX_STORES: usize = 100_000;

/// What a store records of its lineage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineageRecord {
    pub format: u32,
    pub lineage: String,
    /// The chain id of the image the container's rootfs was made from, when the engine could
    /// say (`crate::restore::layers::identify`): a resume onto another image is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

impl LineageRecord {
    pub fn new(lineage: &str, image: Option<String>) -> LineageRecord {
        LineageRecord {
            format: FORMAT,
            lineage: lineage.to_string(),
            image,
        }
    }
}

/// Writes `record` at `store`'s root (temp file, fsync, rename), replacing an earlier one.
pub fn record(store: &Store, record: &LineageRecord) -> Result<(), StoreError> {
    let path = store.root().join(RECORD);
    let mut json = serde_json::to_vec_pretty(record).map_err(|e| StoreError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    json.push(b'\n');
    let mut tmp = store.temp_file("lineage")?;
    std::io::Write::write_all(tmp.file(), &json)
        .map_err(|e| StoreError::io("write", tmp.path(), e))?;
    tmp.persist(&path)
}

/// The lineage record of the store at `root`, if it has a readable one.
pub fn read(root: &Path) -> Option<LineageRecord> {
    let path = root.join(RECORD);
    let bytes = match crate::sys::file::read_regular_bounded(&path, RECORD_MAX) {
        Ok(Some(bytes)) => bytes,
        Ok(None) => return None,
        Err(e @ crate::sys::file::BoundedReadError::TooLarge(_)) => {
            log::warn!("{}: {e}: ignored", path.display());
            return None;
        }
        Err(_) => return None,
    };
    match serde_json::from_slice::<LineageRecord>(&bytes) {
        Ok(r) if r.format <= FORMAT => Some(r),
        Ok(r) => {
            log::warn!(
                "{}: format {} is newer than this crab's",
                path.display(),
                r.format
            );
            None
        }
        Err(e) => {
            log::warn!("{}: {e}: ignored", path.display());
            None
        }
    }
}

/// A checkpoint a container may resume from.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The store's root.
    pub store: PathBuf,
    /// The container id the store belongs to (a set-aside store's original id).
    pub container: String,
    pub record: LineageRecord,
    pub manifest: Manifest,
}

/// The container id a store directory name stands for: its own name, or the id inside a
/// set-aside name (`.replaced-<id>-<nanos>-<pid>`).
pub fn container_of(dir_name: &str) -> Option<String> {
    if let Some(rest) = dir_name.strip_prefix(SET_ASIDE_PREFIX) {
        let mut parts = rest.rsplitn(3, '-');
        let (_pid, _nanos, id) = (parts.next()?, parts.next()?, parts.next()?);
        return (!id.is_empty()).then(|| id.to_string());
    }
    (!dir_name.starts_with('.')).then(|| dir_name.to_string())
}

/// One store of a lineage, as [`stores`] finds it.
#[derive(Debug, Clone)]
pub struct LineageStore {
    /// The store's root.
    pub store: PathBuf,
    /// The container id it belongs to (a set-aside store's original id).
    pub container: String,
    /// Set aside (`.replaced-*`): the container id now names another store.
    pub set_aside: bool,
    pub record: LineageRecord,
    /// Its durable checkpoints, and the newest of them.
    pub durable: usize,
    pub newest: Option<Manifest>,
}

/// The stores under `namespace_dir` (`<state_dir>/<namespace>`) that record a lineage (only
/// `lineage`'s, when given), set-aside ones included, in directory order. Stores that cannot
/// be read are skipped with a warning.
pub fn stores(namespace_dir: &Path, lineage: Option<&str>) -> Vec<LineageStore> {
    let entries = match fs::read_dir(namespace_dir) {
        Ok(it) => it,
        Err(e) => {
            if e.kind() != std::io::ErrorKind::NotFound {
                log::warn!(
                    "{}: {e}: no lineage is found there",
                    namespace_dir.display()
                );
            }
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for entry in entries.flatten().take(MAX_STORES) {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(container) = container_of(&name).filter(|_| kind.is_dir()) else {
            continue;
        };
        let root = entry.path();
        let Some(record) = read(&root).filter(|r| lineage.is_none_or(|l| r.lineage == l)) else {
            continue;
        };
        let manifests = match durable_manifests(&root) {
            Ok(m) => m,
            Err(e) => {
                log::warn!(
                    "lineage {}: the store {} cannot be read ({e}): skipped",
                    record.lineage,
                    root.display()
                );
                continue;
            }
        };
        out.push(LineageStore {
            store: root,
            container,
            set_aside: name.starts_with(SET_ASIDE_PREFIX),
            record,
            durable: manifests.len(),
            newest: manifests.into_iter().next_back(),
        });
    }
    out
}

/// The newest durable checkpoint of `lineage` among the stores under `namespace_dir`
/// (`<state_dir>/<namespace>`), by creation time (then by store, then sequence number, so
/// the choice is stable).
pub fn newest(namespace_dir: &Path, lineage: &str) -> Option<Candidate> {
    newest_of(stores(namespace_dir, Some(lineage)))
}

/// The newest durable checkpoint among `stores` ([`newest`]).
pub fn newest_of(stores: Vec<LineageStore>) -> Option<Candidate> {
    let key = |c: &Candidate| {
        (
            c.manifest.created_at.clone(),
            c.store.clone(),
            c.manifest.seq,
        )
    };
    let mut best: Option<Candidate> = None;
    for s in stores {
        let Some(manifest) = s.newest else {
            continue;
        };
        let c = Candidate {
            store: s.store,
            container: s.container,
            record: s.record,
            manifest,
        };
        if best.as_ref().is_none_or(|b| key(&c) > key(b)) {
            best = Some(c);
        }
    }
    best
}

/// The newest durable checkpoint of the store at `root`, if it can be read: manifests are
/// read from the newest back to the first durable one (a replicator asks at every turn end).
pub fn newest_durable(root: &Path) -> Option<Manifest> {
    for (_, path) in manifest_paths(root).ok()?.into_iter().rev() {
        let bytes = fs::read(&path).ok()?;
        let m = super::store::parse_manifest(&path, &bytes).ok()?;
        if m.kind.is_durable_state() {
            return Some(m);
        }
    }
    None
}

/// The earliest [`Manifest::turn_ended_ms`] of the durable checkpoints of the store at `root`
/// after checkpoint `after` (all of them when `None`): the oldest turn end a push of the
/// newest one makes safe off the node.
pub fn oldest_turn_end_after(root: &Path, after: Option<u64>) -> Option<u64> {
    let mut oldest: Option<u64> = None;
    for (seq, path) in manifest_paths(root).ok()?.into_iter().rev() {
        if after.is_some_and(|a| seq <= a) {
            break;
        }
        let Ok(bytes) = fs::read(&path) else { continue };
        let Ok(m) = super::store::parse_manifest(&path, &bytes) else {
            continue;
        };
        if m.kind.is_durable_state() {
            if let Some(t) = m.turn_ended_ms {
                oldest = Some(oldest.map_or(t, |o| o.min(t)));
            }
        }
    }
    oldest
}

/// The published manifests of the store at `root`, by sequence number.
fn manifest_paths(root: &Path) -> Result<Vec<(u64, PathBuf)>, StoreError> {
    let dir = root.join("checkpoints");
    let mut seqs: Vec<(u64, PathBuf)> = Vec::new();
    for entry in fs::read_dir(&dir).map_err(|e| StoreError::io("read", &dir, e))? {
        let entry = entry.map_err(|e| StoreError::io("read", &dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(seq) = name
            .strip_suffix(".json")
            .filter(|n| n.len() == 6 && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse::<u64>().ok())
        {
            seqs.push((seq, entry.path()));
        }
    }
    seqs.sort();
    Ok(seqs)
}

/// The durable checkpoints of the store at `root`, oldest first, read without opening it as
/// a `Store` (which would create directories and sweep: this is someone else's store).
fn durable_manifests(root: &Path) -> Result<Vec<Manifest>, StoreError> {
    let mut out = Vec::new();
    for (_, path) in manifest_paths(root)? {
        let bytes = fs::read(&path).map_err(|e| StoreError::io("read", &path, e))?;
        let m = super::store::parse_manifest(&path, &bytes)?;
        if m.kind.is_durable_state() {
            out.push(m);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::store::CheckpointKind;

    fn store_with(root: &Path, lineage: Option<&str>, kinds: &[(CheckpointKind, &str)]) {
        let store = Store::open(root).unwrap();
        if let Some(l) = lineage {
            record(&store, &LineageRecord::new(l, None)).unwrap();
        }
        for (kind, at) in kinds {
            let mut m = Manifest::child_of(None, store.next_seq().unwrap(), "t", *kind);
            m.created_at = at.to_string();
            store.publish(&m).unwrap();
        }
    }

    #[test]
    fn the_oldest_turn_end_a_push_covers() {
        use CheckpointKind::*;
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(t.path()).unwrap();
        for (kind, ended) in [
            (Fs, Some(100)),
            (Full, Some(200)),
            (Failed, Some(150)),
            (Proc, None),
            (Fs, Some(400)),
        ] {
            let mut m = Manifest::child_of(None, store.next_seq().unwrap(), "t", kind);
            m.turn_ended_ms = ended;
            store.publish(&m).unwrap();
        }
        let root = t.path();
        assert_eq!(oldest_turn_end_after(root, None), Some(100));
        // After checkpoint 1: 2 (200) and 5 (400); the failed one is not a recovery point.
        assert_eq!(oldest_turn_end_after(root, Some(1)), Some(200));
        assert_eq!(oldest_turn_end_after(root, Some(2)), Some(400));
        assert_eq!(oldest_turn_end_after(root, Some(5)), None);
    }

    #[test]
    fn the_newest_durable_checkpoint_of_a_lineage_across_stores() {
        use CheckpointKind::*;
        let t = tempfile::tempdir().unwrap();
        let ns = t.path();
        store_with(
            &ns.join("a"),
            Some("pods/p/c"),
            &[
                (Fs, "2026-12-06T01:00:00.000Z"),
                (Full, "2026-12-06T01:00:01.000Z"),
            ],
        );
        // Newer, but its newest checkpoint failed: its last durable one counts.
        store_with(
            &ns.join("b"),
            Some("pods/p/c"),
            &[
                (Fs, "2026-12-06T01:00:02.000Z"),
                (Failed, "2026-12-06T01:00:09.000Z"),
            ],
        );
        // Another lineage, and a store without a record: never chosen.
        store_with(
            &ns.join("c"),
            Some("pods/p/other"),
            &[(Full, "2026-12-06T02:00:00.000Z")],
        );
        store_with(&ns.join("d"), None, &[(Full, "2026-12-06T02:00:00.000Z")]);
        let c = newest(ns, "pods/p/c").unwrap();
        assert_eq!((c.container.as_str(), c.manifest.seq), ("b", 1));
        assert!(newest(ns, "pods/p").is_none());
        assert!(newest(&ns.join("missing"), "pods/p/c").is_none());
        // A set-aside store is one of the lineage's too, under its container's id.
        fs::rename(
            ns.join("b"),
            ns.join(".replaced-b-x-1767225600000000000-42"),
        )
        .unwrap();
        let c = newest(ns, "pods/p/c").unwrap();
        assert_eq!(c.container, "b-x");
    }

    #[test]
    fn hostile_records_are_ignored_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let ns = t.path();
        store_with(
            &ns.join("a"),
            None,
            &[(CheckpointKind::Full, "2026-12-06T01:00:00.000Z")],
        );
        let rec = ns.join("a").join(RECORD);
        // A symlink to a record elsewhere is not read.
        let elsewhere = t.path().join("elsewhere.json");
        fs::write(
            &elsewhere,
            serde_json::to_vec(&LineageRecord::new("l", None)).unwrap(),
        )
        .unwrap();
        std::os::unix::fs::symlink(&elsewhere, &rec).unwrap();
        assert!(read(&ns.join("a")).is_none());
        fs::remove_file(&rec).unwrap();
        // Too large, malformed, a newer format, a FIFO: none is a record.
        fs::write(&rec, vec![b' '; RECORD_MAX as usize + 1]).unwrap();
        assert!(read(&ns.join("a")).is_none());
        fs::write(&rec, b"{\"format\":1").unwrap();
        assert!(read(&ns.join("a")).is_none());
        fs::write(&rec, b"{\"format\":99,\"lineage\":\"l\"}").unwrap();
        assert!(read(&ns.join("a")).is_none());
        fs::remove_file(&rec).unwrap();
        nix::unistd::mkfifo(&rec, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(read(&ns.join("a")).is_none());
        assert!(newest(ns, "l").is_none());
        fs::remove_file(&rec).unwrap();
        // A damaged manifest makes its store unreadable: skipped, not fatal.
        fs::write(
            &rec,
            serde_json::to_vec(&LineageRecord::new("l", None)).unwrap(),
        )
        .unwrap();
        assert!(newest(ns, "l").is_some());
        fs::write(ns.join("a/checkpoints/000009.json"), b"{").unwrap();
        assert!(newest(ns, "l").is_none());
    }

    #[test]
    fn set_aside_names_give_back_their_container() {
        assert_eq!(container_of("abc").as_deref(), Some("abc"));
        assert_eq!(container_of(".replaced-abc-1-2").as_deref(), Some("abc"));
        assert_eq!(
            container_of(".replaced-a-b-c-1-2").as_deref(),
            Some("a-b-c")
        );
        assert_eq!(container_of(".replaced--1-2"), None);
        assert_eq!(container_of(".restores"), None);
        assert_eq!(container_of(".lock"), None);
    }
}

//! `crabctl prune`: removes what crab keeps for containers that are gone for good.
//!
//! A container's checkpoint store (`<state_dir>/<namespace>/<id>/`) outlives its task on
//! purpose: after a crash, `recover` and `rollback` need it while the container record is still
//! there. Once the record is gone (the CRI removes containers all the time) nothing can use it,
//! nor the internal images `crab.local/checkpoint/<namespace>/<id>:<seq>` that fork, rollback
//! and recover made of its checkpoints. Prune removes both, only for ids without a container
//! record (a record whose task is gone keeps everything), and asks containerd again
//! (`Containers.Get`) right before removing each store.
//!
//! Which state directories: `--config`'s alone if given; else the default config's and those of
//! the configs every existing crab container of the namespaces names (a gone container's record
//! cannot say which one it used, so a state_dir no remaining container names needs `--config`).
//! A state_dir is taken to be this containerd's alone: stores that another containerd's
//! containers use (same namespace name, same state_dir) would look gone from here.
//!
//! What is left alone, and reported:
//! - symlinks (never followed), entries that are no directory or no container id, directories
//!   without a `checkpoints/` directory (not a crab store);
//! - a store changed in the last [`MIN_AGE`] (its directory or its `checkpoints/`): a safety
//!   margin against clocks and creation order (containerd creates a record before its task, and
//!   the shim opens the store in Create, so a store without a record is never a new one);
//! - a store whose lock a live [`Store`](crab_shim::checkpoint::store::Store) holds (a shim or
//!   crabctl still uses it).
//!
//! Removal renames the store to `.prune-<id>-<unique>.tmp` in its namespace directory, then
//! deletes it: a crash leaves either the intact store under its own name or such a leftover,
//! which the next prune finishes (no container id starts with a dot, so no shim ever takes that
//! name for a store). The check of the record and the rename happen under the lock of the
//! namespace directory, which a shim holds while it creates a store
//! ([`crab_shim::checkpoint::store::lock_namespace_dir`]): a container re-created with the same id
//! meanwhile either finds its store gone and starts a new one, or keeps it.
//!
//! Stores a shim set aside (`.replaced-<id>-<unique>`: an earlier container's, found where a
//! new container with the same id began a new lineage) are removed like such leftovers.
//!
//! Each state dir's restore cache (`.restore-cache`: verified copies of process images, kept
//! for the next restore of the same image, bounded by `[restore] cache_mib`) is cleared too:
//! every entry no restore is building or checking goes (a restore that took one has its own
//! links to the files).

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    fmt,
    fs::{self, File, OpenOptions},
    io,
    os::{
        fd::AsRawFd,
        unix::fs::{MetadataExt, OpenOptionsExt},
    },
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use containerd_client::services::v1::Container;
use crab_runtime_config::Config;

use super::{client::unique, config_for, export::INTERNAL_PREFIX, Client, Ctl, Result};

/// How long a store must have been unchanged before prune removes it.
pub const MIN_AGE: Duration = Duration::from_secs(60);
const LEFTOVER_PREFIX: &str = ".prune-";
const LEFTOVER_SUFFIX: &str = ".tmp";

/// An entry of a namespace directory, as prune sees it (symlinks not followed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub path: PathBuf,
    pub kind: EntryKind,
    /// Since the newest change of the directory or its `checkpoints/` (zero if in the future).
    pub unchanged_for: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A directory; `store`: with a `checkpoints/` directory.
    Dir {
        store: bool,
    },
    Symlink,
    Other,
}

/// What prune does with an entry, from what is on disk and the container records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Its container exists (not reported one by one).
    Existing,
    /// The store of a container without a record.
    Remove,
    /// An interrupted prune's directory: finish removing it.
    Leftover,
    /// Left alone, and reported with the reason.
    Keep(String),
}

/// The decision for `entry` given the ids of the namespace's container records.
pub fn decide(entry: &Entry, existing: &HashSet<String>, min_age: Duration) -> Decision {
    if existing.contains(&entry.name) {
        return Decision::Existing;
    }
    let keep = |why: &str| Decision::Keep(why.to_string());
    match entry.kind {
        EntryKind::Dir { .. } if is_leftover(&entry.name) => Decision::Leftover,
        EntryKind::Symlink => keep("a symlink (not followed)"),
        EntryKind::Other => keep("not a directory"),
        _ if !is_container_id(&entry.name) => keep("not a container id"),
        EntryKind::Dir { store: false } => keep("not a crab store (no checkpoints/ directory)"),
        _ if entry.unchanged_for < min_age => Decision::Keep(format!(
            "too new (changed {}s ago; prune waits {}s)",
            entry.unchanged_for.as_secs(),
            min_age.as_secs()
        )),
        EntryKind::Dir { store: true } => Decision::Remove,
    }
}

fn is_leftover(name: &str) -> bool {
    let set_aside = crab_shim::checkpoint::store::SET_ASIDE_PREFIX;
    (name.len() > LEFTOVER_PREFIX.len() + LEFTOVER_SUFFIX.len()
        && name.starts_with(LEFTOVER_PREFIX)
        && name.ends_with(LEFTOVER_SUFFIX))
        || (name.len() > set_aside.len() && name.starts_with(set_aside))
}

/// containerd's identifiers: alphanumerics separated by single `.`, `_` or `-`.
fn is_container_id(name: &str) -> bool {
    let b = name.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
}

/// The entries of namespace directory `dir`, by name.
pub fn scan(dir: &Path, now: SystemTime) -> io::Result<Vec<Entry>> {
    let mut entries = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        let path = e.path();
        let md = fs::symlink_metadata(&path)?;
        let mut modified = md.modified().ok();
        let kind = if md.file_type().is_symlink() {
            EntryKind::Symlink
        } else if md.is_dir() {
            let checkpoints = fs::symlink_metadata(path.join("checkpoints"));
            let store = checkpoints.as_ref().is_ok_and(|m| m.is_dir());
            if let Some(m) = checkpoints.ok().and_then(|m| m.modified().ok()) {
                modified = modified.max(Some(m));
            }
            EntryKind::Dir { store }
        } else {
            EntryKind::Other
        };
        entries.push(Entry {
            name: e.file_name().to_string_lossy().into_owned(),
            path,
            kind,
            unchanged_for: modified
                .and_then(|m| now.duration_since(m).ok())
                .unwrap_or_default(),
        });
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

/// The (lowercased) container id an internal image of `namespace` was made for, if `name` is one
/// ([`super::export::internal_reference`]).
pub fn internal_image_owner(namespace: &str, name: &str) -> Option<String> {
    let rest = name
        .strip_prefix(INTERNAL_PREFIX)?
        .strip_prefix(&namespace.to_lowercase())?
        .strip_prefix('/')?;
    let (id, seq) = rest.rsplit_once(':')?;
    (!id.is_empty()
        && !id.contains('/')
        && !seq.is_empty()
        && seq.bytes().all(|c| c.is_ascii_digit()))
    .then(|| id.to_string())
}

/// The internal images of `namespace` to remove (`None`) or to keep and report (`Some(why)`):
/// those of containers with no record (ids compare lowercased, as the names are). An image a
/// container still uses (a fork's, or a rolled-back container's under another id) is kept, and so
/// are those of ids in `held` (lowercased: their stores were kept for now). Other images are not
/// listed.
pub fn select_images(
    namespace: &str,
    images: &[String],
    records: &[(String, String)],
    held: &HashSet<String>,
) -> Vec<(String, Option<String>)> {
    let existing: HashSet<String> = records.iter().map(|(id, _)| id.to_lowercase()).collect();
    let mut users: HashMap<&str, Vec<&str>> = HashMap::new();
    for (id, image) in records {
        users.entry(image.as_str()).or_default().push(id.as_str());
    }
    let mut out: Vec<(String, Option<String>)> = images
        .iter()
        .filter_map(|name| {
            let owner = internal_image_owner(namespace, name)?;
            if existing.contains(&owner) {
                return None;
            }
            let why = if let Some(ids) = users.get(name.as_str()) {
                Some(format!("used by container {}", ids.join(", ")))
            } else if held.contains(&owner) {
                Some(format!("its container's store ({owner}) was kept"))
            } else {
                None
            };
            Some((name.clone(), why))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The state directories to look in: `explicit`'s (`--config`) alone, else the default config's
/// and those of the configs `records` of crab containers name (sorted, distinct). A config that
/// cannot be read is a warning (the others are still pruned).
pub fn state_dirs<'a>(
    explicit: Option<&Path>,
    records: impl IntoIterator<Item = &'a Container>,
    warnings: &mut Vec<String>,
) -> Result<Vec<PathBuf>> {
    if let Some(path) = explicit {
        return Ok(vec![Config::load(path)?.store.state_dir]);
    }
    let mut dirs = BTreeSet::new();
    match Config::load_or_default(None) {
        Ok((c, _)) => {
            dirs.insert(c.store.state_dir);
        }
        Err(e) => warnings.push(format!("the default crab config: {e}")),
    }
    for r in records {
        if r.runtime
            .as_ref()
            .is_none_or(|rt| rt.name != crab_shim::RUNTIME_ID)
        {
            continue;
        }
        match config_for(None, r) {
            Ok(c) => {
                dirs.insert(c.store.state_dir);
            }
            Err(e) => warnings.push(format!("container {}: {e}", r.id)),
        }
    }
    Ok(dirs.into_iter().collect())
}

/// Whether a container record exists now (asked right before a removal).
trait Records {
    async fn exists(&self, id: &str) -> Result<bool>;
}

impl Records for Client {
    async fn exists(&self, id: &str) -> Result<bool> {
        Ok(self.container(id).await?.is_some())
    }
}

/// One store directory (or leftover, or other entry) prune reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreItem {
    pub path: PathBuf,
    pub outcome: Outcome,
    /// Disk usage (allocated bytes) of what was (or would be) removed.
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Removed (with --dry-run: would be).
    Removed,
    /// An interrupted prune's leftover removed (would be).
    Finished,
    Kept(String),
    Failed(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageItem {
    pub name: String,
    pub outcome: Outcome,
}

/// What a prune did (or, with `dry_run`, would do).
#[derive(Debug, Clone, Default)]
pub struct Pruned {
    pub dry_run: bool,
    pub namespaces: Vec<String>,
    pub state_dirs: Vec<PathBuf>,
    pub stores: Vec<StoreItem>,
    pub images: Vec<ImageItem>,
    /// Stores of existing containers (kept).
    pub existing: usize,
    pub warnings: Vec<String>,
    /// The restore cache of each state dir: what was (would be) removed of it.
    pub restore_caches: Vec<CacheItem>,
}

/// A state dir's restore cache ([`crab_shim::restore::cache`]) as prune cleared it: verified
/// copies of process images, kept for the next restore of the same image, removable at any
/// time (a restore in progress keeps its own links to the files).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheItem {
    pub path: PathBuf,
    pub entries: usize,
    pub bytes: u64,
}

impl Pruned {
    pub fn failures(&self) -> usize {
        let failed = |o: &Outcome| matches!(o, Outcome::Failed(_));
        self.stores.iter().filter(|s| failed(&s.outcome)).count()
            + self.images.iter().filter(|i| failed(&i.outcome)).count()
    }
}

/// What a lock attempt on a store found.
enum Lock {
    /// Taken (held until dropped).
    Taken(#[allow(dead_code)] File),
    /// No lock file: no `Store` ever opened it.
    None,
    /// A live `Store` holds it.
    Held,
}

fn try_lock(store: &Path) -> io::Result<Lock> {
    let path = store.join(".lock");
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Lock::None),
        Err(e) => return Err(e),
    };
    // SAFETY: flock on a file descriptor `file` owns and keeps open for the call; it touches
    // no memory. The lock is released when `file` is closed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(Lock::Taken(file));
    }
    match io::Error::last_os_error() {
        e if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(Lock::Held),
        e => Err(e),
    }
}

/// The namespace directory's lock (see the module docs), without creating anything.
fn lock_namespace(dir: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)?;
    // SAFETY: flock on a file descriptor we own; released when `file` is closed. A shim
    // holds it only while it creates or sets aside a store.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Allocated bytes under `path` (symlinks not followed, hard links counted once); what cannot
/// be read counts as nothing.
fn disk_usage(path: &Path) -> u64 {
    fn walk(path: &Path, seen: &mut HashSet<(u64, u64)>) -> u64 {
        let Ok(md) = fs::symlink_metadata(path) else {
            return 0;
        };
        if md.nlink() > 1 && !md.is_dir() && !seen.insert((md.dev(), md.ino())) {
            return 0;
        }
        let mut bytes = md.blocks() * 512;
        if md.is_dir() {
            for e in fs::read_dir(path).into_iter().flatten().flatten() {
                bytes += walk(&e.path(), seen);
            }
        }
        bytes
    }
    walk(path, &mut HashSet::new())
}

/// Renames the store `<dir>/<name>` to a leftover name (the caller holds the namespace
/// directory's lock), then deletes it.
fn remove_store(dir: &Path, name: &str, ns_lock: File) -> io::Result<()> {
    let doomed = dir.join(format!(
        "{LEFTOVER_PREFIX}{name}-{}{LEFTOVER_SUFFIX}",
        unique()
    ));
    fs::rename(dir.join(name), &doomed)?;
    drop(ns_lock);
    fs::remove_dir_all(&doomed)
}

/// Removes an interrupted prune's directory, or a store set aside for a reused id (whose
/// figures are first kept for `crabctl metrics`, under the namespace directory's lock).
fn remove_leftover(dir: &Path, entry: &Entry) -> io::Result<()> {
    if entry
        .name
        .starts_with(crab_shim::checkpoint::store::SET_ASIDE_PREFIX)
    {
        let _lock = lock_namespace(dir)?;
        crab_shim::metrics::fold_pruned_store(dir, &entry.name).map_err(|e| {
            io::Error::other(format!(
                "cannot keep its figures for crabctl metrics in {}: {e}",
                dir.join(crab_shim::metrics::PRUNED_FILE).display()
            ))
        })?;
    }
    fs::remove_dir_all(&entry.path)
}

/// Prunes namespace directory `dir`. Ids of stores kept for now go into `held` (lowercased).
async fn prune_dir(
    dir: &Path,
    existing: &HashSet<String>,
    records: &impl Records,
    min_age: Duration,
    report: &mut Pruned,
    held: &mut HashSet<String>,
) {
    match fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        Err(e) => return report.warnings.push(format!("{}: {e}", dir.display())),
        Ok(md) if !md.is_dir() => {
            let why = match md.file_type().is_symlink() {
                true => "a symlink (not followed)",
                false => "not a directory",
            };
            return report.stores.push(StoreItem {
                path: dir.to_path_buf(),
                outcome: Outcome::Kept(why.into()),
                bytes: 0,
            });
        }
        Ok(_) => {}
    }
    let entries = match scan(dir, SystemTime::now()) {
        Ok(e) => e,
        Err(e) => return report.warnings.push(format!("{}: {e}", dir.display())),
    };
    for entry in entries {
        let (outcome, bytes) = match decide(&entry, existing, min_age) {
            Decision::Existing => {
                report.existing += 1;
                continue;
            }
            Decision::Keep(why) => {
                held.insert(entry.name.to_lowercase());
                (Outcome::Kept(why), 0)
            }
            Decision::Leftover => {
                let bytes = disk_usage(&entry.path);
                match report.dry_run {
                    true => (Outcome::Finished, bytes),
                    false => match remove_leftover(dir, &entry) {
                        Ok(()) => (Outcome::Finished, bytes),
                        Err(e) => (Outcome::Failed(e.to_string()), 0),
                    },
                }
            }
            Decision::Remove => {
                let (outcome, bytes) = remove_if_gone(dir, &entry, records, report.dry_run).await;
                if outcome != Outcome::Removed {
                    held.insert(entry.name.to_lowercase());
                }
                (outcome, bytes)
            }
        };
        report.stores.push(StoreItem {
            path: entry.path,
            outcome,
            bytes,
        });
    }
}

/// Removes the store of `entry` unless a live `Store` holds its lock or its container record
/// exists by now (both checked while holding the lock, so a shim opening it meanwhile keeps it).
async fn remove_if_gone(
    dir: &Path,
    entry: &Entry,
    records: &impl Records,
    dry_run: bool,
) -> (Outcome, u64) {
    // Held from the record's check to the rename: a shim creating a store waits for it.
    let ns_lock = match lock_namespace(dir) {
        Ok(l) => l,
        Err(e) => {
            return (
                Outcome::Failed(format!("the lock of {}: {e}", dir.display())),
                0,
            )
        }
    };
    let _lock = match try_lock(&entry.path) {
        Ok(Lock::Held) => {
            return (
                Outcome::Kept("in use (a shim or crabctl holds its lock)".into()),
                0,
            )
        }
        Ok(lock) => lock,
        Err(e) => return (Outcome::Failed(format!("its lock: {e}")), 0),
    };
    match records.exists(&entry.name).await {
        Ok(false) => {}
        Ok(true) => return (Outcome::Kept("its container exists now".into()), 0),
        Err(e) => return (Outcome::Failed(e.to_string()), 0),
    }
    let bytes = disk_usage(&entry.path);
    if dry_run {
        return (Outcome::Removed, bytes);
    }
    // Its figures go on counting in `crabctl metrics`.
    if let Err(e) = crab_shim::metrics::fold_pruned_store(dir, &entry.name) {
        return (
            Outcome::Failed(format!(
                "cannot keep its figures for crabctl metrics in {}: {e}",
                dir.join(crab_shim::metrics::PRUNED_FILE).display()
            )),
            0,
        );
    }
    match remove_store(dir, &entry.name, ns_lock) {
        Ok(()) => (Outcome::Removed, bytes),
        Err(e) => (Outcome::Failed(e.to_string()), 0),
    }
}

impl Ctl {
    /// Prunes the namespace of this `Ctl`, or every namespace of containerd (`all_namespaces`).
    /// With `dry_run` nothing is removed; the report says what would be.
    pub async fn prune(&self, all_namespaces: bool, dry_run: bool) -> Result<Pruned> {
        let mut report = Pruned {
            dry_run,
            namespaces: match all_namespaces {
                true => self.client.namespaces().await?,
                false => vec![self.namespace().to_string()],
            },
            ..Default::default()
        };
        report.namespaces.sort();
        let mut records = HashMap::new();
        for ns in &report.namespaces {
            let client = self.client.in_namespace(ns);
            records.insert(ns.clone(), client.containers_matching(Vec::new()).await?);
        }
        report.state_dirs = state_dirs(
            self.config.as_deref(),
            records.values().flatten(),
            &mut report.warnings,
        )?;
        for ns in report.namespaces.clone() {
            let client = self.client.in_namespace(&ns);
            let records = &records[&ns];
            let existing: HashSet<String> = records.iter().map(|c| c.id.clone()).collect();
            let mut held = HashSet::new();
            for state_dir in report.state_dirs.clone() {
                // Where `sandbox::sandbox_dir` puts the namespace's stores.
                let dir = state_dir.join(&ns);
                prune_dir(&dir, &existing, &client, MIN_AGE, &mut report, &mut held).await;
            }
            let images: Vec<String> = client
                .images(vec![format!(
                    "name~=\"^{}\"",
                    INTERNAL_PREFIX.replace('.', "[.]")
                )])
                .await?
                .into_iter()
                .map(|i| i.name)
                .collect();
            let records: Vec<(String, String)> = records
                .iter()
                .map(|c| (c.id.clone(), c.image.clone()))
                .collect();
            for (name, keep) in select_images(&ns, &images, &records, &held) {
                let outcome = match keep {
                    Some(why) => Outcome::Kept(why),
                    None if dry_run => Outcome::Removed,
                    None => match client.delete_image(&name).await {
                        Ok(()) => Outcome::Removed,
                        Err(e) => Outcome::Failed(e.to_string()),
                    },
                };
                report.images.push(ImageItem { name, outcome });
            }
        }
        for state_dir in report.state_dirs.clone() {
            let path = state_dir.join(crab_shim::restore::cache::CACHE_DIR);
            if fs::symlink_metadata(&path)
                .map(|m| m.is_dir())
                .unwrap_or(false)
            {
                let cache = crab_shim::restore::cache::RestoreCache::new(&path, 0);
                let (entries, bytes) = tokio::task::spawn_blocking(move || cache.clear(dry_run))
                    .await
                    .unwrap_or_default();
                report.restore_caches.push(CacheItem {
                    path,
                    entries,
                    bytes,
                });
            }
        }
        Ok(report)
    }
}

/// `12.3 MB`: sizes for people.
fn human_size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..=999 => format!("{bytes} B"),
        1_000..=999_999 => format!("{:.1} kB", b / 1e3),
        1_000_000..=999_999_999 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.2} GB", b / 1e9),
    }
}

/// What `crabctl prune` prints: one line per store, leftover, other entry and image, then totals.
impl fmt::Display for Pruned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dirs: Vec<String> = self
            .state_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        writeln!(
            f,
            "namespaces: {}; state dirs: {}",
            self.namespaces.join(", "),
            dirs.join(", ")
        )?;
        let (removed, finished) = match self.dry_run {
            true => ("would remove", "would finish"),
            false => ("removed", "finished"),
        };
        for s in &self.stores {
            let path = s.path.display();
            match &s.outcome {
                Outcome::Removed => {
                    writeln!(f, "{removed} store {path} ({})", human_size(s.bytes))?
                }
                Outcome::Finished => writeln!(
                    f,
                    "{finished} {path} ({}, left by an interrupted prune)",
                    human_size(s.bytes)
                )?,
                Outcome::Kept(why) => writeln!(f, "kept {path}: {why}")?,
                Outcome::Failed(e) => writeln!(f, "FAILED to remove {path}: {e}")?,
            }
        }
        for i in &self.images {
            match &i.outcome {
                Outcome::Removed | Outcome::Finished => writeln!(f, "{removed} image {}", i.name)?,
                Outcome::Kept(why) => writeln!(f, "kept image {}: {why}", i.name)?,
                Outcome::Failed(e) => writeln!(f, "FAILED to remove image {}: {e}", i.name)?,
            }
        }
        for c in &self.restore_caches {
            writeln!(
                f,
                "{removed} {} entries of the restore cache {} ({})",
                c.entries,
                c.path.display(),
                human_size(c.bytes)
            )?;
        }
        for w in &self.warnings {
            writeln!(f, "warning: {w}")?;
        }
        let gone = |o: &Outcome| matches!(o, Outcome::Removed | Outcome::Finished);
        let stores: Vec<&StoreItem> = self.stores.iter().filter(|s| gone(&s.outcome)).collect();
        let bytes: u64 = stores.iter().map(|s| s.bytes).sum();
        let images = self.images.iter().filter(|i| gone(&i.outcome)).count();
        let kept = self.stores.len() - stores.len();
        write!(
            f,
            "total: {removed} {} store directories ({}) and {images} images; kept {} stores of \
             existing containers and {kept} other entries",
            stores.len(),
            human_size(bytes),
            self.existing
        )?;
        if self.failures() > 0 {
            write!(f, "; {} FAILED", self.failures())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use containerd_client::services::v1::container::Runtime;

    use super::*;

    fn entry(name: &str, kind: EntryKind, unchanged_for: u64) -> Entry {
        Entry {
            name: name.into(),
            path: PathBuf::from("/ns").join(name),
            kind,
            unchanged_for: Duration::from_secs(unchanged_for),
        }
    }

    fn set(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn only_old_stores_of_containers_without_a_record_are_removed() {
        let store = EntryKind::Dir { store: true };
        let existing = set(&["alive", "linked"]);
        let d = |e: Entry| decide(&e, &existing, MIN_AGE);
        assert_eq!(d(entry("gone", store, 61)), Decision::Remove);
        assert_eq!(d(entry("alive", store, 3600)), Decision::Existing);
        // Whatever an existing container's entry is, it is its own business.
        assert_eq!(
            d(entry("linked", EntryKind::Symlink, 3600)),
            Decision::Existing
        );
        assert_eq!(
            d(entry(
                ".prune-gone-1-2-3.tmp",
                EntryKind::Dir { store: false },
                0
            )),
            Decision::Leftover
        );
        // A store a shim set aside for a new container with the same id.
        assert_eq!(
            d(entry(".replaced-alive-1764600000-42", store, 0)),
            Decision::Leftover
        );
        let kept = |e: Entry, needle: &str| match d(e) {
            Decision::Keep(why) => assert!(why.contains(needle), "{why}"),
            other => panic!("{other:?}, not kept for {needle}"),
        };
        kept(entry("fresh", store, 59), "too new");
        kept(entry("fresh", store, 0), "too new");
        kept(entry("link", EntryKind::Symlink, 3600), "symlink");
        kept(entry(".prune-x.tmp", EntryKind::Symlink, 3600), "symlink");
        kept(
            entry(".prune-x.tmp", EntryKind::Other, 3600),
            "not a directory",
        );
        kept(
            entry("notes.txt", EntryKind::Other, 3600),
            "not a directory",
        );
        kept(
            entry("plain", EntryKind::Dir { store: false }, 3600),
            "not a crab store",
        );
        for name in [".hidden", "a/b", "-x", "x-", "sp ace", "\u{fffd}"] {
            kept(entry(name, store, 3600), "not a container id");
        }
    }

    #[test]
    fn internal_images_name_their_container() {
        let owner = |n| internal_image_owner("Crab-Test", n);
        assert_eq!(
            owner("crab.local/checkpoint/crab-test/c1:3").as_deref(),
            Some("c1")
        );
        assert_eq!(
            owner("crab.local/checkpoint/crab-test/it.sandbox-x:12").as_deref(),
            Some("it.sandbox-x")
        );
        for not in [
            "crab.local/checkpoint/other/c1:3",
            "crab.local/checkpoint/crab-test/c1",
            "crab.local/checkpoint/crab-test/c1:latest",
            "crab.local/checkpoint/crab-test/:3",
            "crab.local/checkpoint/crab-test/a/b:3",
            "localhost/crab-test/c1:3",
        ] {
            assert_eq!(owner(not), None, "{not}");
        }
    }

    #[test]
    fn images_of_gone_containers_go_unless_used() {
        let images: Vec<String> = [
            "crab.local/checkpoint/ns/gone:1",
            "crab.local/checkpoint/ns/gone:2",
            "crab.local/checkpoint/ns/forked:4",
            "crab.local/checkpoint/ns/alive:1",
            "crab.local/checkpoint/ns/held:1",
            "crab.local/checkpoint/other/gone:1",
            "docker.io/library/busybox:latest",
        ]
        .map(String::from)
        .to_vec();
        let records = [
            ("Alive", "docker.io/library/busybox:latest"),
            ("forked-fork-1", "crab.local/checkpoint/ns/forked:4"),
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()));
        let got = select_images("ns", &images, &records, &set(&["held"]));
        let names: Vec<(&str, Option<&str>)> = got
            .iter()
            .map(|(n, w)| (n.as_str(), w.as_deref()))
            .collect();
        assert_eq!(
            names,
            [
                (
                    "crab.local/checkpoint/ns/forked:4",
                    Some("used by container forked-fork-1")
                ),
                ("crab.local/checkpoint/ns/gone:1", None),
                ("crab.local/checkpoint/ns/gone:2", None),
                (
                    "crab.local/checkpoint/ns/held:1",
                    Some("its container's store (held) was kept")
                ),
            ]
        );
    }

    /// `runtimeoptions.v1.Options` with an inline config (field 3), as containerd stores it.
    fn record(id: &str, runtime: &str, config_body: &str) -> Container {
        let mut value = vec![0x1a, config_body.len() as u8];
        value.extend_from_slice(config_body.as_bytes());
        Container {
            id: id.into(),
            runtime: Some(Runtime {
                name: runtime.into(),
                options: Some(prost_types::Any {
                    type_url: format!(
                        "type.googleapis.com/{}",
                        crab_runtime_config::RUNTIME_OPTIONS_TYPE_URL
                    ),
                    value,
                }),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn state_dirs_come_from_the_configs_of_existing_crab_containers() {
        let crab = crab_shim::RUNTIME_ID;
        let records = [
            record("a", crab, "[store]\nstate_dir = \"/srv/a\"\n"),
            record("b", crab, "[store]\nstate_dir = \"/srv/a\"\n"),
            record("c", crab, "[store]\nstate_dir = \"/srv/c\"\n"),
            record(
                "runc",
                "io.containerd.runc.v2",
                "[store]\nstate_dir = \"/srv/runc\"\n",
            ),
            record("bad", crab, "[store]\nstate_dir = \"relative\"\n"),
        ];
        let mut warnings = Vec::new();
        let dirs = state_dirs(None, &records, &mut warnings).unwrap();
        let (default, _) = Config::load_or_default(None).unwrap();
        let mut want: Vec<PathBuf> =
            vec!["/srv/a".into(), "/srv/c".into(), default.store.state_dir];
        want.sort();
        assert_eq!(dirs, want);
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("container bad: "), "{warnings:?}");

        // --config alone decides.
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("crab.toml");
        fs::write(&config, "[store]\nstate_dir = \"/srv/explicit\"\n").unwrap();
        let dirs = state_dirs(Some(&config), &records, &mut Vec::new()).unwrap();
        assert_eq!(dirs, [PathBuf::from("/srv/explicit")]);
        assert!(state_dirs(
            Some(&dir.path().join("missing.toml")),
            &records,
            &mut Vec::new()
        )
        .is_err());
    }

    /// Containers.Get, faked.
    struct FakeRecords(HashSet<String>);

    impl Records for FakeRecords {
        async fn exists(&self, id: &str) -> Result<bool> {
            Ok(self.0.contains(id))
        }
    }

    fn make_store(root: &Path) {
        for d in ["checkpoints", "blobs/sha256", "proc", "chunks"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        fs::write(root.join(".lock"), b"").unwrap();
        fs::write(root.join("checkpoints/000001.json"), b"{}").unwrap();
        fs::write(root.join("blobs/sha256/ab"), vec![7u8; 20_000]).unwrap();
    }

    async fn run(dir: &Path, dry_run: bool, min_age: Duration) -> (Pruned, HashSet<String>) {
        let mut report = Pruned {
            dry_run,
            ..Default::default()
        };
        let mut held = HashSet::new();
        let existing = set(&["alive"]);
        let records = FakeRecords(set(&["alive", "recreated"]));
        prune_dir(dir, &existing, &records, min_age, &mut report, &mut held).await;
        (report, held)
    }

    fn outcomes(report: &Pruned) -> Vec<(String, Outcome)> {
        report
            .stores
            .iter()
            .map(|s| {
                (
                    s.path.file_name().unwrap().to_string_lossy().into_owned(),
                    s.outcome.clone(),
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn prune_dir_removes_gone_stores_and_leaves_everything_else() {
        let tmp = tempfile::tempdir().unwrap();
        let ns = tmp.path().join("state/ns");
        for id in ["gone", "alive", "recreated", "locked"] {
            make_store(&ns.join(id));
        }
        fs::create_dir_all(ns.join("plain/data")).unwrap();
        fs::write(ns.join("notes.txt"), b"x").unwrap();
        let outside = tmp.path().join("outside");
        make_store(&outside);
        symlink(&outside, ns.join("link")).unwrap();
        fs::create_dir_all(ns.join(".prune-old-1-2-3.tmp/blobs")).unwrap();
        fs::write(ns.join(".prune-old-1-2-3.tmp/blobs/x"), vec![1u8; 5000]).unwrap();
        // A live Store holds this one's lock.
        let lock = File::open(ns.join("locked/.lock")).unwrap();
        assert_eq!(
            // SAFETY: flock on a descriptor `lock` owns; it touches no memory.
            unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );

        // Everything was just made: too new, except what is not a store anyway.
        let (report, _) = run(&ns, false, MIN_AGE).await;
        let gone = report
            .stores
            .iter()
            .find(|s| s.path.ends_with("gone"))
            .unwrap();
        assert!(
            matches!(&gone.outcome, Outcome::Kept(why) if why.starts_with("too new")),
            "{report}"
        );
        assert!(ns.join("gone").is_dir());
        // (A leftover is finished whatever its age.)
        fs::create_dir_all(ns.join(".prune-old-1-2-3.tmp/blobs")).unwrap();
        fs::write(ns.join(".prune-old-1-2-3.tmp/blobs/x"), vec![1u8; 5000]).unwrap();

        let kept = |why: &str| Outcome::Kept(why.into());
        let expected = |removed: Outcome, finished: Outcome| {
            vec![
                (".prune-old-1-2-3.tmp".to_string(), finished),
                ("gone".into(), removed),
                ("link".into(), kept("a symlink (not followed)")),
                (
                    "locked".into(),
                    kept("in use (a shim or crabctl holds its lock)"),
                ),
                ("notes.txt".into(), kept("not a directory")),
                (
                    "plain".into(),
                    kept("not a crab store (no checkpoints/ directory)"),
                ),
                ("recreated".into(), kept("its container exists now")),
            ]
        };
        let (dry, held) = run(&ns, true, Duration::ZERO).await;
        assert_eq!(
            outcomes(&dry),
            expected(Outcome::Removed, Outcome::Finished)
        );
        assert_eq!(dry.existing, 1);
        assert_eq!(
            held,
            set(&["link", "locked", "notes.txt", "plain", "recreated"])
        );
        let gone_bytes = dry.stores[1].bytes;
        assert!(gone_bytes >= 20_000, "{dry}");
        assert!(dry.stores[0].bytes >= 5000, "{dry}");
        let text = dry.to_string();
        assert!(
            text.contains(&format!("would remove store {}", ns.join("gone").display())),
            "{text}"
        );
        assert!(
            text.contains("total: would remove 2 store directories"),
            "{text}"
        );
        assert!(
            ns.join("gone").is_dir() && ns.join(".prune-old-1-2-3.tmp").is_dir(),
            "dry run removed something"
        );

        let (real, _) = run(&ns, false, Duration::ZERO).await;
        assert_eq!(
            outcomes(&real),
            expected(Outcome::Removed, Outcome::Finished)
        );
        assert_eq!(real.stores[1].bytes, gone_bytes);
        assert_eq!(real.failures(), 0);
        let mut left: Vec<String> = fs::read_dir(&ns)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        // The figures of what went stay for `crabctl metrics`.
        assert_eq!(
            left,
            [
                crab_shim::metrics::PRUNED_FILE,
                "alive",
                "link",
                "locked",
                "notes.txt",
                "plain",
                "recreated"
            ]
        );
        crab_shim::metrics::Pruned::load(&ns).unwrap();
        assert!(
            outside.join("checkpoints/000001.json").is_file(),
            "the symlink was followed"
        );
        assert!(
            real.to_string()
                .contains("total: removed 2 store directories"),
            "{real}"
        );

        // Once the lock is free, that store goes too; a second run finds nothing else.
        drop(lock);
        let (again, _) = run(&ns, false, Duration::ZERO).await;
        let removed: Vec<_> = again
            .stores
            .iter()
            .filter(|s| s.outcome == Outcome::Removed)
            .collect();
        assert_eq!(removed.len(), 1, "{again}");
        assert!(!ns.join("locked").exists());
    }

    #[tokio::test]
    async fn a_symlinked_or_missing_namespace_dir_is_not_entered() {
        let tmp = tempfile::tempdir().unwrap();
        let (report, _) = run(&tmp.path().join("missing"), false, Duration::ZERO).await;
        assert!(report.stores.is_empty() && report.warnings.is_empty());
        make_store(&tmp.path().join("real/gone"));
        symlink(tmp.path().join("real"), tmp.path().join("ns")).unwrap();
        let (report, _) = run(&tmp.path().join("ns"), false, Duration::ZERO).await;
        assert_eq!(
            outcomes(&report),
            [(
                "ns".to_string(),
                Outcome::Kept("a symlink (not followed)".into())
            )]
        );
        assert!(tmp.path().join("real/gone/checkpoints").is_dir());
    }

    #[test]
    fn sizes_for_people() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(4096), "4.1 kB");
        assert_eq!(human_size(12_345_678), "12.3 MB");
        assert_eq!(human_size(2_500_000_000), "2.50 GB");
    }
}

//! The host's cache of verified CRIU images: N restores of one checkpoint (`crabctl fork
//! --count N`, a rollback repeated, `ctr run` of one image N times) read, hash and copy its
//! CRIU image once, and deduplicate its pages once for their stores.
//!
//! ```text
//! <root>/entries/<key>/image/        the CRIU image, each file verified against a signed statement
//! <root>/entries/<key>/entry.json    what is there: each file's size, the boot it was made in
//! <root>/entries/<key>/store/        the same image deduplicated (proc/: recipes and the other
//!                                    files; chunks/: one pack), made at the first import into a store
//! <root>/locks/<key>                 flock: one restore at a time builds or uses an entry
//! <root>/tmp/                        entries being built, and entries being removed
//! ```
//!
//! `<root>` is `<store.state_dir>/.restore-cache` (root's, `0700`, outside every rootfs and
//! bundle: no container can reach it). An entry's key is the sha256 of the file list of the
//! statement a trusted key signed (each file's name, size and sha256), and an entry appears
//! only by a rename after every one of its files was read, hashed and found equal to that list
//! (the restore's own verification, [`super::intake::take_from_rootfs`]): whoever finds an
//! entry under a key finds the bytes the signature vouches for. Nothing under `<root>` is
//! written in place: entries are built in `tmp/` and renamed, removed by a rename into `tmp/`
//! first, and never changed after they appear.
//!
//! A restore gets its own directory of hard links to the entry's files (a copy where the
//! restore directory is on another filesystem): CRIU reads them, and the one file CRIU writes
//! into the image directory while restoring ([`WRITTEN_BY_RESTORE`]) is always a copy, so no
//! restore writes to a cached file. No restore may pass `--auto-dedup` (which punches holes in
//! the pages files it reads). A link keeps its file alive when the entry is evicted meanwhile.
//!
//! The locks only keep N concurrent restores from doing the same work N times; correctness
//! comes from the renames (an entry is complete or absent). A holder that died releases its
//! lock with its process; a lock not had within [`LOCK_WAIT`] makes the restore go on without
//! the cache. Entries from an earlier boot are not trusted (their files may not have reached
//! the disk before a crash) and are rebuilt. The cache holds at most `max_bytes`; the least
//! recently used entries are removed first, and an image larger than the bound is not cached.

use std::{
    collections::{BTreeMap, HashSet},
    fs::{self, File, OpenOptions},
    io,
    os::{
        fd::AsRawFd,
        unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt},
    },
    path::{Component, Path, PathBuf},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::checkpoint::{pages, provenance::FileDigest};

/// The cache's directory in `store.state_dir` (a dot: no namespace is named so).
pub const CACHE_DIR: &str = ".restore-cache";
/// The files CRIU writes into the image directory while it restores (its statistics): never
/// linked to a cached file, always copied.
pub const WRITTEN_BY_RESTORE: &[&str] = &["stats-restore"];
/// How long a restore waits for another one that builds the same entry.
pub const LOCK_WAIT: Duration = Duration::from_secs(120);
const ENTRY_FORMAT: u32 = 1;
const ENTRY_FILE: &str = "entry.json";
const STORE_FILE: &str = "store.json";
const KEY_DOMAIN: &[u8] = b"crab restore cache v1\n";

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("restore cache: {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("restore cache: {0}")]
    Bad(String),
    #[error("restore cache: deduplicating: {0}")]
    Pages(#[from] pages::PagesError),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CacheError + 'a {
    move |source| CacheError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Where a restore's image came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// An entry was there: nothing of the image in the rootfs was read.
    Hit,
    /// This restore read and verified the image, and it entered the cache.
    Built,
}

/// What [`RestoreCache::provide`] put into a restore's directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Provided {
    pub source: Source,
    /// Files hard-linked to the cached ones, and files copied.
    pub linked: usize,
    pub copied: usize,
}

/// What [`RestoreCache::import`] put into a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Imported {
    /// The image's size without deduplication.
    pub bytes_logical: u64,
    /// What the image costs a store that held none of its pages: its files, recipes, pack and
    /// index (as [`pages::dedup`] counts it).
    pub bytes_stored: u64,
    /// Whether the deduplicated form was made by this import (else it was there).
    pub built: bool,
}

/// `entry.json`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryMeta {
    format: u32,
    /// `/proc/sys/kernel/random/boot_id` when the entry was made.
    boot_id: String,
    /// Each file of `image/` and its size.
    files: BTreeMap<String, u64>,
}

/// `store/store.json`: the deduplicated form's figures.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoreMeta {
    bytes_logical: u64,
    bytes_stored: u64,
}

/// The cache at a root, bounded to `max_bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreCache {
    root: PathBuf,
    max_bytes: u64,
}

fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn unique() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!("{}-{nanos}", std::process::id())
}

/// A name of the statement's file list as one plain path component (a signed statement is
/// trusted, but a name is still never a path).
fn plain_name(name: &str) -> Result<&str, CacheError> {
    let mut c = Path::new(name).components();
    match (c.next(), c.next()) {
        (Some(Component::Normal(n)), None) if n == name => Ok(name),
        _ => Err(CacheError::Bad(format!(
            "{name:?} is not a file name of a CRIU image"
        ))),
    }
}

/// `src` as `dst`: a hard link, or a copy where a link cannot be made (another filesystem, too
/// many links) or must not be ([`WRITTEN_BY_RESTORE`]). Returns whether it linked.
fn link_or_copy(src: &Path, dst: &Path, name: &str) -> Result<bool, CacheError> {
    if !WRITTEN_BY_RESTORE.contains(&name) {
        match fs::hard_link(src, dst) {
            Ok(()) => return Ok(true),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV | libc::EMLINK | libc::EPERM)
                ) => {}
            Err(e) => return Err(io_err("linking", dst)(e)),
        }
    }
    fs::copy(src, dst).map_err(io_err("copying into", dst))?;
    Ok(false)
}

/// Sizes of the regular files directly in `dir`, by name (`None` if anything else is there).
fn listing(dir: &Path) -> Option<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for e in fs::read_dir(dir).ok()? {
        let e = e.ok()?;
        let md = fs::symlink_metadata(e.path()).ok()?;
        if !md.is_file() {
            return None;
        }
        out.insert(e.file_name().into_string().ok()?, md.len());
    }
    Some(out)
}

/// Bytes of the files under `dir`, each inode once.
fn disk_bytes(dir: &Path, seen: &mut HashSet<(u64, u64)>) -> u64 {
    let mut total = 0;
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(md) = fs::symlink_metadata(e.path()) else {
            continue;
        };
        if md.is_dir() {
            total += disk_bytes(&e.path(), seen);
        } else if seen.insert((md.dev(), md.ino())) {
            total += md.len();
        }
    }
    total
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// What a build made, and the entry to publish once it is verified.
pub type Built<T> = (T, Publish);
/// What [`RestoreCache::provide`] did: how the image was put in place, and what was built.
pub type Provision<T> = (Provided, Option<Built<T>>);

/// An entry [`RestoreCache::provide`] built, not in the cache yet: [`Publish::commit`] makes it
/// appear (by a rename, whole), dropping it removes it. Holds the entry's lock meanwhile.
#[derive(Debug)]
pub struct Publish {
    cache: RestoreCache,
    key: String,
    tmp: PathBuf,
    /// The signed files' names and sizes.
    wanted: BTreeMap<String, u64>,
    lock: Option<File>,
    done: bool,
}

impl Publish {
    /// Puts the entry into the cache: call only once every file of it was verified.
    pub fn commit(mut self) -> Result<(), CacheError> {
        self.done = true;
        let made = (|| -> Result<(), CacheError> {
            let meta = EntryMeta {
                format: ENTRY_FORMAT,
                boot_id: boot_id(),
                files: self.wanted.clone(),
            };
            let path = self.tmp.join(ENTRY_FILE);
            fs::write(
                &path,
                serde_json::to_vec(&meta).expect("entry meta serializes"),
            )
            .map_err(io_err("writing", &path))?;
            let entry = self.cache.entry(&self.key);
            fs::rename(&self.tmp, &entry).map_err(io_err("publishing", &entry))
        })();
        if let Err(e) = made {
            let _ = fs::remove_dir_all(&self.tmp);
            return Err(e);
        }
        drop(self.lock.take());
        self.cache.evict(&self.key);
        Ok(())
    }
}

impl Drop for Publish {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

impl RestoreCache {
    pub fn new(root: &Path, max_bytes: u64) -> RestoreCache {
        RestoreCache {
            root: root.to_path_buf(),
            max_bytes,
        }
    }

    /// The cache `config` asks for (`None`: `[restore] cache_mib = 0`).
    pub fn from_config(config: &crab_runtime_config::Config) -> Option<RestoreCache> {
        (config.restore.cache_mib > 0).then(|| {
            RestoreCache::new(
                &config.store.state_dir.join(CACHE_DIR),
                config.restore.cache_mib.saturating_mul(1 << 20),
            )
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The key of a statement's file list.
    pub fn key(files: &BTreeMap<String, FileDigest>) -> String {
        let mut h = Sha256::new();
        h.update(KEY_DOMAIN);
        h.update(serde_json::to_vec(files).expect("a file list serializes"));
        pages::hex(&h.finalize())
    }

    fn entry(&self, key: &str) -> PathBuf {
        self.root.join("entries").join(key)
    }

    fn dirs(&self) -> Result<(), CacheError> {
        let mut b = fs::DirBuilder::new();
        b.recursive(true).mode(0o700);
        for d in ["entries", "locks", "tmp"] {
            let p = self.root.join(d);
            b.create(&p).map_err(io_err("creating", &p))?;
        }
        Ok(())
    }

    /// The lock of `key`, waited for up to `wait` (`None` after that).
    fn lock(&self, key: &str, wait: Duration) -> Result<Option<File>, CacheError> {
        let path = self.root.join("locks").join(key);
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .mode(0o600)
            .open(&path)
            .map_err(io_err("opening", &path))?;
        let deadline = Instant::now() + wait;
        loop {
            // SAFETY: flock on a descriptor we own; released when `file` is closed.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(Some(file));
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(io_err("locking", &path)(e));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A new directory under `tmp/`.
    fn tmp_dir(&self, key: &str) -> Result<PathBuf, CacheError> {
        let p = self.root.join("tmp").join(format!("{key}-{}", unique()));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&p)
            .map_err(io_err("creating", &p))?;
        Ok(p)
    }

    /// Removes `dir` (an entry, or part of one): renamed into `tmp/` first, so that it is gone
    /// from its place at once, whole.
    fn discard(&self, dir: &Path) {
        let gone = self.root.join("tmp").join(format!("gone-{}", unique()));
        match fs::rename(dir, &gone) {
            Ok(()) => {
                let _ = fs::remove_dir_all(&gone);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => log::warn!("restore cache: cannot remove {}: {e}", dir.display()),
        }
    }

    /// Whether `entry` is complete, of this boot, and holds exactly `files` (names and sizes;
    /// their digests were checked when it was made).
    fn valid(entry: &Path, files: &BTreeMap<String, FileDigest>) -> bool {
        let Ok(text) = fs::read(entry.join(ENTRY_FILE)) else {
            return false;
        };
        let Ok(meta) = serde_json::from_slice::<EntryMeta>(&text) else {
            return false;
        };
        let wanted: BTreeMap<String, u64> =
            files.iter().map(|(n, d)| (n.clone(), d.size)).collect();
        meta.format == ENTRY_FORMAT
            && meta.boot_id == boot_id()
            && meta.files == wanted
            && listing(&entry.join("image")).is_some_and(|found| {
                // CRIU never writes into a cached directory, but nothing else may be there.
                found == wanted
            })
    }

    /// Marks `entry` as used now (eviction removes the least recently used first).
    fn touch(entry: &Path) {
        if let Ok(f) = OpenOptions::new().write(true).open(entry.join(ENTRY_FILE)) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    /// Fills `dest` (made anew) with the files of `src` that `files` names.
    fn link_out(
        src: &Path,
        files: &BTreeMap<String, FileDigest>,
        dest: &Path,
    ) -> Result<(usize, usize), CacheError> {
        match fs::remove_dir_all(dest) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("removing", dest)(e)),
        }
        fs::create_dir_all(dest).map_err(io_err("creating", dest))?;
        let (mut linked, mut copied) = (0, 0);
        for name in files.keys() {
            let name = plain_name(name)?;
            if link_or_copy(&src.join(name), &dest.join(name), name)? {
                linked += 1;
            } else {
                copied += 1;
            }
        }
        Ok((linked, copied))
    }

    /// Puts the CRIU image whose verified file list is `files` into `dest` (made anew): linked
    /// from the cache when an entry for it is there, else made by `build`, which must copy the
    /// image into the directory it is given and verify every file against `files` (its error
    /// is returned as it is, and nothing enters the cache). `Ok(None)`: the cache was not used
    /// (the image is larger than the cache, or another restore held the entry for
    /// [`LOCK_WAIT`]); the caller copies and verifies on its own.
    ///
    /// What `build` made enters the cache only through the returned [`Publish`], once every
    /// file is known to be the signed one (at once, or when the page files' deferred
    /// verification passed): until then the entry's lock is held, so other restores of the same
    /// image wait for it rather than build it again; dropped unpublished, nothing enters.
    pub fn provide<T, E: From<CacheError>>(
        &self,
        files: &BTreeMap<String, FileDigest>,
        dest: &Path,
        build: impl FnOnce(&Path) -> Result<T, E>,
    ) -> Result<Option<Provision<T>>, E> {
        let total = files.values().fold(0u64, |a, d| a.saturating_add(d.size));
        if total > self.max_bytes {
            return Ok(None);
        }
        self.dirs()?;
        let key = Self::key(files);
        let Some(lock) = self.lock(&key, LOCK_WAIT)? else {
            log::warn!(
                "restore cache: entry {key} stayed locked for {LOCK_WAIT:?}: restoring without the cache"
            );
            return Ok(None);
        };
        let entry = self.entry(&key);
        if entry.exists() {
            if Self::valid(&entry, files) {
                Self::touch(&entry);
                let (linked, copied) = Self::link_out(&entry.join("image"), files, dest)?;
                return Ok(Some((
                    Provided {
                        source: Source::Hit,
                        linked,
                        copied,
                    },
                    None,
                )));
            }
            self.discard(&entry);
        }
        let tmp = self.tmp_dir(&key)?;
        let built = match build(&tmp.join("image")) {
            Ok(b) => b,
            Err(e) => {
                let _ = fs::remove_dir_all(&tmp);
                return Err(e);
            }
        };
        let publish = Publish {
            cache: self.clone(),
            key,
            tmp,
            wanted: files.iter().map(|(n, d)| (n.clone(), d.size)).collect(),
            lock: Some(lock),
            done: false,
        };
        if listing(&publish.tmp.join("image")).as_ref() != Some(&publish.wanted) {
            return Err(CacheError::Bad(
                "the verified image does not hold exactly the signed files".into(),
            )
            .into());
        }
        let (linked, copied) = Self::link_out(&publish.tmp.join("image"), files, dest)?;
        Ok(Some((
            Provided {
                source: Source::Built,
                linked,
                copied,
            },
            Some((built, publish)),
        )))
    }

    /// Imports the cached image whose verified file list is `files` into a store: its
    /// deduplicated form (made from the cached image at the first import) linked into
    /// `proc_dir` (made anew) and its pack into `chunks`, then made durable. `Ok(None)`: no
    /// valid entry (the caller imports its own copy).
    pub fn import(
        &self,
        files: &BTreeMap<String, FileDigest>,
        proc_dir: &Path,
        chunks: &Path,
    ) -> Result<Option<Imported>, CacheError> {
        let key = Self::key(files);
        let entry = self.entry(&key);
        if !entry.exists() {
            return Ok(None);
        }
        let Some(lock) = self.lock(&key, LOCK_WAIT)? else {
            return Ok(None);
        };
        if !Self::valid(&entry, files) {
            return Ok(None);
        }
        Self::touch(&entry);
        let store = entry.join("store");
        let meta = match fs::read(store.join(STORE_FILE))
            .ok()
            .and_then(|t| serde_json::from_slice::<StoreMeta>(&t).ok())
        {
            Some(m) => (m, false),
            None => {
                if store.exists() {
                    self.discard(&store);
                }
                (self.build_store(&key, &entry, files)?, true)
            }
        };
        let (meta, built) = meta;
        fs::create_dir_all(chunks).map_err(io_err("creating", chunks))?;
        // The pack first: a recipe never names a chunk that is not there.
        let mut packs: Vec<_> = fs::read_dir(store.join("chunks"))
            .map_err(io_err("reading", &store))?
            .flatten()
            .collect();
        packs.sort_by_key(|e| e.file_name().to_string_lossy().ends_with(".idx"));
        for e in packs {
            let name = e.file_name();
            let dst = chunks.join(&name);
            if !dst.exists() {
                link_or_copy(&e.path(), &dst, &name.to_string_lossy())?;
            }
        }
        let proc_files: BTreeMap<String, FileDigest> = listing(&store.join("proc"))
            .ok_or_else(|| {
                CacheError::Bad(format!(
                    "{} holds something other than files",
                    store.display()
                ))
            })?
            .into_iter()
            .map(|(n, size)| {
                (
                    n,
                    FileDigest {
                        sha256: String::new(),
                        size,
                    },
                )
            })
            .collect();
        Self::link_out(&store.join("proc"), &proc_files, proc_dir)?;
        drop(lock);
        pages::sync(proc_dir, chunks)?;
        Ok(Some(Imported {
            bytes_logical: meta.bytes_logical,
            bytes_stored: meta.bytes_stored,
            built,
        }))
    }

    /// Makes `entry/store`: the cached image deduplicated into a pack of its own.
    fn build_store(
        &self,
        key: &str,
        entry: &Path,
        files: &BTreeMap<String, FileDigest>,
    ) -> Result<StoreMeta, CacheError> {
        let tmp = self.tmp_dir(key)?;
        let made = (|| -> Result<StoreMeta, CacheError> {
            let proc = tmp.join("proc");
            Self::link_out(&entry.join("image"), files, &proc)?;
            let stats = pages::dedup(&proc, &tmp.join("chunks"))?;
            let files_bytes: u64 = listing(&proc).unwrap_or_default().values().sum();
            let meta = StoreMeta {
                bytes_logical: files.values().map(|d| d.size).sum(),
                bytes_stored: files_bytes + stats.bytes_stored(),
            };
            let path = tmp.join(STORE_FILE);
            fs::write(
                &path,
                serde_json::to_vec(&meta).expect("store meta serializes"),
            )
            .map_err(io_err("writing", &path))?;
            let store = entry.join("store");
            fs::rename(&tmp, &store).map_err(io_err("publishing", &store))?;
            Ok(meta)
        })();
        if made.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        made
    }

    /// Removes every entry no restore is building or checking (`crabctl prune`): a restore
    /// that took one has its own links to the files already. Returns the entries and their
    /// bytes removed (`dry_run`: that would be).
    pub fn clear(&self, dry_run: bool) -> (usize, u64) {
        if !dry_run && self.dirs().is_err() {
            return (0, 0);
        }
        let mut seen = HashSet::new();
        let (mut entries, mut bytes) = (0, 0);
        for e in fs::read_dir(self.root.join("entries"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let Ok(key) = e.file_name().into_string() else {
                continue;
            };
            let size = disk_bytes(&e.path(), &mut seen);
            if dry_run {
                (entries, bytes) = (entries + 1, bytes + size);
                continue;
            }
            if let Ok(Some(_lock)) = self.lock(&key, Duration::ZERO) {
                self.discard(&self.entry(&key));
                (entries, bytes) = (entries + 1, bytes + size);
            }
        }
        (entries, bytes)
    }

    /// Removes the least recently used entries (never `keep`, nor one in use) until the cache
    /// holds at most its bound, and what dead builders left in `tmp/`.
    pub fn evict(&self, keep: &str) {
        for e in fs::read_dir(self.root.join("tmp"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            // `<key>-<pid>-<nanos>` or `gone-<pid>-<nanos>`.
            let pid = name.rsplit('-').nth(1).and_then(|p| p.parse().ok());
            if pid.is_some_and(|p: u32| !pid_alive(p)) {
                let _ = fs::remove_dir_all(e.path());
            }
        }
        let mut seen = HashSet::new();
        let mut entries: Vec<(SystemTime, String, u64)> = fs::read_dir(self.root.join("entries"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let key = e.file_name().into_string().ok()?;
                let used = fs::metadata(e.path().join(ENTRY_FILE))
                    .and_then(|m| m.modified())
                    .unwrap_or(UNIX_EPOCH);
                Some((used, key, disk_bytes(&e.path(), &mut seen)))
            })
            .collect();
        let mut total: u64 = entries.iter().map(|(_, _, b)| b).sum();
        entries.sort();
        for (_, key, bytes) in entries {
            if total <= self.max_bytes {
                break;
            }
            if key == keep {
                continue;
            }
            if let Ok(Some(_lock)) = self.lock(&key, Duration::ZERO) {
                self.discard(&self.entry(&key));
                total = total.saturating_sub(bytes);
                log::info!("restore cache: evicted {key} ({bytes} bytes)");
            }
        }
    }
}

/// Internals the root-only tests check.
#[doc(hidden)]
pub mod testing {
    /// The directory of the cached image of `key`.
    pub fn image_dir(cache: &super::RestoreCache, key: &str) -> std::path::PathBuf {
        cache.entry(key).join("image")
    }
}

#[cfg(test)]
impl RestoreCache {
    /// [`RestoreCache::provide`] with what it built published at once (a restore that verified
    /// every file while copying it).
    fn provide_now<T, E: From<CacheError>>(
        &self,
        files: &BTreeMap<String, FileDigest>,
        dest: &Path,
        build: impl FnOnce(&Path) -> Result<T, E>,
    ) -> Result<Option<(Provided, Option<T>)>, E> {
        let Some((p, built)) = self.provide(files, dest, build)? else {
            return Ok(None);
        };
        let built = match built {
            Some((t, publish)) => {
                publish.commit()?;
                Some(t)
            }
            None => None,
        };
        Ok(Some((p, built)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::provenance::HashingReader;
    use std::{io::Read, os::unix::fs::MetadataExt, sync::Arc};

    /// A CRIU-like image dir with a pages file of `pages` 4 KiB pages, and its file list.
    fn image(dir: &Path, pages: usize) -> BTreeMap<String, FileDigest> {
        fs::create_dir_all(dir).unwrap();
        fs::write(dir.join("inventory.img"), b"inventory").unwrap();
        fs::write(dir.join("pstree.img"), b"pstree").unwrap();
        let data: Vec<u8> = (0..pages * 4096).map(|i| (i / 4096 % 7) as u8).collect();
        fs::write(dir.join("pages-1.img"), data).unwrap();
        fs::write(dir.join("stats-restore"), b"old stats").unwrap();
        digests(dir)
    }

    fn digests(dir: &Path) -> BTreeMap<String, FileDigest> {
        let mut out = BTreeMap::new();
        for e in fs::read_dir(dir).unwrap().flatten() {
            if e.file_name().to_string_lossy().ends_with(".recipe") {
                continue;
            }
            let mut r = HashingReader::new(File::open(e.path()).unwrap());
            io::copy(&mut r, &mut io::sink()).unwrap();
            out.insert(e.file_name().into_string().unwrap(), r.finish());
        }
        out
    }

    /// A build as the restore does it: copy, hash, compare.
    fn build_from<'a>(
        src: &'a Path,
        files: &'a BTreeMap<String, FileDigest>,
        builds: &'a std::sync::atomic::AtomicUsize,
    ) -> impl FnOnce(&Path) -> Result<(), CacheError> + 'a {
        move |to: &Path| {
            builds.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            fs::create_dir_all(to).unwrap();
            for e in fs::read_dir(src).unwrap().flatten() {
                fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
            if &digests(to) != files {
                return Err(CacheError::Bad("altered".into()));
            }
            Ok(())
        }
    }

    fn read(p: &Path) -> Vec<u8> {
        let mut v = Vec::new();
        File::open(p).unwrap().read_to_end(&mut v).unwrap();
        v
    }

    #[test]
    fn a_second_restore_links_the_verified_copy_and_never_reads_the_image_again() {
        let t = tempfile::tempdir().unwrap();
        let files = image(&t.path().join("src"), 8);
        let cache = RestoreCache::new(&t.path().join("cache"), 1 << 30);
        let builds = std::sync::atomic::AtomicUsize::new(0);
        let (p, _) = cache
            .provide_now(
                &files,
                &t.path().join("r1"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap()
            .unwrap();
        assert_eq!(p.source, Source::Built);
        // The image in the rootfs changes after the first restore (same size): the second
        // restore gets the verified bytes, not these.
        fs::write(t.path().join("src/pages-1.img"), vec![0xaa; 8 * 4096]).unwrap();
        let (p, built) = cache
            .provide_now(
                &files,
                &t.path().join("r2"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap()
            .unwrap();
        assert_eq!((p.source, built), (Source::Hit, None));
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(digests(&t.path().join("r2")), files);
        // Linked, except what CRIU writes while restoring.
        let ino = |p: PathBuf| fs::metadata(p).unwrap().ino();
        let key = RestoreCache::key(&files);
        let cached = testing::image_dir(&cache, &key);
        assert_eq!(
            ino(t.path().join("r2/pages-1.img")),
            ino(cached.join("pages-1.img"))
        );
        assert_ne!(
            ino(t.path().join("r2/stats-restore")),
            ino(cached.join("stats-restore"))
        );
        assert_eq!((p.linked, p.copied), (3, 1));
        // CRIU's statistics written into one restore's directory change no other's.
        fs::write(t.path().join("r2/stats-restore"), b"new stats").unwrap();
        assert_eq!(read(&cached.join("stats-restore")), b"old stats");
        assert_eq!(read(&t.path().join("r1/stats-restore")), b"old stats");
    }

    /// `crabctl prune` clears the cache: a dry run counts, a real one removes every entry no
    /// restore holds, and a restore that already took an entry keeps its own links.
    #[test]
    fn clear_removes_every_entry_not_held_and_restores_keep_their_links() {
        let t = tempfile::tempdir().unwrap();
        let files = image(&t.path().join("src"), 8);
        let cache = RestoreCache::new(&t.path().join("cache"), 1 << 30);
        let builds = std::sync::atomic::AtomicUsize::new(0);
        cache
            .provide_now(
                &files,
                &t.path().join("r1"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap()
            .unwrap();
        let key = RestoreCache::key(&files);
        let (n, bytes) = cache.clear(true);
        assert_eq!(n, 1);
        assert!(bytes >= 8 * 4096, "{bytes}");
        assert!(cache.entry(&key).exists(), "a dry run removes nothing");
        // An entry being built or checked (its lock held) stays.
        let held = cache.lock(&key, Duration::ZERO).unwrap().unwrap();
        assert_eq!(cache.clear(false), (0, 0));
        drop(held);
        assert_eq!(cache.clear(false).0, 1);
        assert!(!cache.entry(&key).exists());
        let restored = fs::read(t.path().join("r1/pages-1.img")).unwrap();
        assert_eq!(
            restored.len(),
            8 * 4096,
            "the restore's own link still reads"
        );
    }

    #[test]
    fn an_image_that_fails_verification_never_enters_the_cache() {
        let t = tempfile::tempdir().unwrap();
        let files = image(&t.path().join("src"), 2);
        fs::write(t.path().join("src/pstree.img"), b"PSTREE").unwrap();
        let cache = RestoreCache::new(&t.path().join("cache"), 1 << 30);
        let builds = std::sync::atomic::AtomicUsize::new(0);
        let e = cache
            .provide_now(
                &files,
                &t.path().join("r1"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap_err();
        assert!(e.to_string().contains("altered"), "{e}");
        let key = RestoreCache::key(&files);
        assert!(!cache.entry(&key).exists());
        assert_eq!(fs::read_dir(cache.root.join("tmp")).unwrap().count(), 0);
        // Repaired, it restores (and is verified again: nothing was cached).
        fs::write(t.path().join("src/pstree.img"), b"pstree").unwrap();
        let (p, _) = cache
            .provide_now(
                &files,
                &t.path().join("r1"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap()
            .unwrap();
        assert_eq!(p.source, Source::Built);
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 2);
    }

    #[test]
    fn a_build_enters_the_cache_only_when_published_and_others_wait_for_it() {
        let t = tempfile::tempdir().unwrap();
        let files = Arc::new(image(&t.path().join("src"), 8));
        let cache = Arc::new(RestoreCache::new(&t.path().join("cache"), 1 << 30));
        let builds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let key = RestoreCache::key(&files);
        // Built, linked into the restore's directory, not published (its page files are still
        // being verified): nothing is in the cache, and the restore has its files.
        let (p, built) = cache
            .provide(
                &files,
                &t.path().join("r1"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap()
            .unwrap();
        let ((), publish) = built.unwrap();
        assert_eq!(p.source, Source::Built);
        assert!(!cache.entry(&key).exists());
        assert_eq!(&digests(&t.path().join("r1")), &*files);
        // Dropped unpublished (the verification failed): gone, and nothing is left in tmp/.
        drop(publish);
        assert!(!cache.entry(&key).exists());
        assert_eq!(fs::read_dir(cache.root.join("tmp")).unwrap().count(), 0);
        // Built again; another restore of the same image meanwhile waits for the lock and then
        // takes the published entry instead of building it a third time.
        let (_, built) = cache
            .provide(
                &files,
                &t.path().join("r2"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap()
            .unwrap();
        let ((), publish) = built.unwrap();
        let waiter = {
            let (cache, files, builds, root) = (
                cache.clone(),
                files.clone(),
                builds.clone(),
                t.path().to_path_buf(),
            );
            std::thread::spawn(move || {
                cache
                    .provide(
                        &files,
                        &root.join("r3"),
                        build_from(&root.join("src"), &files, &builds),
                    )
                    .unwrap()
                    .unwrap()
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !waiter.is_finished(),
            "the other restore waits for the entry's lock"
        );
        publish.commit().unwrap();
        let (p, built) = waiter.join().unwrap();
        assert_eq!((p.source, built.is_none()), (Source::Hit, true));
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(&digests(&t.path().join("r3")), &*files);
    }

    #[test]
    fn entries_that_do_not_hold_exactly_their_files_or_are_of_another_boot_are_rebuilt() {
        let t = tempfile::tempdir().unwrap();
        let files = image(&t.path().join("src"), 2);
        let cache = RestoreCache::new(&t.path().join("cache"), 1 << 30);
        let builds = std::sync::atomic::AtomicUsize::new(0);
        let provide = |to: &str| {
            cache
                .provide_now(
                    &files,
                    &t.path().join(to),
                    build_from(&t.path().join("src"), &files, &builds),
                )
                .unwrap()
                .unwrap()
                .0
                .source
        };
        assert_eq!(provide("r"), Source::Built);
        let key = RestoreCache::key(&files);
        let entry = cache.entry(&key);
        // A file cut short (a crash before it reached the disk).
        fs::write(entry.join("image/pages-1.img"), b"").unwrap();
        assert_eq!(provide("r"), Source::Built);
        // A file too many.
        fs::write(entry.join("image/extra.img"), b"x").unwrap();
        assert_eq!(provide("r"), Source::Built);
        // Made in another boot.
        let meta = entry.join(ENTRY_FILE);
        let text = String::from_utf8(fs::read(&meta).unwrap()).unwrap();
        fs::write(&meta, text.replace(&boot_id(), "another-boot")).unwrap();
        assert_eq!(provide("r"), Source::Built);
        assert_eq!(provide("r"), Source::Hit);
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 4);
        // A statement naming a path, not a file: no entry can hold it.
        let mut bad = files.clone();
        let d = bad.remove("pstree.img").unwrap();
        bad.insert("../pstree.img".into(), d);
        let e = cache
            .provide_now(&bad, &t.path().join("x"), |to: &Path| {
                fs::create_dir_all(to).unwrap();
                for e in fs::read_dir(t.path().join("src")).unwrap().flatten() {
                    fs::copy(e.path(), to.join(e.file_name())).unwrap();
                }
                Ok::<(), CacheError>(())
            })
            .unwrap_err();
        assert!(e.to_string().contains("exactly the signed files"), "{e}");
        assert!(!cache.entry(&RestoreCache::key(&bad)).exists());
        assert!(plain_name("../pstree.img").is_err() && plain_name("a/b").is_err());
        assert_eq!(plain_name("pstree.img").unwrap(), "pstree.img");
    }

    #[test]
    fn concurrent_restores_of_one_image_build_it_once() {
        let t = tempfile::tempdir().unwrap();
        let files = Arc::new(image(&t.path().join("src"), 64));
        let cache = Arc::new(RestoreCache::new(&t.path().join("cache"), 1 << 30));
        let builds = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let root = Arc::new(t.path().to_path_buf());
        let threads: Vec<_> = (0..8)
            .map(|i| {
                let (cache, files, builds, root) =
                    (cache.clone(), files.clone(), builds.clone(), root.clone());
                std::thread::spawn(move || {
                    let src = root.join("src");
                    cache
                        .provide_now(
                            &files,
                            &root.join(format!("r{i}")),
                            build_from(&src, &files, &builds),
                        )
                        .unwrap()
                        .unwrap()
                        .0
                        .source
                })
            })
            .collect();
        let sources: Vec<Source> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(builds.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(sources.iter().filter(|s| **s == Source::Built).count(), 1);
        for i in 0..8 {
            assert_eq!(&digests(&t.path().join(format!("r{i}"))), &*files);
        }
    }

    #[test]
    fn stores_import_one_deduplicated_form_and_restore_it_byte_for_byte() {
        let t = tempfile::tempdir().unwrap();
        let files = image(&t.path().join("src"), 16);
        let cache = RestoreCache::new(&t.path().join("cache"), 1 << 30);
        let builds = std::sync::atomic::AtomicUsize::new(0);
        // Nothing cached yet: the caller imports on its own.
        assert_eq!(
            cache
                .import(
                    &files,
                    &t.path().join("s0/proc/1"),
                    &t.path().join("s0/chunks")
                )
                .unwrap(),
            None
        );
        cache
            .provide_now(
                &files,
                &t.path().join("r"),
                build_from(&t.path().join("src"), &files, &builds),
            )
            .unwrap()
            .unwrap();
        let mut packs = Vec::new();
        for (i, built) in [(1, true), (2, false)] {
            let proc = t.path().join(format!("s{i}/proc/000001"));
            let chunks = t.path().join(format!("s{i}/chunks"));
            let imported = cache.import(&files, &proc, &chunks).unwrap().unwrap();
            assert_eq!(imported.built, built);
            assert_eq!(
                imported.bytes_logical,
                files.values().map(|d| d.size).sum::<u64>()
            );
            assert!(imported.bytes_stored > 0);
            assert!(proc.join("pages-1.img.recipe").is_file());
            assert!(!proc.join("pages-1.img").exists());
            // The store's image rebuilds to the signed bytes.
            pages::materialize(&proc, &chunks).unwrap();
            assert_eq!(digests(&proc), files);
            let pack: Vec<_> = fs::read_dir(&chunks)
                .unwrap()
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".pack"))
                .map(|e| e.metadata().unwrap().ino())
                .collect();
            packs.extend(pack);
        }
        // Both stores hold the one pack.
        assert_eq!(packs.len(), 2);
        assert_eq!(packs[0], packs[1]);
        // A store's garbage collection removes its link, not the other store's pack.
        pages::collect_garbage(&t.path().join("s1/chunks"), &[]).unwrap();
        let proc = t.path().join("s2/proc/000001");
        fs::remove_file(proc.join("pages-1.img")).unwrap();
        pages::materialize(&proc, &t.path().join("s2/chunks")).unwrap();
        assert_eq!(digests(&proc), files);
    }

    #[test]
    fn the_least_recently_used_entries_go_first_and_large_images_are_not_cached() {
        let t = tempfile::tempdir().unwrap();
        // Room for about two images of 16 pages (64 KiB each, plus a few bytes).
        let cache = RestoreCache::new(&t.path().join("cache"), 150 << 10);
        let builds = std::sync::atomic::AtomicUsize::new(0);
        let mut keys = Vec::new();
        for i in 0..3 {
            let src = t.path().join(format!("src{i}"));
            let files = image(&src, 16);
            // Each image different.
            fs::write(src.join("pstree.img"), format!("pstree {i}")).unwrap();
            let files = {
                let mut f = files;
                f.insert(
                    "pstree.img".into(),
                    digests(&src).remove("pstree.img").unwrap(),
                );
                f
            };
            cache
                .provide_now(
                    &files,
                    &t.path().join("r"),
                    build_from(&src, &files, &builds),
                )
                .unwrap()
                .unwrap();
            keys.push(RestoreCache::key(&files));
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(!cache.entry(&keys[0]).exists(), "the oldest went");
        assert!(cache.entry(&keys[1]).exists() && cache.entry(&keys[2]).exists());
        // Larger than the whole cache: not cached, the caller copies on its own.
        let src = t.path().join("big");
        let files = image(&src, 64);
        assert!(cache
            .provide_now(
                &files,
                &t.path().join("r"),
                build_from(&src, &files, &builds)
            )
            .unwrap()
            .is_none());
        assert!(!cache.entry(&RestoreCache::key(&files)).exists());
    }
}

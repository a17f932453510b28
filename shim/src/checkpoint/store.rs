//! The on-disk checkpoint store of one sandbox (`<state_dir>/<namespace>/<container>/`).
//!
//! ```text
//! checkpoints/<seq:06>.json   published manifests (written as .<seq:06>.json.tmp, fsync, rename, fsync dir)
//! blobs/sha256/<hex>          content-addressed layer blobs (zstd tar)
//! proc/<seq:06>/              CRIU image directories, complete before the manifest naming them is published
//! chunks/<hex>                content-addressed page chunks shared by process images (pages.rs)
//! turns/<seq:06>.json         the turn answers (the sandbox writes them)
//! ```
//!
//! Nothing partial is ever visible: every file appears under its final name by a rename after
//! an fsync, and a manifest is published only when everything it names is in place, so a crash
//! at any point leaves the previously published manifests intact and self-sufficient.
//! Leftovers (`*.tmp`, blobs and process images no manifest names) are swept by [`Store::open`],
//! but only by the store that holds the root's lock: a second `Store` on the same root (another
//! job, `crabctl`) never deletes what the first may still be writing.
//!
//! A store belongs to one lineage, not to a container id: a container created with the id of a
//! removed one (from an ordinary image, or restored from another container's checkpoint) must
//! not see, list or roll back to its predecessor's checkpoints. [`Store::open_for_container`]
//! sets such a leftover aside (`.replaced-<id>-<unique>` next to it, which `crabctl prune`
//! removes) before the new store is made; only a container restored from this very store's
//! checkpoint (a rollback or recovery keeping its id) carries on with it. Setting aside and
//! creating happen under the lock of the namespace directory (`flock` on the directory
//! itself), which `crabctl prune` takes too while it removes a store: a container re-created
//! while prune runs never has its new store removed.

use std::{
    collections::HashSet,
    fs::{self, File, OpenOptions},
    io,
    os::{
        fd::AsRawFd,
        unix::{
            ffi::OsStrExt,
            fs::{DirBuilderExt, OpenOptionsExt},
        },
    },
    path::{Component, Path, PathBuf},
    sync::Mutex,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::Deserialize;

const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

mod files;
mod manifest;

pub use files::*;
pub use manifest::*;

/// Where [`Store::open_for_container`] puts a store it sets aside: `<prefix><id>-<unique>`
/// next to it (no container id starts with a dot, so no shim takes that name for a store).
pub const SET_ASIDE_PREFIX: &str = ".replaced-";

/// The lock of the directory that holds the stores of a namespace, held while a store is
/// created or set aside (see the module docs). Creates the directory (`0700`) if needed.
pub fn lock_namespace_dir(dir: &Path) -> Result<File, StoreError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| StoreError::io("create", dir, e))?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|e| StoreError::io("open", dir, e))?;
    // SAFETY: flock on a file descriptor we own; released when `file` is closed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(StoreError::io("lock", dir, io::Error::last_os_error()));
    }
    Ok(file)
}

/// The store of one sandbox. Cheap to share (`&Store` from several threads).
#[derive(Debug)]
pub struct Store {
    root: PathBuf,
    /// Held (flock) by the store that swept on open; `None` when another one holds it.
    _lock: Option<File>,
    /// Blobs put by this store whose manifest is not published yet: retention leaves them alone.
    pending: Mutex<HashSet<String>>,
}

impl Store {
    /// Opens (creating its directories) the store at `root`. If no other `Store` holds the
    /// root, takes its lock and sweeps the leftovers of a crash: `*.tmp` files, then blobs and
    /// process images no published manifest names. Unreadable manifests make the sweep keep
    /// every blob and image (it cannot know what they name).
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        // Layers and images hold the container's files and memory: root's eyes only.
        let mut builder = fs::DirBuilder::new();
        builder.recursive(true).mode(0o700);
        for dir in [
            root.to_path_buf(),
            root.join("checkpoints"),
            root.join("blobs/sha256"),
            root.join("proc"),
            root.join("chunks"),
        ] {
            builder
                .create(&dir)
                .map_err(|e| StoreError::io("create", &dir, e))?;
        }
        let lock_path = root.join(".lock");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| StoreError::io("open", &lock_path, e))?;
        // SAFETY: flock(2) takes no pointers; `lock` is an open file for the whole call.
        let locked = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        let store = Store {
            root: root.to_path_buf(),
            _lock: locked.then_some(lock),
            pending: Mutex::default(),
        };
        if locked {
            store.sweep()?;
        } else {
            log::debug!(
                "checkpoint store {}: in use by another store, not sweeping",
                root.display()
            );
        }
        Ok(store)
    }

    /// Opens the store of a container being created at `root`. If a store is already there
    /// (checkpoints or turns of an earlier container with the same id), `continues` decides
    /// whether the new container carries on its lineage (restored from one of its
    /// checkpoints); if not, it is set aside and a new store begins. Returns the store and
    /// where the old one went.
    pub fn open_for_container(
        root: &Path,
        continues: impl FnOnce(&Store) -> bool,
    ) -> Result<(Store, Option<PathBuf>), StoreError> {
        let (parent, name) = match (root.parent(), root.file_name()) {
            (Some(p), Some(n)) => (p, n.to_string_lossy().into_owned()),
            _ => return Ok((Store::open(root)?, None)),
        };
        let _lock = lock_namespace_dir(parent)?;
        let md = match fs::symlink_metadata(root) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok((Store::open(root)?, None)),
            Err(e) => return Err(StoreError::io("stat", root, e)),
        };
        // A symlink or file where a store belongs is set aside unopened.
        if md.is_dir() {
            let store = Store::open(root)?;
            if !store.holds_a_lineage()? || continues(&store) {
                return Ok((store, None));
            }
        }
        let aside = parent.join(format!(
            "{SET_ASIDE_PREFIX}{name}-{}-{}",
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
            std::process::id()
        ));
        fs::rename(root, &aside).map_err(|e| StoreError::io("set aside", root, e))?;
        fsync_dir(parent)?;
        log::info!(
            "checkpoint store {}: it belonged to an earlier container with this id, set aside as {}",
            root.display(),
            aside.display()
        );
        Ok((Store::open(root)?, Some(aside)))
    }

    /// Whether anything of a lineage is here: a manifest or a turn's answer.
    fn holds_a_lineage(&self) -> Result<bool, StoreError> {
        if !self.seqs()?.is_empty() {
            return Ok(true);
        }
        let turns = turns_dir(&self.root);
        match fs::read_dir(&turns) {
            Ok(mut it) => Ok(it.next().is_some()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(StoreError::io("read", &turns, e)),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the process image of checkpoint `seq` goes (complete before its manifest is published).
    pub fn proc_dir(&self, seq: u64) -> PathBuf {
        self.root.join(proc_image_name(seq))
    }

    pub fn chunks_dir(&self) -> PathBuf {
        self.root.join("chunks")
    }

    /// The stored blob of a descriptor.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.blobs_dir()
            .join(digest.strip_prefix("sha256:").unwrap_or(digest))
    }

    fn blobs_dir(&self) -> PathBuf {
        self.root.join("blobs/sha256")
    }

    fn checkpoints_dir(&self) -> PathBuf {
        self.root.join("checkpoints")
    }

    fn manifest_path(&self, seq: u64) -> PathBuf {
        self.checkpoints_dir().join(format!("{seq:06}.json"))
    }

    /// Published sequence numbers, ascending.
    fn seqs(&self) -> Result<Vec<u64>, StoreError> {
        let dir = self.checkpoints_dir();
        let mut seqs = Vec::new();
        for entry in fs::read_dir(&dir).map_err(|e| StoreError::io("read", &dir, e))? {
            let entry = entry.map_err(|e| StoreError::io("read", &dir, e))?;
            if let Some(seq) = manifest_seq(&entry.file_name()) {
                seqs.push(seq);
            }
        }
        seqs.sort_unstable();
        Ok(seqs)
    }

    pub fn get(&self, seq: u64) -> Result<Manifest, StoreError> {
        let path = self.manifest_path(seq);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound {
                    seq,
                    root: self.root.clone(),
                })
            }
            Err(e) => return Err(StoreError::io("read", &path, e)),
        };
        let m = parse_manifest(&path, &bytes)?;
        if m.seq != seq {
            return Err(StoreError::Corrupt {
                path,
                reason: format!("it says seq {}", m.seq),
            });
        }
        Ok(m)
    }

    pub fn latest(&self) -> Result<Option<Manifest>, StoreError> {
        self.seqs()?.last().map(|&seq| self.get(seq)).transpose()
    }

    /// Every published manifest, oldest first.
    pub fn list(&self) -> Result<Vec<Manifest>, StoreError> {
        self.seqs()?.into_iter().map(|seq| self.get(seq)).collect()
    }

    /// One past the newest published checkpoint (1 for an empty store). Retention always keeps
    /// the newest, so numbers are never reused.
    pub fn next_seq(&self) -> Result<u64, StoreError> {
        Ok(self.seqs()?.last().map_or(1, |s| s + 1))
    }

    /// Publishes `m` atomically: `.<seq>.json.tmp`, fsync, rename (never over an existing
    /// manifest), fsync of the directory. Everything `m` names must already be in the store.
    pub fn publish(&self, m: &Manifest) -> Result<(), StoreError> {
        self.publish_with(m, true)
    }

    /// [`Store::publish`] up to the rename: the manifest is whole and visible, but its name is
    /// durable only once the directory is synced, by [`Store::sync_published`] or by any later
    /// publish (a crash of the machine before that loses it, and with it nothing newer). For a
    /// caller that answers before that second fsync (an in-place rollback).
    pub fn publish_unsynced(&self, m: &Manifest) -> Result<(), StoreError> {
        self.publish_with(m, false)
    }

    /// Makes the names of the manifests published so far durable (fsync of `checkpoints/`).
    pub fn sync_published(&self) -> Result<(), StoreError> {
        fsync_dir(&self.checkpoints_dir())
    }

    fn publish_with(&self, m: &Manifest, sync_dir: bool) -> Result<(), StoreError> {
        let invalid = |reason: String| StoreError::Invalid { seq: m.seq, reason };
        if m.format != FORMAT {
            return Err(invalid(format!(
                "format {} (this crab writes {FORMAT})",
                m.format
            )));
        }
        if m.image_layers > m.fs_layers.len() {
            return Err(invalid(format!(
                "{} image layers of {}",
                m.image_layers,
                m.fs_layers.len()
            )));
        }
        for layer in &m.fs_layers[m.image_layers..] {
            if !self.blob_path(&layer.digest).is_file() {
                return Err(invalid(format!(
                    "layer {} is not in the store",
                    layer.digest
                )));
            }
        }
        if let Some(p) = &m.process {
            let dir = self.resolve(&p.image).ok_or_else(|| {
                invalid(format!("process image {:?} is not a store path", p.image))
            })?;
            if !dir.is_dir() {
                return Err(invalid(format!(
                    "process image {} is not in the store",
                    dir.display()
                )));
            }
        }
        let dir = self.checkpoints_dir();
        let path = self.manifest_path(m.seq);
        let tmp = dir.join(format!(".{:06}.json.tmp", m.seq));
        let mut json = serde_json::to_vec_pretty(m).map_err(|e| invalid(e.to_string()))?;
        json.push(b'\n');
        let mut file = TempFile::create(tmp)?;
        file.write_all(&json)?;
        file.persist_noreplace(&path, sync_dir)
            .map_err(|e| match e {
                PersistError::Exists => StoreError::Exists {
                    seq: m.seq,
                    root: self.root.clone(),
                },
                PersistError::Store(e) => e,
            })?;
        let mut pending = self.pending.lock().unwrap();
        for layer in &m.fs_layers {
            pending.remove(layer.hex());
        }
        Ok(())
    }

    /// A new temporary file in the store (same filesystem as the blobs), removed when dropped.
    pub fn temp_file(&self, what: &str) -> Result<TempFile, StoreError> {
        temp_file_in(&self.root, what)
    }

    /// Puts the blob of `d`, found at `src` (another store's), into this store: a hard link
    /// (blobs are content-addressed and never rewritten), a copy across filesystems. The
    /// caller has checked its digest; it is kept from retention until a manifest names it.
    pub fn link_blob(&self, src: &Path, d: &Descriptor) -> Result<(), StoreError> {
        let dest = self.blob_path(&d.digest);
        if dest.is_file() {
            return Ok(());
        }
        self.pending.lock().unwrap().insert(d.hex().to_string());
        match fs::hard_link(src, &dest) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(_) => {
                let mut from = File::open(src).map_err(|e| StoreError::io("open", src, e))?;
                let mut tmp = self.temp_file("link")?;
                io::copy(&mut from, tmp.file()).map_err(|e| StoreError::io("copy", src, e))?;
                tmp.persist(&dest)?;
            }
        }
        fsync_dir(&self.blobs_dir())
    }

    /// Hashes the layer blob at `tmp_file` (zstd-compressed or plain tar), computing its
    /// diff_id, and moves it into `blobs/` (durably). `tmp_file` is consumed.
    pub fn put_blob(&self, tmp_file: &Path) -> Result<Descriptor, StoreError> {
        let open = |p: &Path| File::open(p).map_err(|e| StoreError::io("open", p, e));
        let mut file = open(tmp_file)?;
        let mut magic = [0u8; 4];
        let n =
            read_full(&mut file, &mut magic).map_err(|e| StoreError::io("read", tmp_file, e))?;
        let compressed = n == 4 && magic == ZSTD_MAGIC;
        let (digest, size) =
            sha256_reader(open(tmp_file)?).map_err(|e| StoreError::io("read", tmp_file, e))?;
        let diff_id = if compressed {
            let decoder = zstd::stream::read::Decoder::new(open(tmp_file)?)
                .map_err(|e| StoreError::io("read", tmp_file, e))?;
            sha256_reader(decoder)
                .map_err(|e| StoreError::Corrupt {
                    path: tmp_file.to_path_buf(),
                    reason: format!("zstd: {e}"),
                })?
                .0
        } else {
            digest.clone()
        };
        let media_type = if compressed {
            MEDIA_TYPE_LAYER_ZSTD
        } else {
            MEDIA_TYPE_LAYER_TAR
        };
        let desc = Descriptor {
            digest,
            diff_id,
            size,
            media_type: media_type.to_owned(),
        };
        // A file elsewhere (another filesystem) is copied in first so the final step is a rename.
        let staged;
        let src = if tmp_file
            .parent()
            .is_some_and(|p| same_device(p, &self.blobs_dir()))
        {
            tmp_file
        } else {
            let mut t = self.temp_file("blob")?;
            io::copy(&mut open(tmp_file)?, &mut t.file)
                .map_err(|e| StoreError::io("copy", t.path(), e))?;
            fs::remove_file(tmp_file).map_err(|e| StoreError::io("remove", tmp_file, e))?;
            staged = t;
            staged.path()
        };
        self.put_blob_hashed(src, &desc)?;
        Ok(desc)
    }

    /// Moves an already hashed blob into `blobs/`: fsync, rename, fsync dir. A blob already
    /// stored (same digest) is kept and `tmp_file` removed.
    pub(crate) fn put_blob_hashed(
        &self,
        tmp_file: &Path,
        desc: &Descriptor,
    ) -> Result<(), StoreError> {
        let dest = self.blob_path(&desc.digest);
        self.pending.lock().unwrap().insert(desc.hex().to_owned());
        if dest.exists() {
            fs::remove_file(tmp_file).map_err(|e| StoreError::io("remove", tmp_file, e))?;
            return Ok(());
        }
        let file = File::open(tmp_file).map_err(|e| StoreError::io("open", tmp_file, e))?;
        file.sync_all()
            .map_err(|e| StoreError::io("fsync", tmp_file, e))?;
        fs::rename(tmp_file, &dest).map_err(|e| StoreError::io("rename", tmp_file, e))?;
        fsync_dir(&self.blobs_dir())
    }

    /// Keeps the newest `keep_last` manifests, every one whose seq is a multiple of
    /// `keep_every`, and always the newest; deletes the other manifests, then every blob and
    /// process image no kept manifest names (a kept manifest names its whole layer chain), and
    /// the turn answers (`turns/`) older than the oldest kept manifest, except those of kept
    /// checkpoints' turns. Blobs this store put for a manifest not yet published, and process
    /// images newer than the newest manifest, are never touched. `None, None` keeps everything.
    /// A corrupt manifest (unparsable: never a recovery point) is renamed
    /// `<seq>.json.corrupt` and left out, so it cannot stop retention for good; one of a newer
    /// format stops it (a newer crab may need what it names).
    /// Page chunks (`chunks/`) are the process images' business (pages.rs).
    pub fn apply_retention(
        &self,
        keep_last: Option<u32>,
        keep_every: Option<u32>,
    ) -> Result<Retention, StoreError> {
        self.apply_retention_with(keep_last, keep_every, |_, _| {})
    }

    /// [`Store::apply_retention`], calling `before_removing` with the manifests and turn
    /// answer files it is about to remove, before it removes anything (the coordinator keeps
    /// their figures for `crabctl metrics` there: [`crate::metrics::retire`]).
    pub fn apply_retention_with(
        &self,
        keep_last: Option<u32>,
        keep_every: Option<u32>,
        before_removing: impl FnOnce(&[&Manifest], &[PathBuf]),
    ) -> Result<Retention, StoreError> {
        let mut report = Retention::default();
        if keep_last.is_none() && keep_every.is_none() {
            return Ok(report);
        }
        // Read every manifest before deleting anything: one unreadable manifest stops it all.
        let all = self.list_setting_aside_corrupt()?;
        let Some(newest) = all.last().map(|m| m.seq) else {
            return Ok(report);
        };
        let n = all.len();
        let keep = |i: usize, m: &Manifest| {
            m.seq == newest
                || keep_last.is_some_and(|k| i + (k as usize) >= n)
                || keep_every.is_some_and(|k| k > 0 && m.seq.is_multiple_of(u64::from(k)))
        };
        let (kept, dropped): (Vec<_>, Vec<_>) =
            all.iter().enumerate().partition(|(i, m)| keep(*i, m));
        let kept: Vec<&Manifest> = kept.into_iter().map(|(_, m)| m).collect();
        let turns = match dropped.is_empty() {
            true => Vec::new(),
            false => self.turns_to_retire(&kept)?,
        };
        let dropped_manifests: Vec<&Manifest> = dropped.iter().map(|(_, m)| *m).collect();
        if !dropped_manifests.is_empty() || !turns.is_empty() {
            before_removing(&dropped_manifests, &turns);
        }
        for (_, m) in &dropped {
            let path = self.manifest_path(m.seq);
            fs::remove_file(&path).map_err(|e| StoreError::io("remove", &path, e))?;
            report.removed_manifests.push(m.seq);
        }
        if !dropped.is_empty() {
            fsync_dir(&self.checkpoints_dir())?;
        }
        self.collect_garbage(&kept, newest, &mut report)?;
        for path in &turns {
            remove_any(path)?;
        }
        if !turns.is_empty() {
            log::info!(
                "checkpoint store {}: retention removed {} turn answers",
                self.root.display(),
                turns.len()
            );
        }
        if !report.removed_manifests.is_empty() {
            log::info!(
                "checkpoint store {}: retention removed checkpoints {:?}, {} blobs, {} process images",
                self.root.display(),
                report.removed_manifests,
                report.removed_blobs.len(),
                report.removed_proc.len()
            );
        }
        Ok(report)
    }

    /// Every manifest, oldest first; corrupt ones are renamed out of the way (logged).
    fn list_setting_aside_corrupt(&self) -> Result<Vec<Manifest>, StoreError> {
        let mut all = Vec::new();
        for seq in self.seqs()? {
            match self.get(seq) {
                Ok(m) => all.push(m),
                Err(StoreError::Corrupt { path, reason }) => {
                    let aside = path.with_extension("json.corrupt");
                    log::error!(
                        "checkpoint store {}: manifest {} is corrupt ({reason}): set aside as {}",
                        self.root.display(),
                        path.display(),
                        aside.display()
                    );
                    fs::rename(&path, &aside).map_err(|e| StoreError::io("rename", &path, e))?;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(all)
    }

    /// The turn answers retention removes: those older than the oldest manifest of `kept`,
    /// except the answers of the turns `kept` names.
    fn turns_to_retire(&self, kept: &[&Manifest]) -> Result<Vec<PathBuf>, StoreError> {
        let dir = turns_dir(&self.root);
        let Some(oldest) = kept.first() else {
            return Ok(Vec::new());
        };
        let since = match fs::metadata(self.manifest_path(oldest.seq)).and_then(|m| m.modified()) {
            Ok(t) => t,
            Err(e) => return Err(StoreError::io("stat", &self.manifest_path(oldest.seq), e)),
        };
        let turns: HashSet<&str> = kept.iter().flat_map(|m| m.turn_id.split(',')).collect();
        let entries = match fs::read_dir(&dir) {
            Ok(it) => it,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::io("read", &dir, e)),
        };
        let mut retire = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            if !name.as_bytes().ends_with(b".json") || name.as_bytes().starts_with(b".") {
                continue;
            }
            let older = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t < since);
            if !older {
                continue;
            }
            #[derive(Deserialize)]
            struct Turn {
                turn_id: String,
            }
            let turn = fs::symlink_metadata(&path)
                .ok()
                .filter(|md| md.is_file() && md.len() <= MAX_ANSWER_BYTES)
                .and_then(|_| fs::read(&path).ok())
                .and_then(|d| serde_json::from_slice::<Turn>(&d).ok());
            // The answer behind a kept checkpoint stays; an unreadable one explains nothing.
            if turn.is_some_and(|t| turns.contains(t.turn_id.as_str())) {
                continue;
            }
            retire.push(path);
        }
        Ok(retire)
    }

    /// Removes blobs and process images that no manifest of `kept` names, except pending
    /// blobs and images newer than `newest`.
    fn collect_garbage(
        &self,
        kept: &[&Manifest],
        newest: u64,
        report: &mut Retention,
    ) -> Result<(), StoreError> {
        let blobs: HashSet<&str> = kept
            .iter()
            .flat_map(|m| m.fs_layers.iter().map(Descriptor::hex))
            .collect();
        let images: HashSet<PathBuf> = kept
            .iter()
            .filter_map(|m| m.process.as_ref().and_then(|p| self.resolve(&p.image)))
            .collect();
        let blobs_dir = self.blobs_dir();
        let mut removed_blob = false;
        for entry in read_dir(&blobs_dir)? {
            let name = entry.file_name();
            let Some(hex) = name.to_str() else { continue };
            if hex.ends_with(".tmp")
                || blobs.contains(hex)
                || self.pending.lock().unwrap().contains(hex)
            {
                continue;
            }
            let path = entry.path();
            fs::remove_file(&path).map_err(|e| StoreError::io("remove", &path, e))?;
            report.removed_blobs.push(format!("sha256:{hex}"));
            removed_blob = true;
        }
        if removed_blob {
            fsync_dir(&blobs_dir)?;
        }
        let proc_dir = self.root.join("proc");
        let mut removed_image = false;
        for entry in read_dir(&proc_dir)? {
            let path = entry.path();
            let seq = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok());
            if images.contains(&path) || seq.is_none_or(|s| s > newest) {
                continue;
            }
            remove_any(&path)?;
            report.removed_proc.push(path);
            removed_image = true;
        }
        if removed_image {
            fsync_dir(&proc_dir)?;
        }
        Ok(())
    }

    fn sweep(&self) -> Result<(), StoreError> {
        for name in [
            "",
            "checkpoints",
            "blobs",
            "blobs/sha256",
            "proc",
            "chunks",
            "turns",
        ] {
            let dir = self.root.join(name);
            // Turn answers come with the first turn end.
            if name == "turns" && !dir.is_dir() {
                continue;
            }
            for entry in read_dir(&dir)? {
                if entry.file_name().as_bytes().ends_with(b".tmp") {
                    let path = entry.path();
                    log::info!("checkpoint store: removing leftover {}", path.display());
                    remove_any(&path)?;
                }
            }
        }
        let all = match self.list() {
            Ok(all) => all,
            Err(e) => {
                log::warn!(
                    "checkpoint store {}: not sweeping unreferenced data: {e}",
                    self.root.display()
                );
                return Ok(());
            }
        };
        let newest = all.last().map_or(0, |m| m.seq);
        let kept: Vec<&Manifest> = all.iter().collect();
        let mut report = Retention::default();
        self.collect_garbage(&kept, newest, &mut report)?;
        // Images newer than the newest manifest were never published: a crash mid-checkpoint.
        let proc_dir = self.root.join("proc");
        for entry in read_dir(&proc_dir)? {
            let seq = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u64>().ok());
            if seq.is_some_and(|s| s > newest) {
                let path = entry.path();
                remove_any(&path)?;
                report.removed_proc.push(path);
            }
        }
        if !report.removed_blobs.is_empty() || !report.removed_proc.is_empty() {
            log::info!(
                "checkpoint store {}: swept unreferenced blobs {:?} and process images {:?}",
                self.root.display(),
                report.removed_blobs,
                report.removed_proc
            );
        }
        Ok(())
    }

    /// A store-relative path (no `..`, not absolute) under the root.
    fn resolve(&self, rel: &str) -> Option<PathBuf> {
        let p = Path::new(rel);
        p.components()
            .all(|c| matches!(c, Component::Normal(_)))
            .then(|| self.root.join(p))
    }
}

/// Retention reads at most this much of a turn answer (far above what crab writes).
const MAX_ANSWER_BYTES: u64 = 64 << 20;

/// Where the turn answers of the sandbox whose store is at `root` are kept (`turns/<seq:06>.json`,
/// written by the sandbox; retention and the sweep here keep them in step with the manifests).
pub fn turns_dir(root: &Path) -> PathBuf {
    root.join("turns")
}

/// `proc/<seq:06>`, as a manifest's `process.image` names it.
pub fn proc_image_name(seq: u64) -> String {
    format!("proc/{seq:06}")
}

/// Helpers shared by the checkpoint tests, also the root-only ones.
#[cfg(test)]
#[path = "../../tests/support/files.rs"]
pub(crate) mod test_support;

#[cfg(test)]
mod tests;

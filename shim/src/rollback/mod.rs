//! In-place rollback: returning a running container's files to one of its checkpoints without
//! touching its processes, when the checkpoint shares the current process epoch (no process
//! changed since it). The task, its pids and its open descriptors stay; only files change.
//!
//! [`reset`], with the container's inspection held (no turn end can interleave):
//! 1. the lineage is checked ([`check_lineage`]): the checkpoint's layer chain must be the start
//!    of the newest checkpoint's (nothing since started a new chain or failed), and must hold
//!    the container's image layers;
//! 2. the checkpoint's own layers (those in the store) are read into a [`state::LayerState`]
//!    (every blob's digest checked), and the layers after it into the paths they name: what
//!    changed between the checkpoint and the last turn end;
//! 3. the inspection is asked what a turn end would answer now ([`Inspection::peek`]): any
//!    process change, or anything it cannot observe, refuses the rollback (nothing was changed:
//!    the caller falls back to recreating the container);
//! 4. the container is frozen (`sys::cgroup::freezer`); if any process was created, exec'd or
//!    ended since the peek, any kernel state outside the processes changed (the host probes'
//!    state classes), or what the kernel holds for a process (pending signals, queued bytes,
//!    stopped, fd state) differs from the peek's, the rollback is refused. The files changed
//!    since the last turn end are scanned ([`Inspection::fs_since_mark`]);
//! 5. every changed path is given its state at the checkpoint, through the container's own view
//!    ([`view`]): from the checkpoint's layers, or the image's lower layers ([`lower`]) where
//!    the layers say nothing. Directories that hide what is below them (opaque, renamed, or
//!    created or deleted whole) are compared entry by entry. Data is copied last, one pass per
//!    layer in the order it is stored, then hard links;
//! 6. the files are scanned again and become the inspection's mark ([`Inspection::rebase`]):
//!    the next turn is compared with the checkpoint's state; then the container is thawed.
//!
//! The caller records the new lineage (a `restored` manifest with the checkpoint's references,
//! so the next layer stacks on the checkpoint's chain).

mod error;
pub mod squash;
pub mod state;
pub mod tar;
pub mod view;

use std::{
    collections::{BTreeSet, HashSet},
    fs::File,
    io::{self, BufReader, Read},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};

use crate::{
    checkpoint::store::{CheckpointKind, Descriptor, Manifest, Store, MEDIA_TYPE_LAYER_TAR},
    inspector::{Inspection, Kind as AnswerKind},
    sys::cgroup::freezer::{CgroupFreezer, Frozen},
};

use crate::inspector::lower::{LowerEntry, Lowers};

pub use self::error::{Failure, LayerProblem, LineageError, Refusal, ResetError, RollbackError};
use self::{
    state::{DataRef, LayerState, Lookup, Named, Node},
    tar::Kind,
    view::{Meta, Special, View},
};

/// What an in-place rollback did.
#[derive(Debug, Clone, Default)]
pub struct Reset {
    /// Paths given their checkpoint state (removed, created or rewritten).
    pub paths: u64,
    /// Bytes of file data written.
    pub bytes: u64,
    /// How long the container was frozen.
    pub freeze: Duration,
    /// Of which applying the changes.
    pub apply: Duration,
    /// Reading the checkpoint's layers and those after it (before the freeze).
    pub read: Duration,
    /// Asking the inspection what a turn end would answer (before the freeze).
    pub peek: Duration,
    /// Scanning the files changed since the last turn end, and after the reset (frozen).
    pub scans: Duration,
    pub total: Duration,
    /// Processes idle before the freeze: their marks are refreshed after it.
    pub idle: Vec<(u32, u64)>,
}

/// Checks that the files of `target` can be reached from the container's present through its
/// lineage (`latest`: the newest checkpoint, every earlier turn's checkpoint durable).
pub fn check_lineage(target: &Manifest, latest: &Manifest) -> Result<(), LineageError> {
    if !target.kind.is_durable_state() {
        return Err(LineageError::NotDurable(target.seq));
    }
    if latest.kind == CheckpointKind::Failed {
        return Err(LineageError::NewestFailed(latest.seq));
    }
    let n = target.fs_layers.len();
    if latest.fs_layers.len() < n || latest.fs_layers[..n] != target.fs_layers[..] {
        return Err(LineageError::Diverged(target.seq));
    }
    if n < latest.image_layers {
        return Err(LineageError::OlderThanImage(target.seq));
    }
    Ok(())
}

/// Whether `pid`'s user namespace maps ids one to one (the initial one): the layers hold the
/// container's ids, the view shows the host's.
fn identity_ids(pid: u32) -> Result<bool, Refusal> {
    for f in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{f}");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(source) => return Err(Refusal::IdMaps { path, source }),
        };
        let fields: Vec<&str> = text.split_whitespace().collect();
        if fields != ["0", "0", "4294967295"] {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A reader that hashes what goes through it.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// Reads the layer blob of `d` in `store` (uncompressed) with `f`, then checks the blob's
/// digest over all of it.
fn read_layer<T>(
    store: &Store,
    d: &Descriptor,
    f: impl FnOnce(&mut dyn Read) -> Result<T, tar::TarError>,
) -> Result<T, RollbackError> {
    read_layer_at(&store.blob_path(&d.digest), d, f)
}

/// [`read_layer`] of the blob at `path`.
pub(crate) fn read_layer_at<T>(
    path: &Path,
    d: &Descriptor,
    f: impl FnOnce(&mut dyn Read) -> Result<T, tar::TarError>,
) -> Result<T, RollbackError> {
    let what = |e: LayerProblem| RollbackError::Layer {
        digest: d.digest.clone(),
        path: path.to_path_buf(),
        source: e,
    };
    let io = |e: io::Error| what(e.into());
    let tar = |e: tar::TarError| what(e.into());
    let file = File::open(path).map_err(io)?;
    let mut raw = Hashing {
        inner: BufReader::new(file),
        hash: Sha256::new(),
    };
    let out = if d.media_type == MEDIA_TYPE_LAYER_TAR {
        let out = f(&mut raw).map_err(tar)?;
        io::copy(&mut raw, &mut io::sink()).map_err(io)?;
        out
    } else {
        let mut dec =
            zstd::stream::read::Decoder::with_buffer(BufReader::new(&mut raw)).map_err(io)?;
        let out = f(&mut dec).map_err(tar)?;
        io::copy(&mut dec, &mut io::sink()).map_err(io)?;
        let mut rest = dec.finish();
        io::copy(&mut rest, &mut io::sink()).map_err(io)?;
        out
    };
    let got = format!("sha256:{:x}", raw.hash.finalize());
    if got != d.digest {
        return Err(what(LayerProblem::Digest(got)));
    }
    Ok(out)
}

/// The state of the layers of the checkpoint rolled back to last, by their digests: a sandbox
/// that returns to the same checkpoint again (a tree search) reads them once. Blobs are
/// content-addressed and never rewritten.
type Cached = (Vec<String>, std::sync::Arc<LayerState>);
static LAST_TARGET: std::sync::Mutex<Option<Cached>> = std::sync::Mutex::new(None);

/// The state the layers `own` (oldest first) give, read (digests checked) or cached.
fn target_state(
    blob: &dyn Fn(&Descriptor) -> PathBuf,
    own: &[Descriptor],
    max_entries: u64,
) -> Result<std::sync::Arc<LayerState>, RollbackError> {
    let key: Vec<String> = own.iter().map(|d| d.digest.clone()).collect();
    if let Some((k, st)) = LAST_TARGET.lock().unwrap().as_ref() {
        if *k == key {
            return Ok(st.clone());
        }
    }
    let mut layers = LayerState::default();
    for d in own {
        read_layer_at(&blob(d), d, |r| layers.apply(r, max_entries))?;
    }
    let st = std::sync::Arc::new(layers);
    *LAST_TARGET.lock().unwrap() = Some((key, st.clone()));
    Ok(st)
}

/// The checkpoint's files as its layers and the image give them.
struct Target<'a> {
    layers: &'a LayerState,
    lowers: Lowers<'a>,
}

/// A path's state in the checkpoint.
struct Want {
    kind: Kind,
    meta: Meta,
    source: Source,
    size: u64,
    link: PathBuf,
    dev: (u32, u32),
}

enum Source {
    None,
    Layer {
        data: DataRef,
        sparse: Option<Vec<(u64, u64)>>,
        linked: Option<PathBuf>,
    },
    /// The image's file; with another path of the same image file (a hard link) to link to.
    Lower(LowerEntry, Option<PathBuf>),
}

impl Target<'_> {
    fn want(&mut self, rel: &Path) -> io::Result<Option<Want>> {
        match self.layers.lookup(rel) {
            Lookup::Absent => Ok(None),
            Lookup::Entry(Node::Gone) => Ok(None),
            Lookup::Entry(Node::Entry {
                header,
                data,
                linked,
            }) => Ok(Some(Want {
                kind: header.kind,
                meta: Meta {
                    mode: header.mode,
                    uid: header.uid,
                    gid: header.gid,
                    mtime: header.mtime,
                    xattrs: header.xattrs.clone(),
                },
                source: match data {
                    Some(d) => Source::Layer {
                        data: *d,
                        sparse: header.sparse.clone(),
                        linked: linked.clone(),
                    },
                    None => Source::None,
                },
                size: header.size,
                link: header.link.clone(),
                dev: header.dev,
            })),
            Lookup::Lower => {
                let Some(e) = self.lowers.lookup(rel) else {
                    return Ok(None);
                };
                let st = e.st;
                let fmt = st.st_mode & libc::S_IFMT;
                let kind = match fmt {
                    libc::S_IFDIR => Kind::Dir,
                    libc::S_IFLNK => Kind::Symlink,
                    libc::S_IFCHR => Kind::CharDev,
                    libc::S_IFBLK => Kind::BlockDev,
                    libc::S_IFIFO => Kind::Fifo,
                    libc::S_IFREG => Kind::File,
                    // A socket in an image is not something a layer can hold either.
                    _ => return Ok(None),
                };
                let link = match kind {
                    Kind::Symlink => self.lowers.readlink(&e, rel)?,
                    _ => PathBuf::new(),
                };
                // A hard link of the image's: the first other name of the same file in its
                // directory, if the checkpoint still has it there, is linked to (overlayfs
                // breaks such links when it copies one up; the checkpoint has them).
                let partner = match kind == Kind::File && st.st_nlink > 1 {
                    false => None,
                    true => self.lowers.same_file_before(&e, rel).into_iter().find(|q| {
                        self.layers.lookup(q) == Lookup::Lower
                            && self
                                .lowers
                                .lookup(q)
                                .is_some_and(|o| o.layer == e.layer && o.st.st_ino == st.st_ino)
                    }),
                };
                Ok(Some(Want {
                    kind,
                    meta: Meta {
                        mode: st.st_mode & 0o7777,
                        uid: st.st_uid,
                        gid: st.st_gid,
                        mtime: (st.st_mtime, st.st_mtime_nsec),
                        xattrs: match kind {
                            Kind::Symlink => Vec::new(),
                            _ => self.lowers.xattrs(&e, rel)?,
                        },
                    },
                    source: Source::Lower(e, partner),
                    size: st.st_size as u64,
                    link,
                    dev: (libc::major(st.st_rdev), libc::minor(st.st_rdev)),
                }))
            }
        }
    }

    /// The checkpoint's names directly below directory `rel`.
    fn children(&mut self, rel: &Path) -> Vec<PathBuf> {
        let mut named: BTreeSet<PathBuf> = BTreeSet::new();
        let mut decided: HashSet<PathBuf> = HashSet::new();
        for (p, present) in self.layers.children(rel) {
            decided.insert(p.clone());
            if present {
                named.insert(p);
            }
        }
        if self.layers.lower_below(rel) {
            for p in self.lowers.children(rel) {
                if !decided.contains(&p) {
                    named.insert(p);
                }
            }
        }
        named.into_iter().collect()
    }
}

/// A regular file to write once the tree's shape is right.
struct Write {
    rel: PathBuf,
    meta: Meta,
    size: u64,
    source: Source,
}

/// Whether the entry `st` in the view already is `want` with permission bits `mode` (for
/// entries reached by a whole-directory comparison, not named as changed).
fn same(st: &libc::stat, want: &Want, mode: u32) -> bool {
    let fmt = st.st_mode & libc::S_IFMT;
    let kind_ok = matches!(
        (fmt, want.kind),
        (libc::S_IFREG, Kind::File)
            | (libc::S_IFLNK, Kind::Symlink)
            | (libc::S_IFCHR, Kind::CharDev)
            | (libc::S_IFBLK, Kind::BlockDev)
            | (libc::S_IFIFO, Kind::Fifo)
    );
    kind_ok
        && st.st_mode & 0o7777 == mode
        && (st.st_uid, st.st_gid) == (want.meta.uid, want.meta.gid)
        && st.st_size as u64 == want.size
        && (st.st_mtime, st.st_mtime_nsec) == want.meta.mtime
}

/// What [`apply`] is given.
struct Plan<'a> {
    /// Where each layer's blob is.
    blob: &'a dyn Fn(&Descriptor) -> PathBuf,
    /// The checkpoint's own layers, as indexed by [`DataRef::layer`].
    layers: &'a [Descriptor],
    /// Container paths (relative) that may differ from the checkpoint.
    changed: BTreeSet<PathBuf>,
    /// Directories whose whole content must be compared.
    deep: HashSet<PathBuf>,
    /// Tracked volumes the checkpoint does not hold (relative): left as they are.
    untouched: Vec<PathBuf>,
    max_bytes: u64,
}

/// Gives every changed path its checkpoint state through `view`.
fn apply(
    view: &mut View,
    target: &mut Target<'_>,
    plan: &Plan<'_>,
) -> Result<(u64, u64), RollbackError> {
    let err = |rel: &Path, what: &'static str, source: io::Error| RollbackError::Path {
        what,
        rel: rel.to_path_buf(),
        source,
    };
    let mut done_deep: HashSet<PathBuf> = HashSet::new();
    let mut writes: Vec<Write> = Vec::new();
    let mut links: Vec<(PathBuf, PathBuf, Write)> = Vec::new();
    let mut paths = 0u64;
    let under = |p: &Path, set: &HashSet<PathBuf>| p.ancestors().skip(1).any(|a| set.contains(a));
    for p in &plan.changed {
        if plan.untouched.iter().any(|v| p.starts_with(v)) || under(p, &done_deep) {
            continue;
        }
        let mut stack = vec![(p.clone(), plan.deep.contains(p))];
        while let Some((q, deep)) = stack.pop() {
            // Named as changed, or only reached by comparing a whole directory.
            let named = plan.changed.contains(&q);
            let want = target
                .want(&q)
                .map_err(|e| err(&q, "reading the checkpoint's", e))?;
            let cur = view.lstat(&q).map_err(|e| err(&q, "lstat", e))?;
            if q.as_os_str().is_empty() {
                // The root is never removed or replaced.
                if let Some(w) = want.as_ref().filter(|w| w.kind == Kind::Dir) {
                    view.set_dir_meta(&q, &w.meta)
                        .map_err(|e| err(&q, "setting", e))?;
                }
                if deep {
                    done_deep.insert(q.clone());
                    push_children(&mut stack, target, view, &q, false)
                        .map_err(|e| err(&q, "listing", e))?;
                }
                continue;
            }
            let Some(want) = want else {
                if cur.is_some() {
                    view.remove(&q).map_err(|e| err(&q, "removing", e))?;
                    paths += 1;
                }
                continue;
            };
            if want.kind == Kind::Dir {
                let fresh = match cur {
                    Some(st) if view::is_dir(&st) => false,
                    Some(_) => {
                        view.remove(&q).map_err(|e| err(&q, "removing", e))?;
                        true
                    }
                    None => true,
                };
                if fresh {
                    view.mkdir(&q, &want.meta)
                        .map_err(|e| err(&q, "creating", e))?;
                    paths += 1;
                } else {
                    view.set_dir_meta(&q, &want.meta)
                        .map_err(|e| err(&q, "setting", e))?;
                    paths += u64::from(named);
                }
                if fresh || deep {
                    done_deep.insert(q.clone());
                    push_children(&mut stack, target, view, &q, fresh)
                        .map_err(|e| err(&q, "listing", e))?;
                }
                continue;
            }
            let mode = view.file_meta(&q, &want.meta).mode;
            if !named && cur.as_ref().is_some_and(|st| same(st, &want, mode)) {
                continue;
            }
            if cur.is_some() {
                view.remove(&q).map_err(|e| err(&q, "removing", e))?;
            }
            paths += 1;
            match want.kind {
                Kind::Symlink => view
                    .symlink(&q, &want.link, &want.meta)
                    .map_err(|e| err(&q, "creating", e))?,
                Kind::CharDev | Kind::BlockDev | Kind::Fifo => {
                    let kind = match want.kind {
                        Kind::CharDev => Special::Char(want.dev.0, want.dev.1),
                        Kind::BlockDev => Special::Block(want.dev.0, want.dev.1),
                        _ => Special::Fifo,
                    };
                    view.mknod(&q, kind, &view.file_meta(&q, &want.meta))
                        .map_err(|e| err(&q, "creating", e))?
                }
                Kind::File | Kind::Hardlink => {
                    let w = Write {
                        rel: q.clone(),
                        meta: want.meta,
                        size: want.size,
                        source: want.source,
                    };
                    match &w.source {
                        Source::Layer {
                            linked: Some(to),
                            data,
                            ..
                        } if matches!(target.layers.lookup(to),
                                Lookup::Entry(Node::Entry { data: Some(d), .. }) if d == data) =>
                        {
                            links.push((q.clone(), to.clone(), w))
                        }
                        Source::Lower(_, Some(to)) => links.push((q.clone(), to.clone(), w)),
                        _ => writes.push(w),
                    }
                }
                Kind::Dir => unreachable!("handled above"),
            }
        }
    }
    let bytes = write_data(view, target, plan, writes)?;
    for (rel, to, w) in links {
        // The link's target is in place (written, or unchanged since the checkpoint) unless
        // it too is a path of a tracked volume left as it is: then the data is written.
        if view.link(&rel, &to).is_err() {
            write_data(view, target, plan, vec![w])?;
        }
    }
    Ok((paths, bytes))
}

/// Pushes the entries of directory `q` to compare: the checkpoint's and (unless it was just
/// made) the view's.
fn push_children(
    stack: &mut Vec<(PathBuf, bool)>,
    target: &mut Target<'_>,
    view: &View,
    q: &Path,
    fresh: bool,
) -> io::Result<()> {
    let mut names: BTreeSet<PathBuf> = target.children(q).into_iter().collect();
    if !fresh {
        names.extend(view.children(q)?);
    }
    for n in names.into_iter().rev() {
        stack.push((n, true));
    }
    Ok(())
}

/// Creates and fills the regular files: those from layers one pass per layer, in the order
/// their data is stored. Returns the bytes written.
fn write_data(
    view: &View,
    target: &Target<'_>,
    plan: &Plan<'_>,
    writes: Vec<Write>,
) -> Result<u64, RollbackError> {
    let total: u64 = writes.iter().map(|w| w.size).sum();
    if total > plan.max_bytes {
        return Err(RollbackError::TooMuchData {
            total,
            max: plan.max_bytes,
        });
    }
    let err = |rel: &Path, source: io::Error| RollbackError::Path {
        what: "writing",
        rel: rel.to_path_buf(),
        source,
    };
    type Sparse = Option<Vec<(u64, u64)>>;
    let mut by_layer: Vec<Vec<(DataRef, Sparse, Write)>> =
        (0..plan.layers.len()).map(|_| Vec::new()).collect();
    for w in writes {
        match &w.source {
            Source::Layer { data, sparse, .. } => {
                let (data, sparse) = (*data, sparse.clone());
                by_layer[data.layer].push((data, sparse, w))
            }
            Source::None => {
                let f = view.create_file(&w.rel).map_err(|e| err(&w.rel, e))?;
                view::finish_file(&f, &view.file_meta(&w.rel, &w.meta))
                    .map_err(|e| err(&w.rel, e))?;
            }
            Source::Lower(e, _) => {
                let mut from = target.lowers.open(e, &w.rel).map_err(|e| err(&w.rel, e))?;
                let mut f = view.create_file(&w.rel).map_err(|e| err(&w.rel, e))?;
                io::copy(&mut from, &mut f).map_err(|e| err(&w.rel, e))?;
                view::finish_file(&f, &view.file_meta(&w.rel, &w.meta))
                    .map_err(|e| err(&w.rel, e))?;
            }
        }
    }
    // Paths sharing data already read in a pass (hard links written as files) get another.
    let mut again: Vec<Write> = Vec::new();
    for (i, mut ws) in by_layer.into_iter().enumerate() {
        if ws.is_empty() {
            continue;
        }
        ws.sort_by_key(|(d, _, _)| d.at.offset);
        let d = &plan.layers[i];
        let path = (plan.blob)(d);
        let blob = |source| RollbackError::Blob {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(blob)?;
        let mut r: Box<dyn Read> = match d.media_type == MEDIA_TYPE_LAYER_TAR {
            true => Box::new(BufReader::new(file)),
            false => Box::new(zstd::stream::read::Decoder::new(file).map_err(blob)?),
        };
        let mut at = 0u64;
        for (data, sparse, w) in ws {
            if data.at.offset < at {
                again.push(w);
                continue;
            }
            let skip = data.at.offset - at;
            let skipped =
                io::copy(&mut (&mut r).take(skip), &mut io::sink()).map_err(|e| err(&w.rel, e))?;
            if skipped != skip {
                let early = io::Error::new(io::ErrorKind::UnexpectedEof, "the layer ends early");
                return Err(err(&w.rel, early));
            }
            let f = view.create_file(&w.rel).map_err(|e| err(&w.rel, e))?;
            let mut chunk = (&mut r).take(data.at.len);
            match &sparse {
                Some(map) => view::write_sparse(&f, w.size, map, &mut chunk),
                None => io::copy(&mut chunk, &mut &f).and_then(|n| match n == data.at.len {
                    true => Ok(()),
                    false => Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                }),
            }
            .map_err(|e| err(&w.rel, e))?;
            view::finish_file(&f, &view.file_meta(&w.rel, &w.meta)).map_err(|e| err(&w.rel, e))?;
            at = data.at.offset + data.at.len;
        }
    }
    if !again.is_empty() {
        write_data(view, target, plan, again)?;
    }
    Ok(total)
}

/// What [`onto_rootfs`] did.
#[derive(Debug, Clone, Default)]
pub struct Applied {
    /// Paths given their checkpoint state.
    pub paths: u64,
    /// Bytes of file data written.
    pub bytes: u64,
    /// Reading the layers (digests checked) and the upperdir.
    pub read: Duration,
    pub apply: Duration,
}

/// The rootfs a resume gives a checkpoint's files ([`onto_rootfs`]).
pub struct Rootfs<'a> {
    /// Where it is mounted on the host.
    pub path: &'a Path,
    /// Its overlay's upperdir and lowerdirs (top first), and which xattrs are overlay state.
    pub upperdir: &'a Path,
    pub lowerdirs: &'a [PathBuf],
    pub overlay_xattrs: crate::inspector::fs::OverlayXattrs,
}

/// Gives a container's rootfs, before anything runs in it, the files of a checkpoint whose
/// fs layers are `layers` (oldest first, each read from the blob file `blob` names, its digest
/// checked over the whole blob): the same machinery as an in-place rollback, with every path
/// the layers name as changed, and every path the rootfs's upperdir already holds (a
/// container restarted on its own rootfs, as Docker's restart policies do, comes back without
/// what its interrupted turn wrote). The rootfs must be an overlay of the checkpoint's image
/// (the caller checks). Writes go through the mounted rootfs (overlayfs makes the whiteouts
/// and copies up), resolved beneath it, never following a symlink.
pub fn onto_rootfs(
    rootfs: &Rootfs<'_>,
    layers: &[Descriptor],
    blob: &dyn Fn(&Descriptor) -> PathBuf,
    limits: &crab_runtime_config::LimitsConfig,
) -> Result<Applied, RollbackError> {
    let reading = Instant::now();
    let mut state = LayerState::default();
    let mut changed: BTreeSet<PathBuf> = BTreeSet::new();
    let mut deep: HashSet<PathBuf> = HashSet::new();
    for d in layers {
        let path = blob(d);
        read_layer_at(&path, d, |r| state.apply(r, limits.max_manifest_entries))?;
        let named = read_layer_at(&path, d, |r| Named::read(r, limits.max_manifest_entries))?;
        changed.extend(named.paths);
        deep.extend(named.opaque);
    }
    let upper = crate::inspector::fs::TreeManifest::scan_with(
        rootfs.upperdir,
        &crate::inspector::fs::ScanLimits::from(limits),
        rootfs.overlay_xattrs,
    )
    .map_err(RollbackError::Upperdir)?;
    for (rel, meta) in upper.iter() {
        if rel.as_os_str().is_empty() {
            continue;
        }
        changed.insert(rel.to_path_buf());
        if meta.opaque || meta.redirect.is_some() {
            deep.insert(rel.to_path_buf());
        }
    }
    let read = reading.elapsed();
    let mut view = View::open_dir(
        rootfs.path,
        limits.max_walk_depth,
        limits.max_manifest_entries,
    )
    .map_err(|source| RollbackError::Root {
        path: rootfs.path.to_path_buf(),
        source,
    })?;
    let mut target = Target {
        layers: &state,
        lowers: Lowers::new(rootfs.lowerdirs, rootfs.overlay_xattrs),
    };
    let plan = Plan {
        blob,
        layers,
        changed,
        deep,
        untouched: Vec::new(),
        max_bytes: limits.max_layer_bytes,
    };
    let applying = Instant::now();
    let (paths, bytes) = apply(&mut view, &mut target, &plan)?;
    Ok(Applied {
        paths,
        bytes,
        read,
        apply: applying.elapsed(),
    })
}

/// Resets the files of the container whose init is `pid` to checkpoint `target`, in place
/// (see the module docs). `latest` is the newest checkpoint; every turn end before is durable.
pub fn reset(
    inspection: &mut Inspection,
    store: &Store,
    target: &Manifest,
    latest: &Manifest,
    pid: u32,
) -> Result<Reset, ResetError> {
    let started = Instant::now();
    check_lineage(target, latest).map_err(Refusal::from)?;
    if !identity_ids(pid)? {
        return Err(Refusal::OwnUserNamespace.into());
    }
    let t = inspection.target().clone();
    if t.upperdir.is_none() {
        return Err(Refusal::NotOverlay.into());
    }
    let limits = &t.limits;
    // The checkpoint's own layers (the image carries the others) and those after it.
    let reading = Instant::now();
    let own = &target.fs_layers[latest.image_layers..];
    let blob = |d: &Descriptor| store.blob_path(&d.digest);
    let layers = target_state(&blob, own, limits.max_manifest_entries).map_err(|source| {
        Refusal::Checkpoint {
            seq: target.seq,
            source: Box::new(source),
        }
    })?;
    let layers = &*layers;
    let mut changed: BTreeSet<PathBuf> = BTreeSet::new();
    let mut deep: HashSet<PathBuf> = HashSet::new();
    for d in &latest.fs_layers[target.fs_layers.len()..] {
        let named = read_layer(store, d, |r| Named::read(r, limits.max_manifest_entries)).map_err(
            |source| Refusal::LaterLayers {
                seq: target.seq,
                source: Box::new(source),
            },
        )?;
        changed.extend(named.paths);
        deep.extend(named.opaque);
    }
    let read = reading.elapsed();
    // Processes: what a turn end would say now.
    let peeking = Instant::now();
    let (answer, observed) = inspection.peek();
    let peek = peeking.elapsed();
    if !answer.degraded.is_empty() {
        return Err(Refusal::Degraded(answer.degraded).into());
    }
    if answer.procs.changed || matches!(answer.kind, AnswerKind::Proc | AnswerKind::Full) {
        return Err(Refusal::ProcessesChanged(answer.summary()).into());
    }
    let Some(observed) = observed else {
        return Err(Refusal::Unobservable.into());
    };
    let idle = inspection.idle_since(&observed);
    let freezer = CgroupFreezer::for_pid(pid).map_err(Refusal::Freezer)?;
    let frozen_at = Instant::now();
    let frozen = Frozen::freeze(&freezer, "a failed in-place rollback").map_err(Refusal::Freeze)?;
    match inspection.process_events_since(&observed) {
        Some(0) => {}
        Some(n) => return Err(Refusal::ProcessEvents(n).into()),
        None => return Err(Refusal::NoCounters.into()),
    }
    // What the kernel holds for the processes (pending signals, queued bytes, stopped, fd
    // state) may have changed between the peek and the freeze without any event above.
    let moved = inspection.processes_changed_since(&observed);
    if !moved.is_empty() {
        return Err(Refusal::KernelState(moved).into());
    }
    let scanning = Instant::now();
    let since = inspection
        .fs_since_mark()
        .map_err(|e| Refusal::Scan(Box::new(e)))?;
    let mut scans = scanning.elapsed();
    let rel = |p: &PathBuf| p.strip_prefix("/").unwrap_or(p).to_path_buf();
    changed.extend(since.changed.paths().map(|p| rel(&p.to_path_buf())));
    deep.extend(since.hiding.iter().map(rel));
    let untouched: Vec<PathBuf> = t
        .volumes
        .iter()
        .filter(|(at, _)| !target.volumes.contains(at))
        .map(|(at, _)| rel(at))
        .collect();
    let mut view = View::open(
        pid,
        &t.volumes,
        limits.max_walk_depth,
        limits.max_manifest_entries,
    )
    .map_err(Refusal::Root)?;
    let mut tgt = Target {
        layers,
        lowers: Lowers::new(&t.lowerdirs, t.overlay_xattrs),
    };
    let plan = Plan {
        blob: &blob,
        layers: own,
        changed,
        deep,
        untouched,
        max_bytes: limits.max_layer_bytes,
    };
    let applying = Instant::now();
    let failed = ResetError::Failed;
    let (paths, bytes) =
        apply(&mut view, &mut tgt, &plan).map_err(|e| failed(Failure::Apply(e)))?;
    let apply_time = applying.elapsed();
    let scanning = Instant::now();
    inspection
        .rebase(observed)
        .map_err(|e| failed(Failure::Rescan(Box::new(e))))?;
    scans += scanning.elapsed();
    frozen.thaw().map_err(|e| failed(Failure::Thaw(e)))?;
    Ok(Reset {
        paths,
        bytes,
        freeze: frozen_at.elapsed(),
        apply: apply_time,
        read,
        peek,
        scans,
        total: started.elapsed(),
        idle,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(n: u8) -> Descriptor {
        Descriptor {
            digest: format!("sha256:{}", format!("{n:02x}").repeat(32)),
            diff_id: format!("sha256:{}", format!("{n:02x}").repeat(32)),
            size: 1,
            media_type: crate::checkpoint::store::MEDIA_TYPE_LAYER_ZSTD.into(),
        }
    }

    fn manifest(seq: u64, kind: CheckpointKind, layers: &[u8]) -> Manifest {
        let mut m = Manifest::child_of(None, seq, &format!("t{seq}"), kind);
        m.fs_layers = layers.iter().map(|&n| desc(n)).collect();
        m
    }

    struct NoFreeze;

    impl crate::sys::cgroup::freezer::Freezer for NoFreeze {
        fn freeze(&self) -> io::Result<()> {
            Ok(())
        }
        fn thaw(&self) -> io::Result<()> {
            Ok(())
        }
    }

    /// What crab's layer writer writes, this reader reads: pax names and times, sparse files,
    /// hard links, symlinks, xattrs, whiteouts; and the data offsets lead to the data.
    #[test]
    fn layers_the_writer_writes_read_back() {
        use std::os::unix::fs::{symlink, FileExt};
        let t = tempfile::tempdir().unwrap();
        let upper = t.path().join("upper");
        let long = "n".repeat(150);
        std::fs::create_dir_all(upper.join("app").join(&long)).unwrap();
        std::fs::write(upper.join("app/a.txt"), "hello").unwrap();
        std::fs::hard_link(upper.join("app/a.txt"), upper.join("app/b.txt")).unwrap();
        symlink("a.txt", upper.join("app/l")).unwrap();
        std::fs::write(upper.join("app").join(&long).join("f"), "deep").unwrap();
        let f = File::create(upper.join("app/sparse")).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(b"middle", 32 << 20).unwrap();
        drop(f);
        let tagged = crate::sys::xattr::lset(&upper.join("app/a.txt"), "user.crab", b"v").is_ok();
        let store = Store::open(&t.path().join("store")).unwrap();
        let p = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        let added = p(&["/app", "/app/a.txt", "/app/b.txt", "/app/l", "/app/sparse"]);
        let mut deep_added = added.clone();
        deep_added.push(Path::new("/app").join(&long));
        deep_added.push(Path::new("/app").join(&long).join("f"));
        let deleted = p(&["/gone"]);
        let diff = crate::checkpoint::layer::FsDiffPaths {
            added: &deep_added,
            modified: &[],
            deleted: &deleted,
        };
        let (desc, _) =
            crate::checkpoint::layer::write_fs_layer(&store, &upper, &diff, &NoFreeze).unwrap();
        let mut st = LayerState::default();
        read_layer(&store, &desc, |r| st.apply(r, 1000)).unwrap();
        assert_eq!(st.lookup(Path::new("gone")), Lookup::Absent);
        let entry = |rel: &str| match st.lookup(Path::new(rel)) {
            Lookup::Entry(Node::Entry {
                header,
                data,
                linked,
            }) => (header.clone(), *data, linked.clone()),
            other => panic!("{rel}: {other:?}"),
        };
        // The data offsets lead to the bytes (one pass over the uncompressed tar).
        let mut tar = Vec::new();
        read_layer(&store, &desc, |r| {
            r.read_to_end(&mut tar)?;
            Ok(())
        })
        .unwrap();
        let bytes = |d: DataRef| tar[d.at.offset as usize..][..d.at.len as usize].to_vec();
        let (a, da, _) = entry("app/a.txt");
        assert_eq!(bytes(da.unwrap()), b"hello");
        if tagged {
            assert_eq!(a.xattrs, vec![(b"user.crab".to_vec(), b"v".to_vec())]);
        }
        let (_, db, linked) = entry("app/b.txt");
        assert_eq!((db, linked.as_deref()), (da, Some(Path::new("app/a.txt"))));
        let (l, _, _) = entry("app/l");
        assert_eq!(
            (l.kind, l.link.as_path()),
            (Kind::Symlink, Path::new("a.txt"))
        );
        let (deep, dd, _) = entry(&format!("app/{long}/f"));
        assert_eq!(
            (deep.kind, bytes(dd.unwrap())),
            (Kind::File, b"deep".to_vec())
        );
        let (sp, ds, _) = entry("app/sparse");
        assert_eq!(sp.size, 64 << 20);
        let map = sp.sparse.expect("stored sparse");
        let data = bytes(ds.unwrap());
        assert_eq!(data.len() as u64, map.iter().map(|e| e.1).sum::<u64>());
        let (off, len) = map.iter().copied().find(|e| e.1 > 0).unwrap();
        assert!(off <= 32 << 20 && 32 << 20 < off + len, "{map:?}");
        let at = (32 << 20) - off as usize;
        assert_eq!(&data[at..at + 6], b"middle");
        // A damaged blob is refused by its digest.
        let blob = store.blob_path(&desc.digest);
        let mut raw = std::fs::read(&blob).unwrap();
        let n = raw.len();
        raw[n - 1] ^= 1;
        std::fs::write(&blob, raw).unwrap();
        let e = read_layer(&store, &desc, |r| LayerState::default().apply(r, 1000));
        assert!(
            matches!(
                e,
                Err(RollbackError::Layer {
                    source: LayerProblem::Digest(_) | LayerProblem::Tar(_) | LayerProblem::Io(_),
                    ..
                })
            ),
            "a damaged layer was read"
        );
    }

    /// What went wrong keeps its kind (and says it as the clients were always told).
    #[test]
    fn errors_say_what_went_wrong_and_keep_its_kind() {
        let t = tempfile::tempdir().unwrap();
        let rootfs = Rootfs {
            path: t.path(),
            upperdir: &t.path().join("no-upper"),
            lowerdirs: &[],
            overlay_xattrs: crate::inspector::fs::OverlayXattrs::Trusted,
        };
        let limits = crab_runtime_config::LimitsConfig::default();
        let e = onto_rootfs(&rootfs, &[], &|_| PathBuf::new(), &limits).unwrap_err();
        assert!(matches!(e, RollbackError::Upperdir(_)), "{e}");
        assert!(e.to_string().starts_with("reading its upperdir: "), "{e}");
        // A layer blob that is not there names the layer and its file.
        let d = desc(7);
        let e = read_layer_at(&t.path().join("gone"), &d, |_| Ok(())).unwrap_err();
        assert!(
            matches!(&e, RollbackError::Layer { source: LayerProblem::Io(io), .. } if io.kind() == io::ErrorKind::NotFound),
            "{e}"
        );
        assert!(
            e.to_string().starts_with(&format!("layer {} (", d.digest)),
            "{e}"
        );
        let refused = ResetError::from(Refusal::Lineage(LineageError::NotDurable(3)));
        assert_eq!(
            refused.to_string(),
            "checkpoint 3 failed: it is no recovery point"
        );
        let failed = ResetError::Failed(Failure::Thaw(io::Error::from_raw_os_error(libc::EBUSY)));
        assert!(
            failed
                .to_string()
                .starts_with("resetting the files failed part way: cannot thaw it: "),
            "{failed}"
        );
    }

    #[test]
    fn the_lineage_must_lead_from_the_checkpoint_to_the_present() {
        use CheckpointKind::*;
        let target = manifest(2, Fs, &[1, 2]);
        assert!(check_lineage(&target, &manifest(5, Fs, &[1, 2, 3, 4])).is_ok());
        assert!(check_lineage(&target, &manifest(5, Full, &[1, 2])).is_ok());
        // A new chain (after a failure), another branch, a failed newest checkpoint.
        let e = check_lineage(&target, &manifest(5, Fs, &[9])).unwrap_err();
        assert_eq!(e, LineageError::Diverged(2));
        assert!(e.to_string().contains("no longer descend"), "{e}");
        assert!(check_lineage(&target, &manifest(5, Fs, &[1, 3, 4])).is_err());
        let e = check_lineage(&target, &manifest(5, Failed, &[1, 2, 3])).unwrap_err();
        assert_eq!(e, LineageError::NewestFailed(5));
        assert!(e.to_string().contains("failed"), "{e}");
        assert!(check_lineage(&manifest(2, Failed, &[1]), &manifest(5, Fs, &[1])).is_err());
        // Older than the image the container runs (a recreate rollback to a later one).
        let mut latest = manifest(5, Fs, &[1, 2, 3]);
        latest.image_layers = 3;
        let e = check_lineage(&target, &latest).unwrap_err();
        assert!(
            e.to_string().contains("older than the checkpoint image"),
            "{e}"
        );
    }
}

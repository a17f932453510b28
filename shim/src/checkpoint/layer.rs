//! Filesystem checkpoints: the net change of a turn as an OCI image layer.
//!
//! [`write_fs_layer`] turns the inspector's diff (container paths added, modified, deleted) into
//! a tar layer (POSIX pax, numeric owners, modes, mtimes with nanoseconds, xattrs including
//! `security.capability`, hardlinks within the layer, symlinks, device nodes, fifos), compressed
//! with zstd (`application/vnd.oci.image.layer.v1.tar+zstd`):
//! - an added or modified path is copied from the upperdir as it is while the container is
//!   frozen (a directory as its own metadata entry; its children are listed by the diff);
//! - a path that is a whiteout in the upperdir, or gone from it, becomes `<dir>/.wh.<name>`;
//! - an opaque upper directory (`overlay.opaque=y`: the image's content there is hidden)
//!   becomes its entry, `<dir>/.wh..wh..opq` and its *whole* upper subtree: the marker hides
//!   every older layer's content of that directory, including crab's own earlier layers, so
//!   the layer must carry everything the directory holds.
//!
//! - a regular file with holes (`SEEK_DATA`/`SEEK_HOLE`) is stored with its holes, as a PAX
//!   GNU sparse 1.0 entry (the format GNU tar writes with `--sparse --posix`, and that Go's
//!   `archive/tar`, hence containerd's differ, GNU tar and libarchive read back): a sparse map
//!   and the data extents only. A `truncate -s 1T` file costs a few blocks, not a terabyte.
//!   (containerd's differ then writes the holes back as zeros when it unpacks the layer: the
//!   restored file has the same size and data, but is not sparse.)
//!
//! What one layer may cost is bounded ([`LayerOptions`]): file data beyond `max_bytes`, or
//! files whose apparent size (holes included, what unpacking the layer writes) adds up beyond
//! `max_apparent_bytes`, fail the layer before the file that crosses the bound is copied, and
//! an opaque subtree is walked with an explicit stack at most `max_depth` deep; only the
//! mount's own overlay xattr prefix is overlay state.
//!
//! A capture can be cancelled ([`Cancel`], set when its checkpoint job passes its deadline):
//! the walk, the copy (per [`super::capture::COPY_CHUNK`]) and the compression check it and
//! stop with [`LayerError::Cancelled`]; the temporary files are removed as on any error, so no
//! part of the layer is ever visible in the store.
//!
//! The upperdir is read without following symlinks at any component ([`super::capture`]), so
//! a container that plants symlinks cannot make the layer read host files; the tar is written by
//! [`super::tar`].
//!
//! The container is frozen only while the changed entries are copied into an uncompressed
//! temporary tar in the store; it is thawed (on every path, errors included) before the tar is
//! compressed, hashed and moved into `blobs/`.
//!
//! For the caller: the layer holds the listed paths as they are at the freeze. Whatever changed
//! after the diff was computed shows up in the next diff, as long as the next diff is taken
//! against the manifest the current diff was computed from; to make a checkpoint an exact
//! instant, scan and diff while frozen ([`CgroupFreezer`] nests: freeze, scan, diff, call this

use std::{
    collections::BTreeSet,
    io::{self, BufWriter, Read, Seek, Write},
    path::{Component, Path, PathBuf},
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};

use super::capture::{self, Capture};
pub use super::capture::{LayerError, LayerOptions};
pub use super::deadline::Cancel;
use super::store::{digest_string, Descriptor, Store, StoreError, MEDIA_TYPE_LAYER_ZSTD};
use super::tar::TarWriter;
use crate::inspector::{fs::FsDiff, FsFinding};
use crate::sys::cgroup::freezer::{Freezer, Frozen};

/// zstd level: fast enough to keep up with a disk, off the critical path anyway (after the thaw).
const ZSTD_LEVEL: i32 = 3;

/// The container paths of a net filesystem change (the inspector's [`FsDiff`] or the `fs`
/// part of a turn's answer).
#[derive(Debug, Clone, Copy)]
pub struct FsDiffPaths<'a> {
    pub added: &'a [PathBuf],
    pub modified: &'a [PathBuf],
    pub deleted: &'a [PathBuf],
}

impl<'a> From<&'a FsDiff> for FsDiffPaths<'a> {
    fn from(d: &'a FsDiff) -> Self {
        FsDiffPaths {
            added: &d.added,
            modified: &d.modified,
            deleted: &d.deleted,
        }
    }
}

impl<'a> From<&'a FsFinding> for FsDiffPaths<'a> {
    fn from(f: &'a FsFinding) -> Self {
        FsDiffPaths {
            added: &f.added,
            modified: &f.modified,
            deleted: &f.deleted,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Tar entries, whiteouts included.
    pub entries: u64,
    /// Bytes of the uncompressed tar.
    pub bytes: u64,
    /// Bytes of the stored (compressed) blob.
    pub compressed: u64,
    /// How long the container was stopped: freeze request to thaw done.
    pub freeze: Duration,
    /// The part of `freeze` spent copying entries into the temporary tar.
    pub capture: Duration,
    pub total: Duration,
}

/// Writes the layer of `diff` (paths of the container whose overlay upperdir is `upperdir`)
/// into `store`, freezing the container with `freezer` only while the entries are read.
pub fn write_fs_layer(
    store: &Store,
    upperdir: &Path,
    diff: &FsDiffPaths<'_>,
    freezer: &dyn Freezer,
) -> Result<(Descriptor, LayerStats), LayerError> {
    write_fs_layer_with(store, upperdir, diff, freezer, &LayerOptions::default())
}

/// [`write_fs_layer`] within `opts`.
pub fn write_fs_layer_with(
    store: &Store,
    upperdir: &Path,
    diff: &FsDiffPaths<'_>,
    freezer: &dyn Freezer,
    opts: &LayerOptions,
) -> Result<(Descriptor, LayerStats), LayerError> {
    write_fs_layer_with_volumes(store, upperdir, diff, &[], freezer, opts, &Cancel::new())
}

/// A tracked volume captured into a layer with the rootfs: a host directory bind-mounted at
/// `at` in the container, whose entries go below `at` in the layer (so an image built from the
/// layers has the volume's contents where the container saw them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeCapture {
    /// The path in the container (absolute).
    pub at: PathBuf,
    /// The host directory.
    pub dir: PathBuf,
    /// Paths relative to the volume's root to capture as in an fs diff (gone: a whiteout), or
    /// `None` for the whole volume (its base: an opaque directory with everything in it).
    pub paths: Option<BTreeSet<PathBuf>>,
}

/// [`write_fs_layer_with`], with tracked volumes captured into the same layer, all while the
/// container is frozen once, until `cancel` is set. `opts.max_bytes` bounds each tree's data on
/// its own, `opts.max_apparent_bytes` the whole layer's.
pub fn write_fs_layer_with_volumes(
    store: &Store,
    upperdir: &Path,
    diff: &FsDiffPaths<'_>,
    volumes: &[VolumeCapture],
    freezer: &dyn Freezer,
    opts: &LayerOptions,
    cancel: &Cancel,
) -> Result<(Descriptor, LayerStats), LayerError> {
    let start = Instant::now();
    let paths = plan(diff)?;
    let mut opened = Vec::with_capacity(volumes.len());
    for v in volumes {
        let prefix: PathBuf =
            v.at.components()
                .filter_map(|c| match c {
                    Component::Normal(n) => Some(n),
                    _ => None,
                })
                .collect();
        if prefix.as_os_str().is_empty() || !v.at.is_absolute() {
            return Err(LayerError::InvalidPath(v.at.clone()));
        }
        opened.push((capture::open_upper(&v.dir)?, prefix, v));
    }
    let upper = capture::open_upper(upperdir)?;
    let tar_tmp = store.temp_file("layer.tar")?;
    let tar_file = tar_tmp
        .file
        .try_clone()
        .map_err(|e| StoreError::io("dup", tar_tmp.path(), e))?;
    let tar = TarWriter::new(
        BufWriter::with_capacity(1 << 20, tar_file),
        tar_tmp.path().to_path_buf(),
    );
    let capture_all = |tar: TarWriter| -> Result<TarWriter, LayerError> {
        let mut capture = Capture::new(upper, upperdir, tar, *opts, cancel.clone());
        capture.run(&paths)?;
        let mut apparent = capture.apparent_bytes();
        let mut tar = capture.into_tar();
        for (fd, prefix, v) in opened {
            tar.set_prefix(&prefix);
            let mut capture =
                Capture::new(fd, &v.dir, tar, *opts, cancel.clone()).with_apparent_bytes(apparent);
            match &v.paths {
                Some(paths) => capture.run(paths)?,
                None => capture.run_whole()?,
            }
            apparent = capture.apparent_bytes();
            tar = capture.into_tar();
        }
        tar.set_prefix(Path::new(""));
        Ok(tar)
    };

    if cancel.is_cancelled() {
        // Its job passed the deadline before it began: the container is not even frozen.
        return Err(LayerError::Cancelled { written: 0 });
    }
    let freeze_start = Instant::now();
    let frozen = Frozen::freeze(freezer, "a failed capture").map_err(LayerError::Freeze)?;
    let capture_start = Instant::now();
    let captured = capture_all(tar);
    let capture_time = capture_start.elapsed();
    let thawed = frozen.thaw();
    let freeze_time = freeze_start.elapsed();
    let mut tar = match (captured, thawed) {
        (Ok(tar), Ok(())) => tar,
        (Err(e), Ok(())) => return Err(e),
        (Ok(_), Err(t)) => return Err(LayerError::Thaw(t)),
        (Err(e), Err(t)) => {
            log::error!("thawing the container after a failed capture: {t}");
            return Err(e);
        }
    };

    let entries = tar.entries();
    let bytes = tar.finish()?;
    let desc = compress(store, tar_tmp, bytes, cancel)?;
    let stats = LayerStats {
        entries,
        bytes,
        compressed: desc.size,
        freeze: freeze_time,
        capture: capture_time,
        total: start.elapsed(),
    };
    log::debug!(
        "fs layer {}: {} entries, {} bytes ({} compressed), frozen {:?}, total {:?}",
        desc.digest,
        stats.entries,
        stats.bytes,
        stats.compressed,
        stats.freeze,
        stats.total
    );
    Ok((desc, stats))
}

/// Writes the whole tree of `dir`, an overlay layer directory (a lowerdir or upperdir: its
/// whiteouts and opaque directories become their OCI forms), as an uncompressed tar into
/// `out` (at `out_path`, for errors), within `opts`; returns its entries and bytes. Nothing is
/// frozen: the directory must not change meanwhile (an overlay's lower layers never do).
pub fn write_tree_tar(
    dir: &Path,
    out: std::fs::File,
    out_path: &Path,
    opts: &LayerOptions,
) -> Result<(u64, u64), LayerError> {
    let upper = capture::open_upper(dir)?;
    let tar = TarWriter::new(
        BufWriter::with_capacity(1 << 20, out),
        out_path.to_path_buf(),
    );
    let mut capture = Capture::new(upper, dir, tar, *opts, Cancel::new());
    capture.run_tree()?;
    let mut tar = capture.into_tar();
    let entries = tar.entries();
    Ok((entries, tar.finish()?))
}

/// Upperdir-relative paths to capture, in path order (parents first, each subtree contiguous).
fn plan(diff: &FsDiffPaths<'_>) -> Result<BTreeSet<PathBuf>, LayerError> {
    let mut out = BTreeSet::new();
    for p in diff.added.iter().chain(diff.modified).chain(diff.deleted) {
        let mut comps = p.components();
        if comps.next() != Some(Component::RootDir) {
            return Err(LayerError::InvalidPath(p.clone()));
        }
        let mut rel = PathBuf::new();
        for c in comps {
            match c {
                Component::Normal(n) => rel.push(n),
                Component::CurDir => {}
                _ => return Err(LayerError::InvalidPath(p.clone())),
            }
        }
        out.insert(rel);
    }
    Ok(out)
}

/// Compresses the finished temporary tar into a blob, hashing both, and stores it (unless
/// `cancel` is set meanwhile).
fn compress(
    store: &Store,
    tar_tmp: super::store::TempFile,
    tar_len: u64,
    cancel: &Cancel,
) -> Result<Descriptor, LayerError> {
    let tar_path = tar_tmp.path().to_path_buf();
    let mut tar = tar_tmp;
    tar.file()
        .rewind()
        .map_err(|e| StoreError::io("seek", &tar_path, e))?;
    let mut blob = store.temp_file("layer.tar.zst")?;
    let blob_path = blob.path().to_path_buf();
    let out = HashingWriter {
        inner: BufWriter::with_capacity(1 << 20, blob.file()),
        hash: Sha256::new(),
        len: 0,
    };
    let write_err = |e: io::Error| StoreError::io("write", &blob_path, e);
    let mut enc = zstd::stream::write::Encoder::new(out, ZSTD_LEVEL).map_err(write_err)?;
    enc.include_checksum(true).map_err(write_err)?;
    enc.set_pledged_src_size(Some(tar_len)).map_err(write_err)?;
    let mut diff_hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        if cancel.is_cancelled() {
            return Err(LayerError::Cancelled { written: tar_len });
        }
        let n = match tar.file().read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(StoreError::io("read", &tar_path, e).into()),
        };
        diff_hash.update(&buf[..n]);
        enc.write_all(&buf[..n]).map_err(write_err)?;
    }
    let mut out = enc.finish().map_err(write_err)?;
    out.inner.flush().map_err(write_err)?;
    if cancel.is_cancelled() {
        return Err(LayerError::Cancelled { written: tar_len });
    }
    let desc = Descriptor {
        digest: digest_string(out.hash),
        diff_id: digest_string(diff_hash),
        size: out.len,
        media_type: MEDIA_TYPE_LAYER_ZSTD.to_owned(),
    };
    drop(tar);
    store.put_blob_hashed(&blob_path, &desc)?;
    Ok(desc)
}

struct HashingWriter<W> {
    inner: W,
    hash: Sha256,
    len: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, os::fd::AsRawFd};

    use super::*;
    use crate::checkpoint::capture::{classify_xattr, data_extents, merge_extents, XattrClass};
    use crate::checkpoint::tar::sparse_map;
    use crate::inspector::fs::OverlayXattrs;

    /// A file of `size` bytes with `chunks` written at their offsets, holes elsewhere.
    fn sparse(p: &Path, size: u64, chunks: &[(u64, &[u8])]) {
        use std::os::unix::fs::FileExt;
        let f = fs::File::create(p).unwrap();
        f.set_len(size).unwrap();
        for (off, data) in chunks {
            f.write_all_at(data, *off).unwrap();
        }
        f.sync_all().unwrap();
    }

    #[test]
    fn sparse_extents_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        // 2000 data blocks, each followed by a hole.
        let chunks: Vec<(u64, Vec<u8>)> = (0..2000u64)
            .map(|i| (i * (1 << 20), vec![1u8; 4096]))
            .collect();
        let refs: Vec<(u64, &[u8])> = chunks.iter().map(|(o, d)| (*o, d.as_slice())).collect();
        sparse(&p, 2000 << 20, &refs);
        let f = fs::File::open(&p).unwrap();
        let all = data_extents(f.as_raw_fd(), 2000 << 20, 4096, &Cancel::new()).unwrap();
        // 2000 data extents and the empty one that marks the end of the file.
        assert_eq!(all.len(), 2001);
        assert_eq!(all[2000], (2000 << 20, 0));
        assert!(
            all[..2000]
                .iter()
                .all(|&(off, len)| off % (1 << 20) == 0 && len >= 4096),
            "{:?}",
            &all[..3]
        );
        let few = data_extents(f.as_raw_fd(), 2000 << 20, 100, &Cancel::new()).unwrap();
        assert!(few.len() <= 100, "{}", few.len());
        // Every data byte is still covered.
        for (off, _) in &chunks {
            assert!(
                few.iter().any(|&(o, l)| o <= *off && off + 4096 <= o + l),
                "{off}"
            );
        }
        assert_eq!(
            merge_extents(&[(0, 10), (15, 5), (100, 1)], 5),
            vec![(0, 20), (100, 1)]
        );
        assert_eq!(sparse_map(&[(0, 4), (8, 2)]).len(), 512);
        assert!(sparse_map(&[(0, 4), (8, 2)]).starts_with(b"2\n0\n4\n8\n2\n\0"));
    }

    struct CountingFreezer(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64);

    impl CountingFreezer {
        fn new() -> Self {
            CountingFreezer(0.into(), 0.into())
        }
        fn counts(&self) -> (u64, u64) {
            use std::sync::atomic::Ordering::SeqCst;
            (self.0.load(SeqCst), self.1.load(SeqCst))
        }
    }

    impl Freezer for CountingFreezer {
        fn freeze(&self) -> io::Result<()> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
        fn thaw(&self) -> io::Result<()> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok(())
        }
    }

    /// A file of `mib` MiB of data (no holes, not all the same bytes).
    fn dense(p: &Path, mib: u64) {
        let mut f = BufWriter::new(fs::File::create(p).unwrap());
        let mut block = vec![0u8; 1 << 20];
        for i in 0..mib {
            for (j, b) in block.iter_mut().enumerate() {
                *b = (i as usize * 31 + j * 7 + 1) as u8;
            }
            f.write_all(&block).unwrap();
        }
        f.into_inner().unwrap().sync_all().unwrap();
    }

    /// Every file left in the store's `blobs/` (temporary or stored).
    fn blob_files(store: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut dirs = vec![store.join("blobs")];
        while let Some(d) = dirs.pop() {
            for e in fs::read_dir(&d).unwrap().flatten() {
                match e.file_type().unwrap().is_dir() {
                    true => dirs.push(e.path()),
                    false => out.push(e.path()),
                }
            }
        }
        out
    }

    fn big_file_layer(
        mib: u64,
    ) -> (
        tempfile::TempDir,
        PathBuf,
        Store,
        Vec<PathBuf>,
        CountingFreezer,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        fs::create_dir_all(upper.join("app")).unwrap();
        fs::write(upper.join("app/small"), b"small").unwrap();
        dense(&upper.join("app/big"), mib);
        let store = Store::open(&dir.path().join("store")).unwrap();
        let added = vec![
            PathBuf::from("/app"),
            PathBuf::from("/app/big"),
            PathBuf::from("/app/small"),
        ];
        (dir, upper, store, added, CountingFreezer::new())
    }

    /// Cancelled in the middle of a big file's data: the capture stops within a chunk, thaws,
    /// and leaves nothing in the store; a capture that is not cancelled writes the whole layer.
    #[test]
    fn a_cancelled_capture_stops_within_a_chunk_and_leaves_nothing() {
        let (dir, upper, store, added, freezer) = big_file_layer(96);
        let diff = FsDiffPaths {
            added: &added,
            modified: &[],
            deleted: &[],
        };
        let opts = LayerOptions::default();
        // Looks: one before the freeze, one per path (/app, /app/big), one at the big file's
        // first extent, then one before each chunk of its data: the sixth is before its second
        // chunk.
        let cancel = Cancel::after_looks(6);
        let e = write_fs_layer_with_volumes(&store, &upper, &diff, &[], &freezer, &opts, &cancel)
            .unwrap_err();
        let LayerError::Cancelled { written } = e else {
            panic!("not cancelled: {e}");
        };
        assert!(
            (capture::COPY_CHUNK as u64..2 * capture::COPY_CHUNK as u64).contains(&written),
            "stopped after {written} bytes"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "the fs capture was stopped after writing {written} bytes of its layer; nothing \
                 of it is stored"
            )
        );
        assert_eq!(freezer.counts(), (1, 1), "thawed once");
        assert_eq!(blob_files(&dir.path().join("store")), Vec::<PathBuf>::new());

        // Set before it starts: nothing is written, the container not even frozen.
        let cancel = Cancel::new();
        cancel.cancel();
        let e = write_fs_layer_with_volumes(&store, &upper, &diff, &[], &freezer, &opts, &cancel)
            .unwrap_err();
        assert!(matches!(e, LayerError::Cancelled { written: 0 }), "{e}");
        assert_eq!(freezer.counts(), (1, 1), "frozen again");
        assert_eq!(blob_files(&dir.path().join("store")), Vec::<PathBuf>::new());

        // Not cancelled: the whole layer.
        let (desc, stats) = write_fs_layer_with_volumes(
            &store,
            &upper,
            &diff,
            &[],
            &freezer,
            &opts,
            &Cancel::new(),
        )
        .unwrap();
        assert!(stats.bytes > 96 << 20, "{stats:?}");
        assert_eq!(
            blob_files(&dir.path().join("store")),
            vec![store.blob_path(&desc.digest)]
        );
    }

    /// Cancelled from another thread while it copies (as the coordinator does at the job
    /// deadline): the capture returns within a few chunks' time and no temporary file is left.
    #[test]
    fn a_capture_cancelled_while_it_copies_stops_promptly() {
        let (dir, upper, store, added, freezer) = big_file_layer(512);
        let diff = FsDiffPaths {
            added: &added,
            modified: &[],
            deleted: &[],
        };
        let cancel = Cancel::new();
        let blobs = dir.path().join("store/blobs");
        let watcher = {
            let cancel = cancel.clone();
            std::thread::spawn(move || {
                // Once the temporary tar holds 32 MiB: the copy is under way.
                let started = Instant::now();
                while started.elapsed() < Duration::from_secs(30) {
                    let big = fs::read_dir(&blobs).unwrap().flatten().any(|e| {
                        e.file_name().to_string_lossy().ends_with(".tmp")
                            && e.metadata().is_ok_and(|m| m.len() >= 32 << 20)
                    });
                    if big {
                        cancel.cancel();
                        return Some(Instant::now());
                    }
                    std::thread::yield_now();
                }
                None
            })
        };
        let r = write_fs_layer_with_volumes(
            &store,
            &upper,
            &diff,
            &[],
            &freezer,
            &LayerOptions::default(),
            &cancel,
        );
        let returned = Instant::now();
        let cancelled_at = watcher
            .join()
            .unwrap()
            .expect("the copy never got under way");
        let e = r.unwrap_err();
        let LayerError::Cancelled { written } = e else {
            panic!("not cancelled: {e}");
        };
        let stop = returned.duration_since(cancelled_at);
        eprintln!("cancelled after {written} bytes written, returned {stop:?} after the cancel");
        assert!(stop < Duration::from_millis(500), "{stop:?}");
        assert_eq!(freezer.counts(), (1, 1));
        assert_eq!(blob_files(&dir.path().join("store")), Vec::<PathBuf>::new());
    }

    /// Sparse files cost their apparent size against `max_apparent_bytes` (what unpacking the
    /// layer writes), before any of their data is read; hard links to a file already in the
    /// layer cost nothing; the bound is the layer's, volumes included.
    #[test]
    fn the_apparent_size_of_a_layer_is_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        fs::create_dir_all(upper.join("app")).unwrap();
        sparse(&upper.join("app/a"), 40 << 20, &[(5, b"a")]);
        fs::hard_link(upper.join("app/a"), upper.join("app/a2")).unwrap();
        sparse(&upper.join("app/b"), 30 << 20, &[(7, b"b")]);
        let vol = dir.path().join("vol");
        fs::create_dir_all(&vol).unwrap();
        sparse(&vol.join("v"), 20 << 20, &[(9, b"v")]);
        let store = Store::open(&dir.path().join("store")).unwrap();
        let p = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        let all = p(&["/app", "/app/a", "/app/a2", "/app/b"]);
        let diff = FsDiffPaths {
            added: &all,
            modified: &[],
            deleted: &[],
        };
        let opts = |mib: u64| LayerOptions {
            max_apparent_bytes: mib << 20,
            ..LayerOptions::default()
        };
        let freezer = CountingFreezer::new();
        let layer = |d: &FsDiffPaths<'_>, vols: &[VolumeCapture], mib: u64| {
            write_fs_layer_with_volumes(
                &store,
                &upper,
                d,
                vols,
                &freezer,
                &opts(mib),
                &Cancel::new(),
            )
        };
        // 40 + 30 MiB (the link is free): over 64 MiB, a clear error naming the key.
        let e = layer(&diff, &[], 64).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(
                e,
                LayerError::Limit {
                    key: "max_layer_apparent_bytes",
                    limit,
                    ..
                } if limit == 64 << 20
            ),
            "{msg}"
        );
        assert!(
            msg.contains("[limits] max_layer_apparent_bytes")
                && msg.contains("67108864")
                && msg.contains("holes included")
                && msg.contains("app/b"),
            "{msg}"
        );
        assert_eq!(blob_files(&dir.path().join("store")), Vec::<PathBuf>::new());
        assert_eq!(freezer.counts(), (1, 1));
        // Within 70 MiB: a layer of a few KB.
        let (desc, stats) = layer(&diff, &[], 70).unwrap();
        assert!(desc.size < 16 << 10 && stats.bytes < 64 << 10, "{stats:?}");
        // A tracked volume counts with the rootfs: 70 + 20 MiB.
        let vols = [VolumeCapture {
            at: PathBuf::from("/data"),
            dir: vol.clone(),
            paths: None,
        }];
        let e = layer(&diff, &vols, 80).unwrap_err();
        assert!(
            e.to_string().contains("max_layer_apparent_bytes") && e.to_string().contains("/v"),
            "{e}"
        );
        layer(&diff, &vols, 90).unwrap();
    }

    /// Only the mount's own prefix is overlay state; escaped `*.overlay.overlay.X` names are
    /// the container's own. (The root-only `tests/root_capture.rs` checks this on a real
    /// overlay.)
    #[test]
    fn overlay_xattrs_are_told_apart_by_the_mount_prefix() {
        assert!(matches!(
            classify_xattr(b"user.overlay.opaque", OverlayXattrs::Trusted),
            XattrClass::Plain(_)
        ));
        assert!(matches!(
            classify_xattr(b"trusted.overlay.opaque", OverlayXattrs::Trusted),
            XattrClass::Overlay(b"opaque")
        ));
        assert!(matches!(
            classify_xattr(b"user.overlay.overlay.x", OverlayXattrs::User),
            XattrClass::Plain(n) if n == b"user.overlay.x"
        ));
    }

    /// The directories above a changed path travel with it, as the upperdir holds them: a
    /// layer that has `tmp/x` but no `tmp/` entry is applied with `tmp` made 0755 by Docker's
    /// layer store, masking the image's 1777 `/tmp`. Each directory once, parents first; a
    /// directory that is itself a change is not written twice.
    #[test]
    fn a_layer_carries_the_directories_above_each_change() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path().join("upper");
        fs::create_dir_all(upper.join("tmp")).unwrap();
        fs::set_permissions(upper.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
        fs::write(upper.join("tmp/x"), b"x").unwrap();
        fs::create_dir_all(upper.join("app/calc/deep")).unwrap();
        fs::set_permissions(upper.join("app/calc"), fs::Permissions::from_mode(0o750)).unwrap();
        fs::write(upper.join("app/calc/ops.py"), b"ops").unwrap();
        fs::write(upper.join("app/calc/deep/y"), b"y").unwrap();
        let mtime = fs::metadata(upper.join("app/calc")).unwrap().mtime();
        let paths: BTreeSet<PathBuf> = ["tmp/x", "app/calc", "app/calc/ops.py", "app/calc/deep/y"]
            .iter()
            .map(PathBuf::from)
            .collect();
        let out = dir.path().join("layer.tar");
        let tar = TarWriter::new(BufWriter::new(fs::File::create(&out).unwrap()), out.clone());
        let mut capture = Capture::new(
            capture::open_upper(&upper).unwrap(),
            &upper,
            tar,
            LayerOptions::default(),
            Cancel::new(),
        );
        capture.run(&paths).unwrap();
        capture.into_tar().finish().unwrap();
        let mut archive = tar::Archive::new(fs::File::open(&out).unwrap());
        let entries: Vec<(String, u32, u64)> = archive
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    h.mode().unwrap(),
                    h.mtime().unwrap(),
                )
            })
            .collect();
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "app/",
                "app/calc/",
                "app/calc/deep/",
                "app/calc/deep/y",
                "app/calc/ops.py",
                "tmp/",
                "tmp/x"
            ],
            "{entries:?}"
        );
        let mode = |n: &str| entries.iter().find(|e| e.0 == n).unwrap().1 & 0o7777;
        assert_eq!(mode("tmp/"), 0o1777);
        assert_eq!(mode("app/calc/"), 0o750);
        let calc = entries.iter().find(|e| e.0 == "app/calc/").unwrap();
        assert_eq!(calc.2 as i64, mtime);
    }
}

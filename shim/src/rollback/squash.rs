//! Squashing a run of a checkpoint's fs layers into one layer, so that an exported image stays
//! within the layer counts image stores take (every fs or full checkpoint adds a layer to the
//! chain; Docker refuses images much deeper than a hundred layers).
//!
//! The layers are read with the rollback's reader ([`crate::rollback::tar`], every header
//! checked, each blob's digest checked over all of it) into a [`LayerState`]: path by path
//! what they leave, with OCI semantics. The squashed layer is that state written as one layer:
//! a path's newest entry, a whiteout where a path is deleted, an opaque marker where a
//! directory's older content is hidden. Applied over the same lower layers it gives what the
//! run of layers gives. The writer is deterministic (path order, the same headers), so the
//! same run squashes to the same digest in every export.

use std::{
    collections::{BTreeSet, HashMap},
    fs::File,
    io::{self, BufWriter, Read, Seek, SeekFrom, Write},
    ops::Range,
    path::{Path, PathBuf},
};

use super::{
    read_layer_at,
    state::{DataRef, LayerState, Lookup, Node},
    tar::{Header, Kind},
    RollbackError,
};
use crate::checkpoint::{
    store::{temp_file_in, Descriptor, StoreError, TempFile},
    tar::{child_name, sparse_map, tar_name, TarEntry, TarWriter, OPAQUE_MARKER},
};

/// Which runs of a chain of `n` fs layers (oldest first) become one layer each so that they
/// take at most `room` layers of an image: every layer alone when they fit; else runs of `b`
/// layers starting at multiples of `b` (the last one shorter), `b` the smallest power of two
/// that fits. A growing chain keeps its runs until `b` doubles, so successive exports of a
/// sandbox share their squashed layers.
pub fn plan(n: usize, room: usize) -> Vec<Range<usize>> {
    let room = room.max(1);
    let mut b = 1usize;
    while n.div_ceil(b) > room {
        b *= 2;
    }
    (0..n).step_by(b).map(|s| s..(s + b).min(n)).collect()
}

/// What [`squash`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Squashed {
    /// Entries of the squashed layer.
    pub entries: u64,
    /// Its bytes (uncompressed tar).
    pub bytes: u64,
}

/// Copies what is read into a file as well (the uncompressed layer, for its data later),
/// counting it against what is `left` of the bound.
struct Tee<'a, R> {
    inner: R,
    copy: &'a mut BufWriter<File>,
    left: &'a mut u64,
}

impl<R: Read> Read for Tee<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        *self.left = self.left.checked_sub(n as u64).ok_or_else(|| {
            io::Error::other("the layers uncompress to more than the bound of their bytes")
        })?;
        self.copy.write_all(&buf[..n])?;
        Ok(n)
    }
}

fn kind_byte(k: Kind) -> u8 {
    match k {
        Kind::File => b'0',
        Kind::Hardlink => b'1',
        Kind::Symlink => b'2',
        Kind::CharDev => b'3',
        Kind::BlockDev => b'4',
        Kind::Dir => b'5',
        Kind::Fifo => b'6',
    }
}

fn entry<'a>(h: &'a Header, kind: Kind, name: &'a [u8], link: &'a [u8]) -> TarEntry<'a> {
    TarEntry {
        name,
        kind: kind_byte(kind),
        mode: h.mode,
        uid: h.uid,
        gid: h.gid,
        size: 0,
        mtime: h.mtime,
        link,
        dev: match h.kind {
            Kind::CharDev | Kind::BlockDev => h.dev,
            _ => (0, 0),
        },
        xattrs: &h.xattrs,
        sparse_size: None,
    }
}

/// Writes `layers` (oldest first: each a blob file and its descriptor) squashed into one
/// uncompressed tar, `out` (at `out_path`, for errors): the layer that, applied over any lower
/// layers, gives what applying them in order gives. Entries come in path order (a directory
/// right before its content), hard links last. Reads at most `max_entries` entries and
/// `max_bytes` uncompressed bytes in all; the uncompressed layers are kept in temporary files
/// of the store at `store` while it runs.
pub fn squash(
    store: &Path,
    layers: &[(PathBuf, Descriptor)],
    out: File,
    out_path: &Path,
    (max_entries, max_bytes): (u64, u64),
) -> Result<Squashed, RollbackError> {
    let mut state = LayerState::default();
    let mut left = max_bytes;
    let mut plain: Vec<TempFile> = Vec::with_capacity(layers.len());
    for (path, d) in layers {
        let mut tmp = temp_file_in(store, "squash")?;
        let tmp_path = tmp.path().to_path_buf();
        let temp = |source| RollbackError::TempFile {
            path: tmp_path.clone(),
            source,
        };
        let file = tmp.file().try_clone().map_err(temp)?;
        let mut copy = BufWriter::new(file);
        read_layer_at(path, d, |r| {
            state.apply(
                Tee {
                    inner: r,
                    copy: &mut copy,
                    left: &mut left,
                },
                max_entries,
            )
        })?;
        copy.flush().map_err(temp)?;
        plain.push(tmp);
    }
    write(&state, &mut plain, out, out_path)
}

/// Writes `state` as one layer; file data from `plain[layer]`.
fn write(
    state: &LayerState,
    plain: &mut [TempFile],
    out: File,
    out_path: &Path,
) -> Result<Squashed, RollbackError> {
    let mut w = TarWriter::new(BufWriter::new(out), out_path.to_path_buf());
    let err = |source: StoreError| RollbackError::Squash {
        out: out_path.to_path_buf(),
        source,
    };
    let mut hidden: BTreeSet<&Path> = state.hidden_dirs().into_iter().collect();
    // A file's data is written once: the first path of it in path order carries it, the
    // others (hard links in the layers) link to that path, after every other entry.
    let mut leaders: HashMap<DataRef, PathBuf> = HashMap::new();
    let mut links: Vec<(&Path, &Header, PathBuf)> = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    for (path, node) in state.nodes() {
        let header = match node {
            Node::Gone => {
                w.whiteout(path).map_err(err)?;
                continue;
            }
            Node::Entry { header, .. } => header,
        };
        let data = match node {
            Node::Entry { data, .. } => *data,
            Node::Gone => None,
        };
        match header.kind {
            Kind::Dir => {
                let name = tar_name(path, true);
                w.append(&entry(header, Kind::Dir, &name, b""))
                    .map_err(err)?;
                if hidden.remove(path) {
                    let marker = child_name(path, OPAQUE_MARKER);
                    w.append(&TarEntry::whiteout(&marker)).map_err(err)?;
                }
            }
            Kind::File | Kind::Hardlink => {
                let data = data.ok_or_else(|| RollbackError::NoData {
                    out: out_path.to_path_buf(),
                    path: path.to_path_buf(),
                })?;
                if let Some(leader) = leaders.get(&data) {
                    links.push((path, header, leader.clone()));
                    continue;
                }
                leaders.insert(data, path.to_path_buf());
                let name = tar_name(path, false);
                let map = header.sparse.as_deref().map(sparse_map);
                let stored = map.as_ref().map_or(0, |m| m.len() as u64) + data.at.len;
                w.append(&TarEntry {
                    size: stored,
                    sparse_size: header.sparse.as_ref().map(|_| header.size),
                    ..entry(header, Kind::File, &name, b"")
                })
                .map_err(err)?;
                if let Some(map) = &map {
                    w.write_raw(map).map_err(err)?;
                }
                let src = plain[data.layer].file();
                src.seek(SeekFrom::Start(data.at.offset))
                    .map_err(|source| RollbackError::SquashRead {
                        out: out_path.to_path_buf(),
                        source,
                    })?;
                let mut left = data.at.len;
                while left > 0 {
                    let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    src.read_exact(&mut buf[..n]).map_err(|source| {
                        RollbackError::DataEndsEarly {
                            out: out_path.to_path_buf(),
                            path: path.to_path_buf(),
                            source,
                        }
                    })?;
                    w.write_raw(&buf[..n]).map_err(err)?;
                    left -= n as u64;
                }
                w.pad(stored).map_err(err)?;
            }
            Kind::Symlink | Kind::CharDev | Kind::BlockDev | Kind::Fifo => {
                let name = tar_name(path, false);
                let link = match header.kind {
                    Kind::Symlink => header.link.as_os_str().as_encoded_bytes(),
                    _ => b"",
                };
                w.append(&entry(header, header.kind, &name, link))
                    .map_err(err)?;
            }
        }
    }
    // Opaque directories the layers do not carry an entry of (the image's own directories).
    for d in hidden {
        if state.lookup(d) == Lookup::Lower {
            let marker = child_name(d, OPAQUE_MARKER);
            w.append(&TarEntry::whiteout(&marker)).map_err(err)?;
        }
    }
    for (path, header, leader) in links {
        let (name, link) = (tar_name(path, false), tar_name(&leader, false));
        w.append(&entry(header, Kind::Hardlink, &name, &link))
            .map_err(err)?;
    }
    let bytes = w.finish().map_err(err)?;
    Ok(Squashed {
        entries: w.entries(),
        bytes,
    })
}

#[cfg(test)]
mod tests;

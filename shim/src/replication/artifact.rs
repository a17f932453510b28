//! A replicated checkpoint as an OCI artifact, and back: pure data and files, no network.
//!
//! ```text
//! manifest   application/vnd.oci.image.manifest.v1+json, tagged per lineage
//! config     application/vnd.crab.checkpoint.config.v1+json: ReplicaConfig (the lineage, the
//!            image the checkpoint was taken on, checkpoint.json as written, its signature)
//! layers     the checkpoint's fs layers, as the store keeps them (tar+zstd), oldest first;
//!            then each file of its CRIU image (pages rebuilt from their chunks), cut into
//!            segments of whole pages ([`segments`]), one blob each, named by the
//!            annotations io.crab.criu.file and io.crab.criu.offset
//! ```
//!
//! The signature ([`provenance`]) covers checkpoint.json (which names every fs layer's digest
//! and diff_id), every CRIU file's digest and size, and the layers the processes run on:
//! the image's chain id, then the fs layers' diff_ids. Blobs are content-addressed: a layer or
//! a CRIU file segment already in the registry is not sent again, so an idle process costs
//! nothing and a process that changed a few pages costs the segments holding them.
//!
//! What comes back from a registry is hostile until verified: [`verify`] checks the config
//! against the trusted keys and the node's own image before anything is written, and every
//! blob is checked against the signed digests as it is stored ([`super::pull`]).

use std::{
    collections::BTreeMap,
    fs,
    io::Read,
    path::{Path, PathBuf},
};

use ed25519_dalek::SigningKey;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::checkpoint::{
    lineage::LineageRecord,
    pages::{self, PagesError},
    provenance::{self, FileDigest, ProvenanceError, Statement, TrustedKeys},
    store::{digest_string, CheckpointKind, Descriptor, Manifest, MEDIA_TYPE_LAYER_ZSTD},
};
use crate::restore::intake::CheckpointMeta;

pub const MEDIA_TYPE_CONFIG: &str = "application/vnd.crab.checkpoint.config.v1+json";
pub const MEDIA_TYPE_CRIU_FILE: &str = "application/vnd.crab.criu.file.v1";
/// The annotation naming a CRIU file blob's file.
pub const ANNOTATION_FILE: &str = "io.crab.criu.file";
/// The config format this crab writes and reads.
pub const FORMAT: u32 = 1;
/// A config is a description and a signature: anything larger is not one.
pub const CONFIG_MAX: u64 = 8 << 20;

/// The artifact's config blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    pub format: u32,
    pub lineage: String,
    /// The chain id of the image the checkpoint was taken on.
    pub image: String,
    pub kind: CheckpointKind,
    /// `checkpoint.json` exactly as signed.
    pub checkpoint_json: String,
    /// The signature file (JSON) over it.
    pub signature: String,
}

/// Why a checkpoint's artifact could not be built (the checkpoint cannot be replicated as it
/// is: not retried).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(
        "the image it runs on could not be told at Create: a resume elsewhere could not check it"
    )]
    NoImage,
    #[error("{0} of its layers are its checkpoint image's, in the image store: not replicated")]
    ImageLayers(usize),
    #[error("its layer {0} is not in its store")]
    MissingLayer(String),
    #[error("more than [replication] max_mib ({max_mib} MiB) to send")]
    TooLarge { max_mib: u64 },
    #[error("{0}: not among the image's files")]
    NotAFile(String),
    #[error("{0}: no recipe")]
    NoRecipe(String),
    /// The chunks of a pages file could not be had.
    #[error(transparent)]
    Pages(#[from] PagesError),
    #[error("rebuilding {name}: {source}")]
    Rebuild {
        name: String,
        #[source]
        source: std::io::Error,
    },
    /// A file of the process image (or its directory) could not be read.
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: not a plain file", .0.display())]
    NotPlain(PathBuf),
    #[error("checkpoint.json: {0}")]
    CheckpointJson(#[source] serde_json::Error),
    #[error(transparent)]
    Config(serde_json::Error),
    #[error(transparent)]
    Signature(#[from] std::string::FromUtf8Error),
}

/// One blob of an artifact.
#[derive(Debug, Clone)]
pub struct Blob {
    pub digest: String,
    pub size: u64,
    pub media_type: String,
    /// The CRIU file it is a segment of (none for an fs layer), and the segment's offset.
    pub file: Option<String>,
    pub offset: u64,
    pub data: BlobData,
}

#[derive(Debug, Clone)]
pub enum BlobData {
    /// A file on disk (a store's layer blob).
    Path(PathBuf),
    Bytes(Vec<u8>),
    /// A part of a file held in memory (a CRIU file's segment).
    Slice(std::sync::Arc<Vec<u8>>, std::ops::Range<usize>),
    /// A part of a CRIU file read (rebuilt) only if it is to be sent.
    Lazy(std::sync::Arc<LazyFile>, std::ops::Range<usize>),
}

impl BlobData {
    pub fn read(&self) -> std::io::Result<Vec<u8>> {
        match self {
            BlobData::Path(p) => fs::read(p),
            BlobData::Bytes(b) => Ok(b.clone()),
            BlobData::Slice(b, r) => Ok(b[r.clone()].to_vec()),
            BlobData::Lazy(f, r) => {
                let data = f.get().map_err(std::io::Error::other)?;
                data.get(r.clone()).map(<[u8]>::to_vec).ok_or_else(|| {
                    std::io::Error::other(format!("{}: shorter than before", f.name))
                })
            }
        }
    }
}

/// A CRIU file of a store's process image, read (pages rebuilt from their chunks) the first
/// time a segment of it is to be sent, then kept until the artifact is dropped.
#[derive(Debug)]
pub struct LazyFile {
    dir: PathBuf,
    chunks: PathBuf,
    name: String,
    data: std::sync::OnceLock<Result<std::sync::Arc<Vec<u8>>, std::sync::Arc<BuildError>>>,
}

impl LazyFile {
    fn get(&self) -> Result<std::sync::Arc<Vec<u8>>, std::sync::Arc<BuildError>> {
        self.data
            .get_or_init(|| {
                self.read()
                    .map(std::sync::Arc::new)
                    .map_err(std::sync::Arc::new)
            })
            .clone()
    }

    fn read(&self) -> Result<Vec<u8>, BuildError> {
        let recipe = format!("{}{}", self.name, pages::RECIPE_SUFFIX);
        if !self.dir.join(&recipe).is_file() {
            let path = self.dir.join(&self.name);
            return fs::read(&path).map_err(|source| BuildError::Read { path, source });
        }
        let mut r = pages::materialized_readers(&self.dir, &self.chunks)?
            .into_iter()
            .find(|r| r.name() == self.name)
            .ok_or_else(|| BuildError::NoRecipe(self.name.clone()))?;
        let mut data = Vec::with_capacity(r.len() as usize);
        r.read_to_end(&mut data)
            .map_err(|source| BuildError::Rebuild {
                name: self.name.clone(),
                source,
            })?;
        Ok(data)
    }
}

/// The CRIU part of a built artifact, by its digests: a replicator keeps the last one, and a
/// later checkpoint with the same process image (an fs-only turn keeps it) reuses it instead
/// of rebuilding and hashing the image again; a segment is read only if it is to be sent.
#[derive(Debug, Clone)]
pub struct CriuDigests {
    /// The process image's directory (a published image never changes).
    pub dir: PathBuf,
    pub files: BTreeMap<String, FileDigest>,
    /// (file, its range, the segment's digest), in push order.
    pub segments: Vec<(String, std::ops::Range<usize>, String)>,
}

/// A checkpoint ready to push.
#[derive(Debug, Clone)]
pub struct Artifact {
    pub config: Vec<u8>,
    pub layers: Vec<Blob>,
    /// Bytes of all its blobs (config included).
    pub bytes: u64,
}

fn sha256(data: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(data);
    digest_string(h)
}

/// The layers a replicated checkpoint's processes run on, as signed: the image's chain id,
/// then the fs layers' diff_ids.
pub fn signed_layers(image: &str, fs_layers: &[Descriptor]) -> Vec<String> {
    std::iter::once(image.to_string())
        .chain(fs_layers.iter().map(|d| d.diff_id.clone()))
        .collect()
}

/// Builds the artifact of checkpoint `m` of the store at `root` (container `container` of
/// `namespace`), signed with `signer`; at most `max_bytes` in all. Reuses `earlier` (the CRIU
/// part of an artifact built before) when `m` has the same process image, and returns the
/// CRIU part of this one too.
#[allow(clippy::too_many_arguments)]
pub fn build(
    root: &Path,
    namespace: &str,
    container: &str,
    record: &LineageRecord,
    m: &Manifest,
    signer: &SigningKey,
    max_bytes: u64,
    earlier: Option<&CriuDigests>,
) -> Result<(Artifact, Option<CriuDigests>), BuildError> {
    let image = record.image.clone().ok_or(BuildError::NoImage)?;
    if m.image_layers > 0 {
        return Err(BuildError::ImageLayers(m.image_layers));
    }
    let mut room = Room {
        bytes: 0,
        max: max_bytes,
    };
    let mut layers = fs_blobs(root, m, &mut room)?;
    let reused = m
        .process
        .as_ref()
        .and_then(|p| earlier.filter(|e| e.dir == root.join(&p.image)));
    let digests = match (reused, &m.process) {
        (Some(e), _) => Some(reused_criu_blobs(root, e, &mut room, &mut layers)?),
        (None, Some(p)) => Some(criu_blobs(
            &root.join(&p.image),
            root,
            &mut room,
            &mut layers,
        )?),
        (None, None) => None,
    };
    let criu = digests
        .as_ref()
        .map(|d| d.files.clone())
        .unwrap_or_default();
    let meta = CheckpointMeta::of_manifest(namespace, container, m);
    let checkpoint_json =
        serde_json::to_string_pretty(&meta).map_err(BuildError::CheckpointJson)?;
    let signature = provenance::sign(
        signer,
        Statement {
            checkpoint_json: sha256(checkpoint_json.as_bytes()),
            criu,
            layers: Some(signed_layers(&image, &m.fs_layers)),
            rootfs: None,
        },
    );
    let config = ReplicaConfig {
        format: FORMAT,
        lineage: record.lineage.clone(),
        image,
        kind: m.kind,
        checkpoint_json,
        signature: String::from_utf8(signature)?,
    };
    let config = serde_json::to_vec(&config).map_err(BuildError::Config)?;
    room.take(config.len() as u64)?;
    Ok((
        Artifact {
            config,
            layers,
            bytes: room.bytes,
        },
        digests,
    ))
}

/// The bytes an artifact holds so far, against [replication] max_mib.
struct Room {
    bytes: u64,
    max: u64,
}

impl Room {
    fn take(&mut self, n: u64) -> Result<(), BuildError> {
        self.bytes += n;
        match self.bytes > self.max {
            true => Err(BuildError::TooLarge {
                max_mib: self.max >> 20,
            }),
            false => Ok(()),
        }
    }
}

/// The blobs of the checkpoint's fs layers, from the store's blobs.
fn fs_blobs(root: &Path, m: &Manifest, room: &mut Room) -> Result<Vec<Blob>, BuildError> {
    let mut layers = Vec::new();
    for d in &m.fs_layers {
        let path = root
            .join("blobs/sha256")
            .join(d.digest.strip_prefix("sha256:").unwrap_or(&d.digest));
        if !path.is_file() {
            return Err(BuildError::MissingLayer(d.digest.clone()));
        }
        room.take(d.size)?;
        layers.push(Blob {
            digest: d.digest.clone(),
            size: d.size,
            media_type: MEDIA_TYPE_LAYER_ZSTD.to_string(),
            file: None,
            offset: 0,
            data: BlobData::Path(path),
        });
    }
    Ok(layers)
}

/// The segments of a process image digested by an earlier artifact (`e`), read again only
/// when sent.
fn reused_criu_blobs(
    root: &Path,
    e: &CriuDigests,
    room: &mut Room,
    layers: &mut Vec<Blob>,
) -> Result<CriuDigests, BuildError> {
    room.take(e.files.values().map(|f| f.size).sum())?;
    let lazy: BTreeMap<&String, std::sync::Arc<LazyFile>> = e
        .files
        .keys()
        .map(|name| {
            let f = LazyFile {
                dir: e.dir.clone(),
                chunks: root.join("chunks"),
                name: name.clone(),
                data: std::sync::OnceLock::new(),
            };
            (name, std::sync::Arc::new(f))
        })
        .collect();
    for (name, range, digest) in &e.segments {
        let file = lazy
            .get(name)
            .ok_or_else(|| BuildError::NotAFile(name.clone()))?;
        layers.push(Blob {
            digest: digest.clone(),
            size: range.len() as u64,
            media_type: MEDIA_TYPE_CRIU_FILE.to_string(),
            file: Some(name.clone()),
            offset: range.start as u64,
            data: BlobData::Lazy(file.clone(), range.clone()),
        });
    }
    Ok(e.clone())
}

/// The segments of the process image in `dir` (pages rebuilt from the store's chunks), with
/// their digests for the next artifact.
fn criu_blobs(
    dir: &Path,
    root: &Path,
    room: &mut Room,
    layers: &mut Vec<Blob>,
) -> Result<CriuDigests, BuildError> {
    let mut made = CriuDigests {
        dir: dir.to_path_buf(),
        files: BTreeMap::new(),
        segments: Vec::new(),
    };
    for (name, data) in image_files(dir, &root.join("chunks"), room)? {
        made.files.insert(
            name.clone(),
            FileDigest {
                sha256: sha256(&data),
                size: data.len() as u64,
            },
        );
        let data = std::sync::Arc::new(data);
        for r in segments(&data) {
            let part = &data[r.clone()];
            let digest = sha256(part);
            made.segments
                .push((name.clone(), r.clone(), digest.clone()));
            layers.push(Blob {
                digest,
                size: part.len() as u64,
                media_type: MEDIA_TYPE_CRIU_FILE.to_string(),
                file: Some(name.clone()),
                offset: r.start as u64,
                data: BlobData::Slice(data.clone(), r),
            });
        }
    }
    Ok(made)
}

/// Every file of the process image in `dir` by name: page files rebuilt from `chunks`, the
/// rest as stored (plain files only).
fn image_files(
    dir: &Path,
    chunks: &Path,
    room: &mut Room,
) -> Result<BTreeMap<String, Vec<u8>>, BuildError> {
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for r in pages::materialized_readers(dir, chunks)? {
        room.take(r.len())?;
        let name = r.name().to_string();
        let mut data = Vec::with_capacity(r.len() as usize);
        let mut r = r;
        r.read_to_end(&mut data)
            .map_err(|source| BuildError::Rebuild {
                name: name.clone(),
                source,
            })?;
        files.insert(name, data);
    }
    let read_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BuildError::Read { path, source }
    };
    for entry in fs::read_dir(dir).map_err(read_err(dir))? {
        let entry = entry.map_err(read_err(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || pages::is_recipe(&name) || files.contains_key(&name) {
            continue;
        }
        if !entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
            return Err(BuildError::NotPlain(entry.path()));
        }
        let data = fs::read(entry.path()).map_err(read_err(&entry.path()))?;
        room.take(data.len() as u64)?;
        files.insert(name, data);
    }
    Ok(files)
}

/// The annotation giving a CRIU file segment's offset in its file.
pub const ANNOTATION_OFFSET: &str = "io.crab.criu.offset";
/// Segments are cut at page boundaries.
pub const SEGMENT_PAGE: usize = 4096;
/// A segment holds at least this many pages (but the last of a file) and at most
/// [`SEGMENT_MAX_PAGES`]; it ends after a page whose content hash is 0 modulo
/// [`SEGMENT_AVG_PAGES`].
pub const SEGMENT_MIN_PAGES: usize = 32;
pub const SEGMENT_MAX_PAGES: usize = 512;
pub const SEGMENT_AVG_PAGES: u64 = 128;

/// Where a CRIU file is cut into the blobs it is pushed as: content-defined at page
/// granularity, so that a changed page costs its segment and a mapping added or removed
/// shifts no boundary after the next one (fixed offsets would resend everything behind it).
/// Segments are 128 KiB to 2 MiB (512 KiB on average); a file under 128 KiB is one segment.
/// Deterministic: the same bytes are always cut the same way (and so keep their digests).
pub fn segments(data: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut pages = 0;
    let mut at = 0;
    while at < data.len() {
        let end = (at + SEGMENT_PAGE).min(data.len());
        pages += 1;
        let cut = pages >= SEGMENT_MAX_PAGES
            || (pages >= SEGMENT_MIN_PAGES
                && page_hash(&data[at..end]).is_multiple_of(SEGMENT_AVG_PAGES));
        at = end;
        if cut {
            out.push(start..at);
            start = at;
            pages = 0;
        }
    }
    if start < data.len() || out.is_empty() {
        out.push(start..data.len());
    }
    out
}

/// A fast 64-bit hash of a page (FNV-1a over its 8-byte words, mixed at the end): a boundary
/// choice, not a digest (the blobs are named by their sha256).
fn page_hash(page: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut words = page.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().unwrap_or([0; 8]))).wrapping_mul(0x100_0000_01b3);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// One blob of a replicated checkpoint's CRIU files, as a manifest lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRef {
    pub media_type: String,
    pub digest: String,
    pub size: i64,
    /// Its annotations: the file it belongs to, and its offset in it.
    pub file: Option<String>,
    pub offset: Option<String>,
}

/// What is wrong with the CRIU blobs a registry's manifest lists ([`plan_files`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SegmentError {
    #[error("blob {0} names no CRIU file")]
    NoFile(String),
    #[error(transparent)]
    FileName(#[from] BadFileName),
    #[error("{name}: a blob of media type {media_type:?}")]
    MediaType { name: String, media_type: String },
    #[error("{name}: offset {offset:?} is not a number")]
    Offset { name: String, offset: String },
    #[error("{0}: a negative size")]
    NegativeSize(String),
    #[error("{name}: {at} bytes where its signature says {signed}")]
    Size { name: String, at: u64, signed: u64 },
    #[error("{0}: its segments are not one after another")]
    Scattered(String),
    #[error("{0} is not among the signed CRIU files")]
    Unsigned(String),
    #[error("{name}: a segment at offset {offset} where {at} comes next")]
    Gap { name: String, offset: u64, at: u64 },
    #[error("{name}: a segment of {size} bytes (at most {max})", max = SEGMENT_MAX_PAGES * SEGMENT_PAGE)]
    TooLarge { name: String, size: u64 },
    #[error("{0}: an empty segment")]
    Empty(String),
    #[error("{name}: its segments pass its signed size {signed}")]
    PastSignedSize { name: String, signed: u64 },
    #[error("{name}: a segment of {size} bytes before its end")]
    Short { name: String, size: u64 },
    #[error("signed CRIU files missing: {0:?}")]
    Missing(Vec<String>),
}

/// One CRIU file to rebuild from its segments: the segments' indexes in the list given to
/// [`plan_files`], in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilePlan {
    pub name: String,
    pub want: FileDigest,
    pub segments: Vec<usize>,
}

/// Checks the CRIU blobs a registry's manifest lists against the signed files, before any is
/// pulled: every blob is a CRIU file segment of a signed file, each file's segments come one
/// after another from offset 0 without gap or overlap and add up to its signed size, none
/// but a file's last is under [`SEGMENT_MIN_PAGES`] pages or any over [`SEGMENT_MAX_PAGES`]
/// (so a hostile manifest cannot make a file of a million one-byte blobs), and every signed
/// file is there. A manifest of an older crab (one blob per file, no offset) reads as one
/// segment at offset 0, and is held to the same sizes only if it has more than one.
pub fn plan_files(
    blobs: &[SegmentRef],
    criu: &BTreeMap<String, FileDigest>,
) -> Result<Vec<FilePlan>, SegmentError> {
    let mut plans: Vec<FilePlan> = Vec::new();
    let mut at = 0u64;
    let size_of = |p: &FilePlan, at: u64| SegmentError::Size {
        name: p.name.clone(),
        at,
        signed: p.want.size,
    };
    for (i, b) in blobs.iter().enumerate() {
        let name = b
            .file
            .as_deref()
            .ok_or_else(|| SegmentError::NoFile(b.digest.clone()))?;
        check_file_name(name)?;
        let named = || name.to_string();
        if b.media_type != MEDIA_TYPE_CRIU_FILE {
            return Err(SegmentError::MediaType {
                name: named(),
                media_type: b.media_type.clone(),
            });
        }
        let offset = match &b.offset {
            None => 0,
            Some(o) => o.parse::<u64>().map_err(|_| SegmentError::Offset {
                name: named(),
                offset: o.clone(),
            })?,
        };
        let size = u64::try_from(b.size).map_err(|_| SegmentError::NegativeSize(named()))?;
        let new_file = plans.last().is_none_or(|p| p.name != name);
        if new_file {
            if let Some(p) = plans.last() {
                if at != p.want.size {
                    return Err(size_of(p, at));
                }
            }
            if plans.iter().any(|p| p.name == name) {
                return Err(SegmentError::Scattered(named()));
            }
            let want = criu
                .get(name)
                .ok_or_else(|| SegmentError::Unsigned(named()))?;
            plans.push(FilePlan {
                name: name.to_string(),
                want: want.clone(),
                segments: Vec::new(),
            });
            at = 0;
        }
        let plan = plans.last_mut().expect("pushed above");
        if offset != at {
            return Err(SegmentError::Gap {
                name: named(),
                offset,
                at,
            });
        }
        if size > (SEGMENT_MAX_PAGES * SEGMENT_PAGE) as u64
            && !(offset == 0 && size == plan.want.size && b.offset.is_none())
        {
            return Err(SegmentError::TooLarge {
                name: named(),
                size,
            });
        }
        if size == 0 && (plan.want.size != 0 || !plan.segments.is_empty()) {
            return Err(SegmentError::Empty(named()));
        }
        if at + size > plan.want.size {
            return Err(SegmentError::PastSignedSize {
                name: named(),
                signed: plan.want.size,
            });
        }
        // Every segment but the last is at least the minimum.
        if at + size < plan.want.size && size < (SEGMENT_MIN_PAGES * SEGMENT_PAGE) as u64 {
            return Err(SegmentError::Short {
                name: named(),
                size,
            });
        }
        plan.segments.push(i);
        at += size;
    }
    if let Some(p) = plans.last() {
        if at != p.want.size {
            return Err(size_of(p, at));
        }
    }
    if plans.len() != criu.len() {
        let missing: Vec<String> = criu
            .keys()
            .filter(|k| !plans.iter().any(|p| &p.name == *k))
            .cloned()
            .collect();
        return Err(SegmentError::Missing(missing));
    }
    Ok(plans)
}

/// A replicated checkpoint whose config verified: what its blobs must be.
#[derive(Debug, Clone)]
pub struct Verified {
    pub config: ReplicaConfig,
    pub meta: CheckpointMeta,
    pub criu: BTreeMap<String, FileDigest>,
}

/// Why a replicated checkpoint is refused.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("its config is malformed: {0}")]
    Malformed(String),
    #[error("{0}")]
    Provenance(#[from] ProvenanceError),
    #[error("it belongs to lineage {found:?}, not {wanted:?}")]
    Lineage { found: String, wanted: String },
    #[error("it was taken on image {was}, and this container's image is {now}")]
    Image { was: String, now: String },
    #[error("{0}")]
    Mismatch(&'static str),
    #[error(transparent)]
    FileName(#[from] BadFileName),
}

/// Checks the config blob `bytes` of lineage `lineage`'s replicated checkpoint: a known
/// format, signed by one of `trusted`, for this lineage, taken on `image` (this container's,
/// when it can be told), its signed layers those checkpoint.json names.
pub fn verify(
    bytes: &[u8],
    lineage: &str,
    image: Option<&str>,
    trusted: &TrustedKeys,
) -> Result<Verified, ReplicaError> {
    if bytes.len() as u64 > CONFIG_MAX {
        return Err(ReplicaError::Malformed(format!(
            "{} bytes (at most {CONFIG_MAX})",
            bytes.len()
        )));
    }
    let config: ReplicaConfig =
        serde_json::from_slice(bytes).map_err(|e| ReplicaError::Malformed(e.to_string()))?;
    if config.format != FORMAT {
        return Err(ReplicaError::Malformed(format!(
            "format {} (this crab reads {FORMAT})",
            config.format
        )));
    }
    let statement = trusted.verify(
        config.signature.as_bytes(),
        config.checkpoint_json.as_bytes(),
    )?;
    if config.lineage != lineage {
        return Err(ReplicaError::Lineage {
            found: config.lineage.clone(),
            wanted: lineage.to_string(),
        });
    }
    if let Some(now) = image.filter(|now| *now != config.image) {
        return Err(ReplicaError::Image {
            was: config.image.clone(),
            now: now.to_string(),
        });
    }
    let meta = CheckpointMeta::parse(
        Path::new("checkpoint.json"),
        config.checkpoint_json.as_bytes(),
    )
    .map_err(|e| ReplicaError::Malformed(e.to_string()))?;
    if statement.layers.as_deref() != Some(&signed_layers(&config.image, &meta.fs_layers)[..]) {
        return Err(ReplicaError::Mismatch(
            "its signature names other layers than its checkpoint.json and image",
        ));
    }
    if meta.process.is_some() == statement.criu.is_empty() {
        return Err(ReplicaError::Mismatch(
            "its signature and checkpoint.json disagree on a process image",
        ));
    }
    for name in statement.criu.keys() {
        check_file_name(name)?;
    }
    Ok(Verified {
        config,
        meta,
        criu: statement.criu,
    })
}

/// A CRIU file name from a registry that is not a plain name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is no CRIU image file name")]
pub struct BadFileName(pub String);

/// A CRIU file name from a registry: a plain name, nothing to climb or hide with.
pub fn check_file_name(name: &str) -> Result<(), BadFileName> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    match ok {
        true => Ok(()),
        false => Err(BadFileName(name.to_string())),
    }
}

/// The registry tag of lineage `lineage`'s newest checkpoint: `l-<the name with characters
/// a tag cannot hold as ->-<12 hex of its sha256>` (tags are at most 128 characters of
/// `[A-Za-z0-9_.-]`; the hash keeps two names that read alike apart).
pub fn newest_tag(lineage: &str) -> String {
    let hash = sha256(lineage.as_bytes());
    let short = &hash[7..19];
    let readable: String = lineage
        .chars()
        .map(
            |c| match c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                true => c,
                false => '-',
            },
        )
        .take(80)
        .collect();
    format!("l-{readable}-{short}")
}

/// The tag of checkpoint `seq` of container `container`'s store in lineage `lineage`.
pub fn seq_tag(lineage: &str, container: &str, seq: u64) -> String {
    let c = sha256(container.as_bytes());
    format!("{}-{}-{seq}", newest_tag(lineage), &c[7..15])
}

#[cfg(test)]
mod tests;

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
    pages,
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
    data: std::sync::OnceLock<Result<std::sync::Arc<Vec<u8>>, String>>,
}

impl LazyFile {
    fn get(&self) -> Result<std::sync::Arc<Vec<u8>>, String> {
        self.data
            .get_or_init(|| {
                let recipe = format!("{}{}", self.name, pages::RECIPE_SUFFIX);
                let data = match self.dir.join(&recipe).is_file() {
                    true => {
                        let mut r = pages::materialized_readers(&self.dir, &self.chunks)
                            .map_err(|e| e.to_string())?
                            .into_iter()
                            .find(|r| r.name() == self.name)
                            .ok_or_else(|| format!("{}: no recipe", self.name))?;
                        let mut data = Vec::with_capacity(r.len() as usize);
                        r.read_to_end(&mut data)
                            .map_err(|e| format!("rebuilding {}: {e}", self.name))?;
                        data
                    }
                    false => fs::read(self.dir.join(&self.name))
                        .map_err(|e| format!("{}: {e}", self.name))?,
                };
                Ok(std::sync::Arc::new(data))
            })
            .clone()
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
) -> Result<(Artifact, Option<CriuDigests>), String> {
    let image = record.image.clone().ok_or(
        "the image it runs on could not be told at Create: a resume elsewhere could not check it",
    )?;
    if m.image_layers > 0 {
        return Err(format!(
            "{} of its layers are its checkpoint image's, in the image store: not replicated",
            m.image_layers
        ));
    }
    let mut layers = Vec::new();
    let mut bytes = 0u64;
    let mut room = |n: u64| -> Result<(), String> {
        bytes += n;
        match bytes > max_bytes {
            true => Err(format!(
                "more than [replication] max_mib ({} MiB) to send",
                max_bytes >> 20
            )),
            false => Ok(()),
        }
    };
    for d in &m.fs_layers {
        let path = root
            .join("blobs/sha256")
            .join(d.digest.strip_prefix("sha256:").unwrap_or(&d.digest));
        if !path.is_file() {
            return Err(format!("its layer {} is not in its store", d.digest));
        }
        room(d.size)?;
        layers.push(Blob {
            digest: d.digest.clone(),
            size: d.size,
            media_type: MEDIA_TYPE_LAYER_ZSTD.to_string(),
            file: None,
            offset: 0,
            data: BlobData::Path(path),
        });
    }
    let mut criu: BTreeMap<String, FileDigest> = BTreeMap::new();
    let mut digests: Option<CriuDigests> = None;
    let reused = m
        .process
        .as_ref()
        .and_then(|p| earlier.filter(|e| e.dir == root.join(&p.image)));
    if let Some(e) = reused {
        room(e.files.values().map(|f| f.size).sum())?;
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
                .ok_or_else(|| format!("{name}: not among the image's files"))?;
            layers.push(Blob {
                digest: digest.clone(),
                size: range.len() as u64,
                media_type: MEDIA_TYPE_CRIU_FILE.to_string(),
                file: Some(name.clone()),
                offset: range.start as u64,
                data: BlobData::Lazy(file.clone(), range.clone()),
            });
        }
        criu = e.files.clone();
        digests = Some(e.clone());
    } else if let Some(p) = &m.process {
        let dir = root.join(&p.image);
        let chunks = root.join("chunks");
        let mut made = CriuDigests {
            dir: dir.clone(),
            files: BTreeMap::new(),
            segments: Vec::new(),
        };
        let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for r in pages::materialized_readers(&dir, &chunks).map_err(|e| e.to_string())? {
            room(r.len())?;
            let name = r.name().to_string();
            let mut data = Vec::with_capacity(r.len() as usize);
            let mut r = r;
            r.read_to_end(&mut data)
                .map_err(|e| format!("rebuilding {name}: {e}"))?;
            files.insert(name, data);
        }
        for entry in fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || pages::is_recipe(&name) || files.contains_key(&name) {
                continue;
            }
            if !entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
                return Err(format!("{}: not a plain file", entry.path().display()));
            }
            let data = fs::read(entry.path()).map_err(|e| format!("{name}: {e}"))?;
            room(data.len() as u64)?;
            files.insert(name, data);
        }
        for (name, data) in files {
            let digest = sha256(&data);
            criu.insert(
                name.clone(),
                FileDigest {
                    sha256: digest.clone(),
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
        made.files = criu.clone();
        digests = Some(made);
    }
    let meta = CheckpointMeta::of_manifest(namespace, container, m);
    let checkpoint_json =
        serde_json::to_string_pretty(&meta).map_err(|e| format!("checkpoint.json: {e}"))?;
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
        signature: String::from_utf8(signature).map_err(|e| e.to_string())?,
    };
    let config = serde_json::to_vec(&config).map_err(|e| e.to_string())?;
    room(config.len() as u64)?;
    Ok((
        Artifact {
            config,
            layers,
            bytes,
        },
        digests,
    ))
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
) -> Result<Vec<FilePlan>, String> {
    let mut plans: Vec<FilePlan> = Vec::new();
    let mut at = 0u64;
    for (i, b) in blobs.iter().enumerate() {
        let name = b
            .file
            .as_deref()
            .ok_or_else(|| format!("blob {} names no CRIU file", b.digest))?;
        check_file_name(name)?;
        if b.media_type != MEDIA_TYPE_CRIU_FILE {
            return Err(format!("{name}: a blob of media type {:?}", b.media_type));
        }
        let offset = match &b.offset {
            None => 0,
            Some(o) => o
                .parse::<u64>()
                .map_err(|_| format!("{name}: offset {o:?} is not a number"))?,
        };
        let size = u64::try_from(b.size).map_err(|_| format!("{name}: a negative size"))?;
        let new_file = plans.last().is_none_or(|p| p.name != name);
        if new_file {
            if let Some(p) = plans.last() {
                if at != p.want.size {
                    return Err(format!(
                        "{}: {at} bytes where its signature says {}",
                        p.name, p.want.size
                    ));
                }
            }
            if plans.iter().any(|p| p.name == name) {
                return Err(format!("{name}: its segments are not one after another"));
            }
            let want = criu
                .get(name)
                .ok_or_else(|| format!("{name} is not among the signed CRIU files"))?;
            plans.push(FilePlan {
                name: name.to_string(),
                want: want.clone(),
                segments: Vec::new(),
            });
            at = 0;
        }
        let plan = plans.last_mut().expect("pushed above");
        if offset != at {
            return Err(format!(
                "{name}: a segment at offset {offset} where {at} comes next"
            ));
        }
        if size > (SEGMENT_MAX_PAGES * SEGMENT_PAGE) as u64
            && !(offset == 0 && size == plan.want.size && b.offset.is_none())
        {
            return Err(format!(
                "{name}: a segment of {size} bytes (at most {})",
                SEGMENT_MAX_PAGES * SEGMENT_PAGE
            ));
        }
        if size == 0 && (plan.want.size != 0 || !plan.segments.is_empty()) {
            return Err(format!("{name}: an empty segment"));
        }
        if at + size > plan.want.size {
            return Err(format!(
                "{name}: its segments pass its signed size {}",
                plan.want.size
            ));
        }
        // Every segment but the last is at least the minimum.
        if at + size < plan.want.size && size < (SEGMENT_MIN_PAGES * SEGMENT_PAGE) as u64 {
            return Err(format!("{name}: a segment of {size} bytes before its end"));
        }
        plan.segments.push(i);
        at += size;
    }
    if let Some(p) = plans.last() {
        if at != p.want.size {
            return Err(format!(
                "{}: {at} bytes where its signature says {}",
                p.name, p.want.size
            ));
        }
    }
    if plans.len() != criu.len() {
        let missing: Vec<&String> = criu
            .keys()
            .filter(|k| !plans.iter().any(|p| &p.name == *k))
            .collect();
        return Err(format!("signed CRIU files missing: {missing:?}"));
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
    Mismatch(String),
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
            "its signature names other layers than its checkpoint.json and image".into(),
        ));
    }
    if meta.process.is_some() == statement.criu.is_empty() {
        return Err(ReplicaError::Mismatch(
            "its signature and checkpoint.json disagree on a process image".into(),
        ));
    }
    for name in statement.criu.keys() {
        check_file_name(name).map_err(ReplicaError::Mismatch)?;
    }
    Ok(Verified {
        config,
        meta,
        criu: statement.criu,
    })
}

/// A CRIU file name from a registry: a plain name, nothing to climb or hide with.
pub fn check_file_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    match ok {
        true => Ok(()),
        false => Err(format!("{name:?} is no CRIU image file name")),
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
mod tests {
    use super::*;

    #[test]
    fn tags_are_valid_stable_and_apart() {
        let valid = |t: &str| {
            t.len() <= 128
                && t.chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                && t.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
        };
        for l in [
            "default/run-7",
            "team-a/agent-0/sandbox",
            &"x/".repeat(120)[..239],
        ] {
            let t = newest_tag(l);
            assert!(valid(&t), "{t}");
            assert!(
                valid(&seq_tag(l, &"c".repeat(64), u64::MAX)),
                "{}",
                seq_tag(l, "c", 1)
            );
            assert_eq!(t, newest_tag(l));
        }
        assert_ne!(newest_tag("a/b"), newest_tag("a-b"));
        assert_ne!(seq_tag("a", "c1", 1), seq_tag("a", "c2", 1));
    }

    fn signed_store() -> (
        tempfile::TempDir,
        LineageRecord,
        Manifest,
        Artifact,
        TrustedKeys,
    ) {
        use crate::checkpoint::store::Store;
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(&t.path().join("s")).unwrap();
        let mut tmp = store.temp_file("l").unwrap();
        std::io::Write::write_all(tmp.file(), b"not really a tar, a blob all the same").unwrap();
        let d = store.put_blob(tmp.path()).unwrap();
        let mut m = Manifest::child_of(None, 1, "t1", CheckpointKind::Fs);
        m.fs_layers = vec![d];
        store.publish(&m).unwrap();
        let record = LineageRecord::new("ns/p/c", Some(format!("sha256:{}", "a".repeat(64))));
        let key = SigningKey::from_bytes(&[7; 32]);
        let a = build(
            store.root(),
            "k8s.io",
            "c1",
            &record,
            &m,
            &key,
            1 << 20,
            None,
        )
        .unwrap()
        .0;
        let mut trusted = TrustedKeys::new();
        trusted.add(key.verifying_key(), "test");
        (t, record, m, a, trusted)
    }

    #[test]
    fn a_built_artifact_verifies_and_a_tampered_one_does_not() {
        let (_t, record, m, a, trusted) = signed_store();
        let image = record.image.as_deref();
        let v = verify(&a.config, "ns/p/c", image, &trusted).unwrap();
        assert_eq!(v.meta.fs_layers, m.fs_layers);
        assert_eq!(a.layers.len(), 1);
        // Another lineage, another image, another key: refused.
        assert!(matches!(
            verify(&a.config, "ns/p/other", image, &trusted),
            Err(ReplicaError::Lineage { .. })
        ));
        assert!(matches!(
            verify(&a.config, "ns/p/c", Some("sha256:b"), &trusted),
            Err(ReplicaError::Image { .. })
        ));
        let mut stranger = TrustedKeys::new();
        stranger.add(SigningKey::from_bytes(&[8; 32]).verifying_key(), "other");
        assert!(verify(&a.config, "ns/p/c", image, &stranger).is_err());
        // checkpoint.json altered (another layer named), the lineage or image changed in the
        // config: the signature no longer holds.
        let mut c: ReplicaConfig = serde_json::from_slice(&a.config).unwrap();
        c.checkpoint_json = c.checkpoint_json.replace("sha256:", "sha256:0");
        let bytes = serde_json::to_vec(&c).unwrap();
        assert!(verify(&bytes, "ns/p/c", image, &trusted).is_err());
        let mut c: ReplicaConfig = serde_json::from_slice(&a.config).unwrap();
        c.image = format!("sha256:{}", "b".repeat(64));
        let bytes = serde_json::to_vec(&c).unwrap();
        let e = verify(&bytes, "ns/p/c", None, &trusted).unwrap_err();
        assert!(matches!(e, ReplicaError::Mismatch(_)), "{e}");
        // Unsigned: no signature, or one over nothing.
        for sig in ["", "{}"] {
            let mut c: ReplicaConfig = serde_json::from_slice(&a.config).unwrap();
            c.signature = sig.into();
            let bytes = serde_json::to_vec(&c).unwrap();
            assert!(
                verify(&bytes, "ns/p/c", image, &trusted).is_err(),
                "{sig:?}"
            );
        }
        // Garbage and oversized configs.
        assert!(verify(b"{", "ns/p/c", image, &trusted).is_err());
        let big = vec![b' '; CONFIG_MAX as usize + 1];
        assert!(verify(&big, "ns/p/c", image, &trusted).is_err());
    }

    #[test]
    fn a_checkpoint_over_the_bound_or_without_an_image_is_not_built() {
        let (t, record, m, _, _) = signed_store();
        let key = SigningKey::from_bytes(&[7; 32]);
        let root = t.path().join("s");
        let e = build(&root, "k8s.io", "c1", &record, &m, &key, 10, None).unwrap_err();
        assert!(e.contains("max_mib"), "{e}");
        let blind = LineageRecord::new("ns/p/c", None);
        let e = build(&root, "k8s.io", "c1", &blind, &m, &key, 1 << 20, None).unwrap_err();
        assert!(e.contains("image"), "{e}");
    }

    use crate::test_rng as rng;

    fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut r = rng::Rng(seed);
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&r.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }

    fn digests(data: &[u8]) -> Vec<String> {
        segments(data)
            .into_iter()
            .map(|r| sha256(&data[r]))
            .collect()
    }

    #[test]
    fn segments_cover_a_file_in_whole_pages_within_their_bounds() {
        let page = SEGMENT_PAGE;
        for (seed, n) in [
            (1, 0),
            (2, 1),
            (3, page),
            (4, 3 * page + 7),
            (5, 40 << 20),
            (6, 5 << 20),
        ] {
            let data = random_bytes(seed, n);
            let segs = segments(&data);
            assert_eq!(segs.first().map(|r| r.start), Some(0), "n={n}");
            assert_eq!(segs.last().map(|r| r.end), Some(n), "n={n}");
            for w in segs.windows(2) {
                assert_eq!(w[0].end, w[1].start, "n={n}");
            }
            for (i, r) in segs.iter().enumerate() {
                assert!(r.len() <= SEGMENT_MAX_PAGES * page, "n={n}: {r:?}");
                if i + 1 < segs.len() {
                    assert_eq!(r.len() % page, 0, "n={n}: {r:?}");
                    assert!(r.len() >= SEGMENT_MIN_PAGES * page, "n={n}: {r:?}");
                }
            }
            assert_eq!(segments(&data), segs, "deterministic");
        }
        // 40 MiB of random pages: about 512 KiB a segment on average.
        let n = segments(&random_bytes(5, 40 << 20)).len();
        assert!((40..=160).contains(&n), "{n} segments for 40 MiB");
        // Pages all alike (zeroes) are cut at the minimum or the maximum, never per page.
        let zeros = segments(&vec![0u8; 8 << 20]);
        assert!(
            zeros.len() <= (8 << 20) / (SEGMENT_MIN_PAGES * page),
            "{}",
            zeros.len()
        );
    }

    #[test]
    fn a_changed_page_costs_its_segment_and_an_inserted_mapping_shifts_nothing_behind_it() {
        let data = random_bytes(9, 32 << 20);
        let before = digests(&data);
        let old: std::collections::HashSet<&String> = before.iter().collect();
        let new_of = |d: &[String]| d.iter().filter(|x| !old.contains(x)).count();
        // One page changed: one segment differs (two when it moves a boundary).
        let mut changed = data.clone();
        changed[(13 << 20) + 100] ^= 1;
        let after = digests(&changed);
        assert!(new_of(&after) <= 2, "{} new segments", new_of(&after));
        // 64 pages inserted in the middle (a mapping added): the segments after the next
        // boundary are the same as before.
        let mut shifted = data[..16 << 20].to_vec();
        shifted.extend(random_bytes(10, 64 * SEGMENT_PAGE));
        shifted.extend_from_slice(&data[16 << 20..]);
        let after = digests(&shifted);
        assert!(
            new_of(&after) <= 3,
            "{} new segments of {}",
            new_of(&after),
            after.len()
        );
        // Fixed 1 MiB pieces would have resent half the file.
        let fixed = |d: &[u8]| -> Vec<String> { d.chunks(1 << 20).map(sha256).collect() };
        let old_fixed: std::collections::HashSet<String> = fixed(&data).into_iter().collect();
        let resent = fixed(&shifted)
            .iter()
            .filter(|x| !old_fixed.contains(*x))
            .count();
        assert!(resent >= 16, "{resent}");
    }

    /// A store whose checkpoint has a process image of `pages` bytes (and a small core file).
    fn process_store(pages: usize) -> (tempfile::TempDir, LineageRecord, Manifest, Artifact) {
        use crate::checkpoint::store::{proc_image_name, ProcessImage, Store};
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(&t.path().join("s")).unwrap();
        let dir = store.proc_dir(1);
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("pages-1.img"), random_bytes(11, pages)).unwrap();
        fs::write(dir.join("core-1.img"), b"core").unwrap();
        let mut m = Manifest::child_of(None, 1, "t1", CheckpointKind::Proc);
        m.process = Some(ProcessImage {
            image: proc_image_name(1),
            bytes_stored: pages as u64 + 4,
            bytes_logical: pages as u64 + 4,
            pids: vec![1],
        });
        store.publish(&m).unwrap();
        let record = LineageRecord::new("ns/p/c", Some(format!("sha256:{}", "a".repeat(64))));
        let key = SigningKey::from_bytes(&[7; 32]);
        let a = build(
            store.root(),
            "k8s.io",
            "c1",
            &record,
            &m,
            &key,
            64 << 20,
            None,
        )
        .unwrap()
        .0;
        (t, record, m, a)
    }

    fn refs(a: &Artifact) -> Vec<SegmentRef> {
        a.layers
            .iter()
            .filter(|b| b.file.is_some())
            .map(|b| SegmentRef {
                media_type: b.media_type.clone(),
                digest: b.digest.clone(),
                size: b.size as i64,
                file: b.file.clone(),
                offset: Some(b.offset.to_string()),
            })
            .collect()
    }

    #[test]
    fn a_process_image_is_pushed_in_segments_that_rebuild_its_signed_files() {
        let (_t, record, _m, a) = process_store(6 << 20);
        let mut trusted = TrustedKeys::new();
        trusted.add(SigningKey::from_bytes(&[7; 32]).verifying_key(), "test");
        let v = verify(&a.config, "ns/p/c", record.image.as_deref(), &trusted).unwrap();
        let refs = refs(&a);
        assert!(refs.len() >= 4, "{} blobs", refs.len());
        let plans = plan_files(&refs, &v.criu).unwrap();
        assert_eq!(plans.len(), 2);
        let crius: Vec<&Blob> = a.layers.iter().filter(|b| b.file.is_some()).collect();
        for plan in plans {
            let mut whole = Sha256::new();
            for i in plan.segments {
                let data = crius[i].data.read().unwrap();
                assert_eq!(sha256(&data), crius[i].digest);
                whole.update(&data);
            }
            assert_eq!(digest_string(whole), plan.want.sha256, "{}", plan.name);
        }
    }

    #[test]
    fn an_fs_only_checkpoint_reuses_the_process_image_it_shares_without_reading_it() {
        use crate::checkpoint::store::Store;
        let (t, record, m, first) = process_store(3 << 20);
        let root = t.path().join("s");
        // The store keeps its pages deduplicated (a recipe and chunks), as crab writes them.
        let dir = root.join(&m.process.as_ref().unwrap().image);
        pages::dedup(&dir, &root.join("chunks")).unwrap();
        assert!(!dir.join("pages-1.img").exists());
        let key = SigningKey::from_bytes(&[7; 32]);
        let (again, digests) =
            build(&root, "k8s.io", "c1", &record, &m, &key, 64 << 20, None).unwrap();
        let digests = digests.expect("a process image");
        let names = |a: &Artifact| -> Vec<(String, u64)> {
            a.layers
                .iter()
                .map(|b| (b.digest.clone(), b.offset))
                .collect()
        };
        assert_eq!(
            names(&again),
            names(&first),
            "rebuilt from its chunks alike"
        );
        // The next checkpoint: a new fs layer, the same process image.
        let store = Store::open(&root).unwrap();
        let mut tmp = store.temp_file("l").unwrap();
        std::io::Write::write_all(tmp.file(), b"a layer").unwrap();
        let d = store.put_blob(tmp.path()).unwrap();
        let mut next = Manifest::child_of(Some(&m), 2, "t2", CheckpointKind::Fs);
        next.fs_layers.push(d);
        store.publish(&next).unwrap();
        let (reused, kept) = build(
            &root,
            "k8s.io",
            "c1",
            &record,
            &next,
            &key,
            64 << 20,
            Some(&digests),
        )
        .unwrap();
        let crius = |a: &Artifact| -> Vec<Blob> {
            a.layers
                .iter()
                .filter(|b| b.file.is_some())
                .cloned()
                .collect()
        };
        assert_eq!(crius(&reused).len(), crius(&first).len());
        for (r, f) in crius(&reused).iter().zip(crius(&first)) {
            assert!(matches!(r.data, BlobData::Lazy(..)), "not read up front");
            assert_eq!((&r.digest, r.offset, r.size), (&f.digest, f.offset, f.size));
            assert_eq!(
                r.data.read().unwrap(),
                f.data.read().unwrap(),
                "read when sent"
            );
        }
        assert_eq!(kept.unwrap().segments, digests.segments);
        let mut trusted = TrustedKeys::new();
        trusted.add(key.verifying_key(), "test");
        let v = verify(&reused.config, "ns/p/c", record.image.as_deref(), &trusted).unwrap();
        assert_eq!(v.criu, digests.files, "signed as the image's files");
        assert_eq!(v.meta.fs_layers.len(), 1, "the new layer");
        // Another process image is built anew.
        let other = CriuDigests {
            dir: root.join("proc/000009"),
            ..digests.clone()
        };
        let (_, made) = build(
            &root,
            "k8s.io",
            "c1",
            &record,
            &next,
            &key,
            64 << 20,
            Some(&other),
        )
        .unwrap();
        assert_eq!(made.unwrap().dir, digests.dir);
        // The bound still counts the image's files.
        let e = build(
            &root,
            "k8s.io",
            "c1",
            &record,
            &next,
            &key,
            1 << 20,
            Some(&digests),
        )
        .unwrap_err();
        assert!(e.contains("max_mib"), "{e}");
    }

    #[test]
    fn hostile_segment_lists_are_refused_before_anything_is_pulled() {
        let (_t, record, _m, a) = process_store(3 << 20);
        let mut trusted = TrustedKeys::new();
        trusted.add(SigningKey::from_bytes(&[7; 32]).verifying_key(), "test");
        let v = verify(&a.config, "ns/p/c", record.image.as_deref(), &trusted).unwrap();
        let good = refs(&a);
        plan_files(&good, &v.criu).unwrap();
        let pages: Vec<usize> = (0..good.len())
            .filter(|&i| good[i].file.as_deref() == Some("pages-1.img"))
            .collect();
        assert!(pages.len() >= 2, "{good:?}");
        type Edit = Box<dyn Fn(&mut Vec<SegmentRef>)>;
        let (p0, p1) = (pages[0], pages[1]);
        let cases: Vec<(&str, Edit)> = vec![
            (
                "a segment dropped",
                Box::new(move |r| {
                    r.remove(p1);
                }),
            ),
            ("two segments swapped", Box::new(move |r| r.swap(p0, p1))),
            (
                "a segment twice",
                Box::new(move |r| {
                    let d = r[p0].clone();
                    r.insert(p0, d);
                }),
            ),
            (
                "an offset moved",
                Box::new(move |r| r[p1].offset = Some("1".into())),
            ),
            (
                "an offset not a number",
                Box::new(move |r| r[p0].offset = Some("-0".into())),
            ),
            ("a negative size", Box::new(move |r| r[p0].size = -1)),
            ("a size too large", Box::new(move |r| r[p0].size += 4096)),
            ("no file named", Box::new(move |r| r[p0].file = None)),
            (
                "an unsigned file",
                Box::new(move |r| r[p0].file = Some("pages-2.img".into())),
            ),
            (
                "a file climbing out",
                Box::new(move |r| r[p0].file = Some("../x".into())),
            ),
            (
                "another media type",
                Box::new(move |r| r[p0].media_type = MEDIA_TYPE_LAYER_ZSTD.into()),
            ),
            (
                "a file missing",
                Box::new(|r| r.retain(|x| x.file.as_deref() != Some("core-1.img"))),
            ),
            (
                "files interleaved",
                Box::new(move |r| {
                    let d = r.remove(p1);
                    r.push(d.clone());
                }),
            ),
            ("nothing", Box::new(|r| r.clear())),
            (
                "a file as a thousand page-sized blobs",
                Box::new(move |r| {
                    let first = r[p0].clone();
                    let total: i64 = r
                        .iter()
                        .filter(|x| x.file == first.file)
                        .map(|x| x.size)
                        .sum();
                    let pages: Vec<SegmentRef> = (0..total / 4096)
                        .map(|k| SegmentRef {
                            size: 4096,
                            offset: Some((k * 4096).to_string()),
                            ..first.clone()
                        })
                        .collect();
                    r.retain(|x| x.file != first.file);
                    r.extend(pages);
                }),
            ),
            (
                "a file twice",
                Box::new(move |r| {
                    let again: Vec<SegmentRef> = r
                        .iter()
                        .filter(|x| x.file.as_deref() == Some("core-1.img"))
                        .cloned()
                        .collect();
                    r.extend(again);
                }),
            ),
            (
                "one segment over the maximum",
                Box::new(move |r| {
                    let total: i64 = r
                        .iter()
                        .filter(|x| x.file.as_deref() == Some("pages-1.img"))
                        .map(|x| x.size)
                        .sum();
                    let first = SegmentRef {
                        size: total,
                        ..r[p0].clone()
                    };
                    r.retain(|x| x.file.as_deref() != Some("pages-1.img"));
                    r.push(first);
                }),
            ),
        ];
        for (what, edit) in cases {
            let mut r = good.clone();
            edit(&mut r);
            assert!(plan_files(&r, &v.criu).is_err(), "{what} was accepted");
        }
        // An older crab's manifest: one blob per file, no offsets.
        let mut whole = v
            .criu
            .iter()
            .map(|(name, f)| SegmentRef {
                media_type: MEDIA_TYPE_CRIU_FILE.into(),
                digest: f.sha256.clone(),
                size: f.size as i64,
                file: Some(name.clone()),
                offset: None,
            })
            .collect::<Vec<_>>();
        plan_files(&whole, &v.criu).unwrap();
        whole[0].offset = Some("0".into());
        whole.rotate_left(0);
        let big = whole
            .iter()
            .position(|x| x.file.as_deref() == Some("pages-1.img"))
            .unwrap();
        whole[big].offset = Some("0".into());
        assert!(
            plan_files(&whole, &v.criu).is_err(),
            "a whole file over the maximum with an offset"
        );
    }

    #[test]
    fn hostile_file_names_are_refused() {
        for bad in [
            "",
            "..",
            ".x",
            "a/b",
            "../../etc/passwd",
            "a\0b",
            &"a".repeat(256),
        ] {
            assert!(check_file_name(bad).is_err(), "{bad:?}");
        }
        for good in ["pages-1.img", "core-42.img", "inventory.img"] {
            check_file_name(good).unwrap();
        }
    }
}

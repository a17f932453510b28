//! A replicated checkpoint as an OCI artifact, and back: pure data and files, no network.
//!
//! ```text
//! manifest   application/vnd.oci.image.manifest.v1+json, tagged per lineage
//! config     application/vnd.crab.checkpoint.config.v1+json: ReplicaConfig (the lineage, the
//!            image the checkpoint was taken on, checkpoint.json as written, its signature)
//! layers     the checkpoint's fs layers, as the store keeps them (tar+zstd), oldest first;
//!            then each file of its CRIU image (pages rebuilt from their chunks), one blob
//!            each, named by the annotation io.crab.criu.file
//! ```
//!
//! The signature ([`provenance`]) covers checkpoint.json (which names every fs layer's digest
//! and diff_id), every CRIU file's digest and size, and the layers the processes run on:
//! the image's chain id, then the fs layers' diff_ids. Blobs are content-addressed: a layer or
//! a CRIU file (an idle process's pages) already in the registry is not sent again.
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
    /// The CRIU file it is (none for an fs layer).
    pub file: Option<String>,
    pub data: BlobData,
}

#[derive(Debug, Clone)]
pub enum BlobData {
    /// A file on disk (a store's layer blob).
    Path(PathBuf),
    Bytes(Vec<u8>),
}

impl BlobData {
    pub fn read(&self) -> std::io::Result<Vec<u8>> {
        match self {
            BlobData::Path(p) => fs::read(p),
            BlobData::Bytes(b) => Ok(b.clone()),
        }
    }
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
/// `namespace`), signed with `signer`; at most `max_bytes` in all.
pub fn build(
    root: &Path,
    namespace: &str,
    container: &str,
    record: &LineageRecord,
    m: &Manifest,
    signer: &SigningKey,
    max_bytes: u64,
) -> Result<Artifact, String> {
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
            data: BlobData::Path(path),
        });
    }
    let mut criu: BTreeMap<String, FileDigest> = BTreeMap::new();
    if let Some(p) = &m.process {
        let dir = root.join(&p.image);
        let chunks = root.join("chunks");
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
            layers.push(Blob {
                digest,
                size: data.len() as u64,
                media_type: MEDIA_TYPE_CRIU_FILE.to_string(),
                file: Some(name),
                data: BlobData::Bytes(data),
            });
        }
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
    Ok(Artifact {
        config,
        layers,
        bytes,
    })
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
        let a = build(store.root(), "k8s.io", "c1", &record, &m, &key, 1 << 20).unwrap();
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
        let e = build(&root, "k8s.io", "c1", &record, &m, &key, 10).unwrap_err();
        assert!(e.contains("max_mib"), "{e}");
        let blind = LineageRecord::new("ns/p/c", None);
        let e = build(&root, "k8s.io", "c1", &blind, &m, &key, 1 << 20).unwrap_err();
        assert!(e.contains("image"), "{e}");
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

//! What a store holds: the manifest of a checkpoint and the types it is made of, and its parse.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use serde::{Deserialize, Serialize};

use super::files::*;

/// An OCI layer compressed with zstd (what [`super::super::layer`] writes).
pub const MEDIA_TYPE_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// An uncompressed OCI layer.
pub const MEDIA_TYPE_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";

/// What a checkpoint holds (`failed` records an attempt that produced nothing new: it keeps the
/// previous references so the lineage stays readable). `created` and `restored` are origins: a
/// container started from an ordinary image (nothing on top of it), or from a checkpoint image
/// (its chain and process image); every later checkpoint of that container descends from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointKind {
    Fs,
    Proc,
    Full,
    Failed,
    Created,
    Restored,
}

impl CheckpointKind {
    /// Whether the checkpoint is a recovery point (everything but `failed`).
    pub fn is_durable_state(self) -> bool {
        self != CheckpointKind::Failed
    }

    /// Whether a turn end produced it (not an origin).
    pub fn is_turn(self) -> bool {
        !matches!(self, CheckpointKind::Created | CheckpointKind::Restored)
    }
}

/// An OCI content descriptor of a layer blob, with the digest of its uncompressed tar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    /// `sha256:<hex>` of the blob as stored (compressed).
    pub digest: String,
    /// `sha256:<hex>` of the uncompressed tar (the image config's `rootfs.diff_ids`).
    pub diff_id: String,
    /// Bytes of the blob as stored.
    pub size: u64,
    pub media_type: String,
}

/// What [`Descriptor::check`] refuses in a layer descriptor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    #[error("layer digest {0:?}")]
    Digest(String),
    #[error("layer diff_id {0:?}")]
    DiffId(String),
    #[error("layer media type {0:?}")]
    MediaType(String),
    #[error("layer {0} of size 0")]
    Empty(String),
}

impl Descriptor {
    /// Checks what an OCI descriptor of a layer must be, before it goes into an image or comes
    /// out of one: sha256 digests, a layer media type, a size.
    pub fn check(&self) -> Result<(), DescriptorError> {
        let sha256 = |s: &str| {
            s.strip_prefix("sha256:")
                .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        };
        if !sha256(&self.digest) {
            return Err(DescriptorError::Digest(self.digest.clone()));
        }
        if !sha256(&self.diff_id) {
            return Err(DescriptorError::DiffId(self.diff_id.clone()));
        }
        if ![MEDIA_TYPE_LAYER_ZSTD, MEDIA_TYPE_LAYER_TAR].contains(&self.media_type.as_str()) {
            return Err(DescriptorError::MediaType(self.media_type.clone()));
        }
        if self.size == 0 {
            return Err(DescriptorError::Empty(self.digest.clone()));
        }
        Ok(())
    }

    /// The hex part of the digest.
    pub fn hex(&self) -> &str {
        self.digest.strip_prefix("sha256:").unwrap_or(&self.digest)
    }
}

/// A process image of the store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessImage {
    /// Relative to the store root: `proc/<seq:06>`.
    pub image: String,
    pub bytes_stored: u64,
    pub bytes_logical: u64,
    pub pids: Vec<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    #[serde(default)]
    pub freeze_ms: f64,
    #[serde(default)]
    pub capture_ms: f64,
    #[serde(default)]
    pub total_ms: f64,
    /// Where a process image's time went (only when the checkpoint has one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessTimings>,
}

/// The phases of a process image, in milliseconds, in the order they run. CRIU's own figures
/// are absent when CRIU did not report them (its log or `stats-dump` unreadable).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessTimings {
    /// How the dump was driven: `runc` (`runc checkpoint`) or `criu` (CRIU's RPC directly).
    #[serde(default)]
    pub driver: String,
    /// crab freezing the container before the dump (CRIU, finding it frozen, does not poll
    /// its freezer).
    #[serde(default)]
    pub freeze_ms: f64,
    /// The trap check before the dump (every live process descends from init).
    #[serde(default)]
    pub check_ms: f64,
    /// The dump as the shim waited for it: `runc checkpoint`, or CRIU from its start to its
    /// answer.
    #[serde(default)]
    pub dump_ms: f64,
    /// CRIU's own run, from its log's first to its last line: `dump_ms` minus this is what
    /// runs around CRIU (runc's start-up, its CRIU version check, CRIU's own start-up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criu_ms: Option<f64>,
    /// From CRIU's `stats-dump`: freezing the container's processes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freezing_ms: Option<f64>,
    /// From CRIU's `stats-dump`: how long the processes stayed frozen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_ms: Option<f64>,
    /// From CRIU's `stats-dump`: collecting the memory to dump (parasite, page pipes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memdump_ms: Option<f64>,
    /// From CRIU's `stats-dump`: writing the pages out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memwrite_ms: Option<f64>,
    /// Thawing the container after the dump (it stays frozen from `freeze_ms` until here).
    #[serde(default)]
    pub thaw_ms: f64,
    /// Checking the image's process tree against the live processes.
    #[serde(default)]
    pub verify_ms: f64,
    /// Page deduplication: hashing the pages, writing the new chunks and the recipes.
    #[serde(default)]
    pub dedup_ms: f64,
    /// Making the image and its chunks durable.
    #[serde(default)]
    pub sync_ms: f64,
    /// The container's network namespace was left out of the image (it could not have
    /// changed: [`crate::checkpoint::netns`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub netns_left_out: bool,
}

impl Timings {
    pub fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1000.0
    }
}

/// One checkpoint `C_i = (P_j, F_k)`: the whole fs layer chain (oldest first) and the process image.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub seq: u64,
    pub parent: Option<u64>,
    pub turn_id: String,
    pub kind: CheckpointKind,
    pub fs_layers: Vec<Descriptor>,
    /// How many of `fs_layers` (the first ones) the container's image itself carries (a
    /// container restored from a checkpoint image): their blobs are the image's layers in
    /// containerd's content store, not in this store.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub image_layers: usize,
    pub process: Option<ProcessImage>,
    /// RFC 3339, UTC.
    pub created_at: String,
    #[serde(default)]
    pub timings: Timings,
    #[serde(default)]
    pub explanation: String,
    /// The tracked volumes (paths in the container) whose whole contents `fs_layers` hold
    /// below those paths: a base of each, then its changes. A volume not listed was never
    /// captured whole in this chain (its next fs layer takes it whole).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<PathBuf>,
    /// Of a `failed` checkpoint: the kind it attempted (for the figures of `crabctl metrics`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempted: Option<CheckpointKind>,
    /// Taken for a turn the inspector could not observe (a degraded answer): a full checkpoint
    /// in place of the one the turn needed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub degraded: bool,
    /// Of a `restored` checkpoint recording an in-place rollback (the container's files reset
    /// to its `parent`, its processes kept): what was done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_place: Option<InPlaceRollback>,
    /// When the first turn it covers ended, in milliseconds since the Unix epoch: how old its
    /// recovery point is by the time it is durable, or replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_ended_ms: Option<u64>,
}

/// What an in-place rollback did (`crate::rollback`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InPlaceRollback {
    /// Paths given their checkpoint state (removed, created or rewritten).
    pub paths: u64,
    /// Bytes of file data written.
    pub bytes: u64,
}

impl Manifest {
    /// A manifest following `parent` (the latest published one, if any): it starts with the
    /// parent's references, so an fs-only checkpoint keeps the process image and a proc-only
    /// one keeps the layer chain; the caller then pushes a layer and/or replaces `process`.
    pub fn child_of(
        parent: Option<&Manifest>,
        seq: u64,
        turn_id: &str,
        kind: CheckpointKind,
    ) -> Manifest {
        Manifest {
            format: FORMAT,
            seq,
            parent: parent.map(|p| p.seq),
            turn_id: turn_id.to_owned(),
            kind,
            fs_layers: parent.map(|p| p.fs_layers.clone()).unwrap_or_default(),
            image_layers: parent.map_or(0, |p| p.image_layers),
            process: parent.and_then(|p| p.process.clone()),
            created_at: rfc3339(SystemTime::now()),
            timings: Timings::default(),
            explanation: String::new(),
            volumes: parent.map(|p| p.volumes.clone()).unwrap_or_default(),
            attempted: None,
            degraded: false,
            in_place: None,
            turn_ended_ms: None,
        }
    }
}

pub(super) fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// What [`Store::apply_retention`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Retention {
    pub removed_manifests: Vec<u64>,
    pub removed_blobs: Vec<String>,
    pub removed_proc: Vec<PathBuf>,
}

/// `<digits>.json` -> seq.
pub(super) fn manifest_seq(name: &OsStr) -> Option<u64> {
    let digits = name.to_str()?.strip_suffix(".json")?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())?
}

/// Parses the manifest `bytes` read from `path` (named in errors). Public for the fuzz targets.
pub fn parse_manifest(path: &Path, bytes: &[u8]) -> Result<Manifest, StoreError> {
    // The format decides how to read the rest: check it before the typed parse, so a newer
    // manifest is reported as such rather than as a missing or mistyped field.
    #[derive(Deserialize)]
    struct Format {
        format: u64,
    }
    let corrupt = |e: serde_json::Error| StoreError::Corrupt {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let Format { format } = serde_json::from_slice(bytes).map_err(corrupt)?;
    if format > u64::from(FORMAT) {
        return Err(StoreError::UnknownFormat {
            path: path.to_path_buf(),
            format,
        });
    }
    if format == 0 {
        return Err(StoreError::Corrupt {
            path: path.to_path_buf(),
            reason: "format 0".into(),
        });
    }
    serde_json::from_slice(bytes).map_err(corrupt)
}

//! `crabctl export`: a checkpoint of a container's store as an OCI image in containerd.

use std::{collections::HashMap, io::Write, time::Instant};

use containerd_client::services::v1::Container;

use super::{
    client::{BlobData, Lease},
    image::{
        self, base_of, CheckpointImage, CriuSource, OciDescriptor, Provenance, LABEL_BASE_LAYERS,
        LABEL_SOURCE, MEDIA_TYPE_LAYER_ZSTD, MEDIA_TYPE_MANIFEST,
    },
    Ctl, CtlError, Result,
};
use crab_shim::checkpoint::{
    provenance,
    restore::{CheckpointMeta, ProcessMeta, Source, META_FORMAT},
    store::{CheckpointKind, Manifest, Store},
};

/// What an export produced.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The image record's name.
    pub reference: String,
    pub source: Source,
    pub kind: CheckpointKind,
    pub image: CheckpointImage,
    pub with_process: bool,
    /// The container record exported from (a template for containers started from the image).
    pub container: Container,
    pub elapsed_ms: f64,
}

impl Exported {
    /// One line for people.
    pub fn summary(&self) -> String {
        let s = &self.source;
        let layers = self.image.layers.len();
        format!(
            "{}/{} checkpoint {} (turn {:?}, {}) as {}: {} layers ({} base, {} fs, 1 checkpoint{}), manifest {}, {:.0} ms",
            s.namespace,
            s.container,
            s.seq,
            s.turn_id,
            format!("{:?}", self.kind).to_lowercase(),
            self.reference,
            layers,
            self.image.base_layers,
            layers - self.image.base_layers - 1,
            if self.with_process { " with the process image" } else { ", files only" },
            self.image.manifest_digest(),
            self.elapsed_ms
        )
    }
}

/// The checkpoint `turn` names among `manifests` (oldest first): a sequence number, else a
/// turn id (the newest checkpoint of that turn: a rollback republishes a turn's state under
/// its turn id); `None` means the newest recovery point. Failed checkpoints are no recovery
/// point: naming one is an error that says which ones are. A `restored` checkpoint that
/// republished one of this store's own (a rollback or recovery) stands for that one: the
/// same layers and process image, so a turn returned to again reuses its image.
pub fn select_checkpoint<'a>(
    container: &str,
    manifests: &'a [Manifest],
    turn: Option<&str>,
) -> Result<&'a Manifest> {
    let usable = || {
        let list: Vec<String> = manifests
            .iter()
            .filter(|m| m.kind.is_durable_state())
            .map(|m| {
                if m.turn_id.is_empty() {
                    format!("{} ({})", m.seq, kind_name(m.kind))
                } else {
                    format!("{} (turn {}, {})", m.seq, m.turn_id, kind_name(m.kind))
                }
            })
            .collect();
        if list.is_empty() {
            "no recovery point".to_string()
        } else {
            list.join(", ")
        }
    };
    let Some(turn) = turn else {
        return manifests
            .iter()
            .rev()
            .find(|m| m.kind.is_durable_state())
            .map(|m| original(manifests, m))
            .ok_or_else(|| CtlError::NoRecoveryPoint {
                container: container.to_string(),
            });
    };
    let by_seq = turn
        .parse::<u64>()
        .ok()
        .and_then(|seq| manifests.iter().find(|m| m.seq == seq));
    let found = by_seq.or_else(|| {
        let of_turn = manifests.iter().rev().filter(|m| m.turn_id == turn);
        of_turn
            .clone()
            .find(|m| m.kind.is_durable_state())
            .or_else(|| of_turn.clone().next())
    });
    match found {
        Some(m) if m.kind.is_durable_state() => Ok(original(manifests, m)),
        Some(m) => Err(CtlError::FailedCheckpoint {
            container: container.to_string(),
            seq: m.seq,
            turn_id: m.turn_id.clone(),
            available: usable(),
        }),
        None => Err(CtlError::NoCheckpoint {
            container: container.to_string(),
            turn: turn.to_string(),
            available: usable(),
        }),
    }
}

/// The checkpoint a `restored` one republished in its own store (its parent, when that holds
/// the same state), followed back to the first; any other checkpoint is its own original.
fn original<'a>(manifests: &'a [Manifest], m: &'a Manifest) -> &'a Manifest {
    let mut m = m;
    while m.kind == CheckpointKind::Restored {
        let source = m
            .parent
            .and_then(|p| manifests.iter().find(|s| s.seq == p))
            .filter(|s| {
                s.kind.is_durable_state() && s.fs_layers == m.fs_layers && s.process == m.process
            });
        match source {
            Some(s) => m = s,
            None => break,
        }
    }
    m
}

fn kind_name(k: CheckpointKind) -> String {
    format!("{k:?}").to_lowercase()
}

/// Where the names of [`internal_reference`]s start.
pub const INTERNAL_PREFIX: &str = "crab.local/checkpoint/";

/// The image name crabctl gives a checkpoint it starts containers from.
pub fn internal_reference(namespace: &str, container: &str, seq: u64) -> String {
    format!(
        "{INTERNAL_PREFIX}{}/{}:{seq}",
        namespace.to_lowercase(),
        container.to_lowercase()
    )
}

impl Ctl {
    /// Exports checkpoint `turn` (default: the newest recovery point) of `container` as
    /// image `reference`.
    pub async fn export(
        &self,
        container: &str,
        turn: Option<&str>,
        reference: &str,
    ) -> Result<Exported> {
        let lease = self.client.create_lease().await?;
        let r = self
            .export_leased(&lease, container, turn, Some(reference))
            .await;
        self.client.delete_lease(lease).await;
        r
    }

    /// [`Ctl::export`] under the caller's lease; without a reference, the image gets
    /// [`internal_reference`].
    pub(super) async fn export_leased(
        &self,
        lease: &Lease,
        container: &str,
        turn: Option<&str>,
        reference: Option<&str>,
    ) -> Result<Exported> {
        let start = Instant::now();
        let record = self.container(container).await?;
        let root = self.store_root(&record)?;
        // The key the container's shim trusts as this host's (generated on first use).
        let signer = provenance::signing_key(&self.config_for(&record)?.signing_key_path())?;
        let store = Store::open(&root)?;
        let manifests = store.list()?;
        let m = select_checkpoint(container, &manifests, turn)?.clone();
        // The store is the shim's, but what goes into an image is checked like what comes out.
        for d in &m.fs_layers {
            d.check().map_err(|e| {
                CtlError::Failed(format!("checkpoint {} of {container}: {e}", m.seq))
            })?;
        }
        let source = Source {
            namespace: self.namespace().to_string(),
            container: container.to_string(),
            seq: m.seq,
            turn_id: m.turn_id.clone(),
        };
        let reference = reference
            .map(str::to_string)
            .unwrap_or_else(|| internal_reference(self.namespace(), container, m.seq));

        let base = self.base_of(&record).await?;
        for layer in &base.layers {
            self.client.lease_content(lease, &layer.digest).await?;
        }
        for layer in &m.fs_layers {
            let path = store.blob_path(&layer.digest);
            if path.is_file() {
                self.client
                    .write_blob(
                        lease,
                        &OciDescriptor::from(layer),
                        BlobData::File(&path),
                        HashMap::new(),
                    )
                    .await?;
            } else if self.client.content_info(&layer.digest).await?.is_some() {
                self.client.lease_content(lease, &layer.digest).await?;
            } else {
                return Err(CtlError::MissingLayer {
                    digest: layer.digest.clone(),
                    seq: m.seq,
                    store: root.clone(),
                });
            }
        }

        let meta = CheckpointMeta {
            format: META_FORMAT,
            source: source.clone(),
            fs_layers: m.fs_layers.clone(),
            process: m.process.as_ref().map(|p| ProcessMeta {
                pids: p.pids.clone(),
            }),
            created_at: m.created_at.clone(),
            volumes: m.volumes.clone(),
        };
        let criu_dir = m.process.as_ref().map(|p| root.join(&p.image));
        let mut tmp = store.temp_file("export")?;
        let file = tmp.file().try_clone().map_err(|e| CtlError::Io {
            what: format!("opening {}", tmp.path().display()),
            source: e,
        })?;
        let chunks = store.chunks_dir();
        let tmp_path = tmp.path().to_path_buf();
        let layer = tokio::task::spawn_blocking(move || {
            let criu = criu_dir.as_deref().map(|dir| CriuSource {
                dir,
                chunks: &chunks,
            });
            let mut out = std::io::BufWriter::new(file);
            let blob = image::write_checkpoint_layer(&meta, criu, &signer, &mut out)?;
            out.flush().map_err(|e| CtlError::Io {
                what: format!("writing {}", tmp_path.display()),
                source: e,
            })?;
            Ok::<_, CtlError>(blob)
        })
        .await
        .map_err(|e| CtlError::Failed(format!("building the checkpoint layer: {e}")))??;
        self.client
            .write_blob(
                lease,
                &OciDescriptor::new(MEDIA_TYPE_LAYER_ZSTD, &layer.digest, layer.size),
                BlobData::File(tmp.path()),
                HashMap::new(),
            )
            .await?;
        drop(tmp);

        let source_label = format!("{}/{}@{}", source.namespace, source.container, source.seq);
        let built = image::build(
            &base,
            &m.fs_layers,
            &layer,
            &Provenance {
                source: &source_label,
                turn_id: &m.turn_id,
                created: &m.created_at,
            },
        );
        let config_desc = OciDescriptor::new(
            image::MEDIA_TYPE_CONFIG,
            &built.config_digest(),
            built.config.len() as u64,
        );
        self.client
            .write_blob(
                lease,
                &config_desc,
                BlobData::Bytes(&built.config),
                HashMap::new(),
            )
            .await?;
        let manifest_desc = OciDescriptor::new(
            MEDIA_TYPE_MANIFEST,
            &built.manifest_digest(),
            built.manifest.len() as u64,
        );
        self.client
            .write_blob(
                lease,
                &manifest_desc,
                BlobData::Bytes(&built.manifest),
                built.manifest_gc_labels(),
            )
            .await?;
        self.client
            .put_image(
                &reference,
                &manifest_desc,
                HashMap::from([
                    (LABEL_SOURCE.to_string(), source_label.clone()),
                    (LABEL_BASE_LAYERS.to_string(), built.base_layers.to_string()),
                ]),
            )
            .await?;
        Ok(Exported {
            reference,
            source,
            kind: m.kind,
            with_process: m.process.is_some(),
            image: built,
            container: record,
            elapsed_ms: start.elapsed().as_secs_f64() * 1000.0,
        })
    }

    /// The base of a checkpoint image of `record`: its image's layers and config (without
    /// crab's additions if that is a checkpoint image itself), checked against the container's
    /// rootfs, which must be built on them.
    async fn base_of(&self, record: &Container) -> Result<image::Base> {
        if record.image.is_empty() {
            return Err(CtlError::Refused(format!(
                "container {} has no image: a checkpoint image needs its base image",
                record.id
            )));
        }
        let (manifest, config) = self.client.manifest_and_config(&record.image).await?;
        let base = base_of(&manifest, &config)?;
        let chains = image::chain_ids(&base.diff_ids);
        if let (Some(top), false) = (chains.last(), record.snapshot_key.is_empty()) {
            let ancestors = self
                .client
                .snapshot_ancestors(&record.snapshotter, &record.snapshot_key)
                .await?;
            if !ancestors.is_empty() && !ancestors.contains(top) {
                return Err(CtlError::BaseMismatch {
                    container: record.id.clone(),
                    image: record.image.clone(),
                });
            }
        }
        Ok(base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crab_shim::checkpoint::store::{Descriptor, Manifest};

    fn manifest(seq: u64, turn: &str, kind: CheckpointKind) -> Manifest {
        let mut m = Manifest::child_of(None, seq, turn, kind);
        m.parent = seq.checked_sub(1).filter(|p| *p > 0);
        m
    }

    fn lineage() -> Vec<Manifest> {
        let mut restored = manifest(4, "t2", CheckpointKind::Restored);
        restored.parent = Some(2);
        vec![
            manifest(1, "t1", CheckpointKind::Fs),
            manifest(2, "t2", CheckpointKind::Proc),
            manifest(3, "t3", CheckpointKind::Failed),
            restored,
            manifest(5, "t5", CheckpointKind::Failed),
        ]
    }

    #[test]
    fn selects_by_seq_by_turn_and_the_newest_recovery_point() {
        let mut ms = lineage();
        assert_eq!(select_checkpoint("c", &ms, Some("1")).unwrap().seq, 1);
        assert_eq!(select_checkpoint("c", &ms, Some("t1")).unwrap().seq, 1);
        assert_eq!(select_checkpoint("c", &ms, Some("2")).unwrap().seq, 2);
        // A turn republished by a rollback stands for the checkpoint it restored.
        for turn in [None, Some("t2"), Some("4")] {
            assert_eq!(
                select_checkpoint("c", &ms, turn).unwrap().seq,
                2,
                "{turn:?}"
            );
        }
        // Not when the state differs (or the source is gone, or another container's).
        ms[3].fs_layers.push(Descriptor {
            digest: "sha256:x".into(),
            diff_id: "sha256:x".into(),
            size: 1,
            media_type: String::new(),
        });
        assert_eq!(select_checkpoint("c", &ms, Some("t2")).unwrap().seq, 4);
        ms[3].fs_layers.clear();
        ms[3].parent = None;
        assert_eq!(select_checkpoint("c", &ms, None).unwrap().seq, 4);
        // The newest of a turn id used again for another state (exec turns after a restart).
        ms.push(manifest(6, "t1", CheckpointKind::Fs));
        assert_eq!(select_checkpoint("c", &ms, Some("t1")).unwrap().seq, 6);
    }

    #[test]
    fn failed_and_unknown_checkpoints_are_clear_errors() {
        let ms = lineage();
        for turn in ["3", "t3", "t5"] {
            let e = select_checkpoint("c", &ms, Some(turn)).unwrap_err();
            assert!(
                matches!(e, CtlError::FailedCheckpoint { .. }),
                "{turn}: {e}"
            );
            let msg = e.to_string();
            assert!(
                msg.contains("failed") && msg.contains("1 (turn t1, fs)"),
                "{msg}"
            );
            assert!(
                !msg.contains("3 (turn t3"),
                "a failed one is not usable: {msg}"
            );
        }
        let e = select_checkpoint("c", &ms, Some("t9")).unwrap_err();
        assert!(matches!(e, CtlError::NoCheckpoint { .. }), "{e}");
        assert!(e.to_string().contains("no checkpoint t9"), "{e}");
        let e = select_checkpoint("c", &ms, Some("99")).unwrap_err();
        assert!(matches!(e, CtlError::NoCheckpoint { .. }), "{e}");
        let only_failed = vec![manifest(1, "t1", CheckpointKind::Failed)];
        let e = select_checkpoint("c", &only_failed, None).unwrap_err();
        assert!(matches!(e, CtlError::NoRecoveryPoint { .. }), "{e}");
        assert!(select_checkpoint("c", &[], None).is_err());
    }

    #[test]
    fn internal_references_name_the_checkpoint() {
        assert_eq!(
            internal_reference("crab-test", "It-Sandbox", 7),
            "crab.local/checkpoint/crab-test/it-sandbox:7"
        );
    }
}

//! `crabctl export`: a checkpoint of a container's store as an OCI image in containerd or in
//! an image archive file ([`super::archive`]). The image's base is the container's image, an
//! image named with `--base-image`, or for a container without one (dockerd mounts its rootfs
//! itself) the lower layers of its rootfs overlay read into layers ([`super::rootfs`]); its
//! config runs the container's process ([`image::set_process`]).

use std::{
    collections::HashMap,
    io::{Seek, Write},
    path::{Path, PathBuf},
    time::Instant,
};

use containerd_client::services::v1::Container;

use oci_spec::image::{self as oci, MediaType};
use serde_json::Value;

use super::{
    archive,
    client::{BlobData, Lease},
    docker,
    image::{
        self, base_of, descriptor_of, CheckpointImage, CriuSource, Provenance, LABEL_BASE_LAYERS,
        LABEL_IDENTITY, LABEL_SOURCE, MEDIA_TYPE_LAYER_ZSTD,
    },
    Ctl, CtlError, Result,
};
use crab_shim::checkpoint::{
    layer::{write_tree_tar, LayerOptions},
    provenance,
    store::{CheckpointKind, Descriptor, Manifest, Store, TempFile},
};
use crab_shim::restore::intake::{CheckpointMeta, Source};
use crab_shim::rollback::squash;

/// What an export produced.
#[derive(Debug, Clone)]
pub struct Exported {
    /// The image's name (of its record in containerd, or in the archive).
    pub reference: String,
    /// The archive file written instead of an image in containerd.
    pub output: Option<PathBuf>,
    pub source: Source,
    pub kind: CheckpointKind,
    pub image: CheckpointImage,
    pub with_process: bool,
    /// The container record exported from (a template for containers started from the image).
    pub container: Container,
    pub elapsed_ms: f64,
    /// The image was already in containerd, built from the same checkpoint with the same key
    /// (an earlier rollback or fork to it): used as it is, not built again.
    pub reused: bool,
    /// A plain image of the files, without a checkpoint layer ([`ExportOptions::files_only`]).
    pub files_only: bool,
}

impl Exported {
    /// One line for people.
    pub fn summary(&self) -> String {
        let s = &self.source;
        let layers = self.image.layers.len();
        let top = match self.files_only {
            true => ", no checkpoint layer: a plain image of the files".to_string(),
            false => format!(
                ", 1 checkpoint{}",
                if self.with_process {
                    " with the process image"
                } else {
                    ", files only"
                }
            ),
        };
        format!(
            "{}/{} checkpoint {} (turn {:?}, {}) as {}{}: {} layers ({} base, {} fs{}), manifest {}, {:.0} ms{}",
            s.namespace,
            s.container,
            s.seq,
            s.turn_id,
            format!("{:?}", self.kind).to_lowercase(),
            self.reference,
            match &self.output {
                Some(path) => format!(" in {}", path.display()),
                None => String::new(),
            },
            layers,
            self.image.base_layers,
            layers - self.image.base_layers - usize::from(!self.files_only),
            top,
            self.image.manifest_digest(),
            self.elapsed_ms,
            if self.reused { " (already exported)" } else { "" }
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

/// How an export is done, beyond the image's name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportOptions {
    /// The checkpoint (sequence number or turn id); default: the newest recovery point.
    pub turn: Option<String>,
    /// The base layers and config from this image (in the container's namespace) instead of
    /// the container's image, or its rootfs's lower layers when it has none.
    pub base_image: Option<String>,
    /// Write an image archive here (`docker load`-able) instead of the image into containerd.
    pub output: Option<PathBuf>,
    /// Only the checkpoint's files: no checkpoint layer (nothing of the processes), the image a
    /// plain one that starts the container's command.
    pub files_only: bool,
}

/// What an exported image of checkpoint `m` is built from, as one digest: the store's record
/// of it (its layers' digests, the process image, its time) and the key that signs it. Equal
/// identities build the same image (up to the signature's own bytes), so an internal image
/// labelled with it need not be built again; a rotated key or a store begun again (a new
/// container under the same id) gives another.
pub fn checkpoint_identity(m: &Manifest, public_key: &str) -> String {
    let record = serde_json::to_vec(m).expect("a manifest serializes");
    image::sha256_of(
        &[
            &record[..],
            b"\n",
            public_key.as_bytes(),
            // What the signature covers: an image signed before it bound the layers is built
            // again (a restore refuses it).
            b"\nstatement: criu, checkpoint.json, layers",
        ]
        .concat(),
    )
}

/// The blobs of an export that are files here (the store's layers, layers built from a
/// rootfs, downloads for an archive), by digest; temporary ones are removed on drop.
#[derive(Default)]
struct LocalBlobs {
    files: HashMap<String, PathBuf>,
    temps: Vec<TempFile>,
}

impl LocalBlobs {
    fn add_temp(&mut self, digest: &str, file: TempFile) {
        self.files
            .insert(digest.to_string(), file.path().to_path_buf());
        self.temps.push(file);
    }
}

/// Where a store keeps the squashed layers it exported into archives (by digest hex), for
/// the exports of containers started from those images; removed with the store.
pub const EXPORTED_DIR: &str = "exported/sha256";

/// The blob `digest` in any store under `state_dir` (`<state_dir>/<namespace>/<container>/`,
/// stores set aside included), if one holds it as a regular file. Stores are the shims' (root's,
/// outside every container), and a blob's name is its digest, which whoever takes it in checks
/// (containerd's content store, `docker load`).
fn in_another_store(state_dir: &Path, digest: &str) -> Option<PathBuf> {
    let hex = digest.strip_prefix("sha256:")?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    for ns in std::fs::read_dir(state_dir).ok()?.flatten() {
        if !ns.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        for store in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            if !store.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            for dir in ["blobs/sha256", EXPORTED_DIR] {
                let blob = store.path().join(dir).join(hex);
                if std::fs::symlink_metadata(&blob).is_ok_and(|m| m.is_file()) {
                    return Some(blob);
                }
            }
        }
    }
    None
}

/// The lower layers (top first) of a rootfs that are its base image's: for a container started
/// from a checkpoint image (a lower at the top, or below Docker's init layer, holds the reserved
/// directory: that image's checkpoint layer), that layer, the `image_layers` fs layers below it
/// (the chain the container's store begins with, exported from there) and the init layer above
/// are left out, so that each generation of exports adds only its own layers; else all of them.
fn below_checkpoint_layers(lowerdirs: &[PathBuf], image_layers: usize) -> &[PathBuf] {
    let reserved = |l: &PathBuf| {
        std::fs::symlink_metadata(l.join(crab_shim::restore::intake::RESERVED_DIR))
            .is_ok_and(|m| m.is_dir())
    };
    match lowerdirs.iter().take(2).position(reserved) {
        Some(top) if lowerdirs.len() > top + 1 + image_layers => {
            &lowerdirs[top + 1 + image_layers..]
        }
        _ => lowerdirs,
    }
}

/// The spec of `record` as JSON, if it has one.
fn spec_of(record: &Container) -> Option<Value> {
    serde_json::from_slice(&record.spec.as_ref()?.value).ok()
}

impl Ctl {
    /// Exports checkpoint `options.turn` (default: the newest recovery point) of `container`
    /// as image `reference`, into containerd or (`options.output`) an archive file.
    pub async fn export(
        &self,
        container: &str,
        reference: &str,
        options: &ExportOptions,
    ) -> Result<Exported> {
        let lease = self.client.create_lease().await?;
        let r = self
            .export_leased(&lease, container, Some(reference), options)
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
        reference: Option<&str>,
        options: &ExportOptions,
    ) -> Result<Exported> {
        let start = Instant::now();
        let turn = options.turn.as_deref();
        let record = self.export_record(container).await?;
        let root = self.store_root(&record)?;
        let config = self.config_for(&record)?;
        // The key the container's shim trusts as this host's (generated on first use).
        let signer = provenance::signing_key(&config.signing_key_path())?;
        let store = Store::open(&root)?;
        let manifests = store.list()?;
        let m = select_checkpoint(container, &manifests, turn)?.clone();
        // The store is the shim's, but what goes into an image is checked like what comes out.
        for d in &m.fs_layers {
            d.check().map_err(|e| {
                CtlError::Failed(format!(
                    "checkpoint {} of {container}: {e} (its manifest is damaged: export another \
                     checkpoint with --turn T; crabctl checkpoints {container} lists them)",
                    m.seq
                ))
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
        let source_label = format!("{}/{}@{}", source.namespace, source.container, source.seq);
        let identity =
            checkpoint_identity(&m, &provenance::public_key_string(&signer.verifying_key()));
        if options.output.is_none()
            && options.base_image.is_none()
            && !options.files_only
            && reference.starts_with(INTERNAL_PREFIX)
        {
            if let Some(image) = self
                .reusable_image(&reference, &source_label, &identity)
                .await
            {
                log::info!(
                    "{container}: checkpoint {} is exported already as {reference}",
                    m.seq
                );
                return Ok(Exported {
                    reference,
                    output: None,
                    source,
                    kind: m.kind,
                    with_process: m.process.is_some(),
                    image,
                    container: record,
                    elapsed_ms: start.elapsed().as_secs_f64() * 1000.0,
                    reused: true,
                    files_only: false,
                });
            }
        }

        let mut local = LocalBlobs::default();
        let layer_options = LayerOptions {
            max_bytes: config.limits.max_layer_bytes,
            max_apparent_bytes: config.limits.max_layer_apparent_bytes,
            max_depth: config.limits.max_walk_depth,
            ..LayerOptions::default()
        };
        let mut base = self
            .base_for(
                &record,
                &root,
                &store,
                options.base_image.as_deref(),
                (layer_options, m.image_layers),
                &mut local,
            )
            .await?;
        if let Some(spec) = spec_of(&record) {
            image::set_process(&mut base.config, &spec);
        }
        // Layers only in containerd's content store (a base image's, a store's layer that
        // was moved there).
        let mut in_content: Vec<String> = base
            .layers
            .iter()
            .map(|l| l.digest().to_string())
            .filter(|d| !local.files.contains_key(d))
            .collect();
        for layer in &m.fs_layers {
            let path = store.blob_path(&layer.digest);
            if path.is_file() {
                local.files.insert(layer.digest.clone(), path);
            } else if self.client.content_info(&layer.digest).await?.is_some() {
                in_content.push(layer.digest.clone());
            } else if let Some(path) = in_another_store(&config.store.state_dir, &layer.digest) {
                // A layer the container got from the checkpoint image it was restored from
                // (under Docker's overlay2 store, whose images are not in containerd): it is in
                // the store of the container that took that checkpoint.
                log::info!(
                    "{container}: layer {} of checkpoint {} from {}",
                    layer.digest,
                    m.seq,
                    path.display()
                );
                local.files.insert(layer.digest.clone(), path);
            } else {
                return Err(CtlError::MissingLayer {
                    digest: layer.digest.clone(),
                    seq: m.seq,
                    store: root.clone(),
                });
            }
        }

        // The layers the image carries for the chain: runs of it squashed when the image would
        // be deeper than [limits] max_image_layers.
        let fs_layers = self
            .image_fs_layers(
                container,
                &root,
                &m,
                (base.layers.len(), &config.limits),
                options.output.is_some(),
                &mut local,
            )
            .await?;
        in_content.retain(|d| !local.files.contains_key(d));

        let meta = CheckpointMeta {
            // What the source container's spec said of its turns travels with the image.
            annotations: spec_of(&record)
                .and_then(|spec| {
                    serde_json::from_value::<std::collections::HashMap<String, String>>(
                        spec.get("annotations")?.clone(),
                    )
                    .ok()
                })
                .map(|a| crab_shim::turns::travelling(&a))
                .unwrap_or_default(),
            fs_layers: fs_layers.clone(),
            ..CheckpointMeta::of_manifest(&source.namespace, &source.container, &m)
        };
        let built = if options.files_only {
            image::build_files(
                &base,
                &fs_layers,
                &Provenance {
                    source: &source_label,
                    turn_id: &m.turn_id,
                    created: &m.created_at,
                },
            )?
        } else {
            let criu_dir = m.process.as_ref().map(|p| root.join(&p.image));
            // The signature binds the layers the image has below the checkpoint layer.
            let below: Vec<String> = base
                .diff_ids
                .iter()
                .cloned()
                .chain(fs_layers.iter().map(|d| d.diff_id.clone()))
                .collect();
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
                let blob = image::write_checkpoint_layer(&meta, &below, criu, &signer, &mut out)?;
                out.flush().map_err(|e| CtlError::Io {
                    what: format!("writing {}", tmp_path.display()),
                    source: e,
                })?;
                Ok::<_, CtlError>(blob)
            })
            .await
            .map_err(|e| CtlError::Failed(format!("building the checkpoint layer: {e}")))??;
            local.add_temp(&layer.digest, tmp);
            image::build(
                &base,
                &fs_layers,
                &layer,
                &Provenance {
                    source: &source_label,
                    turn_id: &m.turn_id,
                    created: &m.created_at,
                },
            )?
        };
        match &options.output {
            None => self
                .upload(
                    lease,
                    &reference,
                    &built,
                    &local,
                    &in_content,
                    // A plain image of the files is no checkpoint image to reuse.
                    match options.files_only {
                        true => HashMap::new(),
                        false => HashMap::from([
                            (LABEL_SOURCE.to_string(), source_label.clone()),
                            (LABEL_IDENTITY.to_string(), identity.clone()),
                            (LABEL_BASE_LAYERS.to_string(), built.base_layers.to_string()),
                        ]),
                    },
                )
                .await
                .inspect_err(|_| self.progress.interrupted())?,
            Some(path) => {
                for digest in &in_content {
                    if local.files.contains_key(digest) {
                        continue;
                    }
                    let mut download = store.temp_file("download")?;
                    self.client.read_blob_into(digest, download.file()).await?;
                    local.add_temp(digest, download);
                }
                let (path, reference, image) = (path.clone(), reference.clone(), built.clone());
                let files = local.files.clone();
                let progress = self.progress.clone();
                tokio::task::spawn_blocking(move || {
                    let sizes: HashMap<&str, u64> = image
                        .layers
                        .iter()
                        .map(|l| (l.digest().as_ref(), l.size()))
                        .collect();
                    let total_bytes = sizes.values().sum();
                    // The archive asks for each layer once, right before writing it.
                    let written = std::sync::Mutex::new((0, 0));
                    let blob = |d: &str| {
                        let mut w = written.lock().unwrap_or_else(|e| e.into_inner());
                        progress.layers("export", w.0, sizes.len(), w.1, total_bytes);
                        *w = (w.0 + 1, w.1 + sizes.get(d).copied().unwrap_or_default());
                        files.get(d).map(|p| archive::Blob::File(p.as_path()))
                    };
                    archive::write(&path, &reference, &image, &blob).map_err(|e| CtlError::Io {
                        what: format!("writing the image archive {}", path.display()),
                        source: e,
                    })?;
                    progress.layers("export", sizes.len(), sizes.len(), total_bytes, total_bytes);
                    Ok::<_, CtlError>(())
                })
                .await
                .map_err(|e| CtlError::Failed(format!("writing the image archive: {e}")))
                .and_then(|r| r)
                .inspect_err(|_| self.progress.interrupted())?;
            }
        }
        drop(local);
        Ok(Exported {
            reference,
            output: options.output.clone(),
            source,
            kind: m.kind,
            with_process: m.process.is_some(),
            image: built,
            container: record,
            elapsed_ms: start.elapsed().as_secs_f64() * 1000.0,
            reused: false,
            files_only: options.files_only,
        })
    }

    /// The fs layers an image of checkpoint `m` carries over `base_layers` base layers: its
    /// chain, or, when base, chain and checkpoint layer would be more than `[limits]
    /// max_image_layers`, runs of the chain squashed into one layer each ([`squash::plan`]).
    /// A squashed layer's blob goes into `local`; for an archive (`keep`) it is also kept in
    /// the store's `exported/` directory, where the export of a container started from the
    /// archive's image finds it (under Docker's overlay2 store no content store holds it).
    async fn image_fs_layers(
        &self,
        container: &str,
        root: &Path,
        m: &Manifest,
        (base_layers, limits): (usize, &crab_runtime_config::LimitsConfig),
        keep: bool,
        local: &mut LocalBlobs,
    ) -> Result<Vec<Descriptor>> {
        let max = usize::try_from(limits.max_image_layers).unwrap_or(usize::MAX);
        let room = max.saturating_sub(base_layers + 1);
        let runs = squash::plan(m.fs_layers.len(), room);
        if runs.iter().all(|r| r.len() == 1) {
            return Ok(m.fs_layers.clone());
        }
        if room == 0 {
            log::warn!(
                "{container}: the base alone has {base_layers} layers, [limits] max_image_layers \
                 is {max}: the checkpoint's fs layers become one"
            );
        }
        let start = Instant::now();
        let mut out = Vec::with_capacity(runs.len());
        for run in &runs {
            if run.len() == 1 {
                out.push(m.fs_layers[run.start].clone());
                continue;
            }
            let mut files = Vec::with_capacity(run.len());
            for d in &m.fs_layers[run.clone()] {
                let path = match local.files.get(&d.digest) {
                    Some(p) => p.clone(),
                    None => {
                        let mut download =
                            crab_shim::checkpoint::store::temp_file_in(root, "download")?;
                        self.client
                            .read_blob_into(&d.digest, download.file())
                            .await?;
                        let p = download.path().to_path_buf();
                        local.add_temp(&d.digest, download);
                        p
                    }
                };
                files.push((path, d.clone()));
            }
            // Bounded like a layer the shim writes: entries, and the apparent bytes of a layer.
            let (root2, bounds) = (
                root.to_path_buf(),
                (limits.max_manifest_entries, limits.max_layer_apparent_bytes),
            );
            let what = format!(
                "squashing fs layers {}..{} of checkpoint {}",
                run.start + 1,
                run.end,
                m.seq
            );
            let (blob, written) = tokio::task::spawn_blocking(move || {
                let fail = |e: &dyn std::fmt::Display| CtlError::Failed(format!("{what}: {e}"));
                let mut tar = crab_shim::checkpoint::store::temp_file_in(&root2, "squash.tar")?;
                let file = tar.file().try_clone().map_err(|e| fail(&e))?;
                squash::squash(&root2, &files, file, tar.path(), bounds).map_err(|e| fail(&e))?;
                tar.file().rewind().map_err(|e| fail(&e))?;
                let mut blob =
                    crab_shim::checkpoint::store::temp_file_in(&root2, "squash.tar.zst")?;
                let mut w = std::io::BufWriter::new(blob.file().try_clone().map_err(|e| fail(&e))?);
                let written = image::compress_layer(std::io::BufReader::new(tar.file()), &mut w)
                    .and_then(|b| w.flush().map(|()| b))
                    .map_err(|e| fail(&e))?;
                Ok::<_, CtlError>((blob, written))
            })
            .await
            .map_err(|e| CtlError::Failed(format!("squashing fs layers: {e}")))??;
            let d = Descriptor {
                digest: written.digest.clone(),
                diff_id: written.diff_id.clone(),
                size: written.size,
                media_type: MEDIA_TYPE_LAYER_ZSTD.to_string(),
            };
            if keep {
                let dir = root.join(EXPORTED_DIR);
                let dest = dir.join(d.hex());
                std::fs::create_dir_all(&dir).map_err(|e| CtlError::Io {
                    what: format!("creating {}", dir.display()),
                    source: e,
                })?;
                if !dest.is_file() {
                    blob.persist(&dest)?;
                }
                local.files.insert(d.digest.clone(), dest);
            } else {
                local.add_temp(&d.digest, blob);
            }
            out.push(d);
        }
        log::info!(
            "{container}: checkpoint {}'s {} fs layers squashed into {} ([limits] max_image_layers \
             {max}, {base_layers} base layers) in {:.0} ms",
            m.seq,
            m.fs_layers.len(),
            out.len(),
            start.elapsed().as_secs_f64() * 1000.0
        );
        Ok(out)
    }

    /// Image `reference` as it is in containerd, if it was built from the checkpoint
    /// `identity` names ([`checkpoint_identity`]) and is whole: labels, manifest, config and
    /// a diff id per layer. Anything else (missing, another checkpoint under the same name, a
    /// key rotated since, unreadable) is `None`: the image is built again.
    async fn reusable_image(
        &self,
        reference: &str,
        source_label: &str,
        identity: &str,
    ) -> Option<CheckpointImage> {
        let record = self.client.image(reference).await.ok()??;
        if record.labels.get(LABEL_SOURCE).map(String::as_str) != Some(source_label)
            || record.labels.get(LABEL_IDENTITY).map(String::as_str) != Some(identity)
        {
            return None;
        }
        let target = record.target?;
        if MediaType::from(target.media_type.as_str()) != MediaType::ImageManifest {
            return None;
        }
        let manifest = self.client.read_blob(&target.digest).await.ok()?;
        let doc: Value = serde_json::from_slice(&manifest).ok()?;
        let config = self
            .client
            .read_blob(doc["config"]["digest"].as_str()?)
            .await
            .ok()?;
        let layers: Vec<oci::Descriptor> = serde_json::from_value(doc["layers"].clone()).ok()?;
        let config_doc: Value = serde_json::from_slice(&config).ok()?;
        let diff_ids: Vec<String> =
            serde_json::from_value(config_doc["rootfs"]["diff_ids"].clone()).ok()?;
        let base_layers: usize = record.labels.get(LABEL_BASE_LAYERS)?.parse().ok()?;
        (!layers.is_empty() && layers.len() == diff_ids.len() && base_layers < layers.len())
            .then_some(CheckpointImage {
                manifest,
                config,
                layers,
                diff_ids,
                base_layers,
            })
    }

    /// The record to export `container` from: containerd's, else for a Docker container that
    /// has exited (dockerd removes the record then, and keeps the container and its layers)
    /// one made from dockerd's inspect document ([`docker::exited_record`]), else a stand-in
    /// when only its store is left.
    async fn export_record(&self, container: &str) -> Result<Container> {
        if let Some(record) = self.client.container(container).await? {
            return Ok(record);
        }
        if self.namespace() == docker::NAMESPACE {
            let (id, host) = (container.to_string(), self.docker_host.clone());
            let looked_up = docker::lookup(host.as_deref(), &id).await;
            match looked_up {
                Ok(docker::Lookup::Found { id, doc, .. }) if id == container => {
                    log::info!("{id} has exited: its process and rootfs as dockerd describes them");
                    return Ok(docker::exited_record(&id, &doc));
                }
                Ok(_) => {}
                Err(e) => log::warn!("cannot ask dockerd about {container}: {e}"),
            }
        }
        // No record anywhere (removed with its container: `docker run --rm` after a crash, or
        // `ctr rm`), but its store outlives it: a stand-in with only the id, so the store is
        // the one `--config` (or the default config) names. The base then comes from
        // `--base-image`, or from the layers `rootfs.json` names if they are still there; the
        // process from the base image's config.
        let mut stand_in = Container {
            id: container.to_string(),
            ..Default::default()
        };
        if let Ok(root) = self.store_root(&stand_in) {
            log::info!("{container} has no record: exporting from its store");
            // Its command, env, cwd and travelling annotations, as the shim recorded them.
            match crate::rootfs::read_spec_record(&root) {
                Ok(Some(spec)) => {
                    stand_in.spec = Some(prost_types::Any {
                        type_url: docker::SPEC_TYPE_URL.to_string(),
                        value: spec,
                    })
                }
                Ok(None) => log::warn!(
                    "{container}: its store has no spec record (written since crab 0.1 at \
                     Start): the image runs its base image's command"
                ),
                Err(e) => log::warn!("{container}: its spec record is unusable: {e}"),
            }
            return Ok(stand_in);
        }
        self.container(container).await
    }

    /// Writes `image` into containerd as `reference`: its layers from `local` files or (those
    /// in `in_content`) already in the content store, its config and manifest; the image
    /// record gets `labels`.
    async fn upload(
        &self,
        lease: &Lease,
        reference: &str,
        image: &CheckpointImage,
        local: &LocalBlobs,
        in_content: &[String],
        labels: HashMap<String, String>,
    ) -> Result<()> {
        for digest in in_content {
            self.client.lease_content(lease, digest).await?;
        }
        let total_bytes = image.layers.iter().map(|l| l.size()).sum();
        let mut bytes = 0;
        for (i, layer) in image.layers.iter().enumerate() {
            if let Some(path) = local.files.get(layer.digest().as_ref()) {
                self.client
                    .write_blob(lease, layer, BlobData::File(path), HashMap::new())
                    .await?;
            }
            bytes += layer.size();
            self.progress
                .layers("export", i + 1, image.layers.len(), bytes, total_bytes);
        }
        let config_desc = descriptor_of(MediaType::ImageConfig, &image.config);
        self.client
            .write_blob(
                lease,
                &config_desc,
                BlobData::Bytes(&image.config),
                HashMap::new(),
            )
            .await?;
        let manifest_desc = descriptor_of(MediaType::ImageManifest, &image.manifest);
        self.client
            .write_blob(
                lease,
                &manifest_desc,
                BlobData::Bytes(&image.manifest),
                image.manifest_gc_labels(),
            )
            .await?;
        self.client
            .put_image(reference, &manifest_desc, labels)
            .await
    }

    /// The base of a checkpoint image of `record`: image `base_image` if given, else the
    /// container's image ([`Ctl::base_of`]), else (a rootfs the caller mounted: Docker's) the
    /// lower layers of its rootfs overlay, each read into a layer here (into `local`).
    async fn base_for(
        &self,
        record: &Container,
        store_dir: &Path,
        store: &Store,
        base_image: Option<&str>,
        (layer_options, image_layers): (LayerOptions, usize),
        local: &mut LocalBlobs,
    ) -> Result<image::Base> {
        if let Some(name) = base_image {
            let (manifest, config) = self.client.manifest_and_config(name).await?;
            return Ok(base_of(&manifest, &config)?);
        }
        if !record.image.is_empty() {
            return self.base_of(record).await;
        }
        let spec = spec_of(record).unwrap_or_default();
        let root_path = spec["root"]["path"].as_str().map(PathBuf::from);
        let overlay = crate::rootfs::resolve(store_dir, root_path.as_deref()).map_err(|e| {
            CtlError::Refused(format!(
                "container {} has no image, and the layers of its rootfs cannot be read: {e} \
                 (--base-image REF names an image of this namespace to build on instead)",
                record.id
            ))
        })?;
        let lowers = below_checkpoint_layers(&overlay.lowerdirs, image_layers);
        if lowers.len() < overlay.lowerdirs.len() {
            log::info!(
                "{}: started from a checkpoint image: its checkpoint layer and the {image_layers} \
                 fs layers of its chain (this store's chain begins with them) are left out of the \
                 base ({} of {} lower layers kept)",
                record.id,
                lowers.len(),
                overlay.lowerdirs.len()
            );
        }
        let mut layers = Vec::with_capacity(lowers.len());
        // Image layers go bottom first; overlay lowers are listed top first.
        for lower in lowers.iter().rev() {
            let tar = store.temp_file("base.tar")?;
            let mut blob = store.temp_file("base.tar.zst")?;
            let io_err = |path: &Path| {
                let path = path.to_path_buf();
                move |e: std::io::Error| CtlError::Io {
                    what: format!("writing {}", path.display()),
                    source: e,
                }
            };
            let tar_file = tar.path().to_path_buf();
            let out = blob.file().try_clone().map_err(io_err(blob.path()))?;
            let blob_path = blob.path().to_path_buf();
            let dir = lower.clone();
            let opts = LayerOptions {
                xattrs: overlay.xattrs,
                ..layer_options
            };
            let written = tokio::task::spawn_blocking(move || {
                let mut tar = tar;
                let file = tar.file().try_clone().map_err(io_err(&tar_file))?;
                write_tree_tar(&dir, file, &tar_file, &opts).map_err(|e| {
                    CtlError::Failed(format!("reading the rootfs layer {}: {e}", dir.display()))
                })?;
                tar.file().rewind().map_err(io_err(&tar_file))?;
                let mut out = std::io::BufWriter::new(out);
                let blob = image::compress_layer(std::io::BufReader::new(tar.file()), &mut out)
                    .and_then(|b| out.flush().map(|()| b))
                    .map_err(io_err(&blob_path))?;
                Ok::<_, CtlError>(blob)
            })
            .await
            .map_err(|e| CtlError::Failed(format!("reading the rootfs layers: {e}")))??;
            local.add_temp(&written.digest, blob);
            layers.push((
                image::descriptor(MEDIA_TYPE_LAYER_ZSTD, &written.digest, written.size)?,
                written.diff_id,
            ));
        }
        log::info!(
            "{}: {} base layers from {}",
            record.id,
            layers.len(),
            overlay.found_in
        );
        Ok(image::rootfs_base(layers))
    }

    /// The base of a checkpoint image of `record`: its image's layers and config (without
    /// crab's additions if that is a checkpoint image itself), checked against the container's
    /// rootfs, which must be built on them.
    async fn base_of(&self, record: &Container) -> Result<image::Base> {
        if record.image.is_empty() {
            return Err(CtlError::Refused(format!(
                "container {} has no image: a checkpoint image needs its base image \
                 (--base-image REF names one of this namespace to build on)",
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
    fn an_identity_changes_with_the_checkpoint_record_and_the_key() {
        let m = manifest(3, "t3", CheckpointKind::Full);
        let id = checkpoint_identity(&m, "ed25519:aa");
        assert_eq!(id, checkpoint_identity(&m.clone(), "ed25519:aa"));
        assert!(id.starts_with("sha256:"), "{id}");
        // Another key (rotated), another record of the same seq (a store begun again).
        assert_ne!(id, checkpoint_identity(&m, "ed25519:bb"));
        let mut later = m.clone();
        later.created_at = "2030-01-01T00:00:00Z".into();
        assert_ne!(id, checkpoint_identity(&later, "ed25519:aa"));
        let mut other = m.clone();
        other.turn_id = "t4".into();
        assert_ne!(id, checkpoint_identity(&other, "ed25519:aa"));
    }

    #[test]
    fn a_checkpoint_image_s_own_layers_are_not_a_base() {
        let dir = tempfile::tempdir().unwrap();
        let layer = |name: &str, reserved: bool| {
            let p = dir.path().join(name);
            std::fs::create_dir_all(&p).unwrap();
            if reserved {
                std::fs::create_dir(p.join(crab_shim::restore::intake::RESERVED_DIR)).unwrap();
            }
            p
        };
        let (init, ckpt, fs2, fs1, base) = (
            layer("init", false),
            layer("ckpt", true),
            layer("fs2", false),
            layer("fs1", false),
            layer("base", false),
        );
        // Docker's init layer on top, the checkpoint layer below it, two fs layers, the base.
        let lowers = vec![
            init.clone(),
            ckpt.clone(),
            fs2.clone(),
            fs1.clone(),
            base.clone(),
        ];
        assert_eq!(
            below_checkpoint_layers(&lowers, 2),
            std::slice::from_ref(&base)
        );
        // Without an init layer.
        let lowers = vec![ckpt.clone(), fs1.clone(), base.clone()];
        assert_eq!(
            below_checkpoint_layers(&lowers, 1),
            std::slice::from_ref(&base)
        );
        // An ordinary container: all its lowers.
        let lowers = vec![init.clone(), fs1.clone(), base.clone()];
        assert_eq!(below_checkpoint_layers(&lowers, 0), &lowers[..]);
        // Fewer lowers than the chain says: nothing left out (never an empty base).
        let lowers = vec![ckpt.clone(), fs1.clone()];
        assert_eq!(below_checkpoint_layers(&lowers, 1), &lowers[..]);
        // The reserved directory deeper down is not a checkpoint layer of this rootfs; a file of
        // that name is not the directory.
        let lowers = vec![init.clone(), fs1.clone(), ckpt.clone(), base.clone()];
        assert_eq!(below_checkpoint_layers(&lowers, 0), &lowers[..]);
        let file = dir.path().join("file-layer");
        std::fs::create_dir(&file).unwrap();
        std::fs::write(file.join(crab_shim::restore::intake::RESERVED_DIR), "x").unwrap();
        let lowers = vec![file, base.clone()];
        assert_eq!(below_checkpoint_layers(&lowers, 0), &lowers[..]);
    }

    #[test]
    fn internal_references_name_the_checkpoint() {
        assert_eq!(
            internal_reference("crab-test", "It-Sandbox", 7),
            "crab.local/checkpoint/crab-test/it-sandbox:7"
        );
    }
}

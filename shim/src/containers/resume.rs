//! Resume at Create: a container created with `io.crab/resume: newest`
//! ([`crate::turns::RESUME`]) starts from the newest durable checkpoint of its lineage on
//! this node ([`crate::checkpoint::lineage::newest`]) instead of fresh: the kubelet's next
//! attempt of a crashed container, Docker's restart of one (same id, new task), a container
//! created again after a node reboot.
//!
//! 1. the checkpoint is found among the stores of the container's containerd namespace (its
//!    own, set-aside ones, those of removed containers); none: a fresh start, logged;
//! 2. it must fit: taken on the same image (the chain id its store recorded against the one
//!    the engine unpacked this rootfs from, when both are known), every layer on this node's
//!    disk, the rootfs an overlay, no user namespace (the layers hold the container's ids);
//!    otherwise Create fails with the reason, never a silent fresh start;
//! 3. its fs layers are put into the rootfs ([`crate::rollback::onto_rootfs`]: the in-place
//!    rollback's machinery, every blob's digest checked; what the rootfs's upperdir already
//!    held, such as the files an interrupted turn wrote before Docker restarted the
//!    container, is returned to the checkpoint's state too);
//! 4. its process image, if it has one, is copied out of the store into the restore's own
//!    directory (pages rebuilt from their chunks) and checked against what the spec grants,
//!    as every process image is; Start then restores it through CRIU's gate and the kernel
//!    check, exactly as for a checkpoint image.
//!
//! The store is the node's own (root's, written by crab alone), which `crabctl export` signs
//! as it is: no signature is checked here. What comes from elsewhere (an image, a registry)
//! goes through [`crate::restore::intake`]'s signature check.

use std::{
    path::{Path, PathBuf},
    time::Instant,
};

use crab_runtime_config::Config;
use oci_spec::runtime::Spec;

use crate::{
    bundle::{self, RootfsMount},
    checkpoint::{
        lineage::{self, Candidate},
        store::{Descriptor, DescriptorError},
    },
    error::{Error, Result},
    restore::{
        intake::{self as restore, CheckpointMeta, RestoreError, Resumed, Taken},
        layers::LayersError,
        privilege::Granted,
        scratch::RestoreDir,
    },
};

/// Why a container cannot resume from the checkpoint of its lineage that was found.
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    #[error(
        "it was taken on image {was}, and this container's image is {now} (a checkpoint's \
         processes and files belong to its image: run the lineage on that image, or give the \
         container a new lineage with io.crab/lineage)"
    )]
    OtherImage { was: String, now: String },
    #[error(
        "the container has a user namespace: resuming one is not supported (its layers hold \
         the container's ids, its rootfs the host's)"
    )]
    UserNamespace,
    #[error("its rootfs is not an overlay: the checkpoint's files cannot be put into it")]
    NotOverlay,
    #[error("its rootfs overlay has no upperdir")]
    NoUpperdir,
    #[error("making its restore directory: {0}")]
    RestoreDir(#[source] std::io::Error),
    #[error("its manifest is damaged: {0}")]
    Damaged(#[source] DescriptorError),
    #[error(
        "its layer {0} is on no checkpoint store of this node (a layer of the checkpoint image \
         its lineage was started from, kept in the image store)"
    )]
    LayerMissing(String),
    /// The in-place rollback's machinery could not put its files into the rootfs.
    #[error("putting its files into the rootfs: {0}")]
    Files(#[source] crate::error::Source),
    #[error("copying its process image: {0}")]
    Copy(#[source] RestoreError),
    /// Its process image asks for more than the spec grants, or cannot be read.
    #[error(transparent)]
    Privilege(RestoreError),
}

/// What a resume found and prepared.
pub(super) struct Resumption {
    pub taken: Taken,
    /// The restore's copy of the process image (removed at Delete, or when Create fails).
    pub restore_dir: Option<RestoreDir>,
}

/// What [`resume`] is given of the container being created.
pub(super) struct ResumeRequest<'a> {
    pub id: &'a str,
    pub namespace: &'a str,
    pub bundle: &'a Path,
    pub config: &'a Config,
    pub spec: &'a Spec,
    pub rootfs: &'a bundle::Rootfs,
    pub lineage: &'a str,
    /// The chain id of the image the engine unpacked this rootfs from, or why it is unknown.
    pub image: &'a std::result::Result<String, LayersError>,
    pub granted: Granted,
}

fn refused(r: &ResumeRequest<'_>, c: &Candidate, why: ResumeError) -> Error {
    Error::Resume {
        id: r.id.to_string(),
        from: format!(
            "checkpoint {} of its lineage {} (store of {})",
            c.manifest.seq, r.lineage, c.container
        ),
        source: why.into(),
    }
}

/// Finds the newest durable checkpoint of the container's lineage and prepares the rootfs and
/// the process image from it; `None`: the lineage has no checkpoint on this node.
pub(super) async fn resume(r: ResumeRequest<'_>) -> Result<Option<Resumption>> {
    let ns_dir = r.config.store.state_dir.join(r.namespace);
    let lineage_name = r.lineage.to_string();
    let found = tokio::task::spawn_blocking(move || lineage::newest(&ns_dir, &lineage_name))
        .await
        .map_err(Error::Task)?;
    let found = match found {
        Some(c) => Some(c),
        None => pulled(&r).await?,
    };
    let Some(c) = found else {
        log::info!(
            "create {}: lineage {} has no checkpoint on this node{}: it starts fresh",
            r.id,
            r.lineage,
            match &r.config.replication.registry {
                Some(reg) => format!(" nor in {reg}"),
                None => String::new(),
            }
        );
        return Ok(None);
    };
    log::info!(
        "create {}: resumes lineage {} from checkpoint {} (turn {:?}, {:?}) of {}",
        r.id,
        r.lineage,
        c.manifest.seq,
        c.manifest.turn_id,
        c.manifest.kind,
        c.container
    );
    match (&c.record.image, r.image) {
        (Some(was), Ok(now)) if was != now => {
            return Err(refused(
                &r,
                &c,
                ResumeError::OtherImage {
                    was: was.clone(),
                    now: now.clone(),
                },
            ))
        }
        (Some(was), Err(why)) => log::warn!(
            "create {}: the checkpoint was taken on image {was}; this rootfs's image cannot be \
             told ({why}): resumed without that check",
            r.id
        ),
        _ => {}
    }
    if bundle::joins_user_namespace(r.spec) || has_uid_mappings(r.spec) {
        return Err(refused(&r, &c, ResumeError::UserNamespace));
    }
    let Some(overlay) = RootfsMount::overlay(&r.rootfs.mounts) else {
        return Err(refused(&r, &c, ResumeError::NotOverlay));
    };
    let Some((upperdir, lowerdirs)) = crate::inspector::fs::overlay_dirs(&overlay.options) else {
        return Err(refused(&r, &c, ResumeError::NoUpperdir));
    };
    let xattrs = crate::inspector::fs::OverlayXattrs::of_mount(&overlay.options);
    let scratch = match &c.manifest.process {
        Some(_) => {
            // On disk in the store, named in the bundle (the cleanup after a shim died).
            let dir = RestoreDir::create(&r.config.store.state_dir, r.namespace, r.id)
                .and_then(|d| d.record_in(r.bundle).map(|()| d))
                .map_err(|e| refused(&r, &c, ResumeError::RestoreDir(e)))?;
            Some(dir)
        }
        None => None,
    };
    let (rootfs_path, limits) = (r.rootfs.path.clone(), r.config.limits.clone());
    let image_limits = restore::ImageLimits::from_config(&r.config.restore);
    let (cand, granted) = (c.clone(), r.granted.clone());
    let ns_dir = r.config.store.state_dir.join(r.namespace);
    let criu_dest = scratch.as_ref().map(RestoreDir::criu);
    let prepared = tokio::task::spawn_blocking(move || {
        let blobs = locate_blobs(&cand, &ns_dir)?;
        let started = Instant::now();
        let rootfs = crate::rollback::Rootfs {
            path: &rootfs_path,
            upperdir: &upperdir,
            lowerdirs: &lowerdirs,
            overlay_xattrs: xattrs,
        };
        let find = |d: &Descriptor| {
            blobs
                .iter()
                .find(|(b, _)| b.digest == d.digest)
                .map(|(_, p)| p.clone())
                .unwrap_or_default()
        };
        let applied =
            crate::rollback::onto_rootfs(&rootfs, &cand.manifest.fs_layers, &find, &limits)
                .map_err(|e| ResumeError::Files(e.into()))?;
        let files_ms = started.elapsed().as_secs_f64() * 1e3;
        let copied = match (&cand.manifest.process, &criu_dest) {
            (Some(p), Some(dest)) => {
                let from = cand.store.join(&p.image);
                let chunks = cand.store.join("chunks");
                let bytes = restore::copy_stored_image(&from, &chunks, dest, image_limits)
                    .map_err(ResumeError::Copy)?;
                restore::check_privilege(dest, &granted).map_err(ResumeError::Privilege)?;
                Some(bytes)
            }
            _ => None,
        };
        Ok::<_, ResumeError>((blobs, applied, files_ms, copied, started.elapsed()))
    })
    .await
    .map_err(Error::Task)?;
    let (blobs, applied, files_ms, copied, took) = prepared.map_err(|e| refused(&r, &c, e))?;
    log::info!(
        "create {}: {} paths ({} bytes) of {} layers put into the rootfs in {files_ms:.1} ms{}; \
         {:.1} ms in all",
        r.id,
        applied.paths,
        applied.bytes,
        c.manifest.fs_layers.len(),
        match copied {
            Some(b) => format!(", its process image ({b} bytes) copied and checked"),
            None => ", no process image".to_string(),
        },
        took.as_secs_f64() * 1e3
    );
    let meta = CheckpointMeta::of_manifest(r.namespace, &c.container, &c.manifest);
    Ok(Some(Resumption {
        taken: Taken {
            meta,
            criu_dir: scratch.as_ref().map(RestoreDir::criu),
            cached: None,
            verification: None,
            resumed: Some(Resumed { blobs }),
        },
        restore_dir: scratch,
    }))
}

/// With `[replication]`, the lineage's newest checkpoint in the registry, pulled into a
/// store of this node (verified: [`crate::replication::pull_newest`]); a registry that cannot
/// be asked fails Create (a silent fresh start could lose the trajectory).
async fn pulled(r: &ResumeRequest<'_>) -> Result<Option<Candidate>> {
    let registry = match crate::replication::Registry::from_config(&r.config.replication) {
        Ok(Some(reg)) => reg,
        Ok(None) => return Ok(None),
        Err(e) => {
            return Err(Error::Unusable {
                what: "[replication]",
                source: e.into(),
            })
        }
    };
    let trusted =
        crate::checkpoint::provenance::trusted_keys(r.config).map_err(|e| Error::Unusable {
            what: "the trusted keys",
            source: e.into(),
        })?;
    let ns_dir = r.config.store.state_dir.join(r.namespace);
    let started = Instant::now();
    let root = crate::replication::pull_newest(
        &registry,
        r.lineage,
        &ns_dir,
        r.image.as_ref().ok().map(String::as_str),
        &trusted,
        r.config.replication.max_mib << 20,
    )
    .await
    .map_err(|e| Error::Resume {
        id: r.id.to_string(),
        from: format!(
            "lineage {}'s newest checkpoint in {}",
            r.lineage, registry.name
        ),
        source: e.into(),
    })?;
    let Some(root) = root else {
        return Ok(None);
    };
    log::info!(
        "create {}: lineage {}'s newest checkpoint pulled from {} into {} in {:.0} ms",
        r.id,
        r.lineage,
        registry.name,
        root.display(),
        started.elapsed().as_secs_f64() * 1e3
    );
    let stores = lineage::stores(&ns_dir, Some(r.lineage))
        .into_iter()
        .filter(|s| s.store == root)
        .collect();
    Ok(lineage::newest_of(stores))
}

/// Whether the spec maps ids (a user namespace of its own).
fn has_uid_mappings(spec: &Spec) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.uid_mappings().as_ref())
        .is_some_and(|m| !m.is_empty())
}

/// Where each fs layer of the candidate's checkpoint is on this node: in its store, else in
/// another store of the namespace (a layer the container got from a checkpoint it was itself
/// restored from).
fn locate_blobs(
    c: &Candidate,
    ns_dir: &Path,
) -> std::result::Result<Vec<(Descriptor, PathBuf)>, ResumeError> {
    let mut out = Vec::with_capacity(c.manifest.fs_layers.len());
    let mut others: Option<Vec<PathBuf>> = None;
    for d in &c.manifest.fs_layers {
        d.check().map_err(ResumeError::Damaged)?;
        let name = d.hex().to_string();
        let own = c.store.join("blobs/sha256").join(&name);
        if own.is_file() {
            out.push((d.clone(), own));
            continue;
        }
        let stores = others.get_or_insert_with(|| {
            std::fs::read_dir(ns_dir)
                .map(|it| it.flatten().map(|e| e.path()).collect())
                .unwrap_or_default()
        });
        match stores
            .iter()
            .map(|s| s.join("blobs/sha256").join(&name))
            .find(|p| p.is_file())
        {
            Some(p) => out.push((d.clone(), p)),
            None => return Err(ResumeError::LayerMissing(d.digest.clone())),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused resume names the container, the checkpoint and the lineage, and keeps why.
    #[test]
    fn a_refused_resume_says_which_checkpoint_and_why() {
        let e = Error::Resume {
            id: "c1".into(),
            from: "checkpoint 3 of its lineage l1 (store of c0)".into(),
            source: ResumeError::OtherImage {
                was: "sha256:a".into(),
                now: "sha256:b".into(),
            }
            .into(),
        };
        assert_eq!(
            e.to_string(),
            "cannot resume c1 from checkpoint 3 of its lineage l1 (store of c0): it was taken on \
             image sha256:a, and this container's image is sha256:b (a checkpoint's processes \
             and files belong to its image: run the lineage on that image, or give the \
             container a new lineage with io.crab/lineage)"
        );
        let kept = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<ResumeError>());
        assert!(
            matches!(kept, Some(ResumeError::OtherImage { .. })),
            "{kept:?}"
        );
        assert_eq!(
            ResumeError::LayerMissing("sha256:c".into()).to_string(),
            "its layer sha256:c is on no checkpoint store of this node (a layer of the \
             checkpoint image its lineage was started from, kept in the image store)"
        );
    }
}

//! containerd's own checkpoint of a container (`ctr task checkpoint`), signed and bound to the
//! rootfs it was dumped on; and the checks of that binding when one is restored.

use std::path::Path;

use super::{Container, Containers, TaskCheckpointOptions};
use crate::{
    bundle::{self, RootfsMount},
    error::{Error, Result},
    process::Status,
    restore::{
        layers::{LayersError, Unpacked},
        rw::{RwDigest, RwError, RwLimits},
        trust,
    },
    runc::RuncError,
};

/// Why a containerd checkpoint's processes may not go back on this rootfs: the image or rw
/// layer its signature binds it to is not the rootfs's, or cannot be told.
#[derive(Debug, thiserror::Error)]
pub enum BindingError {
    #[error("its signature binds it to image {signed}, and {source}")]
    ImageUnknown {
        signed: String,
        #[source]
        source: LayersError,
    },
    #[error(
        "it was dumped on image {signed} and its rootfs is image {found} ({told_by}): its \
         processes would run on other files"
    )]
    OtherImage {
        signed: String,
        found: String,
        /// Who said which image the rootfs is ([`Unpacked::source`]).
        told_by: String,
    },
    #[error("its signature binds its rw layer, and {0}")]
    RwUnknown(#[source] RwError),
    #[error(
        "its rootfs's rw layer is not the one it was dumped with (it changes {changes} paths \
         of the image, not as the signed change does): restore it with its own rw layer (`ctr \
         c restore --rw`; the CRI puts the checkpoint's rootfs diff back itself)"
    )]
    OtherRw { changes: u64 },
}

/// Why the rootfs of a container being checkpointed cannot be bound to the signature.
#[derive(Debug, thiserror::Error)]
enum Unbound {
    #[error(transparent)]
    Image(#[from] LayersError),
    #[error(transparent)]
    Rw(#[from] RwError),
}

impl Containers {
    /// Which image the engine unpacked container `id`'s rootfs from ([`crate::restore::layers`]).
    pub(super) async fn rootfs_image(
        &self,
        id: &str,
        rootfs: &bundle::Rootfs,
    ) -> std::result::Result<Unpacked, LayersError> {
        let overlay = RootfsMount::overlay(&rootfs.mounts).ok_or(LayersError::NotOverlay)?;
        crate::restore::layers::identify(
            self.snapshots.as_ref(),
            &self.namespace,
            id,
            &rootfs.path,
            rootfs.mounted_by == bundle::MountedBy::Containerd,
            Some(overlay.options.as_slice()),
        )
        .await
    }

    /// A containerd checkpoint's processes go back on the image they were dumped on.
    pub(super) async fn check_image(
        &self,
        id: &str,
        rootfs: &bundle::Rootfs,
        bound: &crate::checkpoint::provenance::RootfsBinding,
    ) -> std::result::Result<(), BindingError> {
        let t = std::time::Instant::now();
        let u =
            self.rootfs_image(id, rootfs)
                .await
                .map_err(|source| BindingError::ImageUnknown {
                    signed: bound.image.clone(),
                    source,
                })?;
        if u.top != bound.image {
            return Err(BindingError::OtherImage {
                signed: bound.image.clone(),
                found: u.top,
                told_by: u.source,
            });
        }
        log::info!(
            "create {id}: its rootfs is the image it was dumped on ({}, asked in {:.1} ms)",
            u.source,
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// What the rootfs's rw layer changes in its image ([`crate::restore::rw`]).
    async fn rw_digest(
        rootfs: &bundle::Rootfs,
        limits: RwLimits,
    ) -> std::result::Result<RwDigest, RwError> {
        let options = RootfsMount::overlay(&rootfs.mounts)
            .map(|m| m.options.clone())
            .ok_or(RwError::NotOverlay)?;
        tokio::task::spawn_blocking(move || {
            let (upper, lowers) =
                crate::inspector::fs::overlay_dirs(&options).ok_or(RwError::NoUpperDir)?;
            let xattrs = crate::inspector::fs::OverlayXattrs::of_mount(&options);
            crate::restore::rw::digest(&upper, &lowers, xattrs, limits)
        })
        .await?
    }

    /// A containerd checkpoint's processes go back on the rw layer they were dumped with (put
    /// back by `ctr c restore --rw` before Create, by the CRI between Create and Start).
    pub(super) async fn check_rw(
        id: &str,
        rootfs: &bundle::Rootfs,
        want: &str,
    ) -> std::result::Result<(), BindingError> {
        let t = std::time::Instant::now();
        let got = Self::rw_digest(rootfs, RwLimits::default())
            .await
            .map_err(BindingError::RwUnknown)?;
        if got.digest != want {
            return Err(BindingError::OtherRw {
                changes: got.changes,
            });
        }
        log::info!(
            "container {id}: its rw layer is the one it was dumped with ({} paths, {} bytes \
             hashed in {:.1} ms)",
            got.changes,
            got.bytes,
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(())
    }

    /// The rootfs container `id` runs on, for the signature of a containerd checkpoint of it:
    /// its image's chain id and what its rw layer changes (containerd pauses the container
    /// while it checkpoints it and diffs the rw layer).
    async fn rootfs_binding(
        &self,
        c: &Container,
    ) -> std::result::Result<crate::checkpoint::provenance::RootfsBinding, Unbound> {
        let image = self.rootfs_image(&c.id, &c.rootfs).await?.top;
        let rw = Self::rw_digest(&c.rootfs, RwLimits::default()).await?;
        log::info!(
            "checkpoint of {}: its rw layer changes {} paths ({} bytes hashed)",
            c.id,
            rw.changes,
            rw.bytes
        );
        Ok(crate::checkpoint::provenance::RootfsBinding {
            image,
            rw: rw.digest,
        })
    }

    /// containerd's own checkpoint (`ctr task checkpoint`): a CRIU image of the whole
    /// container into `path`. Refused, before anything is dumped, when a live process would
    /// be missing from the image (an exec's main process is not in init's tree).
    pub async fn checkpoint_task(
        &self,
        id: &str,
        path: &Path,
        opts: TaskCheckpointOptions,
    ) -> Result<()> {
        let c = self.get(id)?;
        let _guard = c.lifecycle.lock().await;
        c.init
            .transition(&[Status::Running, Status::Paused], c.init.status())?;
        let init_pid = c.init.pid();
        let cgroup = self
            .host
            .cgroup2_of(init_pid)?
            .ok_or_else(|| Error::NoCgroup(format!("no cgroup2 directory for container {id}")))?;
        self.host
            .check_dumpable(init_pid, &cgroup)
            .map_err(|e| Error::Checkpoint {
                id: id.to_string(),
                source: e.into(),
            })?;
        let work = match opts.work_path {
            Some(w) => w,
            None => c.bundle.join("criu-work"),
        };
        let result = c
            .runtime
            .checkpoint(
                id,
                &crate::runc::CheckpointOpts {
                    image_path: path.to_path_buf(),
                    work_path: Some(work.clone()),
                    leave_running: !opts.exit,
                    tcp_established: opts.open_tcp,
                    ext_unix_sk: opts.external_unix_sockets,
                    file_locks: opts.file_locks,
                    shell_job: opts.terminal,
                    manage_cgroups_mode: opts.cgroups_mode,
                    lazy_pages: false,
                },
            )
            .await;
        if result.is_ok() && opts.work_path_was_default {
            let _ = std::fs::remove_dir_all(&work);
        }
        // Signed with this host's key, so that a restore of it (`ctr c restore`, the CRI's)
        // passes the same trust decision as crab's own images.
        if result.is_ok() {
            let binding = match self.rootfs_binding(&c).await {
                Ok(b) => Some(b),
                Err(e) => {
                    log::warn!(
                        "checkpoint of {id}: its rootfs cannot be bound to the signature \
                         ({e}): a restore of it is told so"
                    );
                    None
                }
            };
            let (key_path, dir) = (c.signing_key.clone(), path.to_path_buf());
            let signed = tokio::task::spawn_blocking(move || {
                let key = crate::checkpoint::provenance::signing_key(&key_path)?;
                trust::sign_containerd_checkpoint(&dir, &key, binding)
            })
            .await
            .map_err(Error::Task)?;
            match signed {
                Ok(n) => log::info!("checkpoint of {id}: {n} CRIU files signed for containerd"),
                Err(e) => {
                    return Err(Error::Sign {
                        id: id.to_string(),
                        source: e.into(),
                    })
                }
            }
        }
        result.map_err(|e| match e {
            RuncError::Failed { message, .. } => RuncError::Failed {
                command: "checkpoint",
                message: format!("{message} (CRIU log: {})", work.join("dump.log").display()),
            }
            .into(),
            e => e.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refusals of a containerd checkpoint on another rootfs read as they always did
    /// (the e2e tests and the CRI's users look for these words).
    #[test]
    fn binding_refusals_keep_their_words() {
        let e = BindingError::OtherImage {
            signed: "sha256:a".into(),
            found: "sha256:b".into(),
            told_by: "overlayfs snapshot sha256:b".into(),
        };
        assert_eq!(
            e.to_string(),
            "it was dumped on image sha256:a and its rootfs is image sha256:b (overlayfs \
             snapshot sha256:b): its processes would run on other files"
        );
        assert_eq!(
            BindingError::OtherRw { changes: 3 }.to_string(),
            "its rootfs's rw layer is not the one it was dumped with (it changes 3 paths of the \
             image, not as the signed change does): restore it with its own rw layer (`ctr c \
             restore --rw`; the CRI puts the checkpoint's rootfs diff back itself)"
        );
        let e = BindingError::RwUnknown(RwError::NotOverlay);
        assert_eq!(
            e.to_string(),
            "its signature binds its rw layer, and its rootfs is not an overlay"
        );
        let e = Error::Restore {
            id: "c1".into(),
            source: BindingError::ImageUnknown {
                signed: "sha256:a".into(),
                source: LayersError::NotOverlay,
            }
            .into(),
        };
        assert_eq!(
            e.to_string(),
            "cannot restore c1: its signature binds it to image sha256:a, and its rootfs is not \
             an overlay: its image cannot be told"
        );
        let kept = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<BindingError>());
        assert!(
            matches!(
                kept,
                Some(BindingError::ImageUnknown {
                    source: LayersError::NotOverlay,
                    ..
                })
            ),
            "{kept:?}"
        );
    }
}

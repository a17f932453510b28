//! containerd's own checkpoint of a container (`ctr task checkpoint`), signed and bound to the
//! rootfs it was dumped on; and the checks of that binding when one is restored.

use std::path::Path;

use super::{Container, Containers, TaskCheckpointOptions};
use crate::{
    bundle::{self, RootfsMount},
    error::{Error, Result},
    process::Status,
    restore::trust,
    runc::RuncError,
};

impl Containers {
    /// Which image the engine unpacked container `id`'s rootfs from ([`crate::restore::layers`]).
    pub(super) async fn rootfs_image(
        &self,
        id: &str,
        rootfs: &bundle::Rootfs,
    ) -> std::result::Result<crate::restore::layers::Unpacked, String> {
        let overlay = RootfsMount::overlay(&rootfs.mounts)
            .ok_or_else(|| "its rootfs is not an overlay: its image cannot be told".to_string())?;
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
    ) -> std::result::Result<(), String> {
        let t = std::time::Instant::now();
        let u = self
            .rootfs_image(id, rootfs)
            .await
            .map_err(|e| format!("its signature binds it to image {}, and {e}", bound.image))?;
        if u.top != bound.image {
            return Err(format!(
                "it was dumped on image {} and its rootfs is image {} ({}): its processes \
                 would run on other files",
                bound.image, u.top, u.source
            ));
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
        limits: crate::restore::rw::RwLimits,
    ) -> std::result::Result<crate::restore::rw::RwDigest, String> {
        let options = RootfsMount::overlay(&rootfs.mounts)
            .map(|m| m.options.clone())
            .ok_or_else(|| "its rootfs is not an overlay".to_string())?;
        tokio::task::spawn_blocking(move || {
            let (upper, lowers) = crate::inspector::fs::overlay_dirs(&options)
                .ok_or_else(|| "its rootfs overlay has no upper directory".to_string())?;
            let xattrs = crate::inspector::fs::OverlayXattrs::of_mount(&options);
            crate::restore::rw::digest(&upper, &lowers, xattrs, limits)
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// A containerd checkpoint's processes go back on the rw layer they were dumped with (put
    /// back by `ctr c restore --rw` before Create, by the CRI between Create and Start).
    pub(super) async fn check_rw(
        id: &str,
        rootfs: &bundle::Rootfs,
        want: &str,
    ) -> std::result::Result<(), String> {
        let t = std::time::Instant::now();
        let got = Self::rw_digest(rootfs, crate::restore::rw::RwLimits::default())
            .await
            .map_err(|e| format!("its signature binds its rw layer, and {e}"))?;
        if got.digest != want {
            return Err(format!(
                "its rootfs's rw layer is not the one it was dumped with (it changes {} paths \
                 of the image, not as the signed change does): restore it with its own rw \
                 layer (`ctr c restore --rw`; the CRI puts the checkpoint's rootfs diff back \
                 itself)",
                got.changes
            ));
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
    ) -> std::result::Result<crate::checkpoint::provenance::RootfsBinding, String> {
        let image = self.rootfs_image(&c.id, &c.rootfs).await?.top;
        let rw = Self::rw_digest(&c.rootfs, crate::restore::rw::RwLimits::default()).await?;
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
        let cgroup = crate::sys::cgroup::Cgroups::of(init_pid)?
            .unified
            .ok_or_else(|| Error::NoCgroup(format!("no cgroup2 directory for container {id}")))?;
        crate::checkpoint::process::check_dumpable(init_pid, &cgroup)
            .map_err(|e| Error::FailedPrecondition(format!("cannot checkpoint {id}: {e}")))?;
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
                    return Err(Error::FailedPrecondition(format!(
                        "cannot sign the checkpoint of {id}: {e}"
                    )))
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

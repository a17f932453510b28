//! The capture a checkpoint job does on a running container: its fs layer ([`super::layer`],
//! the container frozen while the upperdir is read), its process image ([`super::process`],
//! CRIU driven directly or through runc) and, past the job's deadline, the abort ([`super::deadline`]:
//! the dump killed, the container thawed; a running fs capture stops through its
//! [`deadline::Cancel`]). This is the real [`Capture`] of the [`super::coordinator`].

use std::{path::PathBuf, sync::Arc};

use tokio::sync::OwnedMutexGuard;

use super::{
    coordinator::{Capture, FsLayer, ProcessCaptured, VolumeChanges},
    deadline::{self, Aborted},
    error::CheckpointError,
    layer::{self, FsDiffPaths},
    process::{self, ProcError},
    store::Store,
};
use crate::{
    inspector::{
        self,
        fs::{FsDiff, OverlayXattrs},
        procs,
    },
    runc::Runc,
};

/// A container as its checkpoint jobs capture it.
#[derive(Clone)]
pub struct ContainerCapture {
    pub container_id: String,
    pub runc: Runc,
    pub init_pid: u32,
    pub cgroup2_dir: PathBuf,
    pub upperdir: Option<PathBuf>,
    /// Which xattr prefix is overlay state on the rootfs mount.
    pub overlay_xattrs: OverlayXattrs,
    /// What one checkpoint may cost (`[limits]`).
    pub limits: crab_runtime_config::LimitsConfig,
    /// Tracked volumes: (path in the container, host directory).
    pub volumes: Vec<(PathBuf, PathBuf)>,
    /// How process images are dumped (`[checkpoint] process_dump`).
    pub dumper: process::Dumper,
    /// The page transfer of a lazy restore, while memory may still be missing (CRIU cannot
    /// dump it): process images wait for it, at most `lazy_wait`.
    pub lazy: Option<super::lazy::Transfer>,
    pub lazy_wait: std::time::Duration,
    /// What the container was given, when its network namespace may be left out of process
    /// images (`[checkpoint] network_namespace = "when-changeable"`); `None`: always dumped.
    pub netns: Option<super::netns::Eligibility>,
}

impl ContainerCapture {
    fn upperdir(&self) -> Result<PathBuf, CheckpointError> {
        self.upperdir.clone().ok_or(CheckpointError::NotOverlay)
    }
}

impl Capture for ContainerCapture {
    async fn outside_init(&self) -> Result<Vec<(u32, String)>, CheckpointError> {
        let (init, cgroup) = (self.init_pid, self.cgroup2_dir.clone());
        let check = tokio::task::spawn_blocking(move || process::check_dumpable(init, &cgroup))
            .await
            .map_err(CheckpointError::task("process check"))?;
        match check {
            Ok(_) => Ok(Vec::new()),
            Err(ProcError::Undumpable { pids, cmdlines, .. }) => {
                Ok(pids.into_iter().zip(cmdlines).collect())
            }
            Err(e) => Err(e.into()),
        }
    }

    fn parent_of(&self, pid: u32) -> Option<u32> {
        procs::read_stat(pid).ok().flatten().map(|s| s.ppid)
    }

    async fn scan_upperdir(&self) -> Result<FsDiff, CheckpointError> {
        let upper = self.upperdir()?;
        let (limits, xattrs) = ((&self.limits).into(), self.overlay_xattrs);
        let all = tokio::task::spawn_blocking(move || {
            inspector::fs::TreeManifest::scan_with(&upper, &limits, xattrs)
        })
        .await
        .map_err(CheckpointError::task("upperdir scan"))??;
        Ok(inspector::fs::diff(
            &inspector::fs::TreeManifest::default(),
            &all,
            &[],
        ))
    }

    async fn fs_layer(
        &self,
        store: Arc<Store>,
        changes: FsDiff,
        volumes: Vec<VolumeChanges>,
        capturing: OwnedMutexGuard<()>,
        cancel: deadline::Cancel,
    ) -> Result<FsLayer, CheckpointError> {
        let upper = self.upperdir()?;
        let volumes: Vec<layer::VolumeCapture> = volumes
            .into_iter()
            .filter_map(|v| {
                let dir = self.volumes.iter().find(|(at, _)| *at == v.at)?.1.clone();
                Some(layer::VolumeCapture {
                    at: v.at,
                    dir,
                    paths: v.paths,
                })
            })
            .collect();
        let init_pid = self.init_pid;
        // A container in a user namespace (a pod with hostUsers: false) writes its upper dir as
        // host ids: the layer records the container's own, so that it unpacks right in any
        // other mapping. The maps cannot be read: the checkpoint fails rather than record
        // host ids an image must not carry.
        let ids = super::tar::IdShift::of_pid(init_pid).map_err(CheckpointError::IdMaps)?;
        let opts = layer::LayerOptions {
            max_bytes: self.limits.max_layer_bytes,
            max_apparent_bytes: self.limits.max_layer_apparent_bytes,
            max_depth: self.limits.max_walk_depth,
            xattrs: self.overlay_xattrs,
            ids,
        };
        let (descriptor, stats) = tokio::task::spawn_blocking(move || {
            let _capturing = capturing;
            let freezer = crate::sys::cgroup::freezer::CgroupFreezer::for_pid(init_pid)
                .map_err(CheckpointError::Freezer)?;
            let paths = FsDiffPaths::from(&changes);
            Ok::<_, CheckpointError>(layer::write_fs_layer_with_volumes(
                &store, &upper, &paths, &volumes, &freezer, &opts, &cancel,
            )?)
        })
        .await
        .map_err(CheckpointError::task("fs checkpoint"))??;
        Ok(FsLayer {
            descriptor,
            freeze: stats.freeze,
            capture: stats.capture,
        })
    }

    async fn process_image(
        &self,
        dir: PathBuf,
        chunks: PathBuf,
    ) -> Result<ProcessCaptured, CheckpointError> {
        if let Some(transfer) = self.lazy.clone().filter(|t| t.in_flight_now()) {
            let bound = self.lazy_wait;
            let waited = std::time::Instant::now();
            let state = tokio::task::spawn_blocking(move || transfer.wait(bound))
                .await
                .map_err(CheckpointError::task("lazy restore wait"))?;
            use super::lazy::State;
            match state {
                State::Done => log::debug!(
                    "{}: process checkpoint waited {:?} for the lazy restore's pages",
                    self.container_id,
                    waited.elapsed()
                ),
                State::InFlight => {
                    return Err(CheckpointError::LazyRestore(format!(
                        "the lazy restore's pages are still arriving after {bound:?}"
                    )))
                }
                State::Failed(why) => return Err(CheckpointError::LazyRestore(why)),
            }
        }
        let cp = process::checkpoint(
            &self.runc,
            &self.dumper,
            &self.container_id,
            self.init_pid,
            &self.cgroup2_dir,
            &dir,
            &chunks,
            self.netns.as_ref(),
        )
        .await?;
        Ok(ProcessCaptured {
            pids: cp.pids,
            bytes_logical: cp.bytes_logical,
            bytes_stored: cp.bytes_stored,
            timings: cp.timings,
        })
    }

    async fn abort(&self) -> Aborted {
        let (id, init) = (self.container_id.clone(), self.init_pid);
        // A CRIU the shim drives itself first, then `runc checkpoint` and its CRIU, then the
        // thaw (a CRIU killed midway leaves the container frozen).
        let criu = super::criu_rpc::kill_running(&id);
        let mut aborted = tokio::task::spawn_blocking(move || deadline::abort(&id, init))
            .await
            .unwrap_or_default();
        aborted.killed.extend(criu);
        aborted
    }
}

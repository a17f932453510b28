//! Create: the container's config, spec and rootfs, the checkpoint it may start from (crab's
//! in its rootfs, or containerd's own) and its init created by runc, or left for Start to restore.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use crab_runtime_config::{Config, ShimOptions};
use oci_spec::runtime::Spec;

use super::{count_restore, Container, Containers, CreateParams, PendingRestore};
use crate::{
    bundle::{self, RootfsMount},
    error::{Error, Result},
    events::TaskEvent,
    process::Process,
    restore::{
        intake::{self as restore, Taken},
        layers::{LayersError, Unpacked},
        privilege::Granted,
        scratch::RestoreDir,
        trust,
    },
    runc::{OciRuntime, Runc},
    sandbox::{NotInspected, Origin, Sandbox},
    stdio::PreparedIo,
    turns,
};

/// What Create has made ready before it looks for a checkpoint: the container's config, its
/// runc, its spec (checked) and turn settings, and its rootfs.
struct Prepared {
    config: Config,
    runc: Runc,
    /// What runs the container's verbs: that runc.
    runtime: Arc<dyn OciRuntime>,
    spec: Spec,
    exec_boundary: bool,
    probes: Vec<Vec<String>>,
    /// Create mounted the rootfs (and unmounts it when it fails).
    rootfs_mounted: bool,
    rootfs: bundle::Rootfs,
    /// The container's lineage ([`turns::lineage`]) and what it asks of it at Create.
    lineage: String,
    resume: turns::Resume,
}

/// The checkpoint a container starts from, as Create found it (all empty: none).
#[derive(Default)]
struct Found {
    /// crab's checkpoint, taken out of the rootfs (none for containerd's own checkpoints).
    taken: Option<Taken>,
    /// The restore's copy of a process image: removed when Create fails (dropped), else at
    /// Delete.
    restore_dir: Option<RestoreDir>,
    /// containerd's checkpoint is not restored (its trust decision): the container starts
    /// without its processes.
    start_fresh: bool,
    /// The rw layer containerd's checkpoint was dumped with (checked at Start).
    expect_rw: Option<String>,
}

impl Containers {
    pub async fn create(&self, p: CreateParams) -> Result<u32> {
        if self.map.lock().unwrap().contains_key(&p.id) {
            return Err(Error::AlreadyExists(format!("container {}", p.id)));
        }
        let prepared = self.prepare(&p).await?;
        let rootfs_mounted = prepared.rootfs_mounted;
        // Whatever fails from here on says so and leaves no rootfs mounted behind it.
        self.create_on_rootfs(&p, prepared)
            .await
            .inspect_err(|why| {
                log::warn!("create of {} failed: {why}", p.id);
                if rootfs_mounted {
                    bundle::unmount_rootfs(&p.bundle);
                }
            })
    }

    /// Create's first steps: the config (from containerd's runtime options) and runc, the
    /// spec checked, its turn settings, and the rootfs mounted.
    async fn prepare(&self, p: &CreateParams) -> Result<Prepared> {
        let (config, source, options) = Self::load_config(&p.options)?;
        let runc = Runc::from_config(&config, options.runc(), &self.namespace, &p.bundle)?;
        log::info!(
            "create {}: config from {source}{}, runc {}",
            p.id,
            match options {
                ShimOptions::Runc(_) => " with runc's runtime options",
                _ => "",
            },
            runc.binary.display()
        );
        let spec = bundle::read_spec(&p.bundle)?;
        turns::check_spec_annotations(&spec)?;
        let mut runc = runc;
        runc.merge_memory = merge_memory(&p.id, &spec)?;
        crate::grouping::check_group(&spec, &self.namespace, &config.shim.groups)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let (exec_boundary, probes) = turn_settings(&spec, &config)?;
        let resume = turns::resume(&spec)?;
        let lineage = turns::lineage(&spec, &self.namespace, &p.id)?;
        let (rootfs_mounted, rootfs) = mount_rootfs(p, &spec).await?;
        let runtime = (self.runtimes)(&runc);
        Ok(Prepared {
            config,
            runtime,
            runc,
            spec,
            exec_boundary,
            probes,
            rootfs_mounted,
            rootfs,
            lineage,
            resume,
        })
    }

    /// Create once the rootfs is there: the checkpoint to start from, its volumes and
    /// annotations, then the init created (or its restore left for Start) and the container
    /// registered.
    async fn create_on_rootfs(&self, p: &CreateParams, mut prep: Prepared) -> Result<u32> {
        let checkpointing = prep.config.checkpoint.enabled && turns::is_inspected(&prep.spec);
        if let Some(score) = prep.spec.process().as_ref().and_then(|p| p.oom_score_adj()) {
            crate::placement::follow_container_oom_score(&p.id, score);
        }
        // A checkpoint to start from: containerd's (`ctr run --checkpoint`), or crab's in the
        // rootfs of a checkpoint image.
        // Whoever signed it, a process image may not ask for more than this spec grants.
        let granted = Granted::from_spec(&prep.spec);
        // A container that resumes its lineage records the image it runs on (a later resume
        // onto another image is refused).
        let image = match (prep.resume, &prep.config.replication.registry) {
            (turns::Resume::Newest, _) | (_, Some(_)) => {
                self.rootfs_image(&p.id, &prep.rootfs).await.map(|u| u.top)
            }
            (turns::Resume::Fresh, None) => Err(LayersError::NotAsked),
        };
        let mut found = match p.checkpoint.is_empty() {
            true => self.take_from_rootfs(p, &prep, granted.clone()).await?,
            false => {
                self.trust_containerd_checkpoint(p, &prep, granted.clone())
                    .await?
            }
        };
        // Nothing to start from in the image or from containerd: the lineage's newest
        // checkpoint, if the container asks for it.
        if prep.resume == turns::Resume::Newest && found.taken.is_none() && p.checkpoint.is_empty()
        {
            let resumed = super::resume::resume(super::resume::ResumeRequest {
                id: &p.id,
                namespace: &self.namespace,
                bundle: &p.bundle,
                config: &prep.config,
                spec: &prep.spec,
                rootfs: &prep.rootfs,
                lineage: &prep.lineage,
                image: &image,
                granted,
            })
            .await
            .inspect_err(|_| count_restore(&prep.config.engine, false))?;
            if let Some(r) = resumed {
                found.taken = Some(r.taken);
                found.restore_dir = r.restore_dir;
            }
        }
        if let Some(t) = found.taken.as_ref().filter(|t| !t.meta.volumes.is_empty()) {
            refill_volumes(p, &prep, t).await?;
        }
        if let Some(t) = &found.taken {
            inherit_annotations(&p.id, &mut prep, t)?;
        }
        let restore_image = process_image(p, &found);
        if restore_image.is_some() {
            refuse_joined_user_namespace(&p.id, &prep.spec)?;
        }
        let init = Arc::new(Process::new(String::new(), p.stdio.clone(), None));
        let sandbox = Sandbox::new(
            &p.id,
            &self.namespace,
            &prep.config.store.state_dir,
            prep.exec_boundary,
            match (checkpointing, &restore_image) {
                (false, _) => NotInspected::Disabled,
                (true, Some(_)) => NotInspected::UntilStart,
                (true, None) => NotInspected::Starting,
            },
        );
        sandbox.set_lineage(crate::checkpoint::lineage::LineageRecord::new(
            &prep.lineage,
            image.ok(),
        ));
        let mut pending_restore = None;
        let pid = match restore_image {
            Some(image) => {
                let (taken, expect_rw) = (found.taken, found.expect_rw);
                let r = defer_restore(p, &prep, image, taken, checkpointing, expect_rw);
                pending_restore = Some(r);
                0
            }
            None => {
                let taken = found.taken;
                self.create_running(p, &prep, &init, &sandbox, taken, checkpointing)
                    .await?
            }
        };
        let container = Arc::new(container(
            p,
            prep,
            init,
            sandbox,
            pending_restore,
            found.restore_dir,
        ));
        self.register(p, container, pid).await;
        Ok(pid)
    }

    /// crab's checkpoint in the rootfs of a checkpoint image, taken out of it (its files
    /// checked, its process image copied to disk for Start: [`restore::take_from_rootfs`]).
    async fn take_from_rootfs(
        &self,
        p: &CreateParams,
        prep: &Prepared,
        granted: Granted,
    ) -> Result<Found> {
        let unpacked = self.unpacked_layers(p, &prep.rootfs).await;
        let (rootfs, bundle) = (prep.rootfs.path.clone(), p.bundle.clone());
        let (config, id, ns) = (prep.config.clone(), p.id.clone(), self.namespace.clone());
        let taken = tokio::task::spawn_blocking(move || {
            // A process image is copied to disk, in the store, never into the bundle
            // (tmpfs on most hosts): see [`RestoreDir`].
            let scratch = match std::fs::symlink_metadata(rootfs.join(restore::RESERVED_DIR)) {
                Ok(_) => Some(scratch_dir(&config, &ns, &id, &bundle)?),
                Err(_) => None,
            };
            let dest = match &scratch {
                Some(s) => s.criu(),
                None => bundle.join(crate::restore::scratch::CRIU_SUBDIR),
            };
            let trusted = || crate::checkpoint::provenance::trusted_keys(&config);
            let cache = crate::restore::cache::RestoreCache::from_config(&config);
            let guard = restore::RestoreGuard {
                container: &id,
                trusted: &trusted,
                unsigned: config.restore.unsigned_images,
                limits: restore::ImageLimits::from_config(&config.restore),
                granted: &granted,
                cache: cache.as_ref(),
                // Start holds the restored processes at CRIU's post-restore gate
                // until the verdict ([`crate::restore::gate`]).
                defer_pages: config.restore.verify_during_restore,
                unpacked: &unpacked,
            };
            let taken = restore::take_from_rootfs(&rootfs, &dest, &guard)?;
            // Without a process image nothing was copied: the directory goes now.
            let with_image = taken.as_ref().is_some_and(|t| t.criu_dir.is_some());
            if scratch.is_some() && !with_image {
                log::info!("create {id}: the checkpoint holds no process image: its command runs");
            }
            let scratch = scratch.filter(|_| with_image);
            Ok::<_, restore::RestoreError>((taken, scratch))
        })
        .await;
        match taken {
            Ok(Ok((taken, restore_dir))) => Ok(Found {
                taken,
                restore_dir,
                ..Found::default()
            }),
            Ok(Err(e)) => {
                count_restore(&prep.config.engine, false);
                Err(Error::StartFrom {
                    id: p.id.clone(),
                    from: "its image",
                    source: e.into(),
                })
            }
            Err(e) => Err(Error::Task(e)),
        }
    }

    /// Which layers the engine unpacked, asked only of a rootfs with a checkpoint.
    async fn unpacked_layers(
        &self,
        p: &CreateParams,
        rootfs: &bundle::Rootfs,
    ) -> std::result::Result<Unpacked, LayersError> {
        if !rootfs.path.join(restore::RESERVED_DIR).exists() {
            return Err(LayersError::NoCheckpoint);
        }
        let t = std::time::Instant::now();
        let u = crate::restore::layers::identify(
            self.snapshots.as_ref(),
            &self.namespace,
            &p.id,
            &rootfs.path,
            rootfs.mounted_by == bundle::MountedBy::Containerd,
            RootfsMount::overlay(&rootfs.mounts).map(|m| m.options.as_slice()),
        )
        .await;
        log::info!(
            "create {}: rootfs layers asked of the engine in {:.1} ms: {}",
            p.id,
            t.elapsed().as_secs_f64() * 1e3,
            match &u {
                Ok(u) => u.source.clone(),
                Err(e) => e.to_string(),
            }
        );
        u
    }

    /// containerd's own checkpoint (`ctr c restore`, `ctr run --checkpoint`, the CRI's
    /// restore): the same trust decision as crab's images ([`trust`]), then the image's
    /// claims against the spec (the kernel check follows at Start).
    async fn trust_containerd_checkpoint(
        &self,
        p: &CreateParams,
        prep: &Prepared,
        granted: Granted,
    ) -> Result<Found> {
        let dir = PathBuf::from(&p.checkpoint);
        let config = prep.config.clone();
        let decided = tokio::task::spawn_blocking(move || {
            // Nothing there: said so (not as a missing signature), whatever the trust policy.
            if let Err(source) = std::fs::symlink_metadata(&dir) {
                return Err(restore::RestoreError::Io { path: dir, source });
            }
            let trusted = || crate::checkpoint::provenance::trusted_keys(&config);
            let limits = restore::ImageLimits::from_config(&config.restore);
            let decision = trust::containerd_checkpoint(
                &dir,
                &trusted,
                config.restore.unsigned_images,
                limits,
            )?;
            if !matches!(decision, trust::Decision::StartFresh { .. }) {
                restore::check_privilege(&dir, &granted)?;
            }
            Ok::<_, restore::RestoreError>(decision)
        })
        .await;
        // containerd's extracted copy is not restored: it goes (containerd never removes it).
        let unused = |why: &str| {
            let image = PathBuf::from(&p.checkpoint);
            if super::restore::containerd_extracted(&image) {
                log::info!(
                    "create {}: removing containerd's extracted copy of its checkpoint, {} ({why})",
                    p.id,
                    image.display()
                );
                let _ = std::fs::remove_dir_all(&image);
            }
        };
        match decided {
            Ok(Ok(decision)) => {
                let followed = self.follow_decision(p, prep, &decision).await;
                match &followed {
                    Ok(found) if found.start_fresh => unused("the container starts fresh"),
                    Err(_) => unused("refused"),
                    Ok(_) => {}
                }
                followed
            }
            Ok(Err(e)) => {
                unused("refused");
                count_restore(&prep.config.engine, false);
                Err(Error::Restore {
                    id: p.id.clone(),
                    source: e.into(),
                })
            }
            Err(e) => Err(Error::Task(e)),
        }
    }

    /// What the trust decision on containerd's checkpoint means for Create: a signed one goes
    /// back on the image it was dumped on (and its rw layer, checked at Start); an unsigned one
    /// is restored on the kernel check alone, or not at all.
    async fn follow_decision(
        &self,
        p: &CreateParams,
        prep: &Prepared,
        decision: &trust::Decision,
    ) -> Result<Found> {
        let mut found = Found::default();
        match decision {
            trust::Decision::Signed {
                files,
                bytes,
                rootfs: bound,
            } => {
                log::info!(
                    "create {}: containerd's checkpoint is signed by a trusted key ({files} \
                     files, {bytes} bytes verified)",
                    p.id
                );
                match bound {
                    Some(b) => {
                        if let Err(e) = self.check_image(&p.id, &prep.rootfs, b).await {
                            count_restore(&prep.config.engine, false);
                            return Err(Error::Restore {
                                id: p.id.clone(),
                                source: e.into(),
                            });
                        }
                        found.expect_rw = Some(b.rw.clone());
                    }
                    None => log::warn!(
                        "create {}: its signature names no rootfs (the shim that dumped it \
                         could not tell its image and rw layer): the processes are restored on \
                         the rootfs containerd made",
                        p.id
                    ),
                }
            }
            trust::Decision::KernelCheckOnly { why } => log::warn!(
                "create {}: {why}: restoring it on the kernel check alone ([restore] \
                 unsigned_images = \"kernel-check\")",
                p.id
            ),
            trust::Decision::StartFresh { why } => {
                log::warn!(
                    "create {}: {why}: starting the container without its processes \
                     ([restore] unsigned_images = \"start-fresh\")",
                    p.id
                );
                found.start_fresh = true;
            }
        }
        Ok(found)
    }

    /// The init created by runc (no process image to restore: a fresh container, or a
    /// checkpoint of files only), and checkpointing begun; returns its pid.
    async fn create_running(
        &self,
        p: &CreateParams,
        prep: &Prepared,
        init: &Process,
        sandbox: &Sandbox,
        taken: Option<Taken>,
        checkpointing: bool,
    ) -> Result<u32> {
        let (runtime, engine) = (&prep.runtime, &prep.config.engine);
        let (pid, io) = match self.create_init(p, prep).await {
            Ok(v) => v,
            Err(e) => {
                if let Err(d) = runtime.delete(&p.id, true).await {
                    log::warn!("cleanup after failed create of {}: {d}", p.id);
                }
                if taken.is_some() {
                    count_restore(engine, false);
                }
                return Err(e);
            }
        };
        // A checkpoint without a process image is restored once its files are there.
        if taken.is_some() {
            count_restore(engine, true);
        }
        if checkpointing {
            let origin = match taken {
                Some(t) => Origin::Checkpoint(t),
                None => Origin::Image,
            };
            let started = sandbox
                .start_checkpointing(
                    &p.bundle,
                    &prep.rootfs,
                    &prep.config,
                    &prep.runc,
                    pid,
                    origin,
                )
                .await;
            if let Err(e) = started {
                let _ = runtime.delete(&p.id, true).await;
                return Err(e);
            }
        }
        init.set_pid(pid);
        init.set_io(io).await;
        Ok(pid)
    }

    async fn create_init(
        &self,
        p: &CreateParams,
        prep: &Prepared,
    ) -> Result<(u32, crate::stdio::ProcessIo)> {
        let runc = &prep.runc;
        bundle::save_runc(&p.bundle, runc)?;
        let mut prepared = PreparedIo::new(&p.stdio, &p.id, &self.namespace, runc.io_owner).await?;
        let pid_file = bundle::init_pid_file(&p.bundle);
        let child = std::mem::replace(&mut prepared.child, crate::runc::ChildStdio::null());
        let console = prepared.console.as_ref().map(|c| c.path.clone());
        prep.runtime
            .create(&p.id, &p.bundle, &pid_file, console.as_deref(), child)
            .await?;
        let io = prepared.start().await?;
        Ok((bundle::read_pid(&pid_file)?, io))
    }

    /// The created container joins the shim's map (its init's pid the pid table, and its OOM
    /// kills are watched, once it runs), and containerd hears of it.
    async fn register(&self, p: &CreateParams, container: Arc<Container>, pid: u32) {
        self.map
            .lock()
            .unwrap()
            .insert(p.id.clone(), container.clone());
        if pid != 0 {
            self.pids
                .lock()
                .unwrap()
                .owners
                .insert(pid, (p.id.clone(), String::new()));
            self.watch_oom(&container, pid);
        }
        self.events
            .publish(TaskEvent::Create {
                container_id: p.id.clone(),
                bundle: p.bundle.clone(),
                rootfs: p.rootfs.clone(),
                stdio: p.stdio.clone(),
                checkpoint: p.checkpoint.clone(),
                pid,
            })
            .await;
    }
}

/// Mounts the rootfs Create was given (whether it did is the bool) and finds where it is.
async fn mount_rootfs(p: &CreateParams, spec: &Spec) -> Result<(bool, bundle::Rootfs)> {
    let rootfs_mounted = bundle::mount_rootfs(&p.bundle, &p.rootfs).await?;
    // Docker Engine sends no mounts: it mounted the rootfs itself, at the spec's root.path.
    let rootfs = {
        let (bundle, spec, mounts) = (p.bundle.clone(), spec.clone(), p.rootfs.clone());
        tokio::task::spawn_blocking(move || bundle::Rootfs::resolve(&bundle, &spec, &mounts))
            .await
            .map_err(|e| {
                if rootfs_mounted {
                    bundle::unmount_rootfs(&p.bundle);
                }
                Error::Task(e)
            })?
    };
    if rootfs.mounted_by == bundle::MountedBy::Caller {
        log::info!(
            "create {}: rootfs mounted by the caller at {} ({})",
            p.id,
            rootfs.path.display(),
            match bundle::RootfsMount::overlay(&rootfs.mounts) {
                Some(_) => "an overlay",
                None => "not an overlay: its changes cannot be seen",
            }
        );
    }
    Ok((rootfs_mounted, rootfs))
}

/// The tracked volumes the checkpoint holds come back into their host directories.
async fn refill_volumes(p: &CreateParams, prep: &Prepared, t: &Taken) -> Result<()> {
    let volumes =
        crate::sandbox::tracked_volumes(&prep.spec, &prep.config.checkpoint.tracked_volumes);
    let (held, root, id) = (
        t.meta.volumes.clone(),
        prep.rootfs.path.clone(),
        p.id.clone(),
    );
    let limits = crate::restore::volumes::VolumeLimits::from_config(&prep.config.limits);
    let restored = tokio::task::spawn_blocking(move || {
        for (at, dir) in volumes.iter().filter(|(at, _)| held.contains(at)) {
            let c = crate::restore::volumes::restore_volume(at, &root, dir, limits)?;
            log::info!(
                "container {id}: volume {} restored into {} ({} files, {} bytes{})",
                at.display(),
                dir.display(),
                c.files,
                c.bytes,
                match c.skipped {
                    0 => String::new(),
                    n => format!(", {n} devices/FIFOs/sockets left out"),
                }
            );
        }
        Ok::<_, crate::restore::volumes::VolumeRestoreError>(())
    })
    .await;
    let failed = match restored {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(Error::StartFrom {
            id: p.id.clone(),
            from: "its checkpoint",
            source: e.into(),
        }),
        Err(e) => Some(Error::Task(e)),
    };
    match failed {
        Some(e) => {
            count_restore(&prep.config.engine, false);
            Err(e)
        }
        None => Ok(()),
    }
}

/// A checkpoint image's crab annotations (its source container's turn boundary, checkpoint
/// policy, probe commands) hold unless this spec sets its own: a restored sandbox goes on
/// checkpointing as it did. The turn settings are read again from the spec with them.
fn inherit_annotations(id: &str, prep: &mut Prepared, t: &Taken) -> Result<()> {
    if t.meta.annotations.is_empty() {
        return Ok(());
    }
    let mut spec = prep.spec.clone();
    let lent = turns::inherit(&mut spec, &t.meta.annotations);
    if lent.is_empty() {
        return Ok(());
    }
    log::info!(
        "create {id}: keeps its checkpoint image's {} (its spec sets none)",
        lent.join(", ")
    );
    (prep.exec_boundary, prep.probes) = turn_settings(&spec, &prep.config)?;
    Ok(())
}

/// Whether the container's processes are marked for same-page merging ([`turns::MERGE_MEMORY`]):
/// asked and the kernel can (Linux 6.4); a kernel that cannot is a warning, not a failure
/// (merging saves memory, it changes nothing the processes see).
fn merge_memory(id: &str, spec: &oci_spec::runtime::Spec) -> Result<bool> {
    if !turns::merge_memory(spec)? {
        return Ok(false);
    }
    if !crate::sys::ksm::merge_any_supported() {
        log::warn!(
            "create {id}: {} asks for same-page merging, which this kernel cannot do for a              whole process (PR_SET_MEMORY_MERGE, Linux 6.4): its memory is not merged",
            turns::MERGE_MEMORY
        );
        return Ok(false);
    }
    match crate::sys::ksm::ksmd_running() {
        Some(true) => log::info!("create {id}: its processes' memory is mergeable (ksmd runs)"),
        _ => log::info!(
            "create {id}: its processes' memory is mergeable, but the host's ksmd does not run              ({}/run): nothing is merged until it does",
            crate::sys::ksm::KSM_SYSFS
        ),
    }
    Ok(true)
}

/// The process image Start is to restore, if any: containerd's checkpoint (unless its trust
/// decision starts the container fresh), or the one in crab's checkpoint.
fn process_image(p: &CreateParams, found: &Found) -> Option<PathBuf> {
    match (&found.taken, p.checkpoint.is_empty()) {
        (_, false) if found.start_fresh => None,
        (_, false) => Some(PathBuf::from(&p.checkpoint)),
        (Some(t), true) => t.criu_dir.clone(),
        (None, true) => None,
    }
}

/// CRIU (4.2, through runc 1.3) cannot restore a process tree into a user namespace the
/// container joins (a Kubernetes pod with `hostUsers: false`): it makes a user namespace
/// of its own for the tree, which then may not enter the pod's network namespace
/// (`Can't setns .../net: Operation not permitted`). Refused here, before anything runs,
/// with what works instead; the image's files restore (a filesystem checkpoint).
fn refuse_joined_user_namespace(id: &str, spec: &Spec) -> Result<()> {
    if !bundle::joins_user_namespace(spec) {
        return Ok(());
    }
    Err(Error::FailedPrecondition(format!(
        "cannot restore the processes of {id} into the user namespace it joins (a pod with \
         hostUsers: false): CRIU cannot restore a process tree into an existing user \
         namespace. Restore this checkpoint into a pod without a user namespace, or take \
         filesystem-only checkpoints in such pods (io.crab/checkpoint-policy: fs-every-turn), \
         whose images restore there"
    )))
}

/// The restore of process image `image`, left for Start, as containerd's runc shim does:
/// Create leaves the container created.
fn defer_restore(
    p: &CreateParams,
    prep: &Prepared,
    image: PathBuf,
    taken: Option<Taken>,
    checkpointing: bool,
    expect_rw: Option<String>,
) -> PendingRestore {
    // `docker run IMAGE CMD`, a pod's `command`: with a process image they are not
    // what runs, and the log says so (docs/docker-and-harnesses.md).
    log::info!(
        "create {}: restores the checkpointed processes at Start; the spec's command ({:?}) \
         does not run",
        p.id,
        prep.spec
            .process()
            .as_ref()
            .and_then(|p| p.args().clone())
            .unwrap_or_default()
            .join(" ")
    );
    PendingRestore {
        image,
        taken,
        config: prep.config.clone(),
        rootfs: prep.rootfs.clone(),
        stdio: p.stdio.clone(),
        checkpointing,
        expect_rw,
    }
}

/// The container Create made, from what it prepared.
fn container(
    p: &CreateParams,
    prep: Prepared,
    init: Arc<Process>,
    sandbox: Sandbox,
    pending_restore: Option<PendingRestore>,
    restore_dir: Option<RestoreDir>,
) -> Container {
    Container {
        id: p.id.clone(),
        bundle: p.bundle.clone(),
        signing_key: prep.config.signing_key_path(),
        kill_all_on_exit: bundle::must_kill_all_on_exit(&prep.spec),
        runc: prep.runc,
        runtime: prep.runtime,
        rootfs_mounted: prep.rootfs_mounted,
        rootfs: prep.rootfs,
        init,
        execs: Mutex::new(HashMap::new()),
        annotations: Mutex::new(HashMap::new()),
        init_exit_pending: Mutex::new(None),
        lifecycle: tokio::sync::Mutex::new(()),
        _oom: Mutex::new(None),
        sandbox,
        probes: prep.probes,
        pending_restore: Mutex::new(pending_restore),
        restore_dir: Mutex::new(restore_dir),
    }
}

/// What `spec` says of the container's turns: its turn boundary and probe commands, its
/// checkpoint policy and self-contained changes checked too (the coordinator reads them again;
/// here so that a bad value fails Create and changes nothing).
fn turn_settings(spec: &Spec, config: &Config) -> Result<(bool, Vec<Vec<String>>)> {
    let boundary = turns::exec_boundary(spec, config.checkpoint.turn_boundary)?;
    let probes = turns::probe_commands(spec)?;
    crate::checkpoint::policy::for_container(spec, config.checkpoint.policy)?;
    crate::checkpoint::policy::keeps_self_contained(
        spec,
        config.checkpoint.self_contained_changes,
    )?;
    Ok((boundary, probes))
}

/// A fresh restore directory for container `id` ([`RestoreDir`]), named in its bundle for the
/// cleanup after a shim died.
fn scratch_dir(
    config: &Config,
    namespace: &str,
    id: &str,
    bundle: &Path,
) -> std::result::Result<RestoreDir, restore::RestoreError> {
    let io = |path: PathBuf| move |source| restore::RestoreError::Io { path, source };
    let root = config
        .store
        .state_dir
        .join(crate::restore::scratch::RESTORES_DIR);
    let dir = RestoreDir::create(&config.store.state_dir, namespace, id).map_err(io(root))?;
    dir.record_in(bundle)
        .map_err(io(bundle.join(crate::restore::scratch::BUNDLE_RECORD)))?;
    log::info!(
        "create {id}: its process image, if the checkpoint holds one, is copied to {} to \
         restore it",
        dir.path().display()
    );
    Ok(dir)
}

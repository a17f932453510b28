//! Start of a container created from a process image: `runc restore` behind CRIU's restore
//! gate (the page files' verdict, the kernel check), raced against its bound and its lazy-pages
//! daemon; then the restored init's io, OOM watch and checkpointing.

use std::{
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::Arc,
    time::Duration,
};

use oci_spec::runtime::Spec;
use tokio::{sync::oneshot, task::JoinHandle};

use super::{Container, Containers, Host, PendingRestore};
use crate::{
    bundle,
    checkpoint::lazy,
    error::{Error, Result},
    inspector::Inspection,
    restore::{
        eager, gate as restore_gate,
        intake::{Taken, Verdict, Verification},
        kernel, seccomp,
    },
    runc::{CheckpointOpts, ChildStdio},
    sandbox::{inspection_before_resume, Origin, OriginImport},
    stdio::PreparedIo,
};

/// Where runc's seccomp programs are cached, in `store.state_dir` (a dot: no namespace is
/// named so).
const SECCOMP_CACHE_DIR: &str = ".seccomp-programs";

/// Why Start cannot hold restored processes for their checks before they run (and so
/// restores nothing).
#[derive(Debug, thiserror::Error)]
pub enum Unguarded {
    #[error("{0}: the kernel check could not compare the restored seccomp filters")]
    Seccomp(#[source] seccomp::ReferenceError),
    #[error(
        "{0}: without the restore gate the restored processes cannot be checked before they run"
    )]
    NoGate(#[source] restore_gate::GateError),
}

/// Why restored processes were stopped before they could run on, beside the kernel check's
/// refusal ([`kernel::CheckError`]) and the page files' verdict (an
/// [`crate::restore::intake::RestoreError`]), which keep their own types.
#[derive(Debug, thiserror::Error)]
pub enum NotRun {
    #[error("CRIU resumed the restored processes without the kernel check ({0}): killed them")]
    Unchecked(#[source] restore_gate::NotReached),
    /// A lazy restore's page daemon failed (its status and log, as `lazy::Daemon::failure`
    /// words them).
    #[error("the lazy restore's page daemon failed: {0}")]
    PageDaemon(String),
}

/// A `criu lazy-pages` daemon, with the bundle's spec (what a failed page transfer kills the
/// container by).
type LazyDaemon = (lazy::Daemon, Spec);

/// What `runc restore` runs with.
struct Setup {
    pid_file: PathBuf,
    /// The init's io (its child's end is handed to runc when the restore runs).
    prepared: PreparedIo,
    /// CRIU's work directory (its `restore.log`).
    work: PathBuf,
    /// The daemon serving the restored memory, when it arrives lazily.
    daemon: Option<LazyDaemon>,
    opts: CheckpointOpts,
}

/// The page files' side of the restore gate (post-restore).
struct PageVerdict {
    verification: Option<Verification>,
    /// The verdict found before the restore began.
    early: Option<Verdict>,
    /// The task that waits for the verdict while CRIU restores (and gives it to the gate).
    task: Option<JoinHandle<Verdict>>,
}

/// The kernel check's side of the restore gate (pre-resume).
struct KernelCheck {
    task: JoinHandle<restore_gate::Resumed<Checked, kernel::CheckError>>,
    /// Wakes the check's thread when CRIU never reaches pre-resume.
    cancel: restore_gate::ResumeCancel,
}

/// A passed kernel check, and the inspection whose base mark was taken right after it, while
/// CRIU still held the restored processes (`None` when the container is not inspected, or
/// its memory arrives lazily: then Start marks it once its processes run).
type Checked = (kernel::Passed, Option<Inspection>);

/// What the base mark taken at pre-resume needs ([`inspection_before_resume`]).
struct BeforeResume {
    id: String,
    image: PathBuf,
    rootfs: bundle::Rootfs,
    spec: Spec,
    config: crab_runtime_config::Config,
}

impl BeforeResume {
    /// The inspection of the restored container (init `init`), marked now.
    fn mark(self, init: u32) -> Inspection {
        let started = std::time::Instant::now();
        // The rseq areas the restored threads registered, which memory images leave out.
        let rseq: Vec<(u32, u64)> = match crate::checkpoint::criu_image::read_facts(&self.image) {
            Ok(facts) => facts
                .threads
                .iter()
                .filter_map(|t| Some((t.tid, t.rseq?)))
                .collect(),
            Err(e) => {
                log::warn!("container {}: rseq areas of its image: {e}", self.id);
                Vec::new()
            }
        };
        let inspection = inspection_before_resume(
            &self.id,
            init,
            &self.rootfs,
            &self.spec,
            &self.config,
            &rseq,
        );
        log::info!(
            "container {}: base mark taken in {:.2} ms while CRIU held the restored processes",
            self.id,
            started.elapsed().as_secs_f64() * 1e3
        );
        inspection
    }
}

/// The restore's result so far, and whether it was abandoned (its page daemon failed, or it
/// overran its bound).
type Ran = (Result<()>, bool);

impl Containers {
    /// Start of a container created from a process image: `runc restore` brings its processes
    /// back; then checkpointing begins, its lineage starting at the restored checkpoint.
    /// Returns the init's exit status if it already exited (and was reaped) meanwhile.
    pub(super) async fn restore_init(
        &self,
        c: &Arc<Container>,
        mut r: PendingRestore,
    ) -> Result<Option<i32>> {
        let started = std::time::Instant::now();
        if let Some(want) = &r.expect_rw {
            if let Err(e) = Self::check_rw(&c.id, &r.rootfs, want).await {
                let e = Error::Restore {
                    id: c.id.clone(),
                    source: e.into(),
                };
                return Err(never_ran(c, e));
            }
        }
        let mut setup = self.prepare_restore(c, &r).await?;
        // Every restore goes through CRIU's gate ([`restore_gate`]): at post-restore the
        // restored processes wait for the verdict on the image's page files (their digests
        // may still be being checked), at pre-resume for the kernel check ([`kernel`]), which
        // compares what CRIU restored with this container's spec. No gate, no restore.
        let spec = bundle::read_spec(&c.bundle)?;
        let seccomp = seccomp_reference(c, &r, &spec, &mut setup).await?;
        let host = &self.host;
        let (gate, pages, kernel) = install_gate(c, &r, &spec, seccomp, &mut setup, host)?;
        let refused_early = pages.early.as_ref().and_then(|d| d.result.clone().err());
        self.pids.lock().unwrap().begin_start();
        let (restored, abandoned) =
            run_restore(c, &r, &spec, &mut setup, refused_early, host.as_ref()).await;
        let checked = kernel.result().await;
        let ran = (restored, abandoned);
        let (restored, marked) =
            match with_kernel_check(c, host.as_ref(), &spec, &setup.work, ran, checked) {
                Ok(marked) => (Ok(()), marked),
                Err(e) => (Err(e), None),
            };
        let restored = with_page_verdict(c, host.as_ref(), &spec, gate, pages, restored).await;
        let pid = restored.and_then(|()| bundle::read_pid(&setup.pid_file));
        let early_exit = self
            .pids
            .lock()
            .unwrap()
            .finish_start(pid.as_ref().ok().copied(), (c.id.clone(), String::new()));
        let pid = match pid {
            Ok(pid) => pid,
            Err(e) => return Err(restore_failed(c, &mut setup, e).await),
        };
        if let Some(inspection) = marked {
            c.sandbox.marked_before_resume(inspection);
        }
        let remove_image = watch_lazy_transfer(c, &r, &mut setup, host);
        let lazily = remove_image.is_some();
        if bundle::read_spec(&c.bundle).is_ok_and(|spec| bundle::creates_network_namespace(&spec)) {
            if let Err(e) = host.bring_up_loopback(pid) {
                log::warn!(
                    "container {}: restored, but its loopback interface is down: {e}",
                    c.id
                );
            }
        }
        let io = setup.prepared.start().await?;
        c.init.set_pid(pid);
        c.init.set_io(io).await;
        self.watch_oom(c, pid);
        log::info!(
            "container {} restored from {} in {:?} (init pid {pid}{})",
            c.id,
            r.image.display(),
            started.elapsed(),
            match lazily {
                true => ", memory arriving lazily",
                false => "",
            }
        );
        // The restored-from image under the bundle goes once it is no longer needed: at once, or
        // after the origin has imported it (start_checkpointing).
        let taken = r.taken.take();
        let image_imported = r.checkpointing && checkpoint_restored(c, &r, taken, pid).await;
        let containerds_copy = containerd_extracted(&r.image);
        if containerds_copy && !image_imported {
            log::info!(
                "container {}: removing containerd's extracted copy of its checkpoint, {} \
                 (containerd never removes it)",
                c.id,
                r.image.display()
            );
        }
        if !image_imported && (r.image.starts_with(&c.bundle) || containerds_copy) {
            match remove_image {
                // The daemon may still read it.
                Some(tx) => {
                    let _ = tx.send(r.image);
                }
                None => {
                    let _ = std::fs::remove_dir_all(&r.image);
                }
            }
        }
        Ok(early_exit)
    }

    /// What `runc restore` runs with: the init's io, CRIU's work directory and options, a
    /// lazy-pages daemon ([`Self::lazy_pages_daemon`]); and the loopback hook, when the
    /// container has a network namespace of its own.
    async fn prepare_restore(&self, c: &Container, r: &PendingRestore) -> Result<Setup> {
        let pid_file = bundle::init_pid_file(&c.bundle);
        let prepared = PreparedIo::new(&r.stdio, &c.id, &self.namespace, c.runc.io_owner).await?;
        let work = c.bundle.join("criu-restore-work");
        let daemon = self.lazy_pages_daemon(c, r, &work).await;
        let opts = CheckpointOpts {
            image_path: r.image.clone(),
            work_path: Some(work.clone()),
            tcp_established: true,
            ext_unix_sk: true,
            file_locks: true,
            lazy_pages: daemon.is_some(),
            ..Default::default()
        };
        if bundle::read_spec(&c.bundle).is_ok_and(|spec| bundle::creates_network_namespace(&spec)) {
            add_loopback_hook(c);
            if crate::checkpoint::netns::image_holds_one(&r.image) {
                c.sandbox
                    .netns()
                    .taint("restored from an image that holds a network namespace");
            }
        }
        Ok(Setup {
            pid_file,
            prepared,
            work,
            daemon,
            opts,
        })
    }

    /// A `criu lazy-pages` daemon for the restore of `r`, listening in `work`, when
    /// `[restore] lazy_pages_min_mib` asks for one at the image's size, with the bundle's spec
    /// (what a failed page transfer kills the container by); `None` restores eagerly (also
    /// when the daemon cannot start: that costs time, not correctness).
    async fn lazy_pages_daemon(
        &self,
        c: &Container,
        r: &PendingRestore,
        work: &Path,
    ) -> Option<LazyDaemon> {
        let min = r.config.restore.lazy_pages_min_mib;
        if min == 0 {
            return None;
        }
        let spec = bundle::read_spec(&c.bundle).ok()?;
        let image = r.image.clone();
        let bytes = tokio::task::spawn_blocking(move || lazy::page_bytes(&image))
            .await
            .unwrap_or(0);
        if bytes < min.saturating_mul(1 << 20) {
            return None;
        }
        let eager = |why: String| {
            log::warn!(
                "container {}: restoring {} MiB of memory eagerly: {why}",
                c.id,
                bytes >> 20
            );
        };
        if !crate::sys::uffd::noncoop_available() {
            let why = crate::sys::uffd::probe(crate::sys::uffd::NONCOOP).err();
            eager(format!(
                "this kernel's userfaultfd cannot serve it ({why:?})"
            ));
            return None;
        }
        if !may_rewrite(&r.image, &r.config.store.state_dir) {
            eager(format!(
                "{} is not a copy of the image the restore owns (its command lines could not \
                 be restored first)",
                r.image.display()
            ));
            return None;
        }
        let image = r.image.clone();
        match tokio::task::spawn_blocking(move || eager::bring_command_lines_eagerly(&image)).await
        {
            Ok(Ok(done)) => log::info!(
                "container {}: lazy restore of {} MiB; the command lines and environments of \
                 {} processes ({} pages) restored first",
                c.id,
                bytes >> 20,
                done.processes,
                done.pages
            ),
            Ok(Err(e)) => {
                eager(e.to_string());
                return None;
            }
            Err(e) => {
                eager(e.to_string());
                return None;
            }
        }
        let criu = crate::checkpoint::criu_rpc::criu_binary(&r.config);
        match lazy::Daemon::start(&criu, &r.image, work).await {
            Ok(d) => Some((d, spec)),
            Err(e) => {
                eager(e.to_string());
                None
            }
        }
    }
}

/// Whether the restore may rewrite files of its image directory `image` (the pagemaps a lazy
/// restore brings command lines back by, [`eager`]): only a copy nobody else reads, the
/// restore's own in the store (`restore::scratch`, where files are hard links to the restore
/// cache, replaced by a rename and never written through) or the copy containerd extracted for
/// this restore (`ctr run --checkpoint`, the CRI's `<container root>/ctrd-checkpoint`).
fn may_rewrite(image: &Path, state_dir: &Path) -> bool {
    image.starts_with(state_dir.join(crate::restore::scratch::RESTORES_DIR))
        || containerd_extracted(image)
        || image.file_name().is_some_and(|n| n == "ctrd-checkpoint")
}

/// Whether `image` is the directory containerd extracted a checkpoint into for this Create
/// (`ctr c restore`, `ctr run --checkpoint`: its task service's `os.MkdirTemp(
/// $XDG_RUNTIME_DIR, "ctrd-checkpoint")`, the temp directory when that is unset), which it
/// hands to the runtime and never removes: at thousands of restores, process memory images
/// piling up in /tmp. Not the CRI's `RestoreFromPath` (`<container root>/ctrd-checkpoint`,
/// kept by the CRI), nor any directory a user named.
pub(super) fn containerd_extracted(image: &Path) -> bool {
    let named = image
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("ctrd-checkpoint"))
        .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()));
    let parent = image.parent();
    let temp_dirs = [
        Some(PathBuf::from("/tmp")),
        Some(std::env::temp_dir()),
        std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
    ];
    named
        && parent.is_some_and(|p| temp_dirs.iter().flatten().any(|t| t == p))
        && std::fs::symlink_metadata(image).is_ok_and(|m| m.is_dir())
}

/// The init never ran: it is recorded as stopped (its waiters learn so), `e` being why.
fn never_ran(c: &Container, e: Error) -> Error {
    if let Some(info) = c.init.record_exit(255) {
        c.init.announce_exit(info);
    }
    e
}

/// Connections over 127.0.0.1 need `lo` up before CRIU puts them back.
fn add_loopback_hook(c: &Container) {
    // An upgraded (replaced) shim binary is `... (deleted)`: runc could not run it,
    // and a hook that cannot run fails the restore.
    let why = match std::env::current_exe() {
        Err(e) => format!("the shim's own path: {e}"),
        Ok(exe) if !exe.is_file() => format!("{} is gone", exe.display()),
        Ok(exe) => match bundle::add_loopback_hook(&c.bundle, &exe) {
            Ok(()) => return,
            Err(e) => e.to_string(),
        },
    };
    log::warn!("container {}: no loopback hook for the restore ({why}): TCP connections over 127.0.0.1 cannot come back", c.id);
}

/// runc's seccomp program for this spec (learnt once per profile and runc binary), which the
/// kernel check compares the restored filters with.
async fn seccomp_reference(
    c: &Container,
    r: &PendingRestore,
    spec: &Spec,
    setup: &mut Setup,
) -> Result<seccomp::Reference> {
    let cache = r.config.store.state_dir.join(SECCOMP_CACHE_DIR);
    let reference = match seccomp::reference(spec, &c.runc, &cache).await {
        Ok(reference) => reference,
        Err(e) => {
            drop(setup.daemon.take());
            let e = Error::Restore {
                id: c.id.clone(),
                source: Unguarded::Seccomp(e).into(),
            };
            return Err(never_ran(c, e));
        }
    };
    if let seccomp::Reference::NotCompared(why) = &reference {
        log::warn!(
            "container {}: the restored seccomp filters are not compared: {why}",
            c.id
        );
    }
    Ok(reference)
}

/// CRIU's restore gate for this restore, and the tasks that give its two verdicts: the page
/// files' (post-restore) and the kernel check's (pre-resume), against `spec` and runc's
/// seccomp program `seccomp`.
fn install_gate(
    c: &Container,
    r: &PendingRestore,
    spec: &Spec,
    seccomp: seccomp::Reference,
    setup: &mut Setup,
    host: &Arc<dyn Host>,
) -> Result<(restore_gate::Gate, PageVerdict, KernelCheck)> {
    let verification = r.taken.as_ref().and_then(|t| t.verification.clone());
    let early = verification.as_ref().and_then(|v| v.verdict());
    let gate = match restore_gate::Gate::install(&c.bundle, spec.annotations().as_ref()) {
        Ok(g) => g,
        Err(e) => {
            drop(setup.daemon.take());
            let e = Error::Restore {
                id: c.id.clone(),
                source: Unguarded::NoGate(e).into(),
            };
            return Err(never_ran(c, e));
        }
    };
    // The gate's two verdicts: the page files' (post-restore) and the kernel check's
    // (pre-resume). Without their handles there is no restore.
    let (opener, (resume, cancel)) = match gate.opener().and_then(|o| Ok((o, gate.resume()?))) {
        Ok(handles) => handles,
        Err(e) => {
            drop(setup.daemon.take());
            gate.finish();
            let e = Error::Restore {
                id: c.id.clone(),
                source: e.into(),
            };
            return Err(never_ran(c, e));
        }
    };
    let task = give_page_verdict(opener, verification.clone(), &early);
    // The check's task iterator loads while CRIU restores (the check waits for it).
    let preloading = host.clone();
    tokio::task::spawn_blocking(move || preloading.preload_kernel_check());
    let mut expected = kernel::Expected::from_spec(spec);
    expected.seccomp = seccomp;
    let before_resume = (r.checkpointing && setup.daemon.is_none()).then(|| BeforeResume {
        id: c.id.clone(),
        image: r.image.clone(),
        rootfs: r.rootfs.clone(),
        spec: spec.clone(),
        config: r.config.clone(),
    });
    let checking = host.clone();
    let kernel_task = tokio::task::spawn_blocking(move || {
        resume.wait(|script, init| {
            let passed = checking.check_restored(&expected, script, init)?;
            Ok((passed, before_resume.map(|b| b.mark(init))))
        })
    });
    let pages = PageVerdict {
        verification,
        early,
        task,
    };
    let kernel = KernelCheck {
        task: kernel_task,
        cancel,
    };
    Ok((gate, pages, kernel))
}

/// Gives the gate the page files' verdict: from a task that waits for it while CRIU restores
/// (returned), or at once.
fn give_page_verdict(
    opener: restore_gate::Opener,
    verification: Option<Verification>,
    early: &Option<Verdict>,
) -> Option<JoinHandle<Verdict>> {
    match (verification, early) {
        (Some(v), None) => Some(tokio::task::spawn_blocking(move || {
            let d = v.wait();
            if let Err(e) = opener.open(d.result.is_ok()) {
                log::warn!("restore gate: giving the verdict: {e}");
            }
            d
        })),
        // Nothing (left) to verify: post-restore passes at once (a verdict already found
        // against the image never lets CRIU start, below).
        _ => {
            if let Err(e) = opener.open(early.as_ref().is_none_or(|d| d.result.is_ok())) {
                log::warn!("restore gate: giving the verdict: {e}");
            }
            None
        }
    }
}

/// `runc restore` (unless the page files were refused already: `refused_early`), abandoned
/// when it overruns `[checkpoint] restore_timeout_ms` or its page daemon fails.
async fn run_restore(
    c: &Container,
    r: &PendingRestore,
    spec: &Spec,
    setup: &mut Setup,
    refused_early: Option<std::sync::Arc<crate::restore::intake::RestoreError>>,
    host: &dyn Host,
) -> Ran {
    let bound = Duration::from_millis(r.config.checkpoint.restore_timeout_ms);
    let console = setup.prepared.console.as_ref().map(|c| c.path.clone());
    let child = std::mem::replace(&mut setup.prepared.child, ChildStdio::null());
    let (pid_file, opts) = (&setup.pid_file, &setup.opts);
    // A restore of this id that a crash interrupted left runc's criu-root behind: runc's own
    // `mkdir` of it would fail this one.
    let stale = c.runtime.clear_restore_leftovers(&c.id);
    if stale > 0 {
        log::warn!(
            "restore of {}: detached {stale} mounts an interrupted restore left at runc's criu-root",
            c.id
        );
    }
    if refused_early.is_none() {
        host.share_criu_cache();
    }
    let restore = async {
        match refused_early {
            Some(why) => Err(Error::Refused(Box::new(why))),
            None => c
                .runtime
                .restore(&c.id, &c.bundle, pid_file, opts, console.as_deref(), child)
                .await
                .map_err(Error::from),
        }
    };
    tokio::pin!(restore);
    let outcome = race(restore.as_mut(), &mut setup.daemon, bound).await;
    // Abandoned (its page daemon failed, or it overran its bound): that is why it failed,
    // whatever the kernel check then read of a tree being torn down.
    let abandoned = outcome.is_err();
    let restored = match outcome {
        Ok(result) => result,
        Err((what, err)) => {
            let killed = host.kill_cgroup_members(spec, &c.id);
            log::error!("restore of {}: {what}: killed {killed} processes", c.id);
            let _ = tokio::time::timeout(Duration::from_secs(10), &mut restore).await;
            // A killed CRIU leaves its cgroup yard mounted in the work directory.
            crate::sys::mountinfo::detach_all_under(&setup.work);
            Err(err)
        }
    };
    (restored, abandoned)
}

/// `restore` raced against a lazy-pages daemon that fails first: the restore would wait for
/// it (CRIU reports the end of the restore to it) until the bound, and what it restored could
/// not get its pages. A restore that overran its bound, or whose page daemon failed, is
/// abandoned (the error: what happened, and Start's answer): CRIU and what it restored so far
/// live in the container's cgroup by now; killing them makes runc fail (and return) on its own.
async fn race(
    mut restore: Pin<&mut impl Future<Output = Result<()>>>,
    daemon: &mut Option<LazyDaemon>,
    bound: Duration,
) -> std::result::Result<Result<()>, (String, Error)> {
    let raced = async {
        loop {
            let daemon_ended = async {
                match daemon.as_mut() {
                    Some((d, _)) if !d.has_exited() => d.wait_exit().await,
                    _ => std::future::pending().await,
                }
            };
            tokio::select! {
                r = &mut restore => break Ok(r),
                code = daemon_ended => if code != 0 {
                    break Err(code);
                },
            }
        }
    };
    match tokio::time::timeout(bound, raced).await {
        Ok(Ok(result)) => Ok(result),
        Ok(Err(code)) => {
            let why = daemon
                .as_ref()
                .map(|(d, _)| d.failure(code))
                .unwrap_or_default();
            Err((
                format!("{why} before the restore ended"),
                Error::Refused(NotRun::PageDaemon(why).into()),
            ))
        }
        Err(_) => Err((
            format!("took longer than {bound:?}"),
            Error::TimedOut(format!("the restore took longer than {bound:?} ([checkpoint] restore_timeout_ms) and was abandoned")),
        )),
    }
}

impl KernelCheck {
    /// The kernel check: CRIU waited at pre-resume while it ran, or never got there (the
    /// cancel then wakes its thread).
    async fn result(self) -> restore_gate::Resumed<Checked, kernel::CheckError> {
        self.cancel.cancel();
        self.task
            .await
            .unwrap_or_else(|e| restore_gate::Resumed::NotReached(e.into()))
    }
}

/// The restore's result with the kernel check's (`checked`): a refused check kills what is
/// left of the container's processes, and so does a CRIU that resumed them unchecked.
fn with_kernel_check(
    c: &Container,
    host: &dyn Host,
    spec: &Spec,
    work: &Path,
    (restored, abandoned): Ran,
    checked: restore_gate::Resumed<Checked, kernel::CheckError>,
) -> Result<Option<Inspection>> {
    match (restored, checked) {
        (Ok(()), restore_gate::Resumed::Checked(Ok((passed, marked)))) => {
            log::info!(
                "container {}: kernel check passed in {:.2} ms ({} processes, {} threads, \
                 {} mounts compared with the spec; runc's seccomp program found in {} \
                 threads) while CRIU held them at pre-resume",
                c.id,
                passed.took.as_secs_f64() * 1e3,
                passed.processes,
                passed.threads,
                passed.mounts,
                passed.seccomp_matched
            );
            Ok(marked)
        }
        (r, restore_gate::Resumed::Checked(Err(why))) => {
            // Killed at the gate already (the tree, then CRIU); whatever is left of the
            // container's processes goes too.
            host.kill_cgroup_members(spec, &c.id);
            // A killed CRIU leaves its cgroup yard mounted in the work directory.
            crate::sys::mountinfo::detach_all_under(work);
            match r {
                Err(e) if abandoned => {
                    log::error!(
                        "restore of {}: {e} (the kernel check, on what was left: {why})",
                        c.id
                    );
                    Err(e)
                }
                _ => {
                    log::error!("restore of {} refused by the kernel check: {why}", c.id);
                    Err(Error::Refused(why.into()))
                }
            }
        }
        (Ok(()), restore_gate::Resumed::NotReached(why)) => {
            let killed = host.kill_cgroup_members(spec, &c.id);
            log::error!(
                "restore of {}: CRIU resumed the restored processes without the kernel \
                 check ({why}): killed {killed} processes",
                c.id
            );
            Err(Error::Refused(NotRun::Unchecked(why).into()))
        }
        (Err(e), _) => Err(e),
    }
}

/// The restore's result with the verdict on the page files: waited for when the processes run
/// (nothing may run that was not signed), else taken if it is there (it may say why CRIU
/// failed). The gate goes.
async fn with_page_verdict(
    c: &Container,
    host: &dyn Host,
    spec: &Spec,
    gate: restore_gate::Gate,
    pages: PageVerdict,
    restored: Result<()>,
) -> Result<()> {
    let gated = pages.task.is_some();
    let verdict = match pages.task {
        Some(task) if restored.is_ok() => task.await.ok(),
        Some(task) => {
            task.abort();
            pages.verification.as_ref().and_then(|v| v.verdict())
        }
        None => pages.early,
    };
    let reached = gate.reached();
    gate.finish();
    match (restored, verdict.as_ref()) {
        (
            r,
            Some(Verdict {
                result: Err(why), ..
            }),
        ) => {
            if r.is_ok() {
                // CRIU let them run without the gate's word: they must not go on.
                let killed = host.kill_cgroup_members(spec, &c.id);
                log::error!(
                    "restore of {}: {why}, but its processes were resumed (the restore gate \
                     was {}): killed {killed} processes",
                    c.id,
                    if reached.is_some() {
                        "ignored"
                    } else {
                        "not run"
                    }
                );
            }
            Err(Error::Refused(Box::new(why.clone())))
        }
        (Ok(()), Some(d)) => {
            log_page_verdict(c, d, gated, reached, pages.verification.as_ref());
            Ok(())
        }
        (r, _) => r,
    }
}

/// Says how the page files were verified: before the restore, or while CRIU restored (and
/// how long CRIU waited for them at its gate, if it ran the gate).
fn log_page_verdict(
    c: &Container,
    d: &Verdict,
    gated: bool,
    reached: Option<std::time::SystemTime>,
    verification: Option<&Verification>,
) {
    let waited = reached
        .and_then(|at| d.at.duration_since(at).ok())
        .unwrap_or_default();
    let how = match (gated, reached) {
        (false, _) => "before the restore began".to_string(),
        (true, Some(_)) => format!(
            "while CRIU restored; CRIU waited {:.1} ms for them at its post-restore gate",
            waited.as_secs_f64() * 1e3
        ),
        // The processes ran before the verdict, which found nothing wrong.
        (true, None) => {
            log::warn!(
                "container {}: CRIU did not run the restore gate: its processes were resumed \
                 before their page files were verified",
                c.id
            );
            "while CRIU restored, without the gate".to_string()
        }
    };
    log::info!(
        "checkpoint image of {}: its page files ({} bytes) verified in {:.1} ms {how}",
        c.id,
        verification.map_or(0, |v| v.bytes()),
        d.took.as_secs_f64() * 1e3,
    );
}

/// A restore that failed (`e`): its page daemon goes, runc forgets the container, and the init
/// never ran; the error says what CRIU logged.
async fn restore_failed(c: &Container, setup: &mut Setup, e: Error) -> Error {
    drop(setup.daemon.take());
    // Before `runc delete`, which removes runc's state directory: through a rootfs still
    // mounted there it would remove the container's files.
    let detached = c.runtime.clear_restore_leftovers(&c.id);
    if detached > 0 {
        log::warn!(
            "cleanup after failed restore of {}: detached {detached} mounts runc left at its \
             criu-root",
            c.id
        );
    }
    if let Err(d) = c.runtime.delete(&c.id, true).await {
        log::debug!("cleanup after failed restore of {}: {d}", c.id);
    }
    let log = setup.work.join("restore.log");
    let criu = crate::checkpoint::process::criu_errors(&log)
        .map(|l| format!("; CRIU: {}", l.join(" | ")))
        .unwrap_or_default();
    let e = Error::Restored {
        id: c.id.clone(),
        source: Box::new(e),
        criu,
        log,
    };
    never_ran(c, e)
}

/// A lazy restore's daemon is still handing pages over: checkpoints and the inspection
/// must know until it is done, and it is watched from now on, before anything else can
/// fail (a daemon dropped here would leave the processes running with pages missing).
/// The image it reads goes after it, if this restore is the one to remove it: the sender
/// returned (`None`: the restore was eager, and its work directory is gone).
fn watch_lazy_transfer(
    c: &Container,
    r: &PendingRestore,
    setup: &mut Setup,
    host: &Arc<dyn Host>,
) -> Option<oneshot::Sender<PathBuf>> {
    let Some((daemon, spec)) = setup.daemon.take() else {
        let _ = std::fs::remove_dir_all(&setup.work);
        return None;
    };
    let (remove_image_tx, remove_image_rx) = oneshot::channel::<PathBuf>();
    let transfer = lazy::Transfer::in_flight();
    c.sandbox.restored_lazily(transfer.clone());
    let (id, bound) = (c.id.clone(), r.config.checkpoint.restore_timeout_ms);
    let restored_at = std::time::Instant::now();
    let (host, of) = (host.clone(), id.clone());
    let kill_members: KillMembers = Box::new(move || host.kill_cgroup_members(&spec, &of));
    tokio::spawn(watch_transfer(
        daemon,
        kill_members,
        transfer,
        id,
        Duration::from_millis(bound),
        restored_at,
        remove_image_rx,
    ));
    Some(remove_image_tx)
}

/// Kills what is in a container's cgroup ([`Host::kill_cgroup_members`]); returns how many.
type KillMembers = Box<dyn Fn() -> usize + Send + Sync>;

/// Watches a lazy restore's page transfer to its end (killing the container when its memory
/// does not all arrive), then removes the daemon's work directory and, when told, the image.
async fn watch_transfer(
    daemon: lazy::Daemon,
    kill_members: KillMembers,
    transfer: lazy::Transfer,
    id: String,
    bound: Duration,
    restored_at: std::time::Instant,
    remove_image_rx: oneshot::Receiver<PathBuf>,
) {
    let kill = |why: &str| match kill_members() {
        // Its processes were gone already (killed, or the container deleted
        // during the transfer): the daemon had nothing left to serve.
        0 => log::info!(
            "container {id}: its processes ended before their lazy restore \
             had handed every page over ({why})"
        ),
        killed => log::error!(
            "container {id}: its memory did not all arrive ({why}): killed its \
             {killed} processes rather than let them run with pages missing"
        ),
    };
    let work = lazy::watch(daemon, transfer.clone(), bound, kill).await;
    if transfer.state() == lazy::State::Done {
        log::info!(
            "container {}: every page of its lazy restore arrived {:?} after the \
             restore",
            id,
            restored_at.elapsed()
        );
    }
    let _ = std::fs::remove_dir_all(work);
    // Sent once Start knows whether the image is its to remove; never sent
    // when Start failed after the restore (the image goes with the bundle).
    if let Ok(image) = remove_image_rx.await {
        let _ = std::fs::remove_dir_all(image);
    }
}

/// Checkpointing of the restored container begins, its lineage starting at the restored
/// checkpoint (`taken`; none for containerd's own). Returns whether the origin imports the
/// image in the background (which then removes it).
async fn checkpoint_restored(
    c: &Container,
    r: &PendingRestore,
    taken: Option<Taken>,
    pid: u32,
) -> bool {
    // The threads' rseq areas, which the image records and CRIU registered again:
    // read back from the image that was just restored (a few small files).
    let image = r.image.clone();
    match tokio::task::spawn_blocking(move || crate::checkpoint::criu_image::read_facts(&image))
        .await
    {
        Ok(Ok(facts)) => c.sandbox.restored_rseq(
            facts
                .threads
                .iter()
                .filter_map(|t| Some((t.tid, t.rseq?)))
                .collect(),
        ),
        Ok(Err(e)) => log::warn!("container {}: rseq areas of its image: {e}", c.id),
        Err(e) => log::warn!("container {}: rseq areas of its image: {e}", c.id),
    }
    let origin = match taken {
        Some(t) => Origin::Checkpoint(t),
        None => Origin::Image,
    };
    let ours = matches!(&origin, Origin::Checkpoint(t) if t.criu_dir.as_ref() == Some(&r.image));
    match c
        .sandbox
        .start_checkpointing(&c.bundle, &r.rootfs, &r.config, &c.runc, pid, origin)
        .await
    {
        Ok(import) => ours && import == OriginImport::Background,
        Err(e) => {
            log::error!(
                "container {} runs restored but without checkpoints: {e}",
                c.id
            );
            false
        }
    }
}

/// SIGKILLs every process in container `id`'s cgroup (from the spec's `cgroupsPath`, as
/// runc places it with the cgroupfs or the systemd driver); returns how many
/// ([`super::SystemHost`]'s; the restore asks its [`Host`]).
pub(super) fn kill_cgroup_members(spec: &Spec, id: &str) -> usize {
    let path = spec
        .linux()
        .as_ref()
        .and_then(|l| l.cgroups_path().clone())
        .map(|p| p.display().to_string());
    let suffix = match path.as_deref() {
        // systemd driver: "slice:prefix:name" is the unit prefix-name.scope.
        Some(p) if p.split(':').count() == 3 => {
            let parts: Vec<&str> = p.split(':').collect();
            format!("/{}-{}.scope", parts[1], parts[2])
        }
        Some(p) => format!("/{}", p.trim_start_matches('/')),
        None => format!("/{id}"),
    };
    let mut killed = 0;
    for pid in crate::sys::procfs::pids() {
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        if cgroups.lines().any(|l| {
            l.splitn(3, ':')
                .nth(2)
                .is_some_and(|p| p == suffix || p.ends_with(&suffix))
        }) {
            // SAFETY: plain kill(2) of a pid in the container's cgroup.
            if unsafe { libc::kill(pid as i32, libc::SIGKILL) } == 0 {
                killed += 1;
            }
        }
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What stops restored processes reads as it always did (e2e tests look for it), under
    /// the core's `Refused` kind, with nothing added.
    #[test]
    fn refused_restored_processes_keep_their_words() {
        let e =
            Error::Refused(NotRun::PageDaemon("criu lazy-pages failed (status 1)".into()).into());
        assert_eq!(
            e.to_string(),
            "the lazy restore's page daemon failed: criu lazy-pages failed (status 1)"
        );
        assert!(
            matches!(&e, Error::Refused(s) if matches!(s.downcast_ref(), Some(NotRun::PageDaemon(_)))),
            "{e:?}"
        );
        let e = Error::Refused(NotRun::Unchecked(restore_gate::NotReached::Closed).into());
        assert_eq!(
            e.to_string(),
            "CRIU resumed the restored processes without the kernel check (the gate closed): \
             killed them"
        );
    }

    #[test]
    fn only_containerds_own_extracted_copy_is_removed() {
        let dir = PathBuf::from(format!("/tmp/ctrd-checkpoint{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(containerd_extracted(&dir));
        std::fs::remove_dir(&dir).unwrap();
        // Gone, or a file of that name: nothing to remove.
        assert!(!containerd_extracted(&dir));
        std::fs::write(&dir, "x").unwrap();
        assert!(!containerd_extracted(&dir));
        std::fs::remove_file(&dir).unwrap();
        // The CRI's RestoreFromPath, a user's directory, other names.
        let tmp = tempfile::tempdir().unwrap();
        for p in [
            tmp.path().join("ctrd-checkpoint"),
            tmp.path().join("ctrd-checkpoint123"),
            PathBuf::from("/tmp/ctrd-checkpoint"),
            PathBuf::from("/tmp/ctrd-checkpointabc"),
            PathBuf::from("/tmp/my-checkpoint123"),
        ] {
            std::fs::create_dir_all(&p).unwrap();
            assert!(!containerd_extracted(&p), "{}", p.display());
            std::fs::remove_dir(&p).unwrap();
        }
    }
}

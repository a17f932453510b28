//! The restore at Start ([`super::restore`]) over the fakes: runc's restore is the fake's,
//! whose CRIU runs the real restore gate's action script at post-restore and pre-resume, and
//! the kernel check is the fake host's ([`super::fake::KernelCheck`]). What each outcome asks
//! of runc and of the host, in which order, and what it leaves of the container.

use std::{path::PathBuf, time::Duration};

use super::{
    core_tests::{checkpoint_options, core_file, Core},
    fake::{KernelCheck, FIRST_PID},
    NotRun,
};
use crate::{
    checkpoint::provenance::ProvenanceError,
    error::Error,
    process::Status,
    restore::{gate::GATE_DIR, intake::RestoreError, kernel},
};

impl Core {
    /// A checkpoint of running container `from` signed by this host (containerd's, as `ctr
    /// task checkpoint` takes it): its image directory.
    async fn signed_image(&self, from: &str) -> PathBuf {
        self.running(from).await;
        let image = self.checkpoint_dir(from);
        self.containers
            .checkpoint_task(from, &image, checkpoint_options(None))
            .await
            .unwrap();
        image
    }

    /// Container `id` created from process image `image` (left for Start to restore); the
    /// runtime's calls so far.
    async fn created_from(&self, id: &str, image: &std::path::Path) -> usize {
        let mut p = self.params(id, serde_json::json!({}));
        p.checkpoint = image.display().to_string();
        assert_eq!(self.containers.create(p).await.unwrap(), 0, "no init yet");
        self.calls().len()
    }

    /// The init of `id` was recorded as stopped by a restore that never ran it: its waiters
    /// learn exit status 255, and no pid is its.
    async fn never_ran(&self, id: &str) {
        let c = self.containers.get(id).unwrap();
        assert_eq!(c.init.status(), Status::Stopped);
        let exit = tokio::time::timeout(Duration::from_secs(10), self.containers.wait(id, ""))
            .await
            .expect("waiters learn the exit")
            .unwrap();
        assert_eq!(exit.status, 255);
        assert!(
            !self
                .containers
                .pids
                .lock()
                .unwrap()
                .owners
                .values()
                .any(|(c, _)| c == id),
            "no pid is {id}'s"
        );
        assert!(!self.events().iter().any(|e| e == &format!("start {id}")));
    }

    /// The restore gate of `id` is gone: its script and FIFOs removed, its CRIU configuration
    /// back to what runc would have used (none here).
    fn gate_removed(&self, id: &str) {
        let gate = self.bundle(id).join(GATE_DIR);
        for f in ["gate.sh", "verdict", "resume", "resume-verdict"] {
            assert!(!gate.join(f).exists(), "{f} left in the gate");
        }
        assert_eq!(std::fs::read(gate.join("criu.conf")).unwrap(), b"");
    }
}

/// The restore's runtime calls: runc's leftovers cleared, `runc restore` of `image`, and the
/// stages at which its CRIU ran the gate's script (`stages`: each one's outcome).
fn restore_calls(id: &str, image: &std::path::Path, stages: &[&str]) -> Vec<String> {
    let mut calls = vec![
        format!("clear {id}"),
        format!("restore {id} {}", image.display()),
    ];
    calls.extend(stages.iter().map(|s| format!("criu {s}")));
    calls
}

/// A Create from a signed image, then Start: runc restores it once, behind the gate (the page
/// verdict at post-restore, the kernel check of the restored init at pre-resume), and the
/// init runs with the pid runc wrote; the gate and CRIU's work directory go.
#[tokio::test]
async fn start_restores_a_signed_image_once_behind_the_kernel_check() {
    let core = Core::new();
    let image = core.signed_image("c0").await;
    let before = core.created_from("c1", &image).await;
    assert!(core.host.calls().is_empty(), "nothing checked at Create");
    let pid = core.containers.start("c1", "").await.unwrap();
    assert_eq!(pid, FIRST_PID + 1, "the pid the fake's restore wrote");
    assert_eq!(
        core.calls()[before..],
        restore_calls("c1", &image, &["post-restore ok", "pre-resume ok"])
    );
    // CRIU's kernel probe cache shared before runc restores, the restored tree checked after.
    assert_eq!(
        core.host.calls(),
        ["criu cache".to_string(), format!("check-restored {pid}")]
    );
    let c = core.containers.get("c1").unwrap();
    assert_eq!(c.init.status(), Status::Running);
    assert_eq!(core.containers.init_pid("c1").unwrap(), pid);
    assert_eq!(core.events().last().unwrap(), "start c1");
    core.gate_removed("c1");
    assert!(!core.bundle("c1").join("criu-restore-work").exists());
    assert!(image.is_dir(), "an image the client named stays");
    // Started once: a second Start is refused, runc not asked.
    let calls = core.calls().len();
    assert!(core.containers.start("c1", "").await.is_err());
    assert_eq!(core.calls().len(), calls);
    // Its exit reaches it like any init's.
    core.exit("c1", "", pid, 0).await;
    assert_eq!(core.events().last().unwrap(), "exit c1/c1 0");
}

/// One byte of a signed file changed: refused at Create as altered after signing, before
/// runc is asked anything; there is nothing to Start, and the kernel check never runs.
#[tokio::test]
async fn an_image_altered_after_signing_never_reaches_runc_restore() {
    let core = Core::new();
    let image = core.signed_image("c0").await;
    let pages = core_file(&image);
    let mut bytes = std::fs::read(&pages).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&pages, bytes).unwrap();
    let calls = core.calls();
    let mut p = core.params("c1", serde_json::json!({}));
    p.checkpoint = image.display().to_string();
    let e = core.containers.create(p).await.unwrap_err();
    let Error::Restore { id, source } = &e else {
        panic!("not a restore error: {e:?}");
    };
    assert_eq!(id, "c1");
    assert!(
        matches!(
            source.downcast_ref::<RestoreError>(),
            Some(RestoreError::Provenance(ProvenanceError::Altered(_)))
        ),
        "{source:?}"
    );
    assert!(e.to_string().contains("altered after signing"), "{e}");
    assert!(matches!(
        core.containers.start("c1", "").await,
        Err(Error::NotFound(_))
    ));
    assert_eq!(core.calls(), calls, "no restore: {:?}", core.calls());
    assert!(core.host.calls().is_empty());
}

/// runc's restore fails: Start's error carries runc's words and CRIU's logged errors with the
/// log's path; runc forgets the container (`delete --force`, after its criu-root's mounts are
/// cleared), the gate goes, the kernel check never ran and the init is recorded as stopped.
#[tokio::test]
async fn a_failed_runc_restore_names_runc_and_criu_and_leaves_a_stopped_init() {
    let core = Core::new();
    let image = core.signed_image("c0").await;
    let before = core.created_from("c1", &image).await;
    core.runtime
        .fail("restore", "criu failed: type RESTORE errno 0");
    let e = core.containers.start("c1", "").await.unwrap_err();
    let Error::Restored {
        id,
        source,
        criu,
        log,
    } = &e
    else {
        panic!("not a failed restore: {e:?}");
    };
    assert_eq!(id, "c1");
    assert!(
        matches!(**source, Error::Runc(_)) && source.to_string().contains("type RESTORE errno 0"),
        "{source:?}"
    );
    assert!(
        criu.starts_with("; CRIU: ") && criu.contains("cr-restore.c"),
        "{criu}"
    );
    assert_eq!(
        log,
        &core.bundle("c1").join("criu-restore-work/restore.log")
    );
    assert!(log.is_file(), "the log it names is kept");
    let mut want = restore_calls("c1", &image, &[]);
    want.extend(["clear c1".to_string(), "delete c1 --force".to_string()]);
    assert_eq!(core.calls()[before..], want);
    assert_eq!(core.host.calls(), ["criu cache"], "nothing checked");
    core.gate_removed("c1");
    core.never_ran("c1").await;
}

/// The kernel check refuses the restored processes, or cannot read them: the restore fails
/// with the check's reason, what is left in the container's cgroup is killed through the
/// host after the check, runc forgets the container and nothing runs.
#[tokio::test]
async fn a_kernel_check_that_refuses_or_fails_kills_the_restored_processes() {
    let answers = [
        KernelCheck::Refuses("CapEff 0x3fffffffff, the spec grants 0xa80425fb".into()),
        KernelCheck::Fails("No such process".into()),
    ];
    for answer in answers {
        let core = Core::new();
        let image = core.signed_image("c0").await;
        let before = core.created_from("c1", &image).await;
        core.host.kernel_check(answer.clone());
        let e = core.containers.start("c1", "").await.unwrap_err();
        let Error::Restored { source, .. } = &e else {
            panic!("not a failed restore: {e:?}");
        };
        let Error::Refused(why) = &**source else {
            panic!("not refused: {source:?}");
        };
        let check = why.downcast_ref::<kernel::CheckError>();
        match &answer {
            KernelCheck::Refuses(words) => {
                assert!(
                    matches!(check, Some(kernel::CheckError::Refused(kernel::Refusal(w))) if w == words),
                    "{why:?}"
                );
                assert!(
                    e.to_string().contains(
                        "the restored processes have more than the container's spec grants: CapEff"
                    ),
                    "{e}"
                );
            }
            _ => assert!(
                matches!(check, Some(kernel::CheckError::Restored(_))),
                "{why:?}"
            ),
        }
        let pid = FIRST_PID + 1;
        assert_eq!(
            core.host.calls(),
            [
                "criu cache".to_string(),
                format!("check-restored {pid}"),
                "kill-cgroup c1".to_string()
            ]
        );
        let mut want = restore_calls("c1", &image, &["post-restore ok", "pre-resume failed"]);
        want.extend(["clear c1".to_string(), "delete c1 --force".to_string()]);
        assert_eq!(core.calls()[before..], want);
        core.gate_removed("c1");
        core.never_ran("c1").await;
    }
}

/// A CRIU that runs no action script resumes what it restored without the kernel check: the
/// restore is refused as unchecked, the container's cgroup killed, runc forgets it.
#[tokio::test]
async fn processes_resumed_without_the_kernel_check_are_killed() {
    let core = Core::new();
    let image = core.signed_image("c0").await;
    let before = core.created_from("c1", &image).await;
    core.runtime.ignore_action_scripts();
    let e = core.containers.start("c1", "").await.unwrap_err();
    let Error::Restored { source, .. } = &e else {
        panic!("not a failed restore: {e:?}");
    };
    assert!(
        matches!(&**source, Error::Refused(s) if matches!(s.downcast_ref(), Some(NotRun::Unchecked(_)))),
        "{source:?}"
    );
    assert_eq!(
        core.host.calls(),
        ["criu cache", "kill-cgroup c1"],
        "no check ran"
    );
    let mut want = restore_calls("c1", &image, &[]);
    want.extend(["clear c1".to_string(), "delete c1 --force".to_string()]);
    assert_eq!(core.calls()[before..], want);
    core.never_ran("c1").await;
}

/// A checkpoint path with nothing there: Create says that path is missing (not that a
/// signature is), whatever the policy for unsigned images (none would start it fresh),
/// registers nothing, and asks neither runc nor the host anything.
#[tokio::test]
async fn a_missing_checkpoint_path_fails_create_and_asks_nothing() {
    let core = Core::new();
    let missing = core.dir.path().join("no-such-checkpoint");
    for (id, policy) in [("c1", ""), ("c2", "start-fresh"), ("c3", "kernel-check")] {
        let config = match policy {
            "" => String::new(),
            p => format!("[restore]\nunsigned_images = \"{p}\"\n"),
        };
        let mut p = core.params_with(id, serde_json::json!({}), &config);
        p.checkpoint = missing.display().to_string();
        let e = core.containers.create(p).await.unwrap_err();
        let Error::Restore { source, .. } = &e else {
            panic!("not a restore error: {e:?}");
        };
        assert!(
            matches!(source.downcast_ref(), Some(RestoreError::Io { path, source })
                if path == &missing && source.kind() == std::io::ErrorKind::NotFound),
            "{source:?}"
        );
        assert_eq!(
            e.to_string(),
            format!(
                "cannot restore {id}: checkpoint image: {}: No such file or directory (os \
                 error 2)",
                missing.display()
            )
        );
    }
    assert!(core.calls().is_empty(), "{:?}", core.calls());
    assert!(core.host.calls().is_empty());
    assert!(core.containers.is_empty());
}

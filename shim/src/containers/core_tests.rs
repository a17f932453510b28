//! The task core's verbs over a fake runtime ([`super::fake`]): what each verb asks of runc,
//! in which order, what it tells containerd, and what a runc failure leaves behind. No root,
//! no runc: a bundle in a temporary directory, a config that turns checkpointing off.

use std::{
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use containerd_shim::ExitSignal;

use super::{
    fake::{FakeHost, FakeRuntime, FIRST_PID, HOST_NAMESPACES},
    Containers, CreateParams, TaskCheckpointOptions,
};
use crate::{
    checkpoint::criu_image::{
        testing::{with_caps, write_image},
        Creds,
    },
    error::Error,
    events::{EventSender, TaskEvent},
    process::Status,
    restore::{
        intake::RestoreError,
        layers::{EngineSnapshot, SnapshotError, SnapshotSource},
    },
    stdio::StdioSpec,
};

struct NoEngine;

#[async_trait::async_trait]
impl SnapshotSource for NoEngine {
    async fn snapshot(
        &self,
        _namespace: &str,
        _id: &str,
        _fallback: Option<(String, String)>,
    ) -> Result<EngineSnapshot, SnapshotError> {
        Err(SnapshotError::NoAnswer("no engine in unit tests".into()))
    }
}

/// A core over the fake runtime, the events it published (each acknowledged as containerd's
/// publisher would), and the directory its bundles and store live in.
pub(super) struct Core {
    pub(super) containers: Arc<Containers>,
    pub(super) runtime: Arc<FakeRuntime>,
    pub(super) host: Arc<FakeHost>,
    events: Arc<Mutex<Vec<TaskEvent>>>,
    pub(super) dir: tempfile::TempDir,
}

impl Core {
    pub(super) fn new() -> Core {
        let (sender, mut rx) = EventSender::channel();
        let events = Arc::new(Mutex::new(Vec::new()));
        let seen = events.clone();
        tokio::spawn(async move {
            while let Some(envelope) = rx.recv().await {
                seen.lock().unwrap().push(envelope.event);
                if let Some(done) = envelope.published {
                    let _ = done.send(());
                }
            }
        });
        let runtime = FakeRuntime::new();
        let host = FakeHost::new();
        let containers = Containers::with_seams(
            "unit".into(),
            Arc::new(NoEngine),
            sender,
            Arc::new(ExitSignal::default()),
            runtime.factory(),
            host.clone(),
        );
        Core {
            containers,
            runtime,
            host,
            events,
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// A bundle for container `id` (its spec: `sh`, private pid and mount namespaces, rootfs
    /// `rootfs` in the bundle) and Create's parameters for it, crab's config in the runtime
    /// options (checkpointing off, the store in the test's directory).
    pub(super) fn params(&self, id: &str, spec_extra: serde_json::Value) -> CreateParams {
        self.params_with(id, spec_extra, "")
    }

    /// [`Self::params`] with `config_extra` appended to crab's config.
    pub(super) fn params_with(
        &self,
        id: &str,
        spec_extra: serde_json::Value,
        config_extra: &str,
    ) -> CreateParams {
        let bundle = self.dir.path().join("bundles").join(id);
        std::fs::create_dir_all(bundle.join("rootfs")).unwrap();
        let mut spec = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["sh"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "root": {"path": "rootfs"},
            "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]},
        });
        if let (Some(s), Some(extra)) = (spec.as_object_mut(), spec_extra.as_object()) {
            s.extend(extra.clone());
        }
        std::fs::write(bundle.join("config.json"), spec.to_string()).unwrap();
        let config = format!(
            "[runc]\nbinary = \"/bin/true\"\nroot = \"{root}/runc\"\n\
             [store]\nstate_dir = \"{root}/store\"\n\
             [engine]\nroot = \"{root}/engine\"\n\
             [checkpoint]\nenabled = false\n{config_extra}",
            root = self.dir.path().display()
        );
        CreateParams {
            id: id.into(),
            bundle,
            rootfs: Vec::new(),
            stdio: StdioSpec::default(),
            options: Some((crab_options_url(), options_with_body(&config))),
            checkpoint: String::new(),
        }
    }

    /// Create's parameters for `id` from a containerd checkpoint (`ctr run --checkpoint`): an
    /// unsigned image of one task with `creds`, restored on the kernel check alone.
    pub(super) fn params_of_containerd_checkpoint(&self, id: &str, creds: &Creds) -> CreateParams {
        let mut p = self.params_with(
            id,
            serde_json::json!({}),
            "[restore]\nunsigned_images = \"kernel-check\"\n",
        );
        let image = self.dir.path().join("checkpoint").join(id);
        write_image(&image, &[(1, &[])], creds, HOST_NAMESPACES);
        p.checkpoint = image.display().to_string();
        p
    }

    pub(super) async fn create(&self, id: &str) -> u32 {
        let p = self.params(id, serde_json::json!({}));
        self.containers.create(p).await.unwrap()
    }

    /// A created and started container `id`; its init's pid.
    pub(super) async fn running(&self, id: &str) -> u32 {
        let pid = self.create(id).await;
        assert_eq!(self.containers.start(id, "").await.unwrap(), pid);
        pid
    }

    pub(super) fn calls(&self) -> Vec<String> {
        self.runtime.calls()
    }

    /// The events published so far, as short lines (`create c1`, `exit c1/e1 3`).
    pub(super) fn events(&self) -> Vec<String> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|e| match e {
                TaskEvent::Create { container_id, .. } => format!("create {container_id}"),
                TaskEvent::Start { container_id, .. } => format!("start {container_id}"),
                TaskEvent::Delete {
                    container_id,
                    exit_status,
                    ..
                } => format!("delete {container_id} {exit_status}"),
                TaskEvent::Paused { container_id } => format!("paused {container_id}"),
                TaskEvent::Resumed { container_id } => format!("resumed {container_id}"),
                TaskEvent::ExecAdded {
                    container_id,
                    exec_id,
                } => format!("exec-added {container_id}/{exec_id}"),
                TaskEvent::ExecStarted {
                    container_id,
                    exec_id,
                    ..
                } => format!("exec-started {container_id}/{exec_id}"),
                TaskEvent::Exit {
                    container_id,
                    id,
                    exit_status,
                    ..
                } => format!("exit {container_id}/{id} {exit_status}"),
                TaskEvent::Oom { container_id } => format!("oom {container_id}"),
            })
            .collect()
    }

    /// The reaper reports `pid`'s exit; returns once the core has published it.
    pub(super) async fn exit(&self, id: &str, exec_id: &str, pid: u32, code: i32) {
        self.containers.on_exit(pid, code);
        let p = self.containers.get(id).unwrap().process(exec_id).unwrap();
        tokio::time::timeout(Duration::from_secs(10), p.wait())
            .await
            .expect("the exit is published");
    }
}

pub(super) fn crab_options_url() -> String {
    format!(
        "type.googleapis.com/{}",
        crab_runtime_config::RUNTIME_OPTIONS_TYPE_URL
    )
}

/// `runtimeoptions.v1.Options` with `ConfigBody` (field 3) set to `body`.
pub(super) fn options_with_body(body: &str) -> Vec<u8> {
    let mut v = vec![0x1a];
    let mut len = body.len();
    while len >= 0x80 {
        v.push((len as u8 & 0x7f) | 0x80);
        len >>= 7;
    }
    v.push(len as u8);
    v.extend_from_slice(body.as_bytes());
    v
}

fn exec_spec(args: &[&str]) -> Vec<u8> {
    serde_json::json!({"args": args, "cwd": "/", "user": {"uid": 0, "gid": 0}})
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn create_runs_runc_create_records_runc_in_the_bundle_and_tells_containerd() {
    let core = Core::new();
    let pid = core.create("c1").await;
    assert_eq!(pid, FIRST_PID, "the pid runc wrote");
    assert_eq!(core.calls(), ["create c1"]);
    assert_eq!(core.events(), ["create c1"]);
    // The `delete` shim command (after a shim crash) runs runc as the shim did.
    let saved = crate::bundle::load_runc(&core.dir.path().join("bundles/c1"))
        .unwrap()
        .expect("runc saved in the bundle");
    assert_eq!(saved, core.runtime.made_from()[0]);
    assert_eq!(saved.binary, Path::new("/bin/true"));
    assert_eq!(saved.root, core.dir.path().join("runc/unit"), "namespaced");
    let c = core.containers.get("c1").unwrap();
    assert_eq!(c.init.status(), Status::Created);
    assert_eq!(core.containers.init_pid("c1").unwrap(), pid);
}

#[tokio::test]
async fn a_second_create_of_an_id_is_refused_without_asking_runc() {
    let core = Core::new();
    core.create("c1").await;
    let again = core.params("c1", serde_json::json!({}));
    let e = core.containers.create(again).await.unwrap_err();
    assert!(matches!(e, Error::AlreadyExists(_)), "{e}");
    assert_eq!(core.calls(), ["create c1"]);
}

/// runc's create fails: runc forgets whatever it made (`delete --force`), the error carries
/// runc's words as containerd's runc shim words them, nothing is registered and the id can be
/// created again.
#[tokio::test]
async fn a_failed_runc_create_is_cleaned_up_and_leaves_the_id_free() {
    let core = Core::new();
    core.runtime.fail(
        "create",
        "exec: \"nope\": executable file not found in $PATH",
    );
    let e = core
        .containers
        .create(core.params("c1", serde_json::json!({})))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("OCI runtime create failed: exec: \"nope\""),
        "{e}"
    );
    assert_eq!(core.calls(), ["create c1", "delete c1 --force"]);
    assert!(core.events().is_empty(), "containerd hears of no container");
    assert!(matches!(core.containers.get("c1"), Err(Error::NotFound(_))));
    core.runtime.succeed("create");
    core.create("c1").await;
}

/// Bad input fails Create before runc is asked anything.
#[tokio::test]
async fn a_spec_or_config_create_refuses_never_reaches_runc() {
    let core = Core::new();
    let bad_annotation = core.params(
        "c1",
        serde_json::json!({"annotations": {"io.crab/checkpoint-policy": "sometimes"}}),
    );
    let e = core.containers.create(bad_annotation).await.unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let mut bad_config = core.params("c2", serde_json::json!({}));
    bad_config.options = Some((crab_options_url(), options_with_body("[runc\n")));
    assert!(core.containers.create(bad_config).await.is_err());
    let no_spec = core.params("c3", serde_json::json!({}));
    std::fs::remove_file(no_spec.bundle.join("config.json")).unwrap();
    assert!(core.containers.create(no_spec).await.is_err());
    assert!(core.calls().is_empty(), "{:?}", core.calls());
    assert!(core.containers.is_empty());
}

#[tokio::test]
async fn start_runs_runc_start_once_and_publishes_the_init_pid() {
    let core = Core::new();
    let pid = core.running("c1").await;
    assert_eq!(core.calls(), ["create c1", "start c1"]);
    assert_eq!(core.events(), ["create c1", "start c1"]);
    assert_eq!(
        core.containers.get("c1").unwrap().init.status(),
        Status::Running
    );
    let e = core.containers.start("c1", "").await.unwrap_err();
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
    assert_eq!(core.calls().len(), 2, "no second runc start");
    assert_eq!(core.containers.init_pid("c1").unwrap(), pid);
}

/// runc's start fails: the init stays created (containerd deletes it), nothing is published.
#[tokio::test]
async fn a_failed_runc_start_leaves_the_container_created() {
    let core = Core::new();
    core.create("c1").await;
    core.runtime.fail("start", "container not created");
    assert!(core.containers.start("c1", "").await.is_err());
    assert_eq!(
        core.containers.get("c1").unwrap().init.status(),
        Status::Created
    );
    assert_eq!(core.events(), ["create c1"]);
    // Deleting it forces runc (the init never ran) and reports a killed init.
    let exit = core.containers.delete("c1", "").await.unwrap();
    assert_eq!(exit.status, 128 + libc::SIGKILL as u32);
    assert_eq!(core.calls(), ["create c1", "start c1", "delete c1 --force"]);
    assert_eq!(core.events(), ["create c1", "delete c1 137"]);
}

/// An exec: its process spec written into the bundle for runc (and removed after), its pid
/// from runc's pid file, its events in order, its exit published once the reaper reports it.
#[tokio::test]
async fn an_exec_runs_through_runc_exec_and_exits_in_order() {
    let core = Core::new();
    core.running("c1").await;
    core.containers
        .add_exec(
            "c1",
            "e1",
            StdioSpec::default(),
            exec_spec(&["sh", "-c", "true"]),
        )
        .await
        .unwrap();
    let pid = core.containers.start("c1", "e1").await.unwrap();
    assert_eq!(pid, FIRST_PID + 1);
    assert_eq!(core.calls()[2], "exec c1 sh -c true");
    let bundle = core.dir.path().join("bundles/c1");
    assert!(!bundle.join("exec-e1.json").exists(), "the spec file goes");
    assert!(!bundle.join("exec-e1.pid").exists(), "the pid file goes");
    core.exit("c1", "e1", pid, 3).await;
    assert_eq!(
        core.events(),
        [
            "create c1",
            "start c1",
            "exec-added c1/e1",
            "exec-started c1/e1",
            "exit c1/e1 3"
        ]
    );
    // An ended exec is deleted with its status; a second one of its id may then be added.
    assert_eq!(core.containers.delete("c1", "e1").await.unwrap().status, 3);
    core.containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["true"]))
        .await
        .unwrap();
}

#[tokio::test]
async fn exec_requests_that_cannot_run_are_refused_before_runc() {
    let core = Core::new();
    core.create("c1").await;
    // Not started yet: the exec is added, but cannot start.
    core.containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["true"]))
        .await
        .unwrap();
    let e = core.containers.start("c1", "e1").await.unwrap_err();
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
    core.containers.start("c1", "").await.unwrap();
    let dup = core
        .containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["true"]))
        .await
        .unwrap_err();
    assert!(matches!(dup, Error::AlreadyExists(_)), "{dup}");
    let garbage = core
        .containers
        .add_exec("c1", "e2", StdioSpec::default(), b"{not json".to_vec())
        .await
        .unwrap_err();
    assert!(matches!(garbage, Error::InvalidArgument(_)), "{garbage}");
    let unnamed = core
        .containers
        .add_exec("c1", "", StdioSpec::default(), exec_spec(&["true"]))
        .await
        .unwrap_err();
    assert!(matches!(unnamed, Error::InvalidArgument(_)), "{unnamed}");
    assert_eq!(core.calls(), ["create c1", "start c1"]);
}

/// runc's exec fails: the exec is stopped with 255 (its waiters learn so), the error is
/// runc's, and it can be deleted.
#[tokio::test]
async fn a_failed_runc_exec_stops_the_exec_with_255() {
    let core = Core::new();
    core.running("c1").await;
    core.containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["nope"]))
        .await
        .unwrap();
    core.runtime
        .fail("exec", "exec failed: \"nope\": not found");
    let e = core.containers.start("c1", "e1").await.unwrap_err();
    assert!(e.to_string().contains("OCI runtime exec failed"), "{e}");
    let p = core.containers.get("c1").unwrap().process("e1").unwrap();
    assert_eq!(p.status(), Status::Stopped);
    assert_eq!(p.wait().await.status, 255);
    assert!(!core.events().iter().any(|e| e.starts_with("exec-started")));
    assert_eq!(
        core.containers.delete("c1", "e1").await.unwrap().status,
        255
    );
}

/// Kill of init goes to runc; a process runc says is gone is NotFound as the Task API words it;
/// a started exec is signalled directly (its pid), an unstarted one refused.
#[tokio::test]
async fn kill_goes_to_runc_for_init_and_says_when_the_process_is_gone() {
    let core = Core::new();
    core.running("c1").await;
    core.containers.kill("c1", "", 15, false).await.unwrap();
    core.containers.kill("c1", "", 9, true).await.unwrap();
    core.runtime.fail("kill", "container not running");
    let gone = core.containers.kill("c1", "", 15, false).await.unwrap_err();
    assert!(matches!(gone, Error::NotFound(_)), "{gone}");
    core.runtime.fail("kill", "permission denied");
    let other = core.containers.kill("c1", "", 15, false).await.unwrap_err();
    assert!(!matches!(other, Error::NotFound(_)), "{other}");
    assert_eq!(
        core.calls()[2..],
        ["kill c1 15", "kill c1 9 --all", "kill c1 15", "kill c1 15"]
    );
    core.containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["sleep", "9"]))
        .await
        .unwrap();
    let unstarted = core
        .containers
        .kill("c1", "e1", 9, false)
        .await
        .unwrap_err();
    assert!(
        matches!(unstarted, Error::FailedPrecondition(_)),
        "{unstarted}"
    );
    core.runtime.succeed("kill");
    core.containers.start("c1", "e1").await.unwrap();
    // The fake's pid is no process: the direct signal finds none.
    let e = core
        .containers
        .kill("c1", "e1", 9, false)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e}");
    assert_eq!(
        core.calls().last().unwrap(),
        "exec c1 sleep 9",
        "an exec's signal never goes through runc kill"
    );
}

#[tokio::test]
async fn pause_and_resume_go_to_runc_and_follow_the_state() {
    let core = Core::new();
    core.running("c1").await;
    let e = core.containers.resume("c1").await.unwrap_err();
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
    core.containers.pause("c1").await.unwrap();
    assert_eq!(
        core.containers.get("c1").unwrap().init.status(),
        Status::Paused
    );
    assert!(core.containers.pause("c1").await.is_err(), "paused already");
    core.containers.resume("c1").await.unwrap();
    // runc's pause fails: the container stays running, no event.
    core.runtime.fail("pause", "cannot freeze");
    assert!(core.containers.pause("c1").await.is_err());
    assert_eq!(
        core.containers.get("c1").unwrap().init.status(),
        Status::Running
    );
    assert_eq!(core.calls()[2..], ["pause c1", "resume c1", "pause c1"]);
    assert_eq!(core.events()[2..], ["paused c1", "resumed c1"]);
}

#[tokio::test]
async fn pids_come_from_runc_ps_with_exec_ids() {
    let core = Core::new();
    let init = core.running("c1").await;
    core.containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["sleep", "9"]))
        .await
        .unwrap();
    let exec = core.containers.start("c1", "e1").await.unwrap();
    core.runtime.answer_ps(&[init as i32, exec as i32, 77]);
    let pids = core.containers.pids("c1").await.unwrap();
    assert_eq!(
        pids,
        [(init, None), (exec, Some("e1".to_string())), (77, None)]
    );
}

/// Init's exit: recorded and published; in a container sharing its host's pid namespace
/// (no private pid namespace) runc kills what is left (`kill --all 9`), as containerd's runc
/// shim does. Delete then runs `runc delete` without --force and reports the exit status.
#[tokio::test]
async fn an_init_exit_is_published_and_delete_forgets_it_in_runc() {
    let core = Core::new();
    let pid = core.running("c1").await;
    core.exit("c1", "", pid, 0).await;
    assert_eq!(core.events().last().unwrap(), "exit c1/c1 0");
    assert!(!core.calls().iter().any(|c| c.starts_with("kill")));
    let exit = core.containers.delete("c1", "").await.unwrap();
    assert_eq!(exit.status, 0);
    assert_eq!(core.calls().last().unwrap(), "delete c1");
    assert_eq!(core.events().last().unwrap(), "delete c1 0");
    assert!(core.containers.is_empty());

    let shared = core.params(
        "c2",
        serde_json::json!({"linux": {"namespaces": [{"type": "mount"}]}}),
    );
    let pid = core.containers.create(shared).await.unwrap();
    core.containers.start("c2", "").await.unwrap();
    core.exit("c2", "", pid, 1).await;
    assert!(core.calls().contains(&"kill c2 9 --all".to_string()));
}

/// Init exits while an exec runs: its exit is published after the exec's.
#[tokio::test]
async fn init_exit_waits_for_the_running_execs_exit() {
    let core = Core::new();
    let init = core.running("c1").await;
    core.containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["sleep", "9"]))
        .await
        .unwrap();
    let exec = core.containers.start("c1", "e1").await.unwrap();
    core.containers.on_exit(init, 137);
    let c = core.containers.get("c1").unwrap();
    tokio::time::timeout(Duration::from_secs(10), async {
        while c.init_exit_pending.lock().unwrap().is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("init's exit is held for the exec's");
    assert!(!core.events().iter().any(|e| e == "exit c1/c1 137"));
    core.exit("c1", "e1", exec, 137).await;
    core.exit("c1", "", init, 137).await;
    let events = core.events();
    let at = |needle: &str| events.iter().position(|e| e == needle).unwrap();
    assert!(at("exit c1/e1 137") < at("exit c1/c1 137"), "{events:?}");
}

/// Delete: a running container or exec is refused; runc's delete failing without --force is
/// retried with it; a failure with --force is the caller's.
#[tokio::test]
async fn delete_refuses_what_runs_and_retries_runc_with_force() {
    let core = Core::new();
    let pid = core.running("c1").await;
    core.containers
        .add_exec("c1", "e1", StdioSpec::default(), exec_spec(&["sleep", "9"]))
        .await
        .unwrap();
    let exec = core.containers.start("c1", "e1").await.unwrap();
    let e = core.containers.delete("c1", "e1").await.unwrap_err();
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
    let e = core.containers.delete("c1", "").await.unwrap_err();
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
    assert!(!core.calls().iter().any(|c| c.starts_with("delete")));
    core.exit("c1", "e1", exec, 0).await;
    core.exit("c1", "", pid, 0).await;
    core.runtime.fail("delete", "cgroup busy");
    let e = core.containers.delete("c1", "").await.unwrap_err();
    assert!(e.to_string().contains("cgroup busy"), "{e}");
    assert_eq!(
        core.calls()[core.calls().len() - 2..],
        ["delete c1", "delete c1 --force"]
    );
    assert!(core.containers.get("c1").is_ok(), "kept: the delete failed");
    core.runtime.succeed("delete");
    core.containers.delete("c1", "").await.unwrap();
    assert!(core.containers.is_empty());
}

/// A container whose process image waits for Start does not exist for runc: Delete does not
/// ask runc to delete it, and the restore copy it held goes.
#[tokio::test]
async fn a_container_waiting_for_its_restore_is_deleted_without_runc() {
    let core = Core::new();
    let p = core.params_of_containerd_checkpoint("c1", &Creds::default());
    let pid = core.containers.create(p).await.unwrap();
    assert_eq!(pid, 0, "no init yet: it is restored at Start");
    assert!(core.calls().is_empty(), "{:?}", core.calls());
    assert_eq!(core.events(), ["create c1"]);
    core.containers.delete("c1", "").await.unwrap();
    assert!(
        core.calls().is_empty(),
        "runc never knew it: {:?}",
        core.calls()
    );
    assert!(core.containers.is_empty());
}

/// A process image that asks for more than the spec grants (here: capabilities the spec's
/// process has none of) fails Create before runc is asked anything.
#[tokio::test]
async fn a_process_image_asking_more_than_the_spec_grants_never_reaches_runc() {
    let core = Core::new();
    let p = core.params_of_containerd_checkpoint("c1", &with_caps(1 << 21));
    let e = core.containers.create(p).await.unwrap_err();
    // The restore's own error, kept whole under the core's kind (the edge's code).
    let Error::Restore { id, source } = &e else {
        panic!("not a restore error: {e:?}");
    };
    assert_eq!(id, "c1");
    assert!(
        matches!(
            source.downcast_ref::<RestoreError>(),
            Some(RestoreError::Privilege(_))
        ),
        "{source:?}"
    );
    assert!(
        e.to_string().starts_with(
            "cannot restore c1: checkpoint image asks for more privilege than the container's \
             spec grants: "
        ),
        "{e}"
    );
    assert!(core.calls().is_empty(), "{:?}", core.calls());
    assert!(core.containers.is_empty());
}

#[tokio::test]
async fn verbs_on_an_unknown_container_are_not_found() {
    let core = Core::new();
    assert!(matches!(
        core.containers.start("nope", "").await,
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        core.containers.kill("nope", "", 9, true).await,
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        core.containers.delete("nope", "").await,
        Err(Error::NotFound(_))
    ));
    assert!(matches!(
        core.containers.pause("nope").await,
        Err(Error::NotFound(_))
    ));
    core.create("c1").await;
    assert!(matches!(
        core.containers.start("c1", "e9").await,
        Err(Error::NotFound(_))
    ));
    assert_eq!(core.calls(), ["create c1"]);
}

/// containerd's checkpoint (`ctr task checkpoint`) with the options `ctr` sends by default:
/// the image at `path`, the container left running, CRIU's work directory the bundle's.
pub(super) fn checkpoint_options(work: Option<&Path>) -> TaskCheckpointOptions {
    TaskCheckpointOptions {
        work_path: work.map(Path::to_path_buf),
        work_path_was_default: work.is_none(),
        ..TaskCheckpointOptions::default()
    }
}

impl Core {
    /// Where containerd's checkpoint of `id` is dumped (a fresh directory per call).
    pub(super) fn checkpoint_dir(&self, id: &str) -> std::path::PathBuf {
        self.dir.path().join("containerd-checkpoints").join(id)
    }

    pub(super) fn bundle(&self, id: &str) -> std::path::PathBuf {
        self.dir.path().join("bundles").join(id)
    }
}

/// A container that has not started has no process to dump: refused, runc never asked.
#[tokio::test]
async fn a_containerd_checkpoint_of_a_created_container_never_reaches_runc() {
    let core = Core::new();
    core.create("c1").await;
    let e = core
        .containers
        .checkpoint_task("c1", &core.checkpoint_dir("c1"), checkpoint_options(None))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::FailedPrecondition(_)), "{e:?}");
    assert_eq!(core.calls(), ["create c1"]);
}

/// A checkpoint of a running container: runc dumps it and leaves it running, the default work
/// directory goes, and the image is signed with this host's key, so that a Create from it is
/// restored on its signature (no `unsigned_images` setting needed) while a changed copy of it
/// is refused before runc is asked anything.
#[tokio::test]
async fn a_containerd_checkpoint_is_signed_and_restores_on_its_signature() {
    let core = Core::new();
    core.running("c1").await;
    let image = core.checkpoint_dir("c1");
    core.containers
        .checkpoint_task("c1", &image, checkpoint_options(None))
        .await
        .unwrap();
    assert_eq!(
        core.calls().last().unwrap(),
        &format!("checkpoint c1 {} --leave-running", image.display())
    );
    assert_eq!(
        core.containers.get("c1").unwrap().init.status(),
        Status::Running
    );
    assert!(
        !core.bundle("c1").join("criu-work").exists(),
        "the default work directory is removed after a good dump"
    );
    assert!(image
        .join(crate::restore::trust::CONTAINERD_SIGNATURE)
        .is_file());

    // Restored on the signature: the image waits for Start, runc not asked.
    let mut p = core.params("c2", serde_json::json!({}));
    p.checkpoint = image.display().to_string();
    let calls = core.calls().len();
    assert_eq!(core.containers.create(p).await.unwrap(), 0);
    assert_eq!(core.calls().len(), calls, "{:?}", core.calls());

    // One byte of a signed file changed: refused, nothing registered.
    let core_img = core_file(&image);
    let mut bytes = std::fs::read(&core_img).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&core_img, bytes).unwrap();
    let mut p = core.params("c3", serde_json::json!({}));
    p.checkpoint = image.display().to_string();
    let e = core.containers.create(p).await.unwrap_err();
    assert!(e.to_string().starts_with("cannot restore c3: "), "{e}");
    assert_eq!(core.calls().len(), calls, "{:?}", core.calls());
    assert!(core.containers.get("c3").is_err());
}

/// `ctr task checkpoint --exit`: runc is not told to leave it running; a work directory the
/// client named is the client's and stays.
#[tokio::test]
async fn a_containerd_checkpoint_with_exit_and_a_named_work_directory() {
    let core = Core::new();
    core.running("c1").await;
    let work = core.dir.path().join("work-c1");
    let image = core.checkpoint_dir("c1");
    let opts = TaskCheckpointOptions {
        exit: true,
        ..checkpoint_options(Some(&work))
    };
    core.containers
        .checkpoint_task("c1", &image, opts)
        .await
        .unwrap();
    assert_eq!(
        core.calls().last().unwrap(),
        &format!("checkpoint c1 {}", image.display())
    );
    assert!(
        work.join("dump.log").is_file(),
        "the named work directory stays"
    );
}

/// A live process of the container outside init's tree (an exec's main process) would be
/// missing from the image: refused with which one, runc never asked, nothing written.
#[tokio::test]
async fn a_containerd_checkpoint_that_would_miss_a_process_is_refused_before_runc() {
    let core = Core::new();
    core.running("c1").await;
    core.host.leave_out(&[4242]);
    let image = core.checkpoint_dir("c1");
    let e = core
        .containers
        .checkpoint_task("c1", &image, checkpoint_options(None))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Checkpoint { .. }), "{e:?}");
    let text = e.to_string();
    assert!(
        text.starts_with("cannot checkpoint c1: 1 live process(es)") && text.contains("4242"),
        "{text}"
    );
    assert!(!core.calls().iter().any(|c| c.starts_with("checkpoint")));
    assert!(!image.exists());

    // On a host whose inits have no cgroup2 directory the processes cannot be counted: refused.
    core.host.leave_out(&[]);
    core.host.without_cgroup2();
    let e = core
        .containers
        .checkpoint_task("c1", &image, checkpoint_options(None))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NoCgroup(_)), "{e:?}");
    assert!(!core.calls().iter().any(|c| c.starts_with("checkpoint")));
}

/// runc's failure names CRIU's log, whose work directory is kept for it; nothing is signed,
/// and the container runs on.
#[tokio::test]
async fn a_failed_containerd_checkpoint_names_criu_s_log_and_keeps_it() {
    let core = Core::new();
    core.running("c1").await;
    core.runtime
        .fail("checkpoint", "criu failed: type NOTIFY errno 0");
    let image = core.checkpoint_dir("c1");
    let e = core
        .containers
        .checkpoint_task("c1", &image, checkpoint_options(None))
        .await
        .unwrap_err();
    let log = core.bundle("c1").join("criu-work").join("dump.log");
    assert!(
        e.to_string().contains("criu failed")
            && e.to_string()
                .contains(&format!("(CRIU log: {})", log.display())),
        "{e}"
    );
    assert!(log.is_file(), "the log it names is there");
    assert!(!image
        .join(crate::restore::trust::CONTAINERD_SIGNATURE)
        .exists());
    assert_eq!(
        core.containers.get("c1").unwrap().init.status(),
        Status::Running
    );
}

/// The `core-*.img` file of the CRIU image in `image` (its bytes are signed).
pub(super) fn core_file(image: &std::path::Path) -> std::path::PathBuf {
    std::fs::read_dir(image)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("core-")
        })
        .unwrap()
}

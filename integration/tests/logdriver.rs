//! `binary://` stdio: a logging binary started by the shim reads the process's stdout and
//! stderr (what `nerdctl run -d` and containerd's `cio.BinaryIO` use). The logger is
//! `tests/logdriver/test-logger.sh`, which writes what it got into a directory named in the URI.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use containerd_client::services::v1::snapshots::snapshots_client::SnapshotsClient;
use containerd_client::services::v1::snapshots::MountsRequest;
use containerd_client::services::v1::tasks_client::TasksClient;
use containerd_client::services::v1::{CreateTaskRequest, ExecProcessRequest};
use containerd_client::with_namespace;
use crab_integration::env::{DEFAULT_RUNTIME, RUNC_RUNTIME};
use crab_integration::harness::SNAPSHOTTER;
use crab_integration::host::eventually;
use crab_integration::spec::PROCESS_TYPE_URL;
use crab_integration::{Harness, ProcessSpec};
use prost_types::Any;
use tonic::transport::Channel;
use tonic::Request;

const T: Duration = Duration::from_secs(30);

fn logger_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/logdriver/test-logger.sh")
}

/// A directory for one logger's files, and the `binary://` URI that points the logger at it.
struct LogDir {
    dir: PathBuf,
}

impl LogDir {
    fn new(h: &Harness, name: &str) -> Self {
        let dir = h.env.crab_home.join("tmp").join("logdriver").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        LogDir { dir }
    }

    /// `extra` is appended to the query as is.
    fn uri(&self, extra: &str) -> String {
        format!(
            "binary://{}?dir={}{extra}",
            logger_script().display(),
            self.dir.display()
        )
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(name)).unwrap_or_default()
    }

    fn has(&self, name: &str) -> bool {
        self.dir.join(name).exists()
    }

    /// Waits until file `name` holds `want`; returns what it holds at the end.
    fn wait_for(&self, name: &str, want: &str) -> String {
        eventually(T, || (self.read(name) == want).then_some(()))
            .map_or_else(|| self.read(name), |_| want.into())
    }

    fn env(&self) -> HashMap<String, String> {
        self.read("env")
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn pid(&self) -> Option<i32> {
        self.read("pid").trim().parse().ok()
    }

    /// Waits until the logger process is gone.
    fn assert_logger_gone(&self, what: &str) {
        let pid = self
            .pid()
            .unwrap_or_else(|| panic!("{what}: logger never started"));
        let gone = eventually(T, || {
            // Alive: not reaped and not a zombie (the field after the parenthesized name).
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            matches!(state, None | Some('Z')).then_some(())
        });
        assert!(
            gone.is_some(),
            "{what}: logger (pid {pid}) still running after {T:?}"
        );
    }

    /// Waits until the logger has exited by itself, on EOF of both its pipes.
    fn assert_logger_exits(&self, what: &str) {
        self.assert_logger_gone(what);
        assert!(
            self.has("exited"),
            "{what}: logger died without reaching EOF on its pipes"
        );
    }

    fn cleanup(self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The parts of containerd's task API the harness only offers with FIFOs.
struct Tasks {
    channel: Channel,
    namespace: String,
}

impl Tasks {
    async fn new(h: &Harness) -> Self {
        let channel = containerd_client::connect(&h.env.address).await.unwrap();
        Tasks {
            channel,
            namespace: h.env.namespace.clone(),
        }
    }

    fn req<M>(&self, msg: M) -> Request<M> {
        with_namespace!(msg, self.namespace.as_str())
    }

    async fn create(
        &self,
        id: &str,
        stdout: &str,
        stderr: &str,
        terminal: bool,
    ) -> Result<u32, tonic::Status> {
        let mounts = SnapshotsClient::new(self.channel.clone())
            .mounts(self.req(MountsRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: id.into(),
            }))
            .await?
            .into_inner()
            .mounts;
        let resp = TasksClient::new(self.channel.clone())
            .create(self.req(CreateTaskRequest {
                container_id: id.into(),
                rootfs: mounts,
                stdout: stdout.into(),
                stderr: stderr.into(),
                terminal,
                ..Default::default()
            }))
            .await?;
        Ok(resp.into_inner().pid)
    }

    async fn exec(
        &self,
        h: &Harness,
        id: &str,
        exec_id: &str,
        process: &ProcessSpec,
        stdout: &str,
    ) -> Result<(), tonic::Status> {
        let spec = process.to_oci(&h.image.env, &h.image.cwd);
        TasksClient::new(self.channel.clone())
            .exec(self.req(ExecProcessRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
                stdout: stdout.into(),
                stderr: stdout.into(),
                spec: Some(Any {
                    type_url: PROCESS_TYPE_URL.into(),
                    value: serde_json::to_vec(&spec).unwrap(),
                }),
                ..Default::default()
            }))
            .await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn logger_gets_the_output_of_the_init_and_of_an_exec() {
    let h = Harness::for_test().await;
    let tasks = Tasks::new(&h).await;
    let id = h.unique_id("logdriver_init_exec");
    let _g = h.guard(&[&id]);
    let init_log = LogDir::new(&h, &id);
    let exec_log = LogDir::new(&h, &format!("{id}-exec"));

    h.create_container(
        &id,
        &ProcessSpec::sh("echo init-out; echo init-err >&2; exec sleep 1000"),
    )
    .await
    .unwrap();
    // As containerd's cio.BinaryIO sends it: the same URI for both outputs.
    let uri = init_log.uri("&tag=a+b%2Fc");
    tasks.create(&id, &uri, &uri, false).await.unwrap();
    h.start(&id, "").await.unwrap();
    assert_eq!(init_log.wait_for("stdout", "init-out\n"), "init-out\n");
    assert_eq!(init_log.wait_for("stderr", "init-err\n"), "init-err\n");

    // Go's runc shim passes the query in map order: compare as pairs.
    let args: Vec<String> = init_log.read("args").lines().map(String::from).collect();
    let mut pairs: Vec<(String, String)> = args
        .chunks(2)
        .map(|p| (p[0].clone(), p.get(1).cloned().unwrap_or_default()))
        .collect();
    pairs.sort();
    assert_eq!(
        pairs,
        [
            ("dir".to_string(), init_log.dir.display().to_string()),
            ("tag".to_string(), "a b/c".to_string())
        ],
        "logger arguments: {args:?}"
    );
    let env = init_log.env();
    assert_eq!(env.get("CONTAINER_ID"), Some(&id), "{env:?}");
    assert_eq!(
        env.get("CONTAINER_NAMESPACE"),
        Some(&h.env.namespace),
        "{env:?}"
    );
    assert!(
        !env.contains_key("HOME") && !env.contains_key("TTRPC_ADDRESS"),
        "the shim's environment leaked: {env:?}"
    );

    // An exec gets its own logger, named by the exec id; deleting the exec ends it.
    let mut exits = h.task_exits().await.unwrap();
    tasks
        .exec(
            &h,
            &id,
            "e1",
            &ProcessSpec::sh("echo exec-out; echo exec-err >&2; exit 4"),
            &exec_log.uri(""),
        )
        .await
        .unwrap();
    h.start(&id, "e1").await.unwrap();
    assert_eq!(h.wait(&id, "e1", T).await.unwrap(), 4);
    let exit = exits.next_for(&id, "e1", T).await.unwrap();
    assert_eq!(exit.exit_status, 4);
    // The exit event comes after the output reached the logger.
    assert_eq!(exec_log.wait_for("stdout", "exec-out\n"), "exec-out\n");
    assert_eq!(exec_log.wait_for("stderr", "exec-err\n"), "exec-err\n");
    assert_eq!(
        exec_log.env().get("CONTAINER_ID").map(String::as_str),
        Some("e1")
    );
    h.delete_process(&id, "e1").await.unwrap();
    exec_log.assert_logger_exits("exec e1");

    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    init_log.assert_logger_exits("init");
    assert_eq!(init_log.read("stdout"), "init-out\n");
    h.assert_no_leaks(&id).await;
    init_log.cleanup();
    exec_log.cleanup();
}

#[tokio::test(flavor = "multi_thread")]
async fn create_returns_only_once_the_logger_is_ready() {
    let h = Harness::for_test().await;
    let tasks = Tasks::new(&h).await;
    let id = h.unique_id("logdriver_ready");
    let _g = h.guard(&[&id]);
    let log = LogDir::new(&h, &id);
    h.create_container(&id, &ProcessSpec::sh("echo hello"))
        .await
        .unwrap();
    let uri = log.uri("&ready_delay=1");
    let started = Instant::now();
    tasks.create(&id, &uri, &uri, false).await.unwrap();
    assert!(
        log.has("ready"),
        "Tasks.Create returned before the logger was ready"
    );
    assert!(started.elapsed() >= Duration::from_secs(1));
    h.start(&id, "").await.unwrap();
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 0);
    assert_eq!(log.wait_for("stdout", "hello\n"), "hello\n");
    assert_eq!(h.delete_task(&id).await.unwrap(), 0);
    h.delete_container(&id).await.unwrap();
    log.assert_logger_exits("init");
    h.assert_no_leaks(&id).await;
    log.cleanup();
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_terminal_the_console_goes_to_the_logger() {
    let h = Harness::for_test().await;
    let tasks = Tasks::new(&h).await;
    let id = h.unique_id("logdriver_tty");
    let _g = h.guard(&[&id]);
    let log = LogDir::new(&h, &id);
    h.create_container(
        &id,
        &ProcessSpec::sh("[ -t 1 ] && echo tty; echo on-stderr >&2").terminal(true),
    )
    .await
    .unwrap();
    let uri = log.uri("");
    tasks.create(&id, &uri, "", true).await.unwrap();
    h.start(&id, "").await.unwrap();
    assert_eq!(h.wait(&id, "", T).await.unwrap(), 0);
    assert_eq!(
        log.wait_for("stdout", "tty\r\non-stderr\r\n"),
        "tty\r\non-stderr\r\n"
    );
    assert_eq!(h.delete_task(&id).await.unwrap(), 0);
    h.delete_container(&id).await.unwrap();
    log.assert_logger_exits("init");
    assert_eq!(log.read("stderr"), "");
    h.assert_no_leaks(&id).await;
    log.cleanup();
}

#[tokio::test(flavor = "multi_thread")]
async fn ctr_run_log_uri() {
    let h = Harness::for_test().await;
    let id = h.unique_id("logdriver_ctr");
    let _g = h.guard(&[&id]);
    let log = LogDir::new(&h, &id);
    let uri = log.uri("");
    let out = h
        .ctr()
        .run(&[
            "run",
            "-d",
            "--log-uri",
            &uri,
            "--runtime",
            h.runtime(),
            &h.env.image,
            &id,
            "sh",
            "-c",
            "echo via-ctr; exec sleep 1000",
        ])
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(log.wait_for("stdout", "via-ctr\n"), "via-ctr\n");
    assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
    log.assert_logger_exits("init");
    h.assert_no_leaks(&id).await;
    log.cleanup();
}

/// containerd's runc shim waits for readiness forever (and takes a logger that died as ready);
/// crab gives up after 10 s, kills the logger and fails Create.
#[tokio::test(flavor = "multi_thread")]
async fn a_logger_that_never_gets_ready() {
    let h = Harness::for_test().await;
    let tasks = Tasks::new(&h).await;
    let id = h.unique_id("logdriver_never_ready");
    let _g = h.guard(&[&id]);
    let log = LogDir::new(&h, &id);
    h.create_container(&id, &ProcessSpec::new(&["sleep", "1000"]))
        .await
        .unwrap();
    let uri = log.uri("&never_ready=1");
    let create = tasks.create(&id, &uri, &uri, false);
    match h.runtime() {
        DEFAULT_RUNTIME => {
            let started = Instant::now();
            let err = create.await.unwrap_err();
            assert!(err.message().contains("was not ready within"), "{err:?}");
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "{:?}",
                started.elapsed()
            );
            log.assert_logger_gone("killed after the timeout");
            h.delete_container(&id).await.unwrap();
        }
        RUNC_RUNTIME => {
            tokio::pin!(create);
            tokio::select! {
                r = &mut create => panic!("Tasks.Create returned although the logger never got ready: {r:?}"),
                _ = tokio::time::sleep(Duration::from_secs(12)) => {}
            }
            // The runc shim takes the EOF of a dead logger's ready pipe as "ready".
            nix_kill(log.pid().expect("logger started"));
            create.await.unwrap();
            assert_eq!(h.kill_and_remove(&id).await.unwrap(), 137);
        }
        other => panic!("no expectation for runtime {other}"),
    }
    h.assert_no_leaks(&id).await;
    log.cleanup();
}

fn nix_kill(pid: i32) {
    // SAFETY: kill(2) with a pid and a signal number.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0, "kill {pid}");
}

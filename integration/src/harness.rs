//! containerd's gRPC API, the way a containerd client (ctr, nerdctl, the CRI plugin) drives a
//! shim: image -> snapshot -> container -> task (+ execs), with stdio on FIFOs we create.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use containerd_client::events::TaskExit;
use containerd_client::services::v1::container::Runtime;
use containerd_client::services::v1::snapshots::snapshots_client::SnapshotsClient;
use containerd_client::services::v1::snapshots::{
    MountsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
};
use containerd_client::services::v1::{
    containers_client::ContainersClient, content_client::ContentClient,
    images_client::ImagesClient, leases_client::LeasesClient, tasks_client::TasksClient,
    version_client::VersionClient, CloseIoRequest, Container, CreateContainerRequest,
    CreateRequest as CreateLeaseRequest, CreateTaskRequest, DeleteContainerRequest,
    DeleteProcessRequest, DeleteRequest as DeleteLeaseRequest, DeleteTaskRequest,
    ExecProcessRequest, GetContainerRequest, GetImageRequest, GetRequest, KillRequest,
    PauseTaskRequest, ReadContentRequest, ResumeTaskRequest, StartRequest, WaitRequest,
};
use containerd_client::services::v1::{
    events_client::EventsClient, PublishRequest, SubscribeRequest,
};
use containerd_client::services::v1::{
    namespaces_client::NamespacesClient, ListContainersRequest, ListNamespacesRequest,
    ListTasksRequest,
};
use containerd_client::types::v1::Status;
use containerd_client::types::Mount;
use containerd_client::with_namespace;
use prost::Message;
use prost_types::Any;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tonic::transport::Channel;
use tonic::{Code, Request};

use crate::ctr::Ctr;
use crate::spec::{container_spec, ProcessSpec, PROCESS_TYPE_URL, SPEC_TYPE_URL};
use crate::stdio::{Stdio, StdioOptions};
use crate::{host, Error, Result, TestEnv};

pub const SNAPSHOTTER: &str = "overlayfs";
/// Upper bound for any single lifecycle step; generous so a slow CI box does not flake, small
/// enough that a hung shim fails the test well inside the suite's budget.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// The image facts a container needs: its snapshot parent and config defaults.
#[derive(Debug, Clone)]
pub struct ImageInfo {
    pub name: String,
    pub chain_id: String,
    pub env: Vec<String>,
    pub cwd: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskStatus {
    Unknown,
    Created,
    Running,
    Stopped,
    Paused,
    Pausing,
}

impl From<i32> for TaskStatus {
    fn from(v: i32) -> Self {
        match Status::try_from(v).unwrap_or(Status::Unknown) {
            Status::Unknown => TaskStatus::Unknown,
            Status::Created => TaskStatus::Created,
            Status::Running => TaskStatus::Running,
            Status::Stopped => TaskStatus::Stopped,
            Status::Paused => TaskStatus::Paused,
            Status::Pausing => TaskStatus::Pausing,
        }
    }
}

#[derive(Debug, Clone)]
pub struct NamespaceInventory {
    pub name: String,
    pub containers: Vec<String>,
    /// Task (init process) ids with their status.
    pub tasks: Vec<(String, TaskStatus)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOutput {
    pub exit_status: u32,
    pub stdout: String,
    pub stderr: String,
}

#[derive(Clone)]
pub struct Harness {
    pub env: TestEnv,
    channel: Channel,
    pub image: ImageInfo,
}

impl Harness {
    /// Connects to the private containerd and resolves the test image.
    pub async fn connect() -> Result<Self> {
        Self::connect_env(TestEnv::from_env()).await
    }

    /// [`Harness::connect`] for tests: any failure panics with the reason and how to fix it.
    pub async fn for_test() -> Self {
        match Self::connect().await {
            Ok(h) => h,
            Err(e) => panic!("integration test setup failed: {e}"),
        }
    }

    pub async fn connect_env(env: TestEnv) -> Result<Self> {
        let unreachable = |reason: String| Error::Unreachable {
            address: env.address.clone(),
            reason,
        };
        let channel = connect_channel(&env).await?;
        let version = tokio::time::timeout(
            Duration::from_secs(5),
            VersionClient::new(channel.clone()).version(()),
        )
        .await
        .map_err(|_| unreachable("Version call timed out after 5s".into()))?
        .map_err(|e| unreachable(format!("Version call: {e}")))?;
        log::debug!("containerd {}", version.into_inner().version);
        let image = resolve_image(&channel, &env).await?;
        Ok(Harness {
            env,
            channel,
            image,
        })
    }

    /// The same connection, creating containers for another runtime.
    pub fn with_runtime(&self, runtime: &str) -> Harness {
        let mut h = self.clone();
        h.env.runtime = runtime.to_string();
        h
    }

    pub fn ctr(&self) -> Ctr {
        Ctr::new(&self.env)
    }

    /// The names of crabctl's own checkpoint images of `container`
    /// (`crab.local/checkpoint/<namespace>/<container>:<seq>`).
    pub fn internal_images(&self, container: &str) -> Vec<String> {
        let prefix = format!("crab.local/checkpoint/{}/{container}:", self.env.namespace);
        let listed = self
            .ctr()
            .run(&["images", "ls", "-q"])
            .unwrap()
            .ok()
            .unwrap();
        listed
            .stdout
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .map(str::to_string)
            .collect()
    }

    pub fn runtime(&self) -> &str {
        &self.env.runtime
    }

    /// For tests of crab-only features: true (run the test) under the crab runtime; otherwise
    /// prints why the test does not apply, on the real stderr so the skip shows even in
    /// passing tests' captured output, and returns false.
    pub fn runs_crab_only(&self, test: &str, why: &str) -> bool {
        if self.env.runtime == crate::env::DEFAULT_RUNTIME {
            return true;
        }
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {test} under {}: {why}",
            self.env.runtime
        );
        false
    }

    /// A container id unique to this test and test process: `it-<name>-<pid>`.
    pub fn unique_id(&self, name: &str) -> String {
        unique_id(name)
    }

    /// A guard that removes everything `ids` may have created when dropped (also on panic).
    pub fn guard(&self, ids: &[&str]) -> CleanupGuard {
        CleanupGuard {
            env: self.env.clone(),
            ids: ids.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn req<T>(&self, msg: T) -> Request<T> {
        with_namespace!(msg, self.env.namespace.as_str())
    }

    /// The gRPC channel to containerd, for tests that call an API the harness does not wrap.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    /// `msg` as a request in the test namespace (containerd's `containerd-namespace` header).
    pub fn request<T>(&self, msg: T) -> Request<T> {
        self.req(msg)
    }

    fn req_leased<T>(&self, msg: T, lease: &str) -> Request<T> {
        let mut r = self.req(msg);
        r.metadata_mut().insert(
            "containerd-lease",
            lease.parse().expect("lease ids are ASCII"),
        );
        r
    }

    fn tasks(&self) -> TasksClient<Channel> {
        TasksClient::new(self.channel.clone())
    }

    fn snapshots(&self) -> SnapshotsClient<Channel> {
        SnapshotsClient::new(self.channel.clone())
    }

    fn containers(&self) -> ContainersClient<Channel> {
        ContainersClient::new(self.channel.clone())
    }

    /// Creates the rootfs snapshot and the container record. Like containerd's Go client, a
    /// short-lived lease keeps the fresh snapshot from garbage collection until the container
    /// references it.
    pub async fn create_container(&self, id: &str, process: &ProcessSpec) -> Result<()> {
        let spec = container_spec(
            id,
            &self.env.namespace,
            process.to_oci(&self.image.env, &self.image.cwd),
        );
        self.create_container_with_spec(id, &spec).await
    }

    pub async fn create_container_with_spec(&self, id: &str, spec: &Value) -> Result<()> {
        self.create_container_with_spec_and_options(id, spec, None)
            .await
    }

    /// Like [`Harness::create_container`], with `Container.runtime.options` set to `options`
    /// (containerd hands them to the shim's Create when the task request carries none, as
    /// `ctr run --runtime-config-path` does). See [`crate::api::crab_runtime_options`].
    pub async fn create_container_with_runtime_options(
        &self,
        id: &str,
        process: &ProcessSpec,
        options: Any,
    ) -> Result<()> {
        let spec = container_spec(
            id,
            &self.env.namespace,
            process.to_oci(&self.image.env, &self.image.cwd),
        );
        self.create_container_with_spec_and_options(id, &spec, Some(options))
            .await
    }

    /// The general form: a full runtime spec and optional runtime options.
    pub async fn create_container_with_spec_and_options(
        &self,
        id: &str,
        spec: &Value,
        runtime_options: Option<Any>,
    ) -> Result<()> {
        let lease = format!("{id}-create");
        let mut labels = HashMap::new();
        labels.insert("containerd.io/gc.expire".to_string(), rfc3339_in(3600));
        LeasesClient::new(self.channel.clone())
            .create(self.req(CreateLeaseRequest {
                id: lease.clone(),
                labels,
            }))
            .await
            .map_err(|s| Error::grpc("Leases.Create", s))?;
        let result = async {
            self.snapshots()
                .prepare(self.req_leased(
                    PrepareSnapshotRequest {
                        snapshotter: SNAPSHOTTER.into(),
                        key: id.into(),
                        parent: self.image.chain_id.clone(),
                        labels: HashMap::new(),
                    },
                    &lease,
                ))
                .await
                .map_err(|s| Error::grpc("Snapshots.Prepare", s))?;
            let container = Container {
                id: id.into(),
                image: self.image.name.clone(),
                runtime: Some(Runtime {
                    name: self.env.runtime.clone(),
                    options: runtime_options,
                }),
                spec: Some(Any {
                    type_url: SPEC_TYPE_URL.into(),
                    value: serde_json::to_vec(spec).expect("spec serializes"),
                }),
                snapshotter: SNAPSHOTTER.into(),
                snapshot_key: id.into(),
                ..Default::default()
            };
            self.containers()
                .create(self.req_leased(
                    CreateContainerRequest {
                        container: Some(container),
                    },
                    &lease,
                ))
                .await
                .map_err(|s| Error::grpc("Containers.Create", s))?;
            Ok(())
        }
        .await;
        let _ = LeasesClient::new(self.channel.clone())
            .delete(self.req(DeleteLeaseRequest {
                id: lease,
                sync: false,
            }))
            .await;
        result
    }

    /// Deletes the container record and its snapshot.
    pub async fn delete_container(&self, id: &str) -> Result<()> {
        self.containers()
            .delete(self.req(DeleteContainerRequest { id: id.into() }))
            .await
            .map_err(|s| Error::grpc("Containers.Delete", s))?;
        match self
            .snapshots()
            .remove(self.req(RemoveSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: id.into(),
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::NotFound => Ok(()),
            Err(s) => Err(Error::grpc("Snapshots.Remove", s)),
        }
    }

    /// FIFOs for a process of container `id`, under the harness's FIFO root.
    pub fn stdio(&self, id: &str, name: &str, opts: StdioOptions) -> Result<Stdio> {
        Stdio::create(&self.env.fifo_root().join(id).join(name), name, opts)
    }

    /// Tasks.Create; returns the init pid. Without stdio the process gets /dev/null.
    pub async fn create_task(&self, id: &str, stdio: Option<&Stdio>) -> Result<u32> {
        let mounts = self.rootfs_mounts(id).await?;
        let resp = self
            .tasks()
            .create(self.req(CreateTaskRequest {
                container_id: id.into(),
                rootfs: mounts,
                stdin: stdio.map(Stdio::stdin_path).unwrap_or_default(),
                stdout: stdio.map(Stdio::stdout_path).unwrap_or_default(),
                stderr: stdio.map(Stdio::stderr_path).unwrap_or_default(),
                terminal: stdio.is_some_and(Stdio::terminal),
                ..Default::default()
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Create", s))?;
        Ok(resp.into_inner().pid)
    }

    async fn rootfs_mounts(&self, id: &str) -> Result<Vec<Mount>> {
        Ok(self
            .snapshots()
            .mounts(self.req(MountsRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Snapshots.Mounts", s))?
            .into_inner()
            .mounts)
    }

    /// Tasks.Start of the init process (`exec_id` "") or an exec; returns its pid.
    pub async fn start(&self, id: &str, exec_id: &str) -> Result<u32> {
        let resp = self
            .tasks()
            .start(self.req(StartRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Start", s))?;
        Ok(resp.into_inner().pid)
    }

    /// Tasks.Wait; returns the exit status. Bounded by `timeout`.
    pub async fn wait(&self, id: &str, exec_id: &str, timeout: Duration) -> Result<u32> {
        let mut tasks = self.tasks();
        let call = tasks.wait(self.req(WaitRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
        }));
        match tokio::time::timeout(timeout, call).await {
            Ok(r) => Ok(r
                .map_err(|s| Error::grpc("Tasks.Wait", s))?
                .into_inner()
                .exit_status),
            Err(_) => Err(Error::Timeout {
                what: format!("Tasks.Wait {id}/{exec_id}"),
                after: timeout,
            }),
        }
    }

    pub async fn kill(&self, id: &str, exec_id: &str, signal: i32, all: bool) -> Result<()> {
        self.tasks()
            .kill(self.req(KillRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
                signal: signal as u32,
                all,
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Kill", s))?;
        Ok(())
    }

    /// Tasks.Delete; returns the exit status containerd reports.
    pub async fn delete_task(&self, id: &str) -> Result<u32> {
        let resp = self
            .tasks()
            .delete(self.req(DeleteTaskRequest {
                container_id: id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Delete", s))?;
        Ok(resp.into_inner().exit_status)
    }

    pub async fn exec(
        &self,
        id: &str,
        exec_id: &str,
        process: &ProcessSpec,
        stdio: &Stdio,
    ) -> Result<()> {
        let spec = process
            .clone()
            .terminal(stdio.terminal())
            .to_oci(&self.image.env, &self.image.cwd);
        self.tasks()
            .exec(self.req(ExecProcessRequest {
                container_id: id.into(),
                stdin: stdio.stdin_path(),
                stdout: stdio.stdout_path(),
                stderr: stdio.stderr_path(),
                terminal: stdio.terminal(),
                spec: Some(Any {
                    type_url: PROCESS_TYPE_URL.into(),
                    value: serde_json::to_vec(&spec).expect("process serializes"),
                }),
                exec_id: exec_id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Exec", s))?;
        Ok(())
    }

    pub async fn delete_process(&self, id: &str, exec_id: &str) -> Result<u32> {
        let resp = self
            .tasks()
            .delete_process(self.req(DeleteProcessRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.DeleteProcess", s))?;
        Ok(resp.into_inner().exit_status)
    }

    pub async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        self.tasks()
            .close_io(self.req(CloseIoRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
                stdin: true,
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.CloseIO", s))?;
        Ok(())
    }

    pub async fn pause(&self, id: &str) -> Result<()> {
        self.tasks()
            .pause(self.req(PauseTaskRequest {
                container_id: id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Pause", s))?;
        Ok(())
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        self.tasks()
            .resume(self.req(ResumeTaskRequest {
                container_id: id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Resume", s))?;
        Ok(())
    }

    /// Tasks.Get: status and pid of the init process or an exec.
    pub async fn status(&self, id: &str, exec_id: &str) -> Result<(TaskStatus, u32)> {
        let resp = self
            .tasks()
            .get(self.req(GetRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Get", s))?;
        let p = resp
            .into_inner()
            .process
            .ok_or_else(|| Error::Protocol("Tasks.Get returned no process".into()))?;
        Ok((p.status.into(), p.pid))
    }

    /// Polls Tasks.Get until the status is `want`.
    pub async fn wait_status(&self, id: &str, want: TaskStatus, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let last = self.status(id, "").await;
            if matches!(last, Ok((s, _)) if s == want) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("task {id} to be {want:?} (last: {last:?})"),
                    after: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The whole lifecycle of a short-lived container: create, start, wait, collect output,
    /// delete task and container.
    pub async fn run_to_exit(&self, id: &str, process: &ProcessSpec) -> Result<RunOutput> {
        self.create_container(id, process).await?;
        let result = async {
            let mut io = self.stdio(id, "init", StdioOptions::default())?;
            self.create_task(id, Some(&io)).await?;
            self.start(id, "").await?;
            let exit_status = self.wait(id, "", STEP_TIMEOUT).await?;
            let stdout = io.stdout_string(STEP_TIMEOUT)?;
            let stderr = io.stderr_string(STEP_TIMEOUT)?;
            let deleted = self.delete_task(id).await?;
            if deleted != exit_status {
                return Err(Error::Protocol(format!(
                    "Tasks.Delete reported exit {deleted}, Tasks.Wait {exit_status}"
                )));
            }
            Ok(RunOutput {
                exit_status,
                stdout,
                stderr,
            })
        }
        .await;
        if result.is_err() {
            let _ = self.delete_task(id).await;
        }
        let deleted = self.delete_container(id).await;
        let out = result?;
        deleted?;
        Ok(out)
    }

    /// Creates and starts a container whose stdio is /dev/null; returns the init pid.
    pub async fn start_detached(&self, id: &str, process: &ProcessSpec) -> Result<u32> {
        self.create_container(id, process).await?;
        self.create_task(id, None).await?;
        self.start(id, "").await
    }

    /// Kills (SIGKILL, all processes) and deletes the task, then deletes the container; for
    /// the end of a test whose container is still running. Returns the task's exit status.
    pub async fn kill_and_remove(&self, id: &str) -> Result<u32> {
        self.kill(id, "", libc::SIGKILL, true).await?;
        let status = self.wait(id, "", STEP_TIMEOUT).await?;
        self.delete_task(id).await?;
        self.delete_container(id).await?;
        Ok(status)
    }

    /// Starts collecting `/tasks/exit` events of this namespace. Returns once the subscription
    /// is live: containerd sends a stream's headers only with its first event, so we publish
    /// probe events on a topic of our own until one comes back through the subscription.
    pub async fn task_exits(&self) -> Result<ExitEvents> {
        static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let probe_topic = format!(
            "/crab-integration/probe/{}/{}",
            std::process::id(),
            PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut events = EventsClient::new(self.channel.clone());
        let req = self.req(SubscribeRequest {
            filters: vec![
                format!("topic==\"/tasks/exit\",namespace=={}", self.env.namespace),
                format!("topic==\"{probe_topic}\""),
            ],
        });
        let probe = probe_topic.clone();
        tokio::spawn(async move {
            let Ok(resp) = events.subscribe(req).await else {
                return;
            };
            let mut stream = resp.into_inner();
            while let Ok(Some(env)) = stream.message().await {
                if env.topic == probe {
                    let _ = ready_tx.send(());
                    continue;
                }
                let Some(any) = env.event else { continue };
                if let Ok(exit) = TaskExit::decode(any.value.as_slice()) {
                    if tx.send(exit).is_err() {
                        return;
                    }
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            EventsClient::new(self.channel.clone())
                .publish(self.req(PublishRequest {
                    topic: probe_topic.clone(),
                    event: Some(containerd_client::to_any(&TaskExit::default())),
                }))
                .await
                .map_err(|s| Error::grpc("Events.Publish", s))?;
            match tokio::time::timeout(Duration::from_millis(50), ready_rx.recv()).await {
                Ok(Some(())) => return Ok(ExitEvents { rx }),
                Ok(None) => return Err(Error::Protocol("event subscription failed".into())),
                Err(_) if Instant::now() < deadline => continue,
                Err(_) => {
                    return Err(Error::Timeout {
                        what: "the event subscription to deliver a probe event".into(),
                        after: Duration::from_secs(10),
                    })
                }
            }
        }
    }

    /// Every namespace of this containerd with its containers and tasks, for global leak checks.
    pub async fn inventory(&self) -> Result<Vec<NamespaceInventory>> {
        let namespaces = NamespacesClient::new(self.channel.clone())
            .list(ListNamespacesRequest::default())
            .await
            .map_err(|s| Error::grpc("Namespaces.List", s))?
            .into_inner()
            .namespaces;
        let mut out = Vec::new();
        for ns in namespaces {
            let containers = self
                .containers()
                .list(with_namespace!(
                    ListContainersRequest::default(),
                    ns.name.as_str()
                ))
                .await
                .map_err(|s| Error::grpc("Containers.List", s))?
                .into_inner()
                .containers
                .into_iter()
                .map(|c| c.id)
                .collect();
            let tasks = self
                .tasks()
                .list(with_namespace!(
                    ListTasksRequest::default(),
                    ns.name.as_str()
                ))
                .await
                .map_err(|s| Error::grpc("Tasks.List", s))?
                .into_inner()
                .tasks
                .into_iter()
                .map(|t| (t.id, TaskStatus::from(t.status)))
                .collect();
            out.push(NamespaceInventory {
                name: ns.name,
                containers,
                tasks,
            });
        }
        Ok(out)
    }

    /// Whether containerd still knows container `id` (record or task).
    async fn containerd_leftovers(&self, id: &str) -> Vec<String> {
        let mut l = Vec::new();
        if self
            .containers()
            .get(self.req(GetContainerRequest { id: id.into() }))
            .await
            .is_ok()
        {
            l.push(format!("containerd still has container {id}"));
        }
        if let Ok((s, pid)) = self.status(id, "").await {
            l.push(format!("containerd still has task {id} ({s:?}, pid {pid})"));
        }
        if self
            .snapshots()
            .stat(self.req(StatSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: id.into(),
            }))
            .await
            .is_ok()
        {
            l.push(format!("snapshot {id} still exists"));
        }
        l
    }

    /// Everything container `id` left behind, after giving asynchronous teardown (shim exit,
    /// cgroup removal) a few seconds. Empty means clean.
    pub async fn leaks(&self, id: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let l = self.leaks_now(id).await;
            if l.is_empty() || Instant::now() >= deadline {
                return l;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What container `id` has in containerd and on the host right now.
    pub async fn leaks_now(&self, id: &str) -> Vec<String> {
        let mut l = self.containerd_leftovers(id).await;
        l.extend(host::leaks(&self.env, id));
        l
    }

    /// Panics listing every leak of `id`, with the containerd log lines that mention it.
    pub async fn assert_no_leaks(&self, id: &str) {
        let l = self.leaks(id).await;
        assert!(
            l.is_empty(),
            "container {id} ({}) leaked:\n  {}\n{}",
            self.env.runtime,
            l.join("\n  "),
            self.log_excerpt(id)
        );
    }

    /// The last containerd log lines mentioning `needle` (shim stderr lands there too).
    pub fn log_excerpt(&self, needle: &str) -> String {
        log_excerpt(&self.env, needle, 30)
    }
}

/// `/tasks/exit` events, see [`Harness::task_exits`].
pub struct ExitEvents {
    rx: tokio::sync::mpsc::UnboundedReceiver<TaskExit>,
}

impl ExitEvents {
    /// The next exit event of container `id`'s init process (`exec_id` "") or of an exec.
    pub async fn next_for(
        &mut self,
        id: &str,
        exec_id: &str,
        timeout: Duration,
    ) -> Result<TaskExit> {
        let want_id = if exec_id.is_empty() { id } else { exec_id };
        let found = tokio::time::timeout(timeout, async {
            while let Some(e) = self.rx.recv().await {
                if e.container_id == id && e.id == want_id {
                    return Some(e);
                }
            }
            None
        })
        .await;
        match found {
            Ok(Some(e)) => Ok(e),
            Ok(None) => Err(Error::Protocol("event subscription ended".into())),
            Err(_) => Err(Error::Timeout {
                what: format!("a /tasks/exit event for {id}/{exec_id}"),
                after: timeout,
            }),
        }
    }
}

/// A gRPC channel to the containerd of `env` (its socket must exist; bounded to 5 s).
pub async fn connect_channel(env: &TestEnv) -> Result<Channel> {
    let unreachable = |reason: String| Error::Unreachable {
        address: env.address.clone(),
        reason,
    };
    if !env.address.exists() {
        return Err(unreachable("no socket at that path".into()));
    }
    tokio::time::timeout(
        Duration::from_secs(5),
        containerd_client::connect(&env.address),
    )
    .await
    .map_err(|_| unreachable("connect timed out after 5s".into()))?
    .map_err(|e| unreachable(format!("connect: {e}")))
}

/// containerd's log from byte `from` on, once `done` holds for it or `timeout` has passed (then
/// as it stands). A shim's log lines reach containerd's log through a pipe containerd copies on
/// its own time: a line the shim wrote before it answered (or before an exit) may land after
/// the caller has its answer.
pub async fn log_once(
    env: &TestEnv,
    from: u64,
    timeout: Duration,
    done: impl Fn(&str) -> bool,
) -> String {
    let deadline = std::time::Instant::now() + timeout;
    let mut log = env.containerd_log_since(from);
    while !done(&log) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        log = env.containerd_log_since(from);
    }
    log
}

/// Last `n` lines of containerd's log that mention `needle`, for failure messages.
pub fn log_excerpt(env: &TestEnv, needle: &str, n: usize) -> String {
    let path = env.containerd_log();
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().filter(|l| l.contains(needle)).collect();
            let tail = &lines[lines.len().saturating_sub(n)..];
            format!(
                "containerd log ({}) lines mentioning {needle}:\n{}",
                path.display(),
                tail.join("\n")
            )
        }
        Err(e) => format!("(containerd log {} unreadable: {e})", path.display()),
    }
}

pub fn unique_id(name: &str) -> String {
    let mut s = String::new();
    for c in name.chars() {
        let c = c.to_ascii_lowercase();
        if c.is_ascii_alphanumeric() {
            s.push(c);
        } else if !s.ends_with('-') && !s.is_empty() {
            s.push('-');
        }
    }
    let s = s.trim_end_matches('-');
    format!("it-{s}-{}", std::process::id())
}

/// Removes whatever its container ids left in containerd, with `ctr` so it works from `Drop`
/// (no async) and even when the gRPC client is the thing that broke. Errors are ignored: most
/// steps find nothing to do after a clean test.
pub struct CleanupGuard {
    env: TestEnv,
    ids: Vec<String>,
}

impl CleanupGuard {
    pub fn add(&mut self, id: &str) {
        self.ids.push(id.to_string());
    }
}

impl Drop for CleanupGuard {
    fn drop(&mut self) {
        let ctr = Ctr::new(&self.env);
        let t = Duration::from_secs(15);
        for id in &self.ids {
            let present = ctr
                .run_with(&["containers", "info", id], None, t)
                .is_ok_and(|o| o.status.success());
            if present {
                // A frozen task cannot die, so thaw first.
                let _ = ctr.run_with(&["tasks", "resume", id], None, t);
                let _ = ctr.run_with(&["tasks", "rm", "-f", id], None, t);
                let _ = ctr.run_with(&["containers", "rm", id], None, t);
            }
            let _ = ctr.run_with(&["snapshots", "rm", id], None, t);
            let _ = std::fs::remove_dir_all(self.env.fifo_root().join(id));
        }
    }
}

async fn read_blob(channel: &Channel, env: &TestEnv, digest: &str) -> Result<Vec<u8>> {
    let mut stream = ContentClient::new(channel.clone())
        .read(with_namespace!(
            ReadContentRequest {
                digest: digest.into(),
                offset: 0,
                size: 0,
            },
            env.namespace.as_str()
        ))
        .await
        .map_err(|s| Error::grpc(format!("Content.Read {digest}"), s))?
        .into_inner();
    let mut data = Vec::new();
    while let Some(chunk) = stream
        .message()
        .await
        .map_err(|s| Error::grpc(format!("Content.Read {digest}"), s))?
    {
        data.extend_from_slice(&chunk.data);
    }
    Ok(data)
}

fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Image -> manifest (choosing this platform from an index) -> config: the rootfs chain id that
/// names the unpacked snapshot, and the config's Env and WorkingDir.
async fn resolve_image(channel: &Channel, env: &TestEnv) -> Result<ImageInfo> {
    let name = env.image.clone();
    let bad = |reason: String| Error::Image {
        image: name.clone(),
        reason,
    };
    let image = ImagesClient::new(channel.clone())
        .get(with_namespace!(
            GetImageRequest { name: name.clone() },
            env.namespace.as_str()
        ))
        .await
        .map_err(|s| {
            bad(format!(
                "not in namespace {}: {}",
                env.namespace,
                s.message()
            ))
        })?
        .into_inner()
        .image
        .and_then(|i| i.target)
        .ok_or_else(|| bad("no target descriptor".into()))?;
    let mut digest = image.digest;
    let mut media_type = image.media_type;
    let parse = |data: &[u8], what: &str| -> Result<Value> {
        serde_json::from_slice(data).map_err(|e| bad(format!("bad {what} JSON: {e}")))
    };
    let manifest = loop {
        let doc = parse(&read_blob(channel, env, &digest).await?, &media_type)?;
        let is_index = media_type.contains("image.index") || media_type.contains("manifest.list");
        if !is_index {
            break doc;
        }
        let manifests = doc["manifests"].as_array().cloned().unwrap_or_default();
        let pick = manifests
            .iter()
            .find(|m| m["platform"]["os"] == "linux" && m["platform"]["architecture"] == go_arch())
            .or_else(|| manifests.first())
            .ok_or_else(|| bad("empty index".into()))?;
        digest = pick["digest"].as_str().unwrap_or_default().to_string();
        media_type = pick["mediaType"].as_str().unwrap_or_default().to_string();
    };
    let config_digest = manifest["config"]["digest"]
        .as_str()
        .ok_or_else(|| bad("manifest without config".into()))?
        .to_string();
    let config = parse(&read_blob(channel, env, &config_digest).await?, "config")?;
    let diff_ids: Vec<String> = config["rootfs"]["diff_ids"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|d| d.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    let chain_id = chain_id(&diff_ids).ok_or_else(|| bad("image has no layers".into()))?;
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    Ok(ImageInfo {
        name: name.clone(),
        chain_id,
        env: strings(&config["config"]["Env"]),
        cwd: config["config"]["WorkingDir"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    })
}

/// OCI chain id: chain(0) = diff(0); chain(n) = sha256(chain(n-1) + " " + diff(n)).
pub fn chain_id(diff_ids: &[String]) -> Option<String> {
    let mut it = diff_ids.iter();
    let mut chain = it.next()?.clone();
    for d in it {
        let h = Sha256::digest(format!("{chain} {d}").as_bytes());
        chain = format!(
            "sha256:{}",
            h.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
    }
    Some(chain)
}

/// Now + `secs` as RFC 3339 UTC, for containerd's `gc.expire` lease label.
fn rfc3339_in(secs: u64) -> String {
    crab_shim::checkpoint::store::rfc3339(SystemTime::now() + Duration::from_secs(secs))
}

/// Path of this harness's FIFO dir for `id` (removed by the guard).
pub fn fifo_dir(env: &TestEnv, id: &str) -> PathBuf {
    env.fifo_root().join(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_id_of_one_layer_is_its_diff_id() {
        assert_eq!(
            chain_id(&["sha256:aa".into()]).as_deref(),
            Some("sha256:aa")
        );
        assert_eq!(chain_id(&[]), None);
    }

    #[test]
    fn chain_id_of_two_layers_hashes_parent_and_diff() {
        let c = chain_id(&["sha256:a".into(), "sha256:b".into()]).unwrap();
        let want = Sha256::digest(b"sha256:a sha256:b");
        assert_eq!(
            c,
            format!(
                "sha256:{}",
                want.iter().map(|b| format!("{b:02x}")).collect::<String>()
            )
        );
    }

    #[test]
    fn unique_ids_are_valid_containerd_ids() {
        let id = unique_id("Kill_all  children__");
        assert!(id.starts_with("it-kill-all-children-"), "{id}");
        assert!(!id.contains("--"));
    }

    #[tokio::test]
    async fn unreachable_containerd_fails_with_instructions() {
        let mut env = TestEnv::from_env();
        env.address = PathBuf::from("/nonexistent/containerd.sock");
        let err = Harness::connect_env(env)
            .await
            .err()
            .expect("must not connect");
        assert!(matches!(err, Error::Unreachable { .. }), "{err}");
        assert!(err.to_string().contains("make test"), "{err}");
    }

    #[test]
    fn rfc3339_has_the_right_shape() {
        // containerd parses gc.expire with Go's time.RFC3339, which takes the fraction.
        let s = rfc3339_in(0);
        assert_eq!(s.len(), 24, "{s}");
        assert!(s.ends_with('Z') && s.as_bytes()[10] == b'T');
    }
}

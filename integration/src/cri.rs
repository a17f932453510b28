//! A CRI client for tests that drive the private containerd the way the kubelet does: pods and
//! containers through the CRI plugin's RuntimeService, with a runtime handler per pod (`crab` or
//! `runc`), so the same test body can run on both and the outcomes be compared.
//!
//! Needs the private containerd started with `CRAB_CONTAINERD_CRI=1` and the test images imported
//! into the CRI's containerd namespace (`hack/build-images.sh import k8s.io`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use api::image_service_client::ImageServiceClient;
use api::runtime_service_client::RuntimeServiceClient;
use api::{
    ContainerConfig, ContainerMetadata, ContainerState, ContainerStatus, ContainerStatusRequest,
    CreateContainerRequest, ExecSyncRequest, ExecSyncResponse, ImageSpec, ImageStatusRequest,
    PodSandboxConfig, PodSandboxMetadata, RemoveContainerRequest, RemovePodSandboxRequest,
    RunPodSandboxRequest, StartContainerRequest, StopPodSandboxRequest,
};
pub use k8s_cri::v1 as api;
use tonic::transport::Channel;

use crate::{Error, Result, TestEnv};

/// The runtime handlers the CRI config of hack/containerd.sh defines: the stock runc shim as the
/// reference and crab.
pub const HANDLERS: [&str; 2] = ["runc", "crab"];
pub const BUSYBOX: &str = crate::env::BUSYBOX_IMAGE;
/// The containerd namespace the CRI plugin keeps its images and containers in.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// Kubernetes namespace written into pod metadata, so leftovers are recognisable.
pub const POD_NAMESPACE: &str = "crab-cri-test";
/// Upper bound for one CRI call; RunPodSandbox on a loaded 2-CPU box (CNI, pause image, a shim
/// start) can take several seconds, a hang must still fail well inside the suite's budget.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone)]
pub struct Cri {
    pub env: TestEnv,
    channel: Channel,
}

impl Cri {
    pub async fn connect() -> Result<Self> {
        let env = TestEnv::from_env();
        let address = env.address.clone();
        let unreachable = |reason: String| Error::Unreachable {
            address: address.clone(),
            reason,
        };
        let channel = crate::harness::connect_channel(&env).await?;
        let cri = Cri { env, channel };
        let version = tokio::time::timeout(
            Duration::from_secs(10),
            cri.runtime().version(api::VersionRequest::default()),
        )
        .await
        .map_err(|_| unreachable("CRI Version timed out after 10s".into()))?
        .map_err(|s| {
            unreachable(format!(
                "CRI Version: {}: {} (is the CRI plugin enabled? start containerd with \
                 CRAB_CONTAINERD_CRI=1)",
                s.code(),
                s.message()
            ))
        })?;
        log::debug!("CRI {:?}", version.into_inner());
        cri.check_image(BUSYBOX).await?;
        Ok(cri)
    }

    /// [`Cri::connect`] for tests: a failure panics with the reason and the fix.
    pub async fn for_test() -> Self {
        match Self::connect().await {
            Ok(c) => c,
            Err(e) => panic!("CRI test setup failed: {e}"),
        }
    }

    pub fn runtime(&self) -> RuntimeServiceClient<Channel> {
        RuntimeServiceClient::new(self.channel.clone())
    }

    pub fn images(&self) -> ImageServiceClient<Channel> {
        ImageServiceClient::new(self.channel.clone())
    }

    async fn check_image(&self, image: &str) -> Result<()> {
        let status = self
            .images()
            .image_status(ImageStatusRequest {
                image: Some(image_spec(image)),
                verbose: false,
            })
            .await
            .map_err(|s| Error::grpc(format!("ImageStatus {image}"), s))?
            .into_inner();
        if status.image.is_none() {
            return Err(Error::Image {
                image: image.into(),
                reason: format!(
                    "not in containerd namespace {CRI_NAMESPACE}; import it with \
                     `hack/build-images.sh import {CRI_NAMESPACE}`"
                ),
            });
        }
        Ok(())
    }

    /// Where containers of pod `pod_name` write their CRI log files.
    pub fn log_dir(&self, pod_name: &str) -> PathBuf {
        self.env
            .crab_home
            .join("tmp")
            .join("cri-logs")
            .join(pod_name)
    }

    /// A pod config with a unique name (from `name`), a log directory under CRAB_HOME and the
    /// kubelet's default namespaces.
    pub fn pod_config(&self, name: &str) -> PodSandboxConfig {
        let name = unique_name(name);
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.clone(),
                uid: format!("uid-{name}"),
                namespace: POD_NAMESPACE.into(),
                attempt: 0,
            }),
            hostname: "crab-pod".into(),
            log_directory: self.log_dir(&name).to_string_lossy().into_owned(),
            linux: Some(api::LinuxPodSandboxConfig {
                security_context: Some(api::LinuxSandboxSecurityContext {
                    namespace_options: Some(kubelet_namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// RunPodSandbox with `handler`; the pod is registered with `guard` before anything can fail
    /// after it exists.
    pub async fn run_pod(
        &self,
        guard: &mut PodGuard,
        handler: &str,
        config: &PodSandboxConfig,
    ) -> Result<String> {
        let dir = PathBuf::from(&config.log_directory);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        guard.log_dirs.push(dir);
        let id = timed(
            "RunPodSandbox",
            self.runtime().run_pod_sandbox(RunPodSandboxRequest {
                config: Some(config.clone()),
                runtime_handler: handler.into(),
            }),
        )
        .await?
        .pod_sandbox_id;
        guard.pods.push(id.clone());
        Ok(id)
    }

    pub async fn stop_pod(&self, id: &str) -> Result<()> {
        timed(
            "StopPodSandbox",
            self.runtime().stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: id.into(),
            }),
        )
        .await
        .map(drop)
    }

    pub async fn remove_pod(&self, id: &str) -> Result<()> {
        timed(
            "RemovePodSandbox",
            self.runtime().remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: id.into(),
            }),
        )
        .await
        .map(drop)
    }

    pub async fn pod_status(&self, id: &str) -> Result<api::PodSandboxStatus> {
        timed(
            "PodSandboxStatus",
            self.runtime()
                .pod_sandbox_status(api::PodSandboxStatusRequest {
                    pod_sandbox_id: id.into(),
                    verbose: false,
                }),
        )
        .await?
        .status
        .ok_or_else(|| Error::Protocol(format!("PodSandboxStatus {id}: no status")))
    }

    /// A busybox container config named `name` running `cmd`, logging to `<name>.log`, with the
    /// kubelet's default namespaces.
    pub fn container_config(name: &str, cmd: &[&str]) -> ContainerConfig {
        ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.into(),
                attempt: 0,
            }),
            image: Some(image_spec(BUSYBOX)),
            command: cmd.iter().map(|s| s.to_string()).collect(),
            log_path: format!("{name}.log"),
            linux: Some(api::LinuxContainerConfig {
                resources: None,
                security_context: Some(api::LinuxContainerSecurityContext {
                    namespace_options: Some(kubelet_namespaces()),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        }
    }

    pub async fn create_container(
        &self,
        pod_id: &str,
        pod: &PodSandboxConfig,
        config: ContainerConfig,
    ) -> Result<String> {
        Ok(timed(
            "CreateContainer",
            self.runtime().create_container(CreateContainerRequest {
                pod_sandbox_id: pod_id.into(),
                config: Some(config),
                sandbox_config: Some(pod.clone()),
            }),
        )
        .await?
        .container_id)
    }

    pub async fn start_container(&self, id: &str) -> Result<()> {
        timed(
            "StartContainer",
            self.runtime().start_container(StartContainerRequest {
                container_id: id.into(),
            }),
        )
        .await
        .map(drop)
    }

    /// Create + Start.
    pub async fn run_container(
        &self,
        pod_id: &str,
        pod: &PodSandboxConfig,
        config: ContainerConfig,
    ) -> Result<String> {
        let id = self.create_container(pod_id, pod, config).await?;
        self.start_container(&id).await?;
        Ok(id)
    }

    pub async fn stop_container(&self, id: &str, timeout_s: i64) -> Result<()> {
        timed(
            "StopContainer",
            self.runtime().stop_container(api::StopContainerRequest {
                container_id: id.into(),
                timeout: timeout_s,
            }),
        )
        .await
        .map(drop)
    }

    pub async fn remove_container(&self, id: &str) -> Result<()> {
        timed(
            "RemoveContainer",
            self.runtime().remove_container(RemoveContainerRequest {
                container_id: id.into(),
            }),
        )
        .await
        .map(drop)
    }

    pub async fn container_status(&self, id: &str) -> Result<ContainerStatus> {
        timed(
            "ContainerStatus",
            self.runtime().container_status(ContainerStatusRequest {
                container_id: id.into(),
                verbose: false,
            }),
        )
        .await?
        .status
        .ok_or_else(|| Error::Protocol(format!("ContainerStatus {id}: no status")))
    }

    /// The container's init pid (on the host), from the verbose ContainerStatus, as the
    /// kubelet's debug tools read it.
    pub async fn container_pid(&self, id: &str) -> Result<u32> {
        let info = timed(
            "ContainerStatus",
            self.runtime().container_status(ContainerStatusRequest {
                container_id: id.into(),
                verbose: true,
            }),
        )
        .await?
        .info;
        let json: serde_json::Value = info
            .get("info")
            .and_then(|i| serde_json::from_str(i).ok())
            .ok_or_else(|| Error::Protocol(format!("ContainerStatus {id}: no verbose info")))?;
        json["pid"]
            .as_u64()
            .and_then(|p| u32::try_from(p).ok())
            .filter(|p| *p > 0)
            .ok_or_else(|| Error::Protocol(format!("ContainerStatus {id}: no pid in {json}")))
    }

    /// Polls ContainerStatus until the container has exited.
    pub async fn wait_exited(&self, id: &str, within: Duration) -> Result<ContainerStatus> {
        let start = Instant::now();
        loop {
            let status = self.container_status(id).await?;
            if status.state == ContainerState::ContainerExited as i32 {
                return Ok(status);
            }
            if start.elapsed() > within {
                return Err(Error::Timeout {
                    what: format!("container {id} to exit (last status {status:?})"),
                    after: within,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// ExecSync with `timeout_s` (0: none). The CRI reports a timeout as a call error.
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: &[&str],
        timeout_s: i64,
    ) -> Result<ExecSyncResponse> {
        timed(
            "ExecSync",
            self.runtime().exec_sync(ExecSyncRequest {
                container_id: id.into(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                timeout: timeout_s,
            }),
        )
        .await
    }

    /// Ends turn `turn` of container `id` as an agent harness does under Kubernetes: containerd's
    /// `Tasks.Update` with the turn annotation, in the CRI's namespace.
    pub async fn end_turn(&self, id: &str, turn: &str) -> Result<()> {
        let mut env = self.env.clone();
        env.namespace = CRI_NAMESPACE.into();
        let tasks = crate::Harness::connect_env(env).await?;
        let annotation = (crate::sandbox::TURN_END.to_string(), turn.to_string());
        tasks
            .update(id, None, std::collections::HashMap::from([annotation]))
            .await
    }

    /// The KIND column of `crabctl checkpoints` for turn `turn` of `id` (None: no such line).
    pub fn checkpoint_kind(&self, id: &str, turn: &str) -> Option<String> {
        let (code, out, err) = self.crabctl(&["checkpoints", id]);
        assert_eq!(code, 0, "crabctl checkpoints {id}: {out}{err}");
        out.lines().find_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.len() > 3 && cols[2] == turn).then(|| cols[3].to_string())
        })
    }

    /// crabctl against the CRI's containerd namespace, as an operator runs it on the node: no
    /// `--config`, the CRI handlers' config in `$CRAB_CONFIG` (the handler `crab` is
    /// registered with runc's runtime type, whose options cannot name it; the shim gets the same
    /// variable from its wrapper): (exit code, stdout, stderr).
    pub fn crabctl(&self, args: &[&str]) -> (i32, String, String) {
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/crabctl");
        let out = std::process::Command::new(&bin)
            .env(crab_runtime_config::CONFIG_ENV, &self.env.cri_config)
            .arg("--address")
            .arg(&self.env.address)
            .args(["--namespace", CRI_NAMESPACE])
            .args(args)
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {} (build it with `cargo build --release`): {e}",
                    bin.display()
                )
            });
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (
            out.status.code().unwrap_or(-1),
            text(&out.stdout),
            text(&out.stderr),
        )
    }

    /// `sh -c script` in the container; stdout when it exits 0, else an error with all output.
    pub async fn sh(&self, id: &str, script: &str) -> Result<String> {
        let r = self.exec_sync(id, &["sh", "-c", script], 30).await?;
        if r.exit_code != 0 {
            return Err(Error::Command {
                command: script.into(),
                detail: format!(
                    "exit code {}, stdout {:?}, stderr {:?}",
                    r.exit_code,
                    String::from_utf8_lossy(&r.stdout),
                    String::from_utf8_lossy(&r.stderr)
                ),
            });
        }
        Ok(String::from_utf8_lossy(&r.stdout).into_owned())
    }

    /// Polls `sh -c script` until it exits 0 (a service inside the container coming up).
    pub async fn sh_until_ok(&self, id: &str, script: &str, within: Duration) -> Result<String> {
        let start = Instant::now();
        loop {
            match self.sh(id, script).await {
                Ok(out) => return Ok(out),
                Err(e) if start.elapsed() > within => {
                    return Err(Error::Timeout {
                        what: format!("`{script}` to succeed (last: {e})"),
                        after: within,
                    })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }
}

/// A CRI log file split into its records: (stream, tag, line), checking that each record starts
/// with an RFC 3339 timestamp.
pub fn parse_cri_log(text: &str) -> Result<Vec<(String, String, String)>> {
    text.lines()
        .map(|line| {
            let mut parts = line.splitn(4, ' ');
            let (Some(ts), Some(stream), Some(tag)) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(Error::Protocol(format!(
                    "CRI log line {line:?}: too few fields"
                )));
            };
            let looks_rfc3339 = ts.len() >= 20
                && ts.as_bytes()[4] == b'-'
                && ts.as_bytes()[10] == b'T'
                && (ts.ends_with('Z') || ts[19..].contains(['+', '-']));
            if !looks_rfc3339 {
                return Err(Error::Protocol(format!(
                    "CRI log line {line:?}: {ts:?} is not an RFC 3339 time"
                )));
            }
            Ok((
                stream.to_string(),
                tag.to_string(),
                parts.next().unwrap_or("").to_string(),
            ))
        })
        .collect()
}

/// Polls a CRI log file until `done` accepts its records.
pub async fn wait_log(
    path: &Path,
    within: Duration,
    done: impl Fn(&[(String, String, String)]) -> bool,
) -> Result<Vec<(String, String, String)>> {
    let start = Instant::now();
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let records = parse_cri_log(&text)?;
        if done(&records) {
            return Ok(records);
        }
        if start.elapsed() > within {
            return Err(Error::Timeout {
                what: format!("log {} to be complete (have {text:?})", path.display()),
                after: within,
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the kubelet asks for a pod that shares nothing with the host and does not share its
/// process namespace: network and IPC per pod, PID per container. (The CRI's zero value would
/// put every container in the pause process's PID namespace.)
pub fn kubelet_namespaces() -> api::NamespaceOption {
    api::NamespaceOption {
        network: api::NamespaceMode::Pod as i32,
        pid: api::NamespaceMode::Container as i32,
        ipc: api::NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

pub fn image_spec(image: &str) -> ImageSpec {
    ImageSpec {
        image: image.into(),
        ..Default::default()
    }
}

/// `crab-<name>-<pid>-<n>`: unique within the test process and across test processes, as the
/// CRI refuses a second pod or container with the same metadata.
pub fn unique_name(name: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!("crab-{name}-{}-{n}", std::process::id())
}

async fn timed<T>(
    op: &str,
    call: impl std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(Error::grpc(op, s)),
        Err(_) => Err(Error::Timeout {
            what: op.into(),
            after: CALL_TIMEOUT,
        }),
    }
}

/// Stops and removes the pods (and so their containers) a test made when dropped, also when the
/// test panics. Drop runs inside the test's tokio runtime, which must not be blocked on, so the
/// cleanup gets a thread with its own runtime.
#[derive(Default)]
pub struct PodGuard {
    pods: Vec<String>,
    log_dirs: Vec<PathBuf>,
}

impl PodGuard {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Drop for PodGuard {
    fn drop(&mut self) {
        let pods = std::mem::take(&mut self.pods);
        let dirs = std::mem::take(&mut self.log_dirs);
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for CRI cleanup");
            rt.block_on(async {
                let Ok(cri) = Cri::connect().await else {
                    eprintln!("CRI cleanup: containerd unreachable; pods {pods:?} remain");
                    return;
                };
                for pod in &pods {
                    // Stop first: RemovePodSandbox refuses a running pod in some versions.
                    let stopped = cri.stop_pod(pod).await;
                    if let Err(e) = stopped.and(cri.remove_pod(pod).await) {
                        if e.grpc_code() != Some(tonic::Code::NotFound) {
                            eprintln!("CRI cleanup of pod {pod}: {e}");
                        }
                    }
                }
            });
            for dir in dirs {
                let _ = std::fs::remove_dir_all(dir);
            }
        });
        let _ = cleanup.join();
    }
}

/// The CRI streaming server's websocket protocol (Exec, Attach, PortForward), enough for tests:
/// the kubelet's streaming server accepts websockets next to SPDY, and a websocket client is a
/// page of code where SPDY would need a framing library.
///
/// Every message is `[channel byte] + payload`. remotecommand channels: 0 stdin, 1 stdout,
/// 2 stderr, 3 error (with `v4.channel.k8s.io` a JSON `Status` carrying the exit code),
/// 4 resize. Port forward: per port a data channel (2n) and an error channel (2n+1), each opened
/// by the server with the port number (u16, little endian).
pub mod ws {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use crate::{Error, Result};

    pub const STDIN: u8 = 0;
    pub const STDOUT: u8 = 1;
    pub const STDERR: u8 = 2;
    pub const ERROR: u8 = 3;
    pub const V4: &str = "v4.channel.k8s.io";
    pub const V1: &str = "channel.k8s.io";

    pub struct Conn {
        stream: TcpStream,
        /// Bytes read past the handshake or a frame.
        buf: Vec<u8>,
        /// The subprotocol the server chose.
        pub protocol: String,
    }

    /// Opens `url` (`http://host:port/path`, as the CRI returns it) offering `protocols`.
    pub async fn connect(url: &str, protocols: &[&str]) -> Result<Conn> {
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| Error::Protocol(format!("streaming URL {url:?} is not http://")))?;
        let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let path = if path.is_empty() { "/" } else { path };
        let mut stream = TcpStream::connect(host)
            .await
            .map_err(|e| Error::io(format!("connect to streaming server {host}"), e))?;
        // The key is not secret; the server only echoes a hash of it.
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: Y3JhYi1jcmktdGVzdHMtMQ==\r\nSec-WebSocket-Version: 13\r\n\
             Sec-WebSocket-Protocol: {}\r\nOrigin: http://{host}\r\n\r\n",
            protocols.join(", ")
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| Error::io("websocket handshake", e))?;
        let mut buf = Vec::new();
        let end = loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            let mut chunk = [0u8; 4096];
            let n = stream
                .read(&mut chunk)
                .await
                .map_err(|e| Error::io("websocket handshake", e))?;
            if n == 0 {
                return Err(Error::Protocol(format!(
                    "streaming server closed during the handshake: {:?}",
                    String::from_utf8_lossy(&buf)
                )));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        if !head.starts_with("HTTP/1.1 101") {
            let mut body = [0u8; 4096];
            let n = tokio::time::timeout(std::time::Duration::from_secs(2), stream.read(&mut body))
                .await
                .ok()
                .and_then(|r| r.ok())
                .unwrap_or(0);
            return Err(Error::Protocol(format!(
                "websocket upgrade of {url} refused: {head}{}",
                String::from_utf8_lossy(&body[..n])
            )));
        }
        let protocol = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("sec-websocket-protocol")
                    .then(|| v.trim().to_string())
            })
            .unwrap_or_default();
        Ok(Conn {
            stream,
            buf: buf[end..].to_vec(),
            protocol,
        })
    }

    impl Conn {
        /// Sends `data` on `channel` as one binary frame (masked, as a client must).
        pub async fn send(&mut self, channel: u8, data: &[u8]) -> Result<()> {
            let mut payload = Vec::with_capacity(data.len() + 1);
            payload.push(channel);
            payload.extend_from_slice(data);
            self.send_frame(0x2, &payload).await
        }

        /// Sends a close frame; the server then ends the connection.
        pub async fn close(&mut self) -> Result<()> {
            self.send_frame(0x8, &1000u16.to_be_bytes()).await
        }

        async fn send_frame(&mut self, opcode: u8, payload: &[u8]) -> Result<()> {
            let mut frame = vec![0x80 | opcode];
            let len = payload.len();
            if len < 126 {
                frame.push(0x80 | len as u8);
            } else if len <= u16::MAX as usize {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&(len as u16).to_be_bytes());
            } else {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(len as u64).to_be_bytes());
            }
            let mask = [0x63, 0x72, 0x61, 0x62];
            frame.extend_from_slice(&mask);
            frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
            self.stream
                .write_all(&frame)
                .await
                .map_err(|e| Error::io("websocket send", e))
        }

        async fn fill(&mut self, n: usize) -> Result<bool> {
            while self.buf.len() < n {
                let mut chunk = [0u8; 16384];
                let got = self
                    .stream
                    .read(&mut chunk)
                    .await
                    .map_err(|e| Error::io("websocket receive", e))?;
                if got == 0 {
                    return Ok(false);
                }
                self.buf.extend_from_slice(&chunk[..got]);
            }
            Ok(true)
        }

        /// The next message as (channel, payload); None once the server closed. Messages that
        /// only carry a channel byte (the server opening a channel) come back with an empty
        /// payload.
        pub async fn recv(&mut self) -> Result<Option<(u8, Vec<u8>)>> {
            let mut message = Vec::new();
            loop {
                if !self.fill(2).await? {
                    return Ok(None);
                }
                let (fin, opcode) = (self.buf[0] & 0x80 != 0, self.buf[0] & 0x0f);
                let masked = self.buf[1] & 0x80 != 0;
                let (len, mut at) = match self.buf[1] & 0x7f {
                    126 => {
                        if !self.fill(4).await? {
                            return Ok(None);
                        }
                        (u16::from_be_bytes([self.buf[2], self.buf[3]]) as usize, 4)
                    }
                    127 => {
                        if !self.fill(10).await? {
                            return Ok(None);
                        }
                        let b: [u8; 8] = self.buf[2..10].try_into().expect("8 bytes");
                        (u64::from_be_bytes(b) as usize, 10)
                    }
                    n => (n as usize, 2),
                };
                let mask = if masked {
                    if !self.fill(at + 4).await? {
                        return Ok(None);
                    }
                    at += 4;
                    Some([
                        self.buf[at - 4],
                        self.buf[at - 3],
                        self.buf[at - 2],
                        self.buf[at - 1],
                    ])
                } else {
                    None
                };
                if !self.fill(at + len).await? {
                    return Ok(None);
                }
                let mut payload: Vec<u8> = self.buf.drain(..at + len).skip(at).collect();
                if let Some(m) = mask {
                    payload
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, b)| *b ^= m[i % 4]);
                }
                match opcode {
                    0x8 => return Ok(None),
                    0x9 => self.send_frame(0xa, &payload).await?,
                    0xa => {}
                    _ => {
                        message.extend_from_slice(&payload);
                        if fin {
                            if message.is_empty() {
                                continue;
                            }
                            let channel = message.remove(0);
                            return Ok(Some((channel, message)));
                        }
                    }
                }
            }
        }
    }

    /// What a remotecommand stream (Exec, Attach) produced until the server closed it.
    #[derive(Debug, Clone, Default, PartialEq, Eq)]
    pub struct Output {
        pub stdout: String,
        pub stderr: String,
        /// The error channel's content: empty, or with v4 a JSON Status.
        pub error: String,
    }

    impl Output {
        /// The exit code from the v4 error channel: 0 for `Success`, the `ExitCode` cause of a
        /// `NonZeroExitCode` failure, None when the channel says something else.
        pub fn exit_code(&self) -> Option<i32> {
            if self.error.is_empty() {
                return None;
            }
            let status: serde_json::Value = serde_json::from_str(&self.error).ok()?;
            if status["status"] == "Success" {
                return Some(0);
            }
            status["details"]["causes"]
                .as_array()?
                .iter()
                .find(|c| c["reason"] == "ExitCode")?["message"]
                .as_str()?
                .parse()
                .ok()
        }
    }

    /// Reads stdout, stderr and the error channel until the server closes the stream.
    pub async fn collect(conn: &mut Conn) -> Result<Output> {
        let mut out = Output::default();
        while let Some((channel, data)) = conn.recv().await? {
            let text = String::from_utf8_lossy(&data);
            match channel {
                STDOUT => out.stdout.push_str(&text),
                STDERR => out.stderr.push_str(&text),
                ERROR => out.error.push_str(&text),
                _ => {}
            }
        }
        Ok(out)
    }
}

/// For tests that run one body on every handler ([`HANDLERS`], runc first as the reference) and
/// compare what each observed.
pub mod both {
    use std::fmt::Debug;
    use std::future::Future;

    use super::{api, ws, Cri, PodGuard, HANDLERS};

    /// Runs `body` for each handler, each in its own task so that one handler's failure still lets
    /// the other run and both outcomes are reported together. Returns (handler, result) pairs.
    pub async fn for_both_handlers<T, F, Fut>(body: F) -> Vec<(&'static str, T)>
    where
        F: Fn(Cri, &'static str) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let cri = Cri::for_test().await;
        let mut results = Vec::new();
        let mut failures = Vec::new();
        for handler in HANDLERS {
            match tokio::spawn(body(cri.clone(), handler)).await {
                Ok(r) => results.push((handler, r)),
                Err(e) => {
                    let why = match e.try_into_panic() {
                        Ok(p) => p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "panic".into()),
                        Err(e) => e.to_string(),
                    };
                    failures.push(format!("handler {handler}: {why}"));
                }
            }
        }
        assert!(failures.is_empty(), "failed:\n{}", failures.join("\n"));
        results
    }

    /// Both handlers observed the same `what`.
    pub fn assert_same<T: Debug + PartialEq>(what: &str, results: &[(&str, T)]) {
        let (reference, expected) = &results[0];
        for (handler, got) in &results[1..] {
            assert_eq!(
                got, expected,
                "{what}: handler {handler} differs from {reference} (left: {handler}, right: {reference})"
            );
        }
    }

    /// Runs a pod for `handler` with `edit` applied to the default config.
    pub async fn pod(
        cri: &Cri,
        guard: &mut PodGuard,
        handler: &str,
        name: &str,
        edit: impl FnOnce(&mut api::PodSandboxConfig),
    ) -> (String, api::PodSandboxConfig) {
        let mut config = cri.pod_config(&format!("{name}-{handler}"));
        edit(&mut config);
        let id = cri
            .run_pod(guard, handler, &config)
            .await
            .unwrap_or_else(|e| panic!("handler {handler}: RunPodSandbox {name}: {e}"));
        (id, config)
    }

    /// Creates and starts a busybox container running `cmd` with `edit` applied to its config.
    pub async fn container(
        cri: &Cri,
        pod: &(String, api::PodSandboxConfig),
        name: &str,
        cmd: &[&str],
        edit: impl FnOnce(&mut api::ContainerConfig),
    ) -> String {
        let mut config = Cri::container_config(name, cmd);
        edit(&mut config);
        cri.run_container(&pod.0, &pod.1, config)
            .await
            .unwrap_or_else(|e| panic!("pod {}: create/start container {name}: {e}", pod.0))
    }

    pub fn linux_sc(c: &mut api::ContainerConfig) -> &mut api::LinuxContainerSecurityContext {
        c.linux
            .get_or_insert_with(Default::default)
            .security_context
            .get_or_insert_with(Default::default)
    }

    pub fn pod_sc(p: &mut api::PodSandboxConfig) -> &mut api::LinuxSandboxSecurityContext {
        p.linux
            .get_or_insert_with(Default::default)
            .security_context
            .get_or_insert_with(Default::default)
    }

    /// `sh -c script` in `id`, stdout trimmed; panics with the handler and the output otherwise.
    pub async fn sh(cri: &Cri, handler: &str, id: &str, script: &str) -> String {
        cri.sh(id, script)
            .await
            .unwrap_or_else(|e| panic!("handler {handler}: in container {id}: {e}"))
            .trim()
            .to_string()
    }

    pub fn state_name(state: i32) -> &'static str {
        api::ContainerState::try_from(state)
            .map(|s| s.as_str_name())
            .unwrap_or("invalid")
    }

    /// Opens a streaming URL the CRI handed out; the server must speak `v4.channel.k8s.io`
    /// (exit codes on the error channel).
    pub async fn open_stream(h: &str, url: &str) -> ws::Conn {
        let conn = ws::connect(url, &[ws::V4, ws::V1])
            .await
            .unwrap_or_else(|e| panic!("handler {h}: streaming {url}: {e}"));
        assert_eq!(conn.protocol, ws::V4, "handler {h}: negotiated subprotocol");
        conn
    }

    /// Attach to `id`'s stdin and output (stderr too without a TTY).
    pub async fn attach_stream(cri: &Cri, h: &str, id: &str, tty: bool) -> ws::Conn {
        let url = cri
            .runtime()
            .attach(api::AttachRequest {
                container_id: id.into(),
                stdin: true,
                tty,
                stdout: true,
                stderr: !tty,
            })
            .await
            .unwrap_or_else(|e| panic!("handler {h}: Attach: {e}"))
            .into_inner()
            .url;
        open_stream(h, &url).await
    }

    /// PortForward to `port` of pod `pod_id`. The websocket flavour takes its ports from the
    /// query; the CRI's cached request has them too, so that only matters to servers that read
    /// the query.
    pub async fn port_forward_stream(cri: &Cri, h: &str, pod_id: &str, port: u16) -> ws::Conn {
        let url = cri
            .runtime()
            .port_forward(api::PortForwardRequest {
                pod_sandbox_id: pod_id.into(),
                port: vec![port.into()],
            })
            .await
            .unwrap_or_else(|e| panic!("handler {h}: PortForward: {e}"))
            .into_inner()
            .url;
        ws::connect(&format!("{url}?port={port}"), &[ws::V4])
            .await
            .unwrap_or_else(|e| panic!("handler {h}: port-forward stream: {e}"))
    }
}

//! The rest of the Task API as containerd exposes it (Update, Metrics, ListPids, ResizePty,
//! Checkpoint, Get of an exec), the shim's own `Connect` over ttrpc, and the protobuf messages
//! tests decode from `Any` payloads (cgroup metrics, runc process details, runtime options).
//!
//! containerd-client ships none of the cgroup, runc-options or shim-API protos, so the few
//! messages needed are declared here with the tags of their `.proto` files.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::{
    tasks_client::TasksClient, CheckpointTaskRequest, CheckpointTaskResponse, GetRequest,
    ListPidsRequest, MetricsRequest, ResizePtyRequest, UpdateTaskRequest,
};
use containerd_client::types::v1::Process;
use prost::Message;
use prost_types::Any;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::{Error, Harness, Result};

/// containerd's type URL for a JSON `LinuxResources` in Update.
pub const LINUX_RESOURCES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";
/// containerd's generic runtime options (what `ctr --runtime-config-path` and CRI send).
pub const RUNTIME_OPTIONS_TYPE_URL: &str = "runtimeoptions.v1.Options";
pub const CGROUPS_V1_METRICS_TYPE_URL: &str = "io.containerd.cgroups.v1.Metrics";
pub const CGROUPS_V2_METRICS_TYPE_URL: &str = "io.containerd.cgroups.v2.Metrics";
pub const PROCESS_DETAILS_TYPE_URL: &str = "containerd.runc.v1.ProcessDetails";

/// `runtimeoptions.v1.Options` (containerd api/types/runtimeoptions/v1/api.proto).
#[derive(Clone, PartialEq, Message)]
pub struct RuntimeOptionsProto {
    #[prost(string, tag = "1")]
    pub type_url: String,
    #[prost(string, tag = "2")]
    pub config_path: String,
    #[prost(string, tag = "3")]
    pub config_body: String,
}

/// The type URL of runc's options (`containerd.runc.v1.Options`), which crab also takes.
pub const RUNC_OPTIONS_TYPE_URL: &str = "containerd.runc.v1.Options";

/// `containerd.runc.v1.Options` (api/types/runc/options/oci.proto), the fields tests set.
#[derive(Clone, PartialEq, Message)]
pub struct RuncOptionsProto {
    #[prost(string, tag = "3")]
    pub shim_cgroup: String,
}

/// `Container.runtime.options` as runc's options with a `ShimCgroup`.
pub fn runc_options_with_shim_cgroup(shim_cgroup: &str) -> Any {
    Any {
        type_url: RUNC_OPTIONS_TYPE_URL.into(),
        value: RuncOptionsProto {
            shim_cgroup: shim_cgroup.into(),
        }
        .encode_to_vec(),
    }
}

/// `Container.runtime.options` pointing the crab shim at a config file and/or inline TOML.
pub fn crab_runtime_options(config_path: Option<&str>, config_body: Option<&str>) -> Any {
    let msg = RuntimeOptionsProto {
        type_url: String::new(),
        config_path: config_path.unwrap_or_default().to_string(),
        config_body: config_body.unwrap_or_default().to_string(),
    };
    Any {
        type_url: RUNTIME_OPTIONS_TYPE_URL.into(),
        value: msg.encode_to_vec(),
    }
}

/// A JSON `LinuxResources` for Update.
pub fn linux_resources(json: &Value) -> Any {
    linux_resources_raw(serde_json::to_vec(json).expect("resources serialize"))
}

/// Arbitrary bytes under the `LinuxResources` type URL, for malformed-input tests.
pub fn linux_resources_raw(bytes: Vec<u8>) -> Any {
    Any {
        type_url: LINUX_RESOURCES_TYPE_URL.into(),
        value: bytes,
    }
}

/// `containerd.runc.v1.ProcessDetails` (api/types/runc/options/oci.proto).
#[derive(Clone, PartialEq, Message)]
pub struct ProcessDetails {
    #[prost(string, tag = "1")]
    pub exec_id: String,
}

/// cgroups v1 `Metrics` (containerd/cgroups cgroup1/stats/metrics.proto), the fields tests read.
#[derive(Clone, PartialEq, Message)]
pub struct CgroupV1Metrics {
    #[prost(message, optional, tag = "2")]
    pub pids: Option<PidsStat>,
    #[prost(message, optional, tag = "3")]
    pub cpu: Option<CgroupV1CpuStat>,
    #[prost(message, optional, tag = "4")]
    pub memory: Option<CgroupV1MemoryStat>,
    #[prost(message, optional, tag = "9")]
    pub memory_oom_control: Option<MemoryOomControl>,
}

#[derive(Clone, PartialEq, Message)]
pub struct CgroupV1CpuStat {
    #[prost(message, optional, tag = "1")]
    pub usage: Option<CgroupV1CpuUsage>,
}

#[derive(Clone, PartialEq, Message)]
pub struct CgroupV1CpuUsage {
    /// Nanoseconds.
    #[prost(uint64, tag = "1")]
    pub total: u64,
}

#[derive(Clone, PartialEq, Message)]
pub struct PidsStat {
    #[prost(uint64, tag = "1")]
    pub current: u64,
    #[prost(uint64, tag = "2")]
    pub limit: u64,
}

#[derive(Clone, PartialEq, Message)]
pub struct CgroupV1MemoryStat {
    #[prost(uint64, tag = "1")]
    pub cache: u64,
    #[prost(uint64, tag = "2")]
    pub rss: u64,
    #[prost(uint64, tag = "19")]
    pub total_rss: u64,
    #[prost(message, optional, tag = "33")]
    pub usage: Option<MemoryEntry>,
    #[prost(message, optional, tag = "34")]
    pub swap: Option<MemoryEntry>,
}

#[derive(Clone, PartialEq, Message)]
pub struct MemoryEntry {
    #[prost(uint64, tag = "1")]
    pub limit: u64,
    #[prost(uint64, tag = "2")]
    pub usage: u64,
    #[prost(uint64, tag = "3")]
    pub max: u64,
    #[prost(uint64, tag = "4")]
    pub failcnt: u64,
}

#[derive(Clone, PartialEq, Message)]
pub struct MemoryOomControl {
    #[prost(uint64, tag = "1")]
    pub oom_kill_disable: u64,
    #[prost(uint64, tag = "2")]
    pub under_oom: u64,
    #[prost(uint64, tag = "3")]
    pub oom_kill: u64,
}

/// cgroups v2 `Metrics` (containerd/cgroups cgroup2/stats/metrics.proto), the fields tests read.
#[derive(Clone, PartialEq, Message)]
pub struct CgroupV2Metrics {
    #[prost(message, optional, tag = "1")]
    pub pids: Option<PidsStat>,
    #[prost(message, optional, tag = "2")]
    pub cpu: Option<CgroupV2CpuStat>,
    #[prost(message, optional, tag = "4")]
    pub memory: Option<CgroupV2MemoryStat>,
}

#[derive(Clone, PartialEq, Message)]
pub struct CgroupV2CpuStat {
    #[prost(uint64, tag = "1")]
    pub usage_usec: u64,
}

#[derive(Clone, PartialEq, Message)]
pub struct CgroupV2MemoryStat {
    #[prost(uint64, tag = "32")]
    pub usage: u64,
    #[prost(uint64, tag = "33")]
    pub usage_limit: u64,
}

/// Task metrics in a form independent of the cgroup version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStats {
    pub type_url: String,
    pub memory_usage: u64,
    pub memory_limit: u64,
    pub pids_current: u64,
    pub pids_limit: u64,
    /// CPU time used, in nanoseconds.
    pub cpu_usage_ns: u64,
}

impl TaskStats {
    /// Decodes the `Any` of a `Metric`: cgroups v1 or v2 metrics, by type URL.
    pub fn decode(any: &Any) -> Result<TaskStats> {
        let bad = |e: prost::DecodeError| Error::Protocol(format!("{}: {e}", any.type_url));
        let name = any.type_url.rsplit('/').next().unwrap_or_default();
        match name {
            CGROUPS_V1_METRICS_TYPE_URL => {
                let m = CgroupV1Metrics::decode(any.value.as_slice()).map_err(bad)?;
                let pids = m.pids.unwrap_or_default();
                let usage = m.memory.and_then(|m| m.usage).unwrap_or_default();
                let cpu = m.cpu.and_then(|c| c.usage).unwrap_or_default();
                Ok(TaskStats {
                    cpu_usage_ns: cpu.total,
                    type_url: any.type_url.clone(),
                    memory_usage: usage.usage,
                    memory_limit: usage.limit,
                    pids_current: pids.current,
                    pids_limit: pids.limit,
                })
            }
            CGROUPS_V2_METRICS_TYPE_URL => {
                let m = CgroupV2Metrics::decode(any.value.as_slice()).map_err(bad)?;
                let pids = m.pids.unwrap_or_default();
                let mem = m.memory.unwrap_or_default();
                let cpu = m.cpu.unwrap_or_default();
                Ok(TaskStats {
                    cpu_usage_ns: cpu.usage_usec * 1000,
                    type_url: any.type_url.clone(),
                    memory_usage: mem.usage,
                    memory_limit: mem.usage_limit,
                    pids_current: pids.current,
                    pids_limit: pids.limit,
                })
            }
            other => Err(Error::Protocol(format!(
                "metrics of unknown type {other:?} ({})",
                any.type_url
            ))),
        }
    }
}

/// A process of a task as ListPids reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PidInfo {
    pub pid: u32,
    /// The `Any` type URL of the process info, if any.
    pub info_type: Option<String>,
    /// The exec id from `ProcessDetails`, for processes the shim started as execs.
    pub exec_id: Option<String>,
}

/// `containerd.task.v2` Connect messages (api/runtime/task/v2/shim.proto).
#[derive(Clone, PartialEq, Message)]
pub struct ShimConnectRequest {
    #[prost(string, tag = "1")]
    pub id: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ShimConnectResponse {
    #[prost(uint32, tag = "1")]
    pub shim_pid: u32,
    #[prost(uint32, tag = "2")]
    pub task_pid: u32,
    #[prost(string, tag = "3")]
    pub version: String,
}

// ttrpc's framing (github.com/containerd/ttrpc): a 10-byte header (length u32 BE, stream id
// u32 BE, type u8, flags u8) then a protobuf Request or Response.
#[derive(Clone, PartialEq, Message)]
struct TtrpcRequest {
    #[prost(string, tag = "1")]
    service: String,
    #[prost(string, tag = "2")]
    method: String,
    #[prost(bytes = "vec", tag = "3")]
    payload: Vec<u8>,
    #[prost(int64, tag = "4")]
    timeout_nano: i64,
    #[prost(message, repeated, tag = "5")]
    metadata: Vec<TtrpcKeyValue>,
}

#[derive(Clone, PartialEq, Message)]
struct TtrpcKeyValue {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

#[derive(Clone, PartialEq, Message)]
struct TtrpcResponse {
    #[prost(message, optional, tag = "1")]
    status: Option<TtrpcStatus>,
    #[prost(bytes = "vec", tag = "2")]
    payload: Vec<u8>,
}

#[derive(Clone, PartialEq, Message)]
struct TtrpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
}

const TTRPC_REQUEST: u8 = 1;
const TTRPC_RESPONSE: u8 = 2;

/// One unary ttrpc call on a fresh connection to `socket`.
pub async fn ttrpc_call(
    socket: &Path,
    namespace: &str,
    service: &str,
    method: &str,
    payload: Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let what = format!("ttrpc {service}.{method} on {}", socket.display());
    let call = async {
        let mut s = UnixStream::connect(socket)
            .await
            .map_err(|e| Error::io(format!("connect {}", socket.display()), e))?;
        let req = TtrpcRequest {
            service: service.into(),
            method: method.into(),
            payload,
            timeout_nano: timeout.as_nanos() as i64,
            metadata: vec![TtrpcKeyValue {
                key: "containerd-namespace-ttrpc".into(),
                value: namespace.into(),
            }],
        }
        .encode_to_vec();
        let stream_id: u32 = 1;
        let mut frame = Vec::with_capacity(10 + req.len());
        frame.extend_from_slice(&(req.len() as u32).to_be_bytes());
        frame.extend_from_slice(&stream_id.to_be_bytes());
        frame.extend_from_slice(&[TTRPC_REQUEST, 0]);
        frame.extend_from_slice(&req);
        s.write_all(&frame)
            .await
            .map_err(|e| Error::io(what.clone(), e))?;
        loop {
            let mut header = [0u8; 10];
            s.read_exact(&mut header)
                .await
                .map_err(|e| Error::io(what.clone(), e))?;
            let len = u32::from_be_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
            let id = u32::from_be_bytes(header[4..8].try_into().expect("4 bytes"));
            let mut body = vec![0u8; len];
            s.read_exact(&mut body)
                .await
                .map_err(|e| Error::io(what.clone(), e))?;
            if id != stream_id || header[8] != TTRPC_RESPONSE {
                continue;
            }
            let resp = TtrpcResponse::decode(body.as_slice())
                .map_err(|e| Error::Protocol(format!("{what}: bad response: {e}")))?;
            return match resp.status {
                Some(st) if st.code != 0 => Err(Error::Grpc {
                    op: what.clone(),
                    code: tonic::Code::from_i32(st.code),
                    message: st.message,
                }),
                _ => Ok(resp.payload),
            };
        }
    };
    tokio::time::timeout(timeout, call)
        .await
        .map_err(|_| Error::Timeout {
            what: what.clone(),
            after: timeout,
        })?
}

impl Harness {
    fn tasks_client(&self) -> TasksClient<tonic::transport::Channel> {
        TasksClient::new(self.channel())
    }

    /// Tasks.Update with optional resources and annotations.
    pub async fn update(
        &self,
        id: &str,
        resources: Option<Any>,
        annotations: HashMap<String, String>,
    ) -> Result<()> {
        self.tasks_client()
            .update(self.request(UpdateTaskRequest {
                container_id: id.into(),
                resources,
                annotations,
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Update", s))?;
        Ok(())
    }

    /// Tasks.Metrics for task `id`, decoded.
    pub async fn stats(&self, id: &str) -> Result<TaskStats> {
        let metrics = self
            .tasks_client()
            .metrics(self.request(MetricsRequest {
                filters: vec![format!("id==\"{id}\"")],
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Metrics", s))?
            .into_inner()
            .metrics;
        let m = metrics
            .into_iter()
            .find(|m| m.id == id)
            .ok_or_else(|| Error::Protocol(format!("Tasks.Metrics returned nothing for {id}")))?;
        let data = m
            .data
            .ok_or_else(|| Error::Protocol(format!("Tasks.Metrics for {id}: no data")))?;
        TaskStats::decode(&data)
    }

    /// Tasks.ListPids, with each process's `ProcessDetails` decoded.
    pub async fn list_pids(&self, id: &str) -> Result<Vec<PidInfo>> {
        let processes = self
            .tasks_client()
            .list_pids(self.request(ListPidsRequest {
                container_id: id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.ListPids", s))?
            .into_inner()
            .processes;
        processes
            .into_iter()
            .map(|p| {
                let exec_id = match &p.info {
                    Some(any) if any.type_url.ends_with(PROCESS_DETAILS_TYPE_URL) => Some(
                        ProcessDetails::decode(any.value.as_slice())
                            .map_err(|e| Error::Protocol(format!("ProcessDetails: {e}")))?
                            .exec_id,
                    ),
                    _ => None,
                };
                Ok(PidInfo {
                    pid: p.pid,
                    info_type: p.info.map(|a| a.type_url),
                    exec_id,
                })
            })
            .collect()
    }

    pub async fn resize_pty(&self, id: &str, exec_id: &str, width: u32, height: u32) -> Result<()> {
        self.tasks_client()
            .resize_pty(self.request(ResizePtyRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
                width,
                height,
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.ResizePty", s))?;
        Ok(())
    }

    /// Tasks.Checkpoint without options (containerd picks a temporary image path).
    pub async fn checkpoint(&self, id: &str) -> Result<CheckpointTaskResponse> {
        Ok(self
            .tasks_client()
            .checkpoint(self.request(CheckpointTaskRequest {
                container_id: id.into(),
                parent_checkpoint: String::new(),
                options: None,
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Checkpoint", s))?
            .into_inner())
    }

    /// Tasks.Get: the whole process record of the init process or an exec.
    pub async fn process(&self, id: &str, exec_id: &str) -> Result<Process> {
        self.tasks_client()
            .get(self.request(GetRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
            }))
            .await
            .map_err(|s| Error::grpc("Tasks.Get", s))?
            .into_inner()
            .process
            .ok_or_else(|| Error::Protocol("Tasks.Get returned no process".into()))
    }

    /// The ttrpc socket of the shim serving task `id`, from the bundle's `bootstrap.json`
    /// (containerd 2.x) or `address` file (1.7).
    pub fn shim_socket(&self, id: &str) -> Result<PathBuf> {
        Ok(self.shim_endpoint(id)?.0)
    }

    /// The shim's socket and the version of the task API it serves (2 or 3; containerd 2.x's
    /// own shims speak `containerd.task.v3`, crab's framework `containerd.task.v2`).
    pub fn shim_endpoint(&self, id: &str) -> Result<(PathBuf, u64)> {
        let bundle = self.env.task_bundle(id);
        let bootstrap = bundle.join("bootstrap.json");
        let (address, version) = match std::fs::read(&bootstrap) {
            Ok(data) => {
                let v: Value = serde_json::from_slice(&data).map_err(|e| {
                    Error::Protocol(format!("{}: bad JSON: {e}", bootstrap.display()))
                })?;
                (
                    v["address"].as_str().unwrap_or_default().to_string(),
                    v["version"].as_u64().unwrap_or(2),
                )
            }
            Err(_) => {
                let f = bundle.join("address");
                let a = std::fs::read_to_string(&f)
                    .map_err(|e| Error::io(format!("read {}", f.display()), e))?;
                (a, 2)
            }
        };
        let address = address.trim();
        let path = address.strip_prefix("unix://").unwrap_or(address);
        if path.is_empty() {
            return Err(Error::Protocol(format!(
                "no shim address in {}",
                bundle.display()
            )));
        }
        Ok((PathBuf::from(path), version))
    }

    /// The shim's own `Connect` RPC (not exposed by containerd's API), over ttrpc.
    pub async fn shim_connect(&self, id: &str) -> Result<ShimConnectResponse> {
        let (socket, version) = self.shim_endpoint(id)?;
        let payload = ShimConnectRequest { id: id.into() }.encode_to_vec();
        let resp = ttrpc_call(
            &socket,
            &self.env.namespace,
            &format!("containerd.task.v{version}.Task"),
            "Connect",
            payload,
            Duration::from_secs(10),
        )
        .await?;
        ShimConnectResponse::decode(resp.as_slice())
            .map_err(|e| Error::Protocol(format!("ConnectResponse: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_options_encode_like_go() {
        // Options{config_path: "/etc/crab/config.toml"} as Go's proto.Marshal writes it.
        let any = crab_runtime_options(Some("/etc/crab/config.toml"), None);
        let mut want = vec![0x12, 0x15];
        want.extend_from_slice(b"/etc/crab/config.toml");
        assert_eq!(any.value, want);
        assert_eq!(any.type_url, RUNTIME_OPTIONS_TYPE_URL);
        let decoded = crab_runtime_config::decode_runtime_options(
            &crab_runtime_options(Some("/p"), Some("[log]\nlevel = \"warn\"\n")).value,
        )
        .unwrap();
        assert_eq!(decoded.config_path.as_deref(), Some(Path::new("/p")));
        assert_eq!(
            decoded.config_body.as_deref(),
            Some("[log]\nlevel = \"warn\"\n")
        );
    }

    #[test]
    fn v1_metrics_decode() {
        let m = CgroupV1Metrics {
            pids: Some(PidsStat {
                current: 3,
                limit: 50,
            }),
            memory: Some(CgroupV1MemoryStat {
                usage: Some(MemoryEntry {
                    usage: 4096,
                    limit: 1 << 30,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            memory_oom_control: None,
            cpu: Some(CgroupV1CpuStat {
                usage: Some(CgroupV1CpuUsage { total: 7 }),
            }),
        };
        let s = TaskStats::decode(&Any {
            type_url: CGROUPS_V1_METRICS_TYPE_URL.into(),
            value: m.encode_to_vec(),
        })
        .unwrap();
        assert_eq!(
            (
                s.memory_usage,
                s.memory_limit,
                s.pids_current,
                s.pids_limit,
                s.cpu_usage_ns
            ),
            (4096, 1 << 30, 3, 50, 7)
        );
    }
}

//! containerd's record of the snapshots a container runs on, asked over containerd's gRPC API
//! (the shim's `-address`): the [`SnapshotSource`] a restore checks a signed image's layers
//! with ([`crate::restore::layers`]). Protocol types stay here, at the edge.

use containerd_client::services::v1::{
    containers_client::ContainersClient,
    snapshots::{snapshots_client::SnapshotsClient, MountsRequest, StatSnapshotRequest},
    GetContainerRequest,
};
use tonic::Request;

use crate::restore::layers::{
    is_chain_id, EngineSnapshot, SnapshotError, SnapshotSource, CALL_TIMEOUT, MAX_DEPTH,
};

/// containerd at `address`.
pub struct ContainerdSnapshots {
    address: String,
}

impl ContainerdSnapshots {
    pub fn new(address: String) -> ContainerdSnapshots {
        ContainerdSnapshots { address }
    }
}

fn request<T>(namespace: &str, msg: T) -> Request<T> {
    let mut r = Request::new(msg);
    if let Ok(ns) = namespace.parse() {
        r.metadata_mut().insert("containerd-namespace", ns);
    }
    r.set_timeout(CALL_TIMEOUT);
    r
}

#[async_trait::async_trait]
impl SnapshotSource for ContainerdSnapshots {
    async fn snapshot(
        &self,
        namespace: &str,
        id: &str,
        fallback: Option<(String, String)>,
    ) -> Result<EngineSnapshot, SnapshotError> {
        let address = &self.address;
        let channel = tokio::time::timeout(CALL_TIMEOUT, containerd_client::connect(address))
            .await
            .map_err(|_| SnapshotError::NoAnswer(address.clone()))?
            .map_err(|e| SnapshotError::Unreachable {
                address: address.clone(),
                source: e.into(),
            })?;
        let container = ContainersClient::new(channel.clone())
            .get(request(
                namespace,
                GetContainerRequest { id: id.to_string() },
            ))
            .await
            .map_err(|s| SnapshotError::Lookup {
                id: id.to_string(),
                message: s.message().to_string(),
            })?
            .into_inner()
            .container
            .ok_or_else(|| SnapshotError::NoRecord(id.to_string()))?;
        let (snapshotter, key) = match (container.snapshot_key.is_empty(), fallback) {
            (true, Some(engine)) => engine,
            _ => (container.snapshotter, container.snapshot_key),
        };
        if key.is_empty() {
            return Err(SnapshotError::NoSnapshot(id.to_string()));
        }
        let mut snapshots = SnapshotsClient::new(channel);
        let overlay_options = snapshots
            .mounts(request(
                namespace,
                MountsRequest {
                    snapshotter: snapshotter.clone(),
                    key: key.clone(),
                },
            ))
            .await
            .map_err(|s| SnapshotError::Call {
                call: "Snapshots.Mounts",
                key: key.clone(),
                message: s.message().to_string(),
            })?
            .into_inner()
            .mounts
            .into_iter()
            .find(|m| m.r#type == "overlay")
            .map(|m| m.options);
        let mut ancestors: Vec<String> = Vec::new();
        let mut at = key.clone();
        while ancestors.len() < MAX_DEPTH {
            let parent = snapshots
                .stat(request(
                    namespace,
                    StatSnapshotRequest {
                        snapshotter: snapshotter.clone(),
                        key: at.clone(),
                    },
                ))
                .await
                .map_err(|s| SnapshotError::Call {
                    call: "Snapshots.Stat",
                    key: at.clone(),
                    message: s.message().to_string(),
                })?
                .into_inner()
                .info
                .map(|i| i.parent)
                .unwrap_or_default();
            if parent.is_empty() {
                break;
            }
            // Enough once the top image layer and its parent are known.
            let done = ancestors.iter().any(|a| is_chain_id(a));
            ancestors.push(parent.clone());
            if done {
                break;
            }
            at = parent;
        }
        Ok(EngineSnapshot {
            snapshotter,
            key,
            overlay_options,
            ancestors,
        })
    }
}

//! containerd's gRPC API, the parts crabctl needs: leases, content (streaming Write), images,
//! snapshots and the differ (unpacking an image as containerd's Go unpacker does), containers
//! and tasks. Protocol types stay here; callers get plain data and [`CtlError`]s.

use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime},
};

use containerd_client::{
    services::v1::{
        containers_client::ContainersClient,
        content_client::ContentClient,
        diff_client::DiffClient,
        images_client::ImagesClient,
        leases_client::LeasesClient,
        namespaces_client::NamespacesClient,
        snapshots::{
            snapshots_client::SnapshotsClient, CommitSnapshotRequest, MountsRequest,
            PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
        },
        tasks_client::TasksClient,
        AddResourceRequest, ApplyRequest, Container, CreateContainerRequest, CreateImageRequest,
        CreateRequest as CreateLeaseRequest, CreateTaskRequest, DeleteContainerRequest,
        DeleteImageRequest, DeleteRequest as DeleteLeaseRequest, DeleteTaskRequest,
        GetContainerRequest, GetImageRequest, Image, Info as ContentInfo, InfoRequest, KillRequest,
        ListContainersRequest, ListImagesRequest, ListNamespacesRequest, ListPidsRequest,
        ListTasksRequest, ReadContentRequest, Resource, ResumeTaskRequest, StartRequest,
        UpdateImageRequest, UpdateRequest as UpdateContentRequest, UpdateTaskRequest, WaitRequest,
        WriteAction, WriteContentRequest, WriteContentResponse,
    },
    types::{v1::Status as TaskStatus, Descriptor, Mount},
};
use containerd_shim_protos::{protobuf::Message as _, shim::oci::ProcessDetails};
use serde_json::Value;
use tokio::io::AsyncReadExt;
use tonic::{transport::Channel, Code, Request, Status};

use oci_spec::image::{self as oci, MediaType};

use super::{
    image::{pick_manifest, CheckpointImage, MEDIA_TYPE_DOCKER_LIST},
    CtlError,
};
use crab_shim::{
    checkpoint::store::rfc3339,
    turns::{ROLLBACK, TURN_END},
};

/// Bytes per `Content.Write` message (containerd's own clients use 1 MiB).
const WRITE_CHUNK: usize = 1 << 20;
/// How long a lease outlives a crabctl that died without deleting it.
const LEASE_EXPIRY: Duration = Duration::from_secs(3600);
/// Bound for a task to exit after SIGKILL.
const KILL_TIMEOUT: Duration = Duration::from_secs(30);
const PROCESS_DETAILS_TYPE_URL: &str = "containerd.runc.v1.ProcessDetails";

fn grpc(op: impl Into<String>) -> impl FnOnce(Status) -> CtlError {
    let op = op.into();
    move |s| CtlError::Grpc {
        op,
        code: s.code(),
        message: s.message().to_string(),
    }
}

/// A unique suffix for names crabctl makes up (leases, ingest refs, extraction keys, pruned
/// stores).
pub(super) fn unique() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A containerd lease: what is written or prepared under it survives garbage collection until
/// it is deleted (or expires, if crabctl dies first).
#[derive(Debug, Clone)]
pub struct Lease(String);

impl Lease {
    pub fn id(&self) -> &str {
        &self.0
    }
}

/// Where the bytes of a blob to upload come from.
pub enum BlobData<'a> {
    Bytes(&'a [u8]),
    File(&'a Path),
}

/// A connection to containerd in one namespace.
#[derive(Clone)]
pub struct Client {
    channel: Channel,
    namespace: String,
}

impl Client {
    pub async fn connect(address: &Path, namespace: &str) -> Result<Client, CtlError> {
        let channel = containerd_client::connect(address)
            .await
            .map_err(|e| CtlError::Connect {
                address: address.to_path_buf(),
                reason: e.to_string(),
            })?;
        Ok(Client {
            channel,
            namespace: namespace.to_string(),
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The same connection, in namespace `namespace`.
    pub fn in_namespace(&self, namespace: &str) -> Client {
        Client {
            channel: self.channel.clone(),
            namespace: namespace.to_string(),
        }
    }

    /// The names of containerd's namespaces.
    pub async fn namespaces(&self) -> Result<Vec<String>, CtlError> {
        Ok(NamespacesClient::new(self.channel.clone())
            .list(Request::new(ListNamespacesRequest::default()))
            .await
            .map_err(grpc("Namespaces.List"))?
            .into_inner()
            .namespaces
            .into_iter()
            .map(|n| n.name)
            .collect())
    }

    fn req<T>(&self, msg: T, lease: Option<&Lease>) -> Request<T> {
        let mut r = Request::new(msg);
        let md = r.metadata_mut();
        if let Ok(ns) = self.namespace.parse() {
            md.insert("containerd-namespace", ns);
        }
        if let Some(l) = lease.and_then(|l| l.0.parse().ok()) {
            md.insert("containerd-lease", l);
        }
        r
    }

    // --- leases ---

    pub async fn create_lease(&self) -> Result<Lease, CtlError> {
        let id = format!("crabctl-{}", unique());
        let labels = HashMap::from([(
            "containerd.io/gc.expire".to_string(),
            rfc3339(SystemTime::now() + LEASE_EXPIRY),
        )]);
        LeasesClient::new(self.channel.clone())
            .create(self.req(
                CreateLeaseRequest {
                    id: id.clone(),
                    labels,
                },
                None,
            ))
            .await
            .map_err(grpc("Leases.Create"))?;
        Ok(Lease(id))
    }

    /// Deletes the lease; what it protected is now kept only by references (images, containers).
    pub async fn delete_lease(&self, lease: Lease) {
        let r = LeasesClient::new(self.channel.clone())
            .delete(self.req(
                DeleteLeaseRequest {
                    id: lease.0.clone(),
                    sync: false,
                },
                None,
            ))
            .await;
        if let Err(s) = r {
            log::warn!("cannot delete lease {}: {}", lease.0, s.message());
        }
    }

    // --- content ---

    pub async fn content_info(&self, digest: &str) -> Result<Option<ContentInfo>, CtlError> {
        match ContentClient::new(self.channel.clone())
            .info(self.req(
                InfoRequest {
                    digest: digest.to_string(),
                },
                None,
            ))
            .await
        {
            Ok(r) => Ok(r.into_inner().info),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(grpc(format!("Content.Info {digest}"))(s)),
        }
    }

    /// Adds content already in the store to `lease`, so it survives until referenced.
    pub async fn lease_content(&self, lease: &Lease, digest: &str) -> Result<(), CtlError> {
        LeasesClient::new(self.channel.clone())
            .add_resource(self.req(
                AddResourceRequest {
                    id: lease.0.clone(),
                    resource: Some(Resource {
                        id: digest.to_string(),
                        r#type: "content".into(),
                    }),
                },
                None,
            ))
            .await
            .map_err(grpc(format!("Leases.AddResource {digest}")))?;
        Ok(())
    }

    pub async fn read_blob(&self, digest: &str) -> Result<Vec<u8>, CtlError> {
        let op = || format!("Content.Read {digest}");
        let mut stream = ContentClient::new(self.channel.clone())
            .read(self.req(
                ReadContentRequest {
                    digest: digest.into(),
                    offset: 0,
                    size: 0,
                },
                None,
            ))
            .await
            .map_err(grpc(op()))?
            .into_inner();
        let mut data = Vec::new();
        while let Some(chunk) = stream.message().await.map_err(grpc(op()))? {
            data.extend_from_slice(&chunk.data);
        }
        Ok(data)
    }

    /// Streams blob `digest` into `out` (at its current position).
    pub async fn read_blob_into(
        &self,
        digest: &str,
        out: &mut std::fs::File,
    ) -> Result<(), CtlError> {
        use std::io::Write as _;
        let op = || format!("Content.Read {digest}");
        let mut stream = ContentClient::new(self.channel.clone())
            .read(self.req(
                ReadContentRequest {
                    digest: digest.into(),
                    offset: 0,
                    size: 0,
                },
                None,
            ))
            .await
            .map_err(grpc(op()))?
            .into_inner();
        while let Some(chunk) = stream.message().await.map_err(grpc(op()))? {
            out.write_all(&chunk.data).map_err(|e| CtlError::Io {
                what: format!("saving blob {digest}"),
                source: e,
            })?;
        }
        out.flush().map_err(|e| CtlError::Io {
            what: format!("saving blob {digest}"),
            source: e,
        })
    }

    /// Writes a blob into the content store under `lease` with containerd's streaming Write
    /// (stat, writes, commit with the expected digest and size, which containerd verifies).
    /// A blob that is already there is only added to the lease (containerd does that when a
    /// write names an existing digest), and its labels are left as they are.
    pub async fn write_blob(
        &self,
        lease: &Lease,
        desc: &oci::Descriptor,
        data: BlobData<'_>,
        labels: HashMap<String, String>,
    ) -> Result<(), CtlError> {
        match self.write_session(lease, desc, data, labels).await {
            Ok(()) => Ok(()),
            Err(WriteFailure::Status(s)) if s.code() == Code::AlreadyExists => Ok(()),
            Err(WriteFailure::Status(s)) => {
                Err(grpc(format!("Content.Write {}", desc.digest()))(s))
            }
            Err(WriteFailure::Source { path, source }) => Err(CtlError::Io {
                what: format!("reading {}", path.display()),
                source,
            }),
        }
    }

    async fn write_session(
        &self,
        lease: &Lease,
        desc: &oci::Descriptor,
        data: BlobData<'_>,
        labels: HashMap<String, String>,
    ) -> Result<(), WriteFailure> {
        let (tx, rx) = tokio::sync::mpsc::channel::<WriteContentRequest>(1);
        let ingest_ref = format!("crabctl-{}-{}", unique(), desc.digest());
        let request = |action: WriteAction, offset: i64, data: Vec<u8>| WriteContentRequest {
            action: action as i32,
            r#ref: ingest_ref.clone(),
            total: desc.size() as i64,
            expected: desc.digest().to_string(),
            offset,
            data,
            ..Default::default()
        };
        // containerd answers (and sends the stream's headers) only once it has the first
        // request, so that one must be queued before the call is awaited.
        let _ = tx.send(request(WriteAction::Stat, 0, Vec::new())).await;
        let responses = ContentClient::new(self.channel.clone())
            .write(self.req(tokio_stream::wrappers::ReceiverStream::new(rx), Some(lease)))
            .await?
            .into_inner();
        let mut session = WriteSession { tx, responses };
        session.response().await?;
        let mut offset = 0i64;
        match data {
            BlobData::Bytes(bytes) => {
                for chunk in bytes.chunks(WRITE_CHUNK) {
                    session
                        .round_trip(request(WriteAction::Write, offset, chunk.to_vec()))
                        .await?;
                    offset += chunk.len() as i64;
                }
            }
            BlobData::File(path) => {
                let failed = |source| WriteFailure::Source {
                    path: path.to_path_buf(),
                    source,
                };
                let mut f = tokio::fs::File::open(path).await.map_err(failed)?;
                loop {
                    let mut buf = Vec::with_capacity(WRITE_CHUNK);
                    (&mut f)
                        .take(WRITE_CHUNK as u64)
                        .read_to_end(&mut buf)
                        .await
                        .map_err(failed)?;
                    if buf.is_empty() {
                        break;
                    }
                    let n = buf.len() as i64;
                    session
                        .round_trip(request(WriteAction::Write, offset, buf))
                        .await?;
                    offset += n;
                }
            }
        }
        let mut commit = request(WriteAction::Commit, offset, Vec::new());
        commit.labels = labels;
        session.round_trip(commit).await?;
        Ok(())
    }

    /// Sets labels on content (others are kept).
    pub async fn label_content(
        &self,
        digest: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), CtlError> {
        let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
        ContentClient::new(self.channel.clone())
            .update(self.req(
                UpdateContentRequest {
                    info: Some(ContentInfo {
                        digest: digest.to_string(),
                        labels,
                        ..Default::default()
                    }),
                    update_mask: Some(prost_types::FieldMask { paths }),
                },
                None,
            ))
            .await
            .map_err(grpc(format!("Content.Update {digest}")))?;
        Ok(())
    }

    // --- images ---

    pub async fn image(&self, name: &str) -> Result<Option<Image>, CtlError> {
        match ImagesClient::new(self.channel.clone())
            .get(self.req(GetImageRequest { name: name.into() }, None))
            .await
        {
            Ok(r) => Ok(r.into_inner().image),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(grpc(format!("Images.Get {name}"))(s)),
        }
    }

    /// The image records of the namespace matching any of containerd's `filters` (all
    /// without one).
    pub async fn images(&self, filters: Vec<String>) -> Result<Vec<Image>, CtlError> {
        Ok(ImagesClient::new(self.channel.clone())
            .list(self.req(ListImagesRequest { filters }, None))
            .await
            .map_err(grpc("Images.List"))?
            .into_inner()
            .images)
    }

    /// The manifest and config of image `name` (for an index, this host's manifest).
    pub async fn manifest_and_config(&self, name: &str) -> Result<(Value, Value), CtlError> {
        let image = self
            .image(name)
            .await?
            .ok_or_else(|| CtlError::NoImage(name.to_string()))?;
        let target = image
            .target
            .ok_or_else(|| CtlError::BadImage(name.to_string(), "no target".into()))?;
        let parse = |data: &[u8], what: &str| -> Result<Value, CtlError> {
            serde_json::from_slice(data)
                .map_err(|e| CtlError::BadImage(name.to_string(), format!("{what}: {e}")))
        };
        let (mut digest, mut media_type) = (target.digest, target.media_type);
        for _ in 0..4 {
            let doc = parse(&self.read_blob(&digest).await?, &media_type)?;
            let index = MediaType::from(media_type.as_str()) == MediaType::ImageIndex;
            if !index && media_type != MEDIA_TYPE_DOCKER_LIST {
                let config = doc["config"]["digest"].as_str().ok_or_else(|| {
                    CtlError::BadImage(name.to_string(), "manifest without config".into())
                })?;
                let config = parse(&self.read_blob(config).await?, "config")?;
                return Ok((doc, config));
            }
            let pick = pick_manifest(&doc)?;
            (digest, media_type) = (pick.digest().to_string(), pick.media_type().to_string());
        }
        Err(CtlError::BadImage(
            name.to_string(),
            "indexes nested too deep".into(),
        ))
    }

    /// Creates image `name` pointing at `target`, or points an existing one there.
    pub async fn put_image(
        &self,
        name: &str,
        target: &oci::Descriptor,
        labels: HashMap<String, String>,
    ) -> Result<(), CtlError> {
        let image = Image {
            name: name.to_string(),
            labels,
            target: Some(descriptor(target)),
            ..Default::default()
        };
        let mut images = ImagesClient::new(self.channel.clone());
        match images
            .create(self.req(
                CreateImageRequest {
                    image: Some(image.clone()),
                    ..Default::default()
                },
                None,
            ))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::AlreadyExists => images
                .update(self.req(
                    UpdateImageRequest {
                        image: Some(image),
                        ..Default::default()
                    },
                    None,
                ))
                .await
                .map(|_| ())
                .map_err(grpc(format!("Images.Update {name}"))),
            Err(s) => Err(grpc(format!("Images.Create {name}"))(s)),
        }
    }

    /// Deletes image `name` (its content goes with the next garbage collection unless
    /// something else references it).
    pub async fn delete_image(&self, name: &str) -> Result<(), CtlError> {
        match ImagesClient::new(self.channel.clone())
            .delete(self.req(
                DeleteImageRequest {
                    name: name.into(),
                    sync: false,
                    target: None,
                },
                None,
            ))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::NotFound => Ok(()),
            Err(s) => Err(grpc(format!("Images.Delete {name}"))(s)),
        }
    }

    // --- snapshots and the differ ---

    fn snapshots(&self) -> SnapshotsClient<Channel> {
        SnapshotsClient::new(self.channel.clone())
    }

    /// The parent of snapshot `key` (`""` for none), or `None` if there is no such snapshot.
    pub async fn snapshot_parent(
        &self,
        snapshotter: &str,
        key: &str,
    ) -> Result<Option<String>, CtlError> {
        match self
            .snapshots()
            .stat(self.req(
                StatSnapshotRequest {
                    snapshotter: snapshotter.into(),
                    key: key.into(),
                },
                None,
            ))
            .await
        {
            Ok(r) => Ok(Some(
                r.into_inner().info.map(|i| i.parent).unwrap_or_default(),
            )),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(grpc(format!("Snapshots.Stat {key}"))(s)),
        }
    }

    /// Every ancestor of snapshot `key`, nearest first.
    pub async fn snapshot_ancestors(
        &self,
        snapshotter: &str,
        key: &str,
    ) -> Result<Vec<String>, CtlError> {
        let mut out = Vec::new();
        let mut at = key.to_string();
        while let Some(parent) = self.snapshot_parent(snapshotter, &at).await? {
            if parent.is_empty() || out.len() > 4096 {
                break;
            }
            out.push(parent.clone());
            at = parent;
        }
        Ok(out)
    }

    async fn remove_snapshot(&self, snapshotter: &str, key: &str) -> Result<(), CtlError> {
        match self
            .snapshots()
            .remove(self.req(
                RemoveSnapshotRequest {
                    snapshotter: snapshotter.into(),
                    key: key.into(),
                },
                None,
            ))
            .await
        {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::NotFound => Ok(()),
            Err(s) => Err(grpc(format!("Snapshots.Remove {key}"))(s)),
        }
    }

    async fn prepare(
        &self,
        lease: &Lease,
        snapshotter: &str,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
    ) -> Result<Vec<Mount>, CtlError> {
        Ok(self
            .snapshots()
            .prepare(self.req(
                PrepareSnapshotRequest {
                    snapshotter: snapshotter.into(),
                    key: key.into(),
                    parent: parent.into(),
                    labels,
                },
                Some(lease),
            ))
            .await
            .map_err(grpc(format!("Snapshots.Prepare {key}")))?
            .into_inner()
            .mounts)
    }

    /// Unpacks `image` into committed snapshots named by chain id, as containerd's unpacker
    /// does (layers already unpacked are skipped), and labels its config so the snapshots stay
    /// as long as the image does. Returns the top chain id.
    pub async fn unpack(
        &self,
        lease: &Lease,
        snapshotter: &str,
        image: &CheckpointImage,
    ) -> Result<String, CtlError> {
        let chains = image.chain_ids();
        let mut parent = String::new();
        for ((layer, chain), diff_id) in image.layers.iter().zip(&chains).zip(&image.diff_ids) {
            if self.snapshot_parent(snapshotter, chain).await?.is_none() {
                self.apply_layer(lease, snapshotter, layer, diff_id, chain, &parent)
                    .await?;
            }
            parent = chain.clone();
        }
        let top = chains
            .last()
            .cloned()
            .ok_or_else(|| CtlError::Refused("an image without layers".into()))?;
        self.label_content(
            &image.config_digest(),
            HashMap::from([(
                format!("containerd.io/gc.ref.snapshot.{snapshotter}"),
                top.clone(),
            )]),
        )
        .await?;
        Ok(top)
    }

    async fn apply_layer(
        &self,
        lease: &Lease,
        snapshotter: &str,
        layer: &oci::Descriptor,
        diff_id: &str,
        chain: &str,
        parent: &str,
    ) -> Result<(), CtlError> {
        let key = format!("extract-{} {chain}", unique());
        let labels = HashMap::from([("containerd.io/snapshot.ref".to_string(), chain.to_string())]);
        let mounts = self
            .prepare(lease, snapshotter, &key, parent, labels)
            .await?;
        let applied = async {
            let applied = DiffClient::new(self.channel.clone())
                .apply(self.req(
                    ApplyRequest {
                        diff: Some(descriptor(layer)),
                        mounts,
                        ..Default::default()
                    },
                    Some(lease),
                ))
                .await
                .map_err(grpc(format!("Diff.Apply {}", layer.digest())))?
                .into_inner()
                .applied
                .map(|d| d.digest)
                .unwrap_or_default();
            if applied != diff_id {
                return Err(CtlError::Refused(format!(
                    "layer {} unpacks to {applied}, but the image config says {diff_id}",
                    layer.digest()
                )));
            }
            match self
                .snapshots()
                .commit(self.req(
                    CommitSnapshotRequest {
                        snapshotter: snapshotter.into(),
                        name: chain.into(),
                        key: key.clone(),
                        ..Default::default()
                    },
                    Some(lease),
                ))
                .await
            {
                Ok(_) => Ok(()),
                // Unpacked meanwhile by someone else: theirs is as good.
                Err(s) if s.code() == Code::AlreadyExists => Err(CtlError::Grpc {
                    op: String::new(),
                    code: Code::AlreadyExists,
                    message: String::new(),
                }),
                Err(s) => Err(grpc(format!("Snapshots.Commit {chain}"))(s)),
            }
        }
        .await;
        match applied {
            Ok(()) => Ok(()),
            Err(CtlError::Grpc {
                code: Code::AlreadyExists,
                ..
            }) => self.remove_snapshot(snapshotter, &key).await,
            Err(e) => {
                let _ = self.remove_snapshot(snapshotter, &key).await;
                Err(e)
            }
        }
    }

    // --- containers ---

    pub async fn container(&self, id: &str) -> Result<Option<Container>, CtlError> {
        match ContainersClient::new(self.channel.clone())
            .get(self.req(GetContainerRequest { id: id.into() }, None))
            .await
        {
            Ok(r) => Ok(r.into_inner().container),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(grpc(format!("Containers.Get {id}"))(s)),
        }
    }

    /// Every container record of the namespace.
    pub async fn containers(&self) -> Result<Vec<Container>, CtlError> {
        Ok(ContainersClient::new(self.channel.clone())
            .list(self.req(ListContainersRequest::default(), None))
            .await
            .map_err(grpc("Containers.List"))?
            .into_inner()
            .containers)
    }

    /// The container records matching any of containerd's `filters` (all records without
    /// one), streamed one by one so a crowded namespace does not hit gRPC's message limit.
    pub async fn containers_matching(
        &self,
        filters: Vec<String>,
    ) -> Result<Vec<Container>, CtlError> {
        let mut stream = ContainersClient::new(self.channel.clone())
            .list_stream(self.req(ListContainersRequest { filters }, None))
            .await
            .map_err(grpc("Containers.ListStream"))?
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = stream
            .message()
            .await
            .map_err(grpc("Containers.ListStream"))?
        {
            out.extend(m.container);
        }
        Ok(out)
    }

    /// Prepares `container`'s rootfs snapshot on `parent` and creates the container record.
    /// On failure nothing is left behind.
    pub async fn create_container(
        &self,
        lease: &Lease,
        container: Container,
        parent: &str,
    ) -> Result<(), CtlError> {
        let (snapshotter, key) = (
            container.snapshotter.clone(),
            container.snapshot_key.clone(),
        );
        self.prepare(lease, &snapshotter, &key, parent, HashMap::new())
            .await?;
        let id = container.id.clone();
        let created = ContainersClient::new(self.channel.clone())
            .create(self.req(
                CreateContainerRequest {
                    container: Some(container),
                },
                Some(lease),
            ))
            .await;
        if let Err(s) = created {
            let _ = self.remove_snapshot(&snapshotter, &key).await;
            return Err(grpc(format!("Containers.Create {id}"))(s));
        }
        Ok(())
    }

    /// Deletes the container record, then its rootfs snapshot.
    pub async fn delete_container(&self, container: &Container) -> Result<(), CtlError> {
        match ContainersClient::new(self.channel.clone())
            .delete(self.req(
                DeleteContainerRequest {
                    id: container.id.clone(),
                },
                None,
            ))
            .await
        {
            Ok(_) => {}
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(grpc(format!("Containers.Delete {}", container.id))(s)),
        }
        if container.snapshot_key.is_empty() {
            return Ok(());
        }
        self.remove_snapshot(&container.snapshotter, &container.snapshot_key)
            .await
    }

    // --- tasks ---

    fn tasks(&self) -> TasksClient<Channel> {
        TasksClient::new(self.channel.clone())
    }

    /// Ends a turn of `id`: `Tasks.Update` with no resources and the turn-end annotation,
    /// which containerd hands to the shim.
    pub async fn end_turn(&self, id: &str, turn: &str) -> Result<(), CtlError> {
        self.tasks()
            .update(self.req(
                UpdateTaskRequest {
                    container_id: id.into(),
                    resources: None,
                    annotations: HashMap::from([(TURN_END.to_string(), turn.to_string())]),
                },
                None,
            ))
            .await
            .map_err(grpc(format!("turn end of {id}: Tasks.Update")))?;
        Ok(())
    }

    /// Asks `id`'s shim to reset its files to checkpoint `seq` in place (`Tasks.Update` with
    /// the rollback annotation; the shim refuses what it cannot do in place).
    pub async fn rollback_in_place(&self, id: &str, seq: u64) -> Result<(), CtlError> {
        self.tasks()
            .update(self.req(
                UpdateTaskRequest {
                    container_id: id.into(),
                    resources: None,
                    annotations: HashMap::from([(ROLLBACK.to_string(), seq.to_string())]),
                },
                None,
            ))
            .await
            .map_err(grpc(format!("in-place rollback of {id}: Tasks.Update")))?;
        Ok(())
    }

    /// The pid of the task's init, or `None` if the container has no task.
    pub async fn task_pid(&self, id: &str) -> Result<Option<u32>, CtlError> {
        let req = containerd_client::services::v1::GetRequest {
            container_id: id.into(),
            exec_id: String::new(),
        };
        match self.tasks().get(self.req(req, None)).await {
            Ok(r) => Ok(r.into_inner().process.map(|p| p.pid)),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(grpc(format!("Tasks.Get {id}"))(s)),
        }
    }

    /// The ids of the containers whose task is alive (running or paused).
    pub async fn live_tasks(&self) -> Result<HashSet<String>, CtlError> {
        let live = [TaskStatus::Running, TaskStatus::Paused, TaskStatus::Pausing].map(|s| s as i32);
        Ok(self
            .tasks()
            .list(self.req(ListTasksRequest::default(), None))
            .await
            .map_err(grpc("Tasks.List"))?
            .into_inner()
            .tasks
            .into_iter()
            .filter(|t| live.contains(&t.status))
            // A task's id is its container's (containerd leaves `container_id` empty here).
            .map(|t| t.id)
            .collect())
    }

    /// The exec ids of the task's processes, or `None` if the container has no task.
    pub async fn task_execs(&self, id: &str) -> Result<Option<Vec<String>>, CtlError> {
        let processes = match self
            .tasks()
            .list_pids(self.req(
                ListPidsRequest {
                    container_id: id.into(),
                },
                None,
            ))
            .await
        {
            Ok(r) => r.into_inner().processes,
            Err(s) if s.code() == Code::NotFound => return Ok(None),
            // A task whose shim died is still listed until containerd cleans it up.
            Err(s) => {
                log::warn!("Tasks.ListPids {id}: {}", s.message());
                Vec::new()
            }
        };
        let mut execs: Vec<String> = processes
            .into_iter()
            .filter_map(|p| p.info)
            .filter(|i| i.type_url.ends_with(PROCESS_DETAILS_TYPE_URL))
            .filter_map(|i| ProcessDetails::parse_from_bytes(&i.value).ok())
            .map(|d| d.exec_id)
            .filter(|e| !e.is_empty())
            .collect();
        execs.sort();
        execs.dedup();
        Ok(Some(execs))
    }

    /// Kills every process of the task (SIGKILL), waits for it and deletes it. A container
    /// without a task (or whose task is gone with its shim) is fine.
    pub async fn remove_task(&self, id: &str) -> Result<(), CtlError> {
        // A frozen process cannot die: thaw a paused task first (an error just means it was
        // not paused, or is gone).
        let _ = self
            .tasks()
            .resume(self.req(
                ResumeTaskRequest {
                    container_id: id.into(),
                },
                None,
            ))
            .await;
        let kill = self
            .tasks()
            .kill(self.req(
                KillRequest {
                    container_id: id.into(),
                    exec_id: String::new(),
                    signal: libc::SIGKILL as u32,
                    all: true,
                },
                None,
            ))
            .await;
        match kill {
            Err(s) if s.code() == Code::NotFound => return Ok(()),
            Err(s) => log::info!("Tasks.Kill {id}: {} (deleting anyway)", s.message()),
            Ok(_) => {
                let mut tasks = self.tasks();
                let wait = tasks.wait(self.req(
                    WaitRequest {
                        container_id: id.into(),
                        exec_id: String::new(),
                    },
                    None,
                ));
                match tokio::time::timeout(KILL_TIMEOUT, wait).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(s)) => log::info!("Tasks.Wait {id}: {}", s.message()),
                    Err(_) => log::warn!("task {id} did not exit {KILL_TIMEOUT:?} after SIGKILL"),
                }
            }
        }
        let mut last = None;
        for _ in 0..50 {
            match self
                .tasks()
                .delete(self.req(
                    DeleteTaskRequest {
                        container_id: id.into(),
                    },
                    None,
                ))
                .await
            {
                Ok(_) => return Ok(()),
                Err(s) if s.code() == Code::NotFound => return Ok(()),
                Err(s) => last = Some(s),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(grpc(format!("Tasks.Delete {id}"))(
            last.expect("at least one attempt"),
        ))
    }

    /// Creates the task of `container` on its rootfs snapshot (stdio: none, so /dev/null, or a
    /// terminal whose output is discarded) and starts it; returns the init pid.
    pub async fn start_task(&self, container: &Container) -> Result<u32, CtlError> {
        self.start_task_timed(container).await.map(|(pid, _)| pid)
    }

    /// [`Client::start_task`], also returning when Tasks.Create returned (Start began).
    pub async fn start_task_timed(
        &self,
        container: &Container,
    ) -> Result<(u32, std::time::Instant), CtlError> {
        let id = container.id.clone();
        let rootfs = self
            .snapshots()
            .mounts(self.req(
                MountsRequest {
                    snapshotter: container.snapshotter.clone(),
                    key: container.snapshot_key.clone(),
                },
                None,
            ))
            .await
            .map_err(grpc(format!("Snapshots.Mounts {}", container.snapshot_key)))?
            .into_inner()
            .mounts;
        // A container with a terminal gets one again (its process image holds a tty, which
        // CRIU recreates): the shim keeps the pty master, discarding its output.
        let terminal = container
            .spec
            .as_ref()
            .and_then(|s| serde_json::from_slice::<Value>(&s.value).ok())
            .is_some_and(|s| s["process"]["terminal"] == Value::Bool(true));
        self.tasks()
            .create(self.req(
                CreateTaskRequest {
                    container_id: id.clone(),
                    rootfs,
                    terminal,
                    ..Default::default()
                },
                None,
            ))
            .await
            .map_err(grpc(format!("Tasks.Create {id}")))?;
        let created = std::time::Instant::now();
        let started = self
            .tasks()
            .start(self.req(
                StartRequest {
                    container_id: id.clone(),
                    exec_id: String::new(),
                },
                None,
            ))
            .await;
        match started {
            Ok(r) => Ok((r.into_inner().pid, created)),
            Err(s) => {
                let _ = self.remove_task(&id).await;
                Err(grpc(format!("Tasks.Start {id}"))(s))
            }
        }
    }
}

enum WriteFailure {
    Status(Status),
    Source {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

impl From<Status> for WriteFailure {
    fn from(s: Status) -> Self {
        WriteFailure::Status(s)
    }
}

/// One `Content.Write` stream: every request gets one response.
struct WriteSession {
    tx: tokio::sync::mpsc::Sender<WriteContentRequest>,
    responses: tonic::Streaming<WriteContentResponse>,
}

impl WriteSession {
    async fn response(&mut self) -> Result<WriteContentResponse, Status> {
        self.responses
            .message()
            .await?
            .ok_or_else(|| Status::unknown("containerd ended the write stream early"))
    }

    async fn round_trip(
        &mut self,
        req: WriteContentRequest,
    ) -> Result<WriteContentResponse, Status> {
        // A closed request channel means containerd ended the call: its status says why.
        let _ = self.tx.send(req).await;
        self.response().await
    }
}

fn descriptor(d: &oci::Descriptor) -> Descriptor {
    Descriptor {
        media_type: d.media_type().to_string(),
        digest: d.digest().to_string(),
        size: d.size() as i64,
        annotations: d.annotations().clone().unwrap_or_default(),
    }
}

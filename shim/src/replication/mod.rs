//! Off-node replication (`[replication]`): every durable checkpoint of a sandbox is pushed, in
//! the background, to an OCI registry as a signed artifact ([`artifact`]) tagged per lineage,
//! and a container of the lineage created on a node that has no checkpoint of it (with
//! `io.crab/resume: newest`) pulls the newest one ([`pull_newest`]) and resumes from it.
//!
//! The push never delays a turn and never holds an engine slot: a [`Replicator`] per sandbox
//! wakes when the sandbox's checkpoints are durable, builds the newest one's artifact and
//! pushes it, blobs the registry already has skipped. Its queue is one checkpoint deep: a
//! newer checkpoint supersedes one not yet pushed (the oldest superseded are dropped first,
//! by construction). A registry that is down or refuses costs nothing locally: attempts are
//! retried with doubling waits (250 ms up to `retry_max_ms`), and what happened is written to
//! `<store>/replication.json` ([`Status`], which `crabctl replication` reads).
//!
//! The registry protocol is oci-client's (a maintained OCI distribution client); nothing here
//! speaks HTTP itself.

pub mod artifact;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use crab_runtime_config::ReplicationConfig;
use oci_client::{
    client::{ClientConfig, ClientProtocol},
    errors::{OciDistributionError, OciErrorCode},
    manifest::{OciDescriptor, OciImageManifest, OciManifest, OCI_IMAGE_MEDIA_TYPE},
    secrets::RegistryAuth,
    Client, Reference,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::checkpoint::{
    lineage::{self, LineageRecord},
    provenance::{ProvenanceError, TrustedKeys},
    store::{digest_string, rfc3339, Manifest, ProcessImage, Store, StoreError},
};

use self::artifact::{Artifact, BuildError, ReplicaError, SegmentError, MEDIA_TYPE_CONFIG};

/// What can go wrong replicating: the registry `[replication]` names, its credentials, a push
/// or a pull. `at` is `REGISTRY/REPOSITORY:TAG` where a pulled artifact is concerned.
#[derive(Debug, thiserror::Error)]
pub enum ReplicationError {
    #[error("{0}: no repository")]
    NoRepository(String),
    #[error("{}: {source}", path.display())]
    AuthFile {
        path: PathBuf,
        #[source]
        source: AuthError,
    },
    /// A registry call failed (the client's error).
    #[error(transparent)]
    Registry(#[from] OciDistributionError),
    #[error("the registry did not answer in {} s", CALL_TIMEOUT.as_secs())]
    Timeout,
    /// A registry call of a pull failed or was not answered (`registry`: its name).
    #[error("{registry}: {source}")]
    Pull {
        registry: String,
        #[source]
        source: Box<ReplicationError>,
    },
    #[error("{0} did not answer")]
    NoAnswer(String),
    /// A blocking task of the push died.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    #[error("reading {digest}: {source}")]
    ReadBlob {
        digest: String,
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint's artifact could not be built (not retried).
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The key to sign it with could not be had (not retried).
    #[error(transparent)]
    SigningKey(#[from] ProvenanceError),
    #[error("{at} is not a crab checkpoint (config {media_type})")]
    NotCrab { at: String, media_type: String },
    #[error("{at}: its config is too large")]
    ConfigTooLarge { at: String },
    #[error("{at}: {source}")]
    Refused {
        at: String,
        #[source]
        source: ReplicaError,
    },
    #[error("{at}: {blobs} blobs where its signature names {layers} layers")]
    TooFewBlobs {
        at: String,
        blobs: usize,
        layers: usize,
    },
    #[error("{at}: {source}")]
    Segments {
        at: String,
        #[source]
        source: SegmentError,
    },
    #[error("{at}: {total} bytes, more than [replication] max_mib")]
    TooLarge { at: String, total: u64 },
    #[error("blob {digest} of {size} bytes is too large")]
    BlobTooLarge { digest: String, size: i64 },
    #[error("blob {0}: its content is not what it is named by")]
    BlobContent(String),
    #[error("layer {0}: not the one its signature names")]
    LayerNotSigned(String),
    #[error("layer {digest}: its content has diff_id {got}, its signature names {want}")]
    DiffId {
        digest: String,
        got: String,
        want: String,
    },
    #[error("{0}: its segments are not the file its signature names")]
    FileDigest(String),
    /// The store the pull goes into could not be written.
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{}: {source}", path.display())]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What is wrong with a Docker-style credentials file ([`auth_from_file`]).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error(transparent)]
    Read(#[from] std::io::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("the auth of {registry}: {source}")]
    Base64 {
        registry: String,
        #[source]
        source: base64::DecodeError,
    },
    #[error("the auth of {0} is not text")]
    NotText(String),
    #[error("the auth of {0} is not user:password")]
    NotUserPassword(String),
}

/// What a replicator records of its pushes (`<store>/replication.json`).
pub const STATUS_FILE: &str = "replication.json";
/// Each registry call is bounded: a registry that does not answer is an error, retried.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
const FIRST_RETRY: Duration = Duration::from_millis(250);

/// A registry and a repository in it, with the credentials to use.
pub struct Registry {
    client: Client,
    registry: String,
    repository: String,
    auth: RegistryAuth,
    /// `HOST[:PORT]/REPOSITORY`, for messages.
    pub name: String,
}

impl Registry {
    /// The registry `[replication]` names, if replication is on.
    pub fn from_config(c: &ReplicationConfig) -> Result<Option<Registry>, ReplicationError> {
        let Some(name) = &c.registry else {
            return Ok(None);
        };
        let (registry, repository) = name
            .split_once('/')
            .ok_or_else(|| ReplicationError::NoRepository(name.clone()))?;
        let auth = match &c.auth_file {
            Some(path) => auth_from_file(path, registry)?,
            None => RegistryAuth::Anonymous,
        };
        let client = Client::new(ClientConfig {
            protocol: match c.insecure {
                true => ClientProtocol::Http,
                false => ClientProtocol::Https,
            },
            ..ClientConfig::default()
        });
        Ok(Some(Registry {
            client,
            registry: registry.to_string(),
            repository: repository.to_string(),
            auth,
            name: name.clone(),
        }))
    }

    fn reference(&self, tag: &str) -> Reference {
        Reference::with_tag(
            self.registry.clone(),
            self.repository.clone(),
            tag.to_string(),
        )
    }

    async fn authed(&self, tag: &str) -> Reference {
        let r = self.reference(tag);
        self.client
            .store_auth_if_needed(r.resolve_registry(), &self.auth)
            .await;
        r
    }

    /// Pushes `a` under each of `tags` (the first one's reference for the blobs), skipping the
    /// blobs the repository has and those in `known` (pushed or found by an earlier push of the
    /// same replicator: a chain's older layers are not asked about again), adding the ones it
    /// pushes or finds. Returns (bytes sent, bytes skipped). A push that fails empties `known` (the registry may have
    /// lost what it had: the next one asks again).
    pub async fn push_known(
        &self,
        a: &Artifact,
        tags: &[String],
        known: &mut std::collections::HashSet<String>,
    ) -> Result<(u64, u64), ReplicationError> {
        let pushed = self.push_inner(a, tags, known).await;
        if pushed.is_err() {
            known.clear();
        }
        pushed
    }

    async fn push_inner(
        &self,
        a: &Artifact,
        tags: &[String],
        known: &mut std::collections::HashSet<String>,
    ) -> Result<(u64, u64), ReplicationError> {
        let r = self.authed(&tags[0]).await;
        let (mut sent, mut skipped) = (0u64, 0u64);
        let config_digest = sha256(&a.config);
        let config = artifact::Blob {
            digest: config_digest.clone(),
            size: a.config.len() as u64,
            media_type: MEDIA_TYPE_CONFIG.to_string(),
            file: None,
            offset: 0,
            data: artifact::BlobData::Bytes(a.config.clone()),
        };
        for blob in std::iter::once(&config).chain(&a.layers) {
            let digest = blob.digest.as_str();
            if known.contains(digest) || call(self.client.blob_exists(&r, digest)).await? {
                known.insert(digest.to_string());
                skipped += blob.size;
                continue;
            }
            let data = blob.data.clone();
            let bytes = tokio::task::spawn_blocking(move || data.read())
                .await?
                .map_err(|source| ReplicationError::ReadBlob {
                    digest: digest.to_string(),
                    source,
                })?;
            call(self.client.push_blob(&r, bytes, digest)).await?;
            known.insert(digest.to_string());
            sent += blob.size;
        }
        let manifest = OciImageManifest {
            schema_version: 2,
            media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_string()),
            config: OciDescriptor {
                media_type: MEDIA_TYPE_CONFIG.to_string(),
                digest: config_digest,
                size: a.config.len() as i64,
                ..OciDescriptor::default()
            },
            layers: a
                .layers
                .iter()
                .map(|l| OciDescriptor {
                    media_type: l.media_type.clone(),
                    digest: l.digest.clone(),
                    size: l.size as i64,
                    annotations: l.file.as_ref().map(|f| {
                        BTreeMap::from([
                            (artifact::ANNOTATION_FILE.to_string(), f.clone()),
                            (
                                artifact::ANNOTATION_OFFSET.to_string(),
                                l.offset.to_string(),
                            ),
                        ])
                    }),
                    ..OciDescriptor::default()
                })
                .collect(),
            artifact_type: Some(MEDIA_TYPE_CONFIG.to_string()),
            ..OciImageManifest::default()
        };
        let manifest = OciManifest::Image(manifest);
        for tag in tags {
            let r = self.reference(tag);
            call(self.client.push_manifest(&r, &manifest)).await?;
        }
        Ok((sent, skipped))
    }
}

async fn call<T>(
    f: impl std::future::Future<Output = Result<T, OciDistributionError>>,
) -> Result<T, ReplicationError> {
    match tokio::time::timeout(CALL_TIMEOUT, f).await {
        Ok(r) => Ok(r?),
        Err(_) => Err(ReplicationError::Timeout),
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

fn sha256(data: &[u8]) -> String {
    let mut h = Sha256::new();
    h.update(data);
    digest_string(h)
}

/// The credentials for `registry` in a Docker-style credentials file (`{"auths": {"HOST":
/// {"auth": base64("user:password")}}}`, or `username` and `password`); anonymous when the
/// file names none for it.
pub fn auth_from_file(path: &Path, registry: &str) -> Result<RegistryAuth, ReplicationError> {
    auth_in(path, registry).map_err(|source| ReplicationError::AuthFile {
        path: path.to_path_buf(),
        source,
    })
}

fn auth_in(path: &Path, registry: &str) -> Result<RegistryAuth, AuthError> {
    use base64::Engine;
    #[derive(Deserialize)]
    struct Entry {
        auth: Option<String>,
        username: Option<String>,
        password: Option<String>,
    }
    #[derive(Deserialize)]
    struct File {
        #[serde(default)]
        auths: BTreeMap<String, Entry>,
    }
    let bytes = std::fs::read(path)?;
    let file: File = serde_json::from_slice(&bytes)?;
    let entry = file.auths.iter().find(|(k, _)| {
        let k = k
            .trim_start_matches("https://")
            .trim_start_matches("http://");
        k == registry || k.split('/').next() == Some(registry)
    });
    let Some((_, e)) = entry else {
        return Ok(RegistryAuth::Anonymous);
    };
    if let (Some(u), Some(p)) = (&e.username, &e.password) {
        return Ok(RegistryAuth::Basic(u.clone(), p.clone()));
    }
    let Some(auth) = &e.auth else {
        return Ok(RegistryAuth::Anonymous);
    };
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .map_err(|source| AuthError::Base64 {
            registry: registry.to_string(),
            source,
        })?;
    let text = String::from_utf8(decoded).map_err(|_| AuthError::NotText(registry.to_string()))?;
    let (u, p) = text
        .split_once(':')
        .ok_or_else(|| AuthError::NotUserPassword(registry.to_string()))?;
    Ok(RegistryAuth::Basic(u.to_string(), p.to_string()))
}

/// What a sandbox's replicator has done (`<store>/replication.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub registry: String,
    pub lineage: String,
    /// The newest checkpoint pushed, when, and how long after the replicator saw it durable.
    pub pushed_seq: Option<u64>,
    pub pushed_at: Option<String>,
    pub lag_ms: Option<f64>,
    /// The newest durable checkpoint seen (pushed or not).
    pub newest_seq: Option<u64>,
    pub pushes: u64,
    pub failures: u64,
    /// Checkpoints superseded before they were pushed.
    pub superseded: u64,
    pub bytes_sent: u64,
    pub bytes_skipped: u64,
    pub last_error: Option<String>,
    /// Every lag measured, in milliseconds (the newest 1000), for the figures.
    #[serde(default)]
    pub lags_ms: Vec<f64>,
    /// From the end of the oldest turn the newest push covered (the first turn after the push
    /// before it) to that push: how old a node's loss could make the recovery point. Absent
    /// when no checkpoint pushed recorded its turn end (one taken by an older crab).
    #[serde(default)]
    pub turn_lag_ms: Option<f64>,
    /// Every such lag, in milliseconds (the newest 1000).
    #[serde(default)]
    pub turn_lags_ms: Vec<f64>,
    /// Every lag measured, in seconds, from the turn end when it is known (else from the
    /// checkpoint durable), over [`crate::metrics::REPLICATION_BOUNDS`] (for
    /// `crabctl metrics`: it only grows).
    #[serde(default)]
    pub lag: crate::metrics::Histogram,
}

impl Status {
    fn write(&self, root: &Path) {
        let path = root.join(STATUS_FILE);
        let tmp = root.join(format!(".{STATUS_FILE}.tmp"));
        let r = serde_json::to_vec_pretty(self)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = r {
            log::warn!("{}: {e}", path.display());
        }
    }

    /// A store's replication status, if it has one.
    pub fn read(root: &Path) -> Option<Status> {
        let bytes = std::fs::read(root.join(STATUS_FILE)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }
}

/// What a [`Replicator`] is given.
pub struct ReplicatorParams {
    pub registry: Arc<Registry>,
    pub store_root: PathBuf,
    pub namespace: String,
    pub container: String,
    pub record: LineageRecord,
    pub signing_key: PathBuf,
    pub max_bytes: u64,
    pub retry_max: Duration,
}

/// Pushes a sandbox's newest durable checkpoint whenever there is a newer one.
pub struct Replicator;

/// How long a shim that has ended waits for its replicators' last pushes ([`drain_at_exit`]).
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(30);

/// Replicators still running in this shim.
static RUNNING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts a replicator as running while it lives.
struct Running;

impl Running {
    fn new() -> Running {
        RUNNING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        RUNNING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Run by the shim's process after the shim has ended (containerd's Shutdown answered, its
/// socket closed: containerd waits for nothing, a new shim of the same id can start): waits at
/// most [`SHUTDOWN_DRAIN`] for its replicators' last pushes, so a checkpoint taken right
/// before its container was removed (a pod drained or deleted) still leaves the node.
/// (Waiting inside Shutdown does not work: containerd gives it about 3 s, then leaks the shim.)
pub async fn drain_at_exit() {
    if RUNNING.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        return;
    }
    log::info!("waiting for the last pushes of the replicators");
    let left = drain(SHUTDOWN_DRAIN).await;
    if left > 0 {
        log::warn!(
            "ending with {left} replicator(s) still pushing after {SHUTDOWN_DRAIN:?}: their \
             newest checkpoints stay on this node only"
        );
    }
}

/// Waits at most `within` for every replicator of this process to end (each ends after its
/// sandbox's last checkpoint is pushed, or its last attempt failed). Returns how many are
/// still running.
pub async fn drain(within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        let n = RUNNING.load(std::sync::atomic::Ordering::SeqCst);
        if n == 0 || Instant::now() >= deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Replicator {
    /// Runs until `durable` closes (the sandbox's checkpointing ended), then pushes what is
    /// newest once more.
    pub fn spawn(p: ReplicatorParams, mut durable: tokio::sync::watch::Receiver<u64>) {
        let running = Running::new();
        runtime().spawn(async move {
            let _running = running;
            let mut status = Status {
                registry: p.registry.name.clone(),
                lineage: p.record.lineage.clone(),
                ..Status::read(&p.store_root).unwrap_or_default()
            };
            status.registry = p.registry.name.clone();
            let mut seen: Option<(u64, Instant)> = None;
            let mut wait = FIRST_RETRY;
            let mut open = true;
            let mut skip: Option<u64> = None;
            let mut known = std::collections::HashSet::new();
            // The CRIU part of the last artifact built (an fs-only turn keeps the image).
            let mut criu = None;
            loop {
                let newest = {
                    let root = p.store_root.clone();
                    tokio::task::spawn_blocking(move || lineage::newest_durable(&root))
                        .await
                        .ok()
                        .flatten()
                };
                let pending = newest.filter(|m| status.pushed_seq.is_none_or(|s| m.seq > s));
                let Some(m) = pending else {
                    if !open {
                        return;
                    }
                    // Woken by the next durable checkpoint, or after a while (an origin
                    // recorded in the background bumps nothing).
                    if let Ok(Err(_)) =
                        tokio::time::timeout(Duration::from_secs(5), durable.changed()).await
                    {
                        open = false;
                    }
                    continue;
                };
                // The one seen before, if not pushed, is superseded by this newer one.
                if seen.is_some_and(|(s, _)| s != m.seq && status.pushed_seq != Some(s)) {
                    status.superseded += 1;
                }
                if seen.is_none_or(|(s, _)| s != m.seq) {
                    seen = Some((m.seq, Instant::now()));
                }
                status.newest_seq = Some(m.seq);
                if skip == Some(m.seq) {
                    // Not replicable (see the status): the next checkpoint may be.
                    match tokio::time::timeout(Duration::from_secs(5), durable.changed()).await {
                        Ok(Err(_)) if !open => return,
                        Ok(Err(_)) => open = false,
                        _ => {}
                    }
                    continue;
                }
                match push_one(&p, &m, &mut known, &mut criu).await {
                    Ok((sent, skipped)) => {
                        let lag = seen.map_or(0.0, |(_, t)| t.elapsed().as_secs_f64() * 1e3);
                        let turn_lag = {
                            let (root, after) = (p.store_root.clone(), status.pushed_seq);
                            tokio::task::spawn_blocking(move || {
                                lineage::oldest_turn_end_after(&root, after)
                            })
                            .await
                            .ok()
                            .flatten()
                            .map(|t| unix_ms().saturating_sub(t) as f64)
                        };
                        status.pushed_seq = Some(m.seq);
                        status.pushed_at = Some(rfc3339(SystemTime::now()));
                        status.lag_ms = Some(lag);
                        status.lags_ms.push(lag);
                        status.turn_lag_ms = turn_lag;
                        status.turn_lags_ms.extend(turn_lag);
                        status.lag.observe(
                            crate::metrics::REPLICATION_BOUNDS,
                            turn_lag.unwrap_or(lag) / 1e3,
                        );
                        for v in [&mut status.lags_ms, &mut status.turn_lags_ms] {
                            if v.len() > 1000 {
                                v.remove(0);
                            }
                        }
                        status.pushes += 1;
                        status.bytes_sent += sent;
                        status.bytes_skipped += skipped;
                        status.last_error = None;
                        wait = FIRST_RETRY;
                        log::info!(
                            "{}: checkpoint {} of lineage {} replicated to {} in {lag:.0} ms \
                             ({sent} bytes sent, {skipped} already there)",
                            p.container,
                            m.seq,
                            p.record.lineage,
                            p.registry.name
                        );
                        status.write(&p.store_root);
                    }
                    Err(PushError::Permanent(e)) => {
                        status.failures += 1;
                        status.last_error = Some(format!("checkpoint {}: {e}", m.seq));
                        status.write(&p.store_root);
                        log::warn!(
                            "{}: checkpoint {} cannot be replicated: {e}",
                            p.container,
                            m.seq
                        );
                        skip = Some(m.seq);
                    }
                    Err(PushError::Transient(e)) => {
                        status.failures += 1;
                        status.last_error = Some(e.to_string());
                        status.write(&p.store_root);
                        log::warn!(
                            "{}: checkpoint {} not replicated to {} (retried in {} ms): {e}",
                            p.container,
                            m.seq,
                            p.registry.name,
                            wait.as_millis()
                        );
                        // A newer checkpoint meanwhile is pushed instead (this one is
                        // superseded); the sandbox going away ends the retries.
                        match tokio::time::timeout(wait, durable.changed()).await {
                            Ok(Err(_)) if !open => return,
                            Ok(Err(_)) => open = false,
                            _ => {}
                        }
                        wait = (wait * 2).min(p.retry_max);
                    }
                }
            }
        });
    }
}

/// Why a push did not happen: the checkpoint cannot be replicated at all, or the registry
/// failed (retried).
enum PushError {
    Permanent(ReplicationError),
    Transient(ReplicationError),
}

async fn push_one(
    p: &ReplicatorParams,
    m: &Manifest,
    known: &mut std::collections::HashSet<String>,
    criu: &mut Option<artifact::CriuDigests>,
) -> Result<(u64, u64), PushError> {
    let (root, ns, c, record, key, max) = (
        p.store_root.clone(),
        p.namespace.clone(),
        p.container.clone(),
        p.record.clone(),
        p.signing_key.clone(),
        p.max_bytes,
    );
    let m2 = m.clone();
    let earlier = criu.take();
    let (art, digests) = tokio::task::spawn_blocking(move || {
        // Building (pages rebuilt and hashed) yields to the sandboxes and their checkpoints.
        let _lower = LowerPriority::new();
        let signer = crate::checkpoint::provenance::signing_key(&key)?;
        Ok::<_, ReplicationError>(artifact::build(
            &root,
            &ns,
            &c,
            &record,
            &m2,
            &signer,
            max,
            earlier.as_ref(),
        )?)
    })
    .await
    .map_err(|e| PushError::Transient(e.into()))?
    .map_err(PushError::Permanent)?;
    *criu = digests;
    let tags = [
        artifact::seq_tag(&p.record.lineage, &p.container, m.seq),
        artifact::newest_tag(&p.record.lineage),
    ];
    p.registry
        .push_known(&art, &tags, known)
        .await
        .map_err(PushError::Transient)
}

/// The runtime replicators run on: one thread of its own at nice +10 (its blocking pool's
/// threads inherit it), so that building, hashing and sending checkpoints never compete at
/// equal weight with what the agent waits for (the task service, runc, the checkpoints); under
/// contention it gets about a tenth of a CPU's share, and all of an idle one. Measured on a
/// 2-CPU host at 16 sandboxes: replicators on the shim's own runtime exposed about +3% of delay
/// to the agent with the registry out of the way (`bench-replication`).
fn runtime() -> &'static tokio::runtime::Handle {
    static HANDLE: std::sync::OnceLock<tokio::runtime::Handle> = std::sync::OnceLock::new();
    HANDLE.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("crab-replication".into())
            .spawn(move || {
                // Kept for the thread's life (and inherited by the threads it starts).
                std::mem::forget(LowerPriority::new());
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match rt {
                    Ok(rt) => {
                        let _ = tx.send(Some(rt.handle().clone()));
                        rt.block_on(std::future::pending::<()>());
                    }
                    Err(e) => {
                        log::warn!("replication runtime: {e}; replicating on the shim's own");
                        let _ = tx.send(None);
                    }
                }
            });
        let handle = spawned.ok().and_then(|_| rx.recv().ok().flatten());
        handle.unwrap_or_else(tokio::runtime::Handle::current)
    })
}

/// The calling thread at a lower CPU priority (nice +10) while this lives; its own priority
/// back when dropped (a blocking-pool thread runs other work after).
struct LowerPriority(Option<libc::c_int>);

impl LowerPriority {
    fn new() -> LowerPriority {
        // SAFETY: gettid/getpriority/setpriority take and return plain integers; errno is
        // cleared first as getpriority's -1 is also a valid priority.
        unsafe {
            let tid = libc::gettid() as libc::id_t;
            *libc::__errno_location() = 0;
            let was = libc::getpriority(libc::PRIO_PROCESS, tid);
            if *libc::__errno_location() != 0 {
                return LowerPriority(None);
            }
            match libc::setpriority(libc::PRIO_PROCESS, tid, (was + 10).min(19)) {
                0 => LowerPriority(Some(was)),
                _ => LowerPriority(None),
            }
        }
    }
}

impl Drop for LowerPriority {
    fn drop(&mut self) {
        if let Some(was) = self.0 {
            // SAFETY: as above. Raising it back needs CAP_SYS_NICE, which the shim (root) has.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, was);
            }
        }
    }
}

fn not_found(e: &OciDistributionError) -> bool {
    match e {
        OciDistributionError::ImageManifestNotFoundError(_) => true,
        OciDistributionError::RegistryError { envelope, .. } => envelope.errors.iter().any(|x| {
            matches!(
                x.code,
                OciErrorCode::ManifestUnknown | OciErrorCode::NameUnknown | OciErrorCode::NotFound
            )
        }),
        _ => false,
    }
}

/// Pulls the newest replicated checkpoint of `lineage` from `registry` into a new store under
/// `namespace_dir` (`replica-<hash>-<unique>`, which [`lineage::newest`] then finds, and
/// `crabctl prune` removes once unused): its config verified first ([`artifact::verify`]:
/// signed by a trusted key, this lineage, taken on `image`), then every blob checked
/// against the signed digests as it is stored. `None`: the registry has none.
pub async fn pull_newest(
    registry: &Registry,
    lineage_name: &str,
    namespace_dir: &Path,
    image: Option<&str>,
    trusted: &TrustedKeys,
    max_bytes: u64,
) -> Result<Option<PathBuf>, ReplicationError> {
    let tag = artifact::newest_tag(lineage_name);
    let r = registry.authed(&tag).await;
    let manifest = match tokio::time::timeout(
        CALL_TIMEOUT,
        registry.client.pull_image_manifest(&r, &registry.auth),
    )
    .await
    {
        Err(_) => return Err(ReplicationError::NoAnswer(registry.name.clone())),
        Ok(Err(e)) if not_found(&e) => return Ok(None),
        Ok(Err(e)) => {
            return Err(ReplicationError::Pull {
                registry: registry.name.clone(),
                source: Box::new(e.into()),
            })
        }
        Ok(Ok((m, _))) => m,
    };
    let at = format!("{}:{tag}", registry.name);
    if manifest.config.media_type != MEDIA_TYPE_CONFIG {
        return Err(ReplicationError::NotCrab {
            at,
            media_type: manifest.config.media_type,
        });
    }
    if manifest.config.size < 0 || manifest.config.size as u64 > artifact::CONFIG_MAX {
        return Err(ReplicationError::ConfigTooLarge { at });
    }
    let config = pull_bytes(registry, &r, &manifest.config, artifact::CONFIG_MAX).await?;
    let v = match artifact::verify(&config, lineage_name, image, trusted) {
        Ok(v) => v,
        Err(source) => return Err(ReplicationError::Refused { at, source }),
    };
    let n = v.meta.fs_layers.len();
    if manifest.layers.len() < n {
        return Err(ReplicationError::TooFewBlobs {
            at,
            blobs: manifest.layers.len(),
            layers: n,
        });
    }
    let plans = match artifact::plan_files(&segment_refs(&manifest.layers[n..]), &v.criu) {
        Ok(plans) => plans,
        Err(source) => return Err(ReplicationError::Segments { at, source }),
    };
    let total: u64 = v.meta.fs_layers.iter().map(|d| d.size).sum::<u64>()
        + v.criu.values().map(|f| f.size).sum::<u64>();
    if total > max_bytes {
        return Err(ReplicationError::TooLarge { at, total });
    }
    let unique = format!(
        "replica-{}-{}",
        &sha256(lineage_name.as_bytes())[7..19],
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
    );
    let root = namespace_dir.join(&unique);
    let pulled = pull_into(registry, &r, &manifest, &v, &plans, &root).await;
    if pulled.is_err() {
        let _ = std::fs::remove_dir_all(&root);
    }
    pulled.map(|()| Some(root))
}

/// The CRIU blobs of a manifest, as [`artifact::plan_files`] checks them.
fn segment_refs(layers: &[OciDescriptor]) -> Vec<artifact::SegmentRef> {
    layers
        .iter()
        .map(|d| {
            let a = |k: &str| d.annotations.as_ref().and_then(|a| a.get(k)).cloned();
            artifact::SegmentRef {
                media_type: d.media_type.clone(),
                digest: d.digest.clone(),
                size: d.size,
                file: a(artifact::ANNOTATION_FILE),
                offset: a(artifact::ANNOTATION_OFFSET),
            }
        })
        .collect()
}

/// An in-memory sink that refuses to grow past its bound.
struct Bounded {
    data: Vec<u8>,
    max: usize,
}

impl Bounded {
    fn new(max: usize) -> Bounded {
        Bounded {
            data: Vec::with_capacity(max.min(64 << 20)),
            max,
        }
    }
}

impl tokio::io::AsyncWrite for Bounded {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if this.data.len() + buf.len() > this.max {
            return std::task::Poll::Ready(Err(std::io::Error::other(format!(
                "the registry sent more than the {} bytes it announced",
                this.max
            ))));
        }
        this.data.extend_from_slice(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }
}

async fn pull_bytes(
    registry: &Registry,
    r: &Reference,
    d: &OciDescriptor,
    max: u64,
) -> Result<Vec<u8>, ReplicationError> {
    if d.size < 0 || d.size as u64 > max {
        return Err(ReplicationError::BlobTooLarge {
            digest: d.digest.clone(),
            size: d.size,
        });
    }
    // A registry that sends more than the descriptor says is cut off at that size (the
    // client would otherwise take whatever it sends).
    let mut out = Bounded::new(d.size as usize);
    call(registry.client.pull_blob(r, d, &mut out)).await?;
    let out = out.data;
    if out.len() as i64 != d.size || sha256(&out) != d.digest {
        return Err(ReplicationError::BlobContent(d.digest.clone()));
    }
    Ok(out)
}

async fn pull_into(
    registry: &Registry,
    r: &Reference,
    manifest: &OciImageManifest,
    v: &artifact::Verified,
    plans: &[artifact::FilePlan],
    root: &Path,
) -> Result<(), ReplicationError> {
    let file_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ReplicationError::File { path, source }
    };
    let store = Store::open(root)?;
    let n = v.meta.fs_layers.len();
    for (want, d) in v.meta.fs_layers.iter().zip(&manifest.layers[..n]) {
        if d.digest != want.digest || d.size as u64 != want.size {
            return Err(ReplicationError::LayerNotSigned(d.digest.clone()));
        }
        let data = pull_bytes(registry, r, d, want.size).await?;
        let mut tmp = store.temp_file("pull")?;
        let tmp_path = tmp.path().to_path_buf();
        std::io::Write::write_all(tmp.file(), &data).map_err(file_err(&tmp_path))?;
        let got = store.put_blob(tmp.path())?;
        if got.digest != want.digest || got.diff_id != want.diff_id {
            return Err(ReplicationError::DiffId {
                digest: want.digest.clone(),
                got: got.diff_id,
                want: want.diff_id.clone(),
            });
        }
    }
    let process = match &v.meta.process {
        None => None,
        Some(p) => {
            let dir = store.proc_dir(1);
            std::fs::create_dir_all(&dir).map_err(file_err(&dir))?;
            let mut bytes = 0u64;
            let segments = &manifest.layers[n..];
            for plan in plans {
                let path = dir.join(&plan.name);
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(file_err(&path))?;
                let mut whole = Sha256::new();
                for &i in &plan.segments {
                    let d = &segments[i];
                    let data = pull_bytes(registry, r, d, plan.want.size).await?;
                    whole.update(&data);
                    std::io::Write::write_all(&mut file, &data).map_err(file_err(&path))?;
                    bytes += data.len() as u64;
                }
                if digest_string(whole) != plan.want.sha256 {
                    return Err(ReplicationError::FileDigest(plan.name.clone()));
                }
            }
            Some(ProcessImage {
                image: crate::checkpoint::store::proc_image_name(1),
                bytes_stored: bytes,
                bytes_logical: bytes,
                pids: p.pids.clone(),
            })
        }
    };
    let mut m = Manifest::child_of(None, 1, &v.meta.source.turn_id, v.config.kind);
    m.fs_layers = v.meta.fs_layers.clone();
    m.process = process;
    m.created_at = v.meta.created_at.clone();
    m.volumes = v.meta.volumes.clone();
    m.explanation = format!(
        "replicated from {}/{} checkpoint {} through {}",
        v.meta.source.namespace, v.meta.source.container, v.meta.source.seq, registry.name
    );
    store.publish(&m)?;
    lineage::record(
        &store,
        &LineageRecord::new(&v.config.lineage, Some(v.config.image.clone())),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    #[test]
    fn credentials_files_and_registry_names_that_are_wrong_say_how() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("auth.json");
        let auth = |text: &str| {
            std::fs::write(&path, text).unwrap();
            auth_from_file(&path, "reg.example")
        };
        let e = auth("{").unwrap_err();
        assert!(
            matches!(&e, ReplicationError::AuthFile { source: AuthError::Json(_), path: p } if *p == path),
            "{e}"
        );
        let e = auth(r#"{"auths": {"reg.example": {"auth": "!!"}}}"#).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{}: the auth of reg.example: ", path.display())),
            "{e}"
        );
        let e = auth(r#"{"auths": {"reg.example": {"auth": "bm9jb2xvbg=="}}}"#).unwrap_err();
        assert!(
            matches!(&e, ReplicationError::AuthFile { source: AuthError::NotUserPassword(r), .. } if r == "reg.example"),
            "{e}"
        );
        assert!(matches!(
            auth(r#"{"auths": {"other": {"auth": "!!"}}}"#),
            Ok(RegistryAuth::Anonymous)
        ));
        let e = auth_from_file(&d.path().join("none"), "reg.example").unwrap_err();
        assert!(
            matches!(
                &e,
                ReplicationError::AuthFile {
                    source: AuthError::Read(_),
                    ..
                }
            ),
            "{e}"
        );
        let config = ReplicationConfig {
            registry: Some("reg.example".into()),
            ..ReplicationConfig::default()
        };
        let e = Registry::from_config(&config).err().unwrap();
        assert_eq!(e.to_string(), "reg.example: no repository");
    }

    #[tokio::test]
    async fn a_blob_sink_takes_its_bound_and_no_more() {
        let mut b = Bounded::new(10);
        b.write_all(b"0123456789").await.unwrap();
        assert_eq!(b.data, b"0123456789");
        let e = b.write_all(b"x").await.unwrap_err();
        assert!(e.to_string().contains("more than the 10 bytes"), "{e}");
        assert_eq!(b.data.len(), 10, "nothing past the bound is kept");
        // A huge announced size reserves a bounded amount up front.
        assert!(Bounded::new(usize::MAX / 2).data.capacity() <= 64 << 20);
    }
}

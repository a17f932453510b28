//! crabctl's work with checkpoints through containerd: export a checkpoint as an OCI image,
//! and start containers from one (fork, rollback, recover). The binary only parses arguments.
//!
//! - [`image`]: the checkpoint image as data (base image stripping, manifest and config,
//!   the checkpoint layer with `.crab-checkpoint/`), no I/O to containerd;
//! - [`client`]: the containerd API calls (leases, content, images, snapshots and the differ,
//!   containers, tasks);
//! - [`export`]: choosing a checkpoint in a container's store and exporting it;
//! - [`lifecycle`]: unpacking it and starting containers from it;
//! - [`pod`]: a Kubernetes pod's container by pod and container name (CRI records);
//! - [`prune`]: removing the stores and internal images of containers that are gone.
//!
//! Every operation first does everything that can fail without touching the source container
//! (read the store, write the image, unpack it), so bad input leaves nothing behind; content
//! and snapshots are written under a lease until an image or a container references them.

pub mod client;
pub mod export;
pub mod image;
pub mod lifecycle;
pub mod pod;
pub mod prune;

use std::path::{Path, PathBuf};

use containerd_client::services::v1::Container;
use crab_runtime_config::{Config, ConfigError};

pub use self::{
    client::Client,
    export::{select_checkpoint, Exported},
    lifecycle::{clone_spec, Forked, Phases, Restarted, RolledBack},
    pod::{PodContainer, PodError, Resolved},
};
use crate::checkpoint::{pages::PagesError, store::StoreError};

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("cannot connect to containerd at {address}: {reason}")]
    Connect { address: PathBuf, reason: String },
    #[error("{op}: {message} ({code:?})")]
    Grpc {
        op: String,
        code: tonic::Code,
        message: String,
    },
    #[error("no container {container} in namespace {namespace}")]
    NoContainer {
        namespace: String,
        container: String,
    },
    #[error("{container} has no checkpoint store at {path} (is it run by the crab runtime, with this state_dir?)")]
    NoStore { container: String, path: PathBuf },
    #[error("{container} has no checkpoint {turn}; it has: {available}")]
    NoCheckpoint {
        container: String,
        turn: String,
        available: String,
    },
    #[error("checkpoint {seq} of {container} (turn {turn_id:?}) failed: it is not a recovery point; usable: {available}")]
    FailedCheckpoint {
        container: String,
        seq: u64,
        turn_id: String,
        available: String,
    },
    #[error("{container} has no recovery point yet (no checkpoint, or only failed ones)")]
    NoRecoveryPoint { container: String },
    #[error("image {0} is not in containerd's content store")]
    NoImage(String),
    #[error("image {0}: {1}")]
    BadImage(String, String),
    #[error("{container}'s rootfs is not built on its image {image} any more (the name points elsewhere now): cannot tell its base layers")]
    BaseMismatch { container: String, image: String },
    #[error("layer {digest} of checkpoint {seq} is neither in the store ({store}) nor in containerd's content store")]
    MissingLayer {
        digest: String,
        seq: u64,
        store: PathBuf,
    },
    #[error("container {0} already exists")]
    Exists(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("crab config: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Image(#[from] image::ImageError),
    #[error(transparent)]
    Pages(#[from] PagesError),
    #[error(transparent)]
    Pod(#[from] PodError),
    #[error(transparent)]
    Provenance(#[from] crate::checkpoint::provenance::ProvenanceError),
}

pub type Result<T, E = CtlError> = std::result::Result<T, E>;

/// crab's config for `container` as its shim loads it: `explicit` (`--config`) if given, else
/// the container's runtime options (inline TOML or a path), else the default file or defaults.
pub fn config_for(explicit: Option<&Path>, container: &Container) -> Result<Config> {
    if let Some(path) = explicit {
        return Ok(Config::load(path)?);
    }
    let options = container
        .runtime
        .as_ref()
        .and_then(|r| r.options.as_ref())
        .filter(|o| {
            o.type_url
                .ends_with(crab_runtime_config::RUNTIME_OPTIONS_TYPE_URL)
        })
        .map(|o| crab_runtime_config::decode_runtime_options(&o.value))
        .transpose()?;
    Ok(crab_runtime_config::RuntimeOptions::load_config(options.as_ref())?.0)
}

/// What every operation needs: containerd, and where crab's config is when the container's
/// own runtime options do not say.
#[derive(Clone)]
pub struct Ctl {
    pub client: Client,
    /// `--config`: overrides the config the container's runtime options name.
    pub config: Option<PathBuf>,
}

impl Ctl {
    pub fn new(client: Client, config: Option<PathBuf>) -> Ctl {
        Ctl { client, config }
    }

    pub fn namespace(&self) -> &str {
        self.client.namespace()
    }

    /// The container record, or a clear error.
    pub async fn container(&self, id: &str) -> Result<Container> {
        self.client
            .container(id)
            .await?
            .ok_or_else(|| CtlError::NoContainer {
                namespace: self.namespace().to_string(),
                container: id.to_string(),
            })
    }

    /// crab's config for `container` as its shim loads it: `--config` if given, else the
    /// container's runtime options (inline TOML or a path), else the default file or defaults.
    pub fn config_for(&self, container: &Container) -> Result<Config> {
        config_for(self.config.as_deref(), container)
    }

    /// The directory of container `id`'s checkpoint store and turn answers, as its shim
    /// chose it (see [`Ctl::config_for`]). A store outlives its container: for an id without
    /// a record, `--config` or the default config says where.
    pub async fn sandbox_dir(&self, id: &str) -> Result<PathBuf> {
        let config = match self.client.container(id).await? {
            Some(record) => self.config_for(&record)?,
            None => Config::load_or_default(self.config.as_deref())?.0,
        };
        Ok(crate::turns::sandbox_dir(
            &config.store.state_dir,
            self.namespace(),
            id,
        ))
    }

    /// The checkpoint store directory of `container`.
    pub fn store_root(&self, container: &Container) -> Result<PathBuf> {
        let config = self.config_for(container)?;
        let root =
            crate::turns::sandbox_dir(&config.store.state_dir, self.namespace(), &container.id);
        if !root.join("checkpoints").is_dir() {
            return Err(CtlError::NoStore {
                container: container.id.clone(),
                path: root,
            });
        }
        Ok(root)
    }
}

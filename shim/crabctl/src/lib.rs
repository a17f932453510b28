//! crabctl, crab's command line for people and agent harnesses: ending turns, reading turn
//! answers and checkpoint lineages, exporting a checkpoint as an OCI image and starting
//! containers from one (fork, rollback, recover), the host engine's state, and pruning what
//! removed containers left behind. The binary (`main.rs`) parses, runs and exits.
//!
//! - [`cli`]: the command line (clap): commands, flags, help text, shell completions;
//! - [`commands`]: each command, run against containerd and crab's store, printing its output;
//! - [`error`]: [`CtlError`] and the one mapping from an error to an exit status;
//! - [`image`]: the checkpoint image as data (base image stripping, manifest and config,
//!   the checkpoint layer with `.crab-checkpoint/`), no I/O to containerd;
//! - [`client`]: the containerd API calls (leases, content, images, snapshots and the differ,
//!   containers, tasks);
//! - [`export`]: choosing a checkpoint in a container's store and exporting it;
//! - [`archive`]: an exported image as an image archive file (`docker load`-able);
//! - [`rootfs`]: the overlay layers of a rootfs the caller mounted (Docker's), for its base;
//! - [`lifecycle`]: unpacking it and starting containers from it;
//! - [`answer`]: the turn answers of a store as typed data; [`diff`]: what changed between
//!   two checkpoints or turns, from the answers and manifests;
//! - [`output`]: `-o json`, the documents every list/show command prints;
//! - [`progress`]: progress of long operations (export, fork) on stderr;
//! - [`pod`]: a Kubernetes pod's container by pod and container name (CRI records);
//! - [`resolve`]: CONTAINER as spelled: an id, a unique id prefix, a Docker container name;
//! - [`docker`]: the containers dockerd owns, and dockerd's names for them (its API);
//! - [`prune`]: removing the stores and internal images of containers that are gone;
//! - [`metrics`]: the host's figures in the OpenMetrics text format (`crabctl metrics`).
//!
//! Every operation first does everything that can fail without touching the source container
//! (read the store, write the image, unpack it), so bad input leaves nothing behind; content
//! and snapshots are written under a lease until an image or a container references them.

pub mod answer;
pub mod archive;
pub mod cli;
pub mod client;
pub mod commands;
pub mod diff;
pub mod docker;
pub mod error;
pub mod export;
pub mod image;
pub mod lifecycle;
pub mod lineages;
pub mod metrics;
pub mod output;
pub mod pod;
pub mod progress;
pub mod prune;
pub mod resolve;
pub mod rootfs;

use std::path::{Path, PathBuf};

use containerd_client::services::v1::Container;
use crab_runtime_config::Config;

pub use self::{
    client::Client,
    error::{CtlError, ErrorKind, Result},
    export::{select_checkpoint, ExportOptions, Exported},
    lifecycle::{clone_spec, Fork, ForkTimes, Forked, Phases, Restarted, RolledBack},
    pod::{PodContainer, PodError, Resolved},
};

/// crab's config for `container` as its shim loads it: `explicit` (`--config`) if given, else
/// what the container's runtime options lead to: crab's own name the config (inline TOML or a
/// path); with runc's (crab registered with runc's runtime type) or none, `$CRAB_CONFIG`, the
/// default file or the defaults, with runc's settings on top.
pub fn config_for(explicit: Option<&Path>, container: &Container) -> Result<Config> {
    if let Some(path) = explicit {
        return Ok(Config::load(path)?);
    }
    let options = match container.runtime.as_ref().and_then(|r| r.options.as_ref()) {
        Some(o) => crab_runtime_config::ShimOptions::decode(&o.type_url, &o.value)?,
        None => crab_runtime_config::ShimOptions::None,
    };
    Ok(options.load_config()?.0)
}

/// What every operation needs: containerd, and where crab's config is when the container's
/// own runtime options do not say.
#[derive(Clone)]
pub struct Ctl {
    pub client: Client,
    /// `--config`: overrides the config the container's runtime options name.
    pub config: Option<PathBuf>,
    /// `DOCKER_HOST`: where dockerd is asked about its containers in namespace `moby`.
    pub docker_host: Option<String>,
    /// Where export and fork report their progress (off by default).
    pub progress: progress::Progress,
}

impl Ctl {
    pub fn new(client: Client, config: Option<PathBuf>) -> Ctl {
        Ctl {
            client,
            config,
            docker_host: None,
            progress: progress::Progress::off(),
        }
    }

    /// The same, reporting the progress of export and fork to `progress`.
    pub fn with_progress(mut self, progress: progress::Progress) -> Ctl {
        self.progress = progress;
        self
    }

    /// The same, asking dockerd at `docker_host` (`DOCKER_HOST`; `None`: Docker's default).
    pub fn with_docker_host(mut self, docker_host: Option<String>) -> Ctl {
        self.docker_host = docker_host;
        self
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
        Ok(crab_shim::sandbox::sandbox_dir(
            &config.store.state_dir,
            self.namespace(),
            id,
        ))
    }

    /// The checkpoint store directory of `container`.
    pub fn store_root(&self, container: &Container) -> Result<PathBuf> {
        let config = self.config_for(container)?;
        let root = crab_shim::sandbox::sandbox_dir(
            &config.store.state_dir,
            self.namespace(),
            &container.id,
        );
        if !root.join("checkpoints").is_dir() {
            return Err(CtlError::NoStore {
                container: container.id.clone(),
                path: root,
            });
        }
        Ok(root)
    }
}

//! The shim core's error: what the task core ([`crate::containers`] and the modules it drives)
//! returns to the protocol edge, which maps each kind to a status code (in
//! `service::status`, the one place that knows the codes).
//!
//! Failures of a subsystem keep their own typed error as the source (runc's, the checkpoint
//! store's, a system call's errno), so a caller can tell a full disk from a corrupt image;
//! the message clients see is the one the shim always sent.

use crate::{reaper::ReaperError, runc::RuncError};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0} not found")]
    NotFound(String),
    #[error("{0} already exists")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("{0} is not implemented by crab")]
    Unimplemented(&'static str),
    #[error("configuration: {0}")]
    Config(#[from] crab_runtime_config::ConfigError),
    /// A runc invocation failed (its message is worded as containerd's runc shim words it).
    #[error(transparent)]
    Runc(#[from] RuncError),
    /// A helper command could not be run, or its exit not learnt, through the reaper.
    #[error(transparent)]
    Reaper(#[from] ReaperError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// A system call failed (the errno is the source).
    #[error("{context}: {source}")]
    Sys {
        context: String,
        #[source]
        source: nix::Error,
    },
    /// A file crab wrote itself (runc settings in the bundle) could not be read back or written.
    #[error("{context}: {source}")]
    Json {
        context: String,
        #[source]
        source: serde_json::Error,
    },
    /// A rootfs mount failed (`what`: its type and source).
    #[error("cannot mount rootfs ({what}): {source}")]
    Mount {
        what: String,
        #[source]
        source: containerd_shim::Error,
    },
    /// A pid file (runc's `--pid-file`) does not hold a pid.
    #[error("bad pid `{text}` in {}", path.display())]
    Pid {
        text: String,
        path: std::path::PathBuf,
        #[source]
        source: std::num::ParseIntError,
    },
    /// Work handed to a blocking task never finished: the task panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// Something the shim waited for did not happen in time (runc's console, a restore, a
    /// logging binary's readiness).
    #[error("{0}")]
    TimedOut(String),
    /// The container's cgroup (or the controller asked for) is not where it must be.
    #[error("{0}")]
    NoCgroup(String),
    /// A logging binary (`binary://` stdout) exited or misbehaved before it was ready.
    #[error("{0}")]
    Logger(String),
    /// Container `id` cannot be restored from its checkpoint (its trust decision, the image's
    /// claims against the spec, its rootfs binding, CRIU's restore gate): the restore
    /// subsystem's typed error is the source.
    #[error("cannot restore {id}: {source}")]
    Restore {
        id: String,
        #[source]
        source: Source,
    },
    /// Container `id` cannot start from crab's checkpoint (`from`: "its image" when taking it
    /// out of the rootfs failed, "its checkpoint" when its tracked volumes did).
    #[error("cannot start {id} from {from}: {source}")]
    StartFrom {
        id: String,
        from: &'static str,
        #[source]
        source: Source,
    },
    /// Container `id` cannot resume its lineage from checkpoint `from` (which one, or the
    /// registry's newest).
    #[error("cannot resume {id} from {from}: {source}")]
    Resume {
        id: String,
        from: String,
        #[source]
        source: Source,
    },
    /// The restore of container `id` ran and failed (`source`: why, runc's error or a refusal
    /// of the restored processes); `criu` is what CRIU logged as errors, `log` its log.
    #[error("cannot restore {id} from its checkpoint: {source}{criu} (log: {})", log.display())]
    Restored {
        id: String,
        source: Box<Error>,
        criu: String,
        log: std::path::PathBuf,
    },
    /// Restored processes were refused before they ran, or lost (the kernel check, the page
    /// files' verdict, a lazy restore's page daemon): the restore's typed reason.
    #[error(transparent)]
    Refused(Source),
    /// Container `id` cannot be checkpointed as asked (a process would be missing from the
    /// image).
    #[error("cannot checkpoint {id}: {source}")]
    Checkpoint {
        id: String,
        #[source]
        source: Source,
    },
    /// containerd's checkpoint of container `id` was dumped and cannot be signed.
    #[error("cannot sign the checkpoint of {id}: {source}")]
    Sign {
        id: String,
        #[source]
        source: Source,
    },
    /// What a restore needs cannot be used (`what`: `[replication]`, the trusted keys).
    #[error("{what}: {source}")]
    Unusable {
        what: &'static str,
        #[source]
        source: Source,
    },
    /// A turn's checkpoint, or the checkpoint store under it, did not happen: the capture
    /// subsystem's typed error (`checkpoint::CheckpointError`) is the source, and the edge
    /// tells by its kind whether the client can act on it (not yet durable, an exec still
    /// running, no slot, a deadline) or it failed.
    #[error(transparent)]
    Capture(Source),
    /// An in-place rollback of container `id` to checkpoint `seq` failed part-way (rollback's
    /// typed error is the source): its files match neither the checkpoint nor the chain.
    #[error(
        "in-place rollback of {id} to checkpoint {seq}: {source}; roll it back by recreating it \
         (crabctl rollback --recreate)"
    )]
    Rollback {
        id: String,
        seq: u64,
        #[source]
        source: Source,
    },
    #[error("{0}")]
    Other(String),
}

/// A subsystem's own typed error kept whole as the source of a core [`Error`]. The
/// subsystems that make these (restore, replication, checkpoint signing) sit above this
/// layer, so the type is named where the error is made and got back by downcasting
/// (`source.downcast_ref::<RestoreError>()`); the variant holding it is its kind.
pub type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

impl Error {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }

    pub fn sys(context: impl Into<String>) -> impl FnOnce(nix::Error) -> Error {
        let context = context.into();
        move |source| Error::Sys { context, source }
    }
}

impl From<crate::sys::cgroup::CgroupError> for Error {
    fn from(e: crate::sys::cgroup::CgroupError) -> Self {
        match e {
            crate::sys::cgroup::CgroupError::Io { context, source } => {
                Error::Io { context, source }
            }
        }
    }
}

impl From<nix::Error> for Error {
    fn from(e: nix::Error) -> Self {
        Error::Io {
            context: "system call".into(),
            source: std::io::Error::from(e),
        }
    }
}

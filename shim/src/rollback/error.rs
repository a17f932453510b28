//! What can go wrong giving files their state at a checkpoint: reading its layers, writing
//! the files, squashing layers ([`RollbackError`]), the lineage check ([`LineageError`]), and
//! why an in-place rollback is refused or fails ([`ResetError`]). Typed until the sandbox
//! turns them into the task core's error.

use std::{io, path::PathBuf};

use super::tar::TarError;
use crate::{
    checkpoint::store::StoreError,
    inspector::{fs::FsError, InspectError},
};

/// Reading a checkpoint's layers, and writing the files they give.
#[derive(Debug, thiserror::Error)]
pub enum RollbackError {
    /// A layer blob could not be read, or is not what its descriptor names.
    #[error("layer {digest} ({}): {source}", path.display())]
    Layer {
        digest: String,
        path: PathBuf,
        #[source]
        source: LayerProblem,
    },
    /// A path of the container could not be given its state (`what`: the step, `rel`: the path
    /// below the root).
    #[error("{what} /{}: {source}", rel.display())]
    Path {
        what: &'static str,
        rel: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{total} bytes of file data to write, more than [limits] max_layer_bytes ({max})")]
    TooMuchData { total: u64, max: u64 },
    /// A layer blob could not be opened (or decompressed) to copy data out of it.
    #[error("{}: {source}", path.display())]
    Blob {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("reading its upperdir: {0}")]
    Upperdir(#[source] FsError),
    #[error("opening {}: {source}", path.display())]
    Root {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A temporary file of the store (squashing) could not be made.
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{}: {source}", path.display())]
    TempFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The squashed layer could not be written (`out`: its file).
    #[error("squashing into {}: {source}", out.display())]
    Squash {
        out: PathBuf,
        #[source]
        source: StoreError,
    },
    /// The uncompressed copy of a layer being squashed could not be read.
    #[error("squashing into {}: {source}", out.display())]
    SquashRead {
        out: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("squashing into {}: {} has no data", out.display(), path.display())]
    NoData { out: PathBuf, path: PathBuf },
    #[error("squashing into {}: the data of {} ends early: {source}", out.display(), path.display())]
    DataEndsEarly {
        out: PathBuf,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// What is wrong with a layer blob.
#[derive(Debug, thiserror::Error)]
pub enum LayerProblem {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Tar(#[from] TarError),
    #[error("its content has digest {0}: it is damaged")]
    Digest(String),
}

/// Why the files of a checkpoint cannot be reached from the container's present.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineageError {
    #[error("checkpoint {0} failed: it is no recovery point")]
    NotDurable(u64),
    #[error("the newest checkpoint ({0}) failed: the files of its turns are in no layer")]
    NewestFailed(u64),
    #[error(
        "the container's files no longer descend from checkpoint {0}'s layers (a later \
         checkpoint began a new chain, or it is on another branch)"
    )]
    Diverged(u64),
    #[error("checkpoint {0} is older than the checkpoint image the container was started from")]
    OlderThanImage(u64),
}

/// Why a rollback was not done in place.
#[derive(Debug, thiserror::Error)]
pub enum ResetError {
    /// Nothing was changed: the container can be rolled back by recreating it.
    #[error(transparent)]
    Refused(#[from] Refusal),
    /// Files may have been changed: the container must be rolled back by recreating it.
    #[error("resetting the files failed part way: {0}")]
    Failed(#[source] Failure),
}

/// Why an in-place rollback was refused before anything changed.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    Lineage(#[from] LineageError),
    #[error("the container has a user namespace of its own: its files are reset by recreating it")]
    OwnUserNamespace,
    #[error("cannot read its id maps: {path}: {source}")]
    IdMaps {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("its rootfs is not an overlay")]
    NotOverlay,
    #[error("cannot read checkpoint {seq}: {source}")]
    Checkpoint {
        seq: u64,
        #[source]
        source: Box<RollbackError>,
    },
    #[error("cannot read the layers after checkpoint {seq}: {source}")]
    LaterLayers {
        seq: u64,
        #[source]
        source: Box<RollbackError>,
    },
    #[error("the container cannot be fully observed now: {}", .0.join("; "))]
    Degraded(Vec<String>),
    /// The inspection's answer now (its summary).
    #[error("its processes changed since the last turn end ({0})")]
    ProcessesChanged(String),
    #[error("the container cannot be observed now")]
    Unobservable,
    #[error("cannot find its freezer: {0}")]
    Freezer(#[source] io::Error),
    #[error("cannot freeze it: {0}")]
    Freeze(#[source] io::Error),
    #[error("{0} process events (fork, exec, exit) while the rollback began")]
    ProcessEvents(u64),
    #[error("the kernel counters cannot be read")]
    NoCounters,
    #[error("its processes' kernel state changed while the rollback began: {}", .0.join("; "))]
    KernelState(Vec<String>),
    #[error("cannot scan its files: {0}")]
    Scan(#[source] Box<InspectError>),
    #[error("cannot open its root: {0}")]
    Root(#[source] io::Error),
}

/// Why an in-place rollback failed part way (files may have changed).
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error(transparent)]
    Apply(#[from] RollbackError),
    #[error("cannot scan the files reset: {0}")]
    Rescan(#[source] Box<InspectError>),
    #[error("cannot thaw it: {0}")]
    Thaw(#[source] io::Error),
}

//! What can go wrong with a checkpoint: one error type for the coordinator and its jobs, kept
//! typed until it leaves the checkpoint subsystem (a failed job's manifest and log say it in
//! words; an action that waited too long gets it as the task core's error).

use std::{fmt, time::Duration};

use super::{deadline::Aborted, layer::LayerError, process::ProcError, store::StoreError};
use crate::{engine::EngineError, inspector::fs::FsError};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The store could not be read or written ([`StoreError::is_no_space`]: a full disk).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The fs layer could not be written.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// The upperdir could not be scanned (a new chain after a failure).
    #[error(transparent)]
    Scan(#[from] FsError),
    /// The process image could not be taken (or the check before it failed).
    #[error("process checkpoint: {0}")]
    Process(#[from] ProcError),
    /// The origin of a restored container could not be imported (a restore error, kept as
    /// its source: restore depends on checkpoint, not the other way round).
    #[error("{0}")]
    Origin(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the rootfs is not an overlay: no fs checkpoint possible")]
    NotOverlay,
    #[error("find the container's freezer: {0}")]
    Freezer(#[source] std::io::Error),
    /// The id maps of the container's user namespace could not be read.
    #[error("read the container's user namespace id maps: {0}")]
    IdMaps(#[source] super::tar::IdMapError),
    /// The job got no slot of the host engine in time.
    #[error("no checkpoint taken: {0}")]
    NoSlot(#[from] EngineError),
    /// An exec's main process still ran when the job gave up waiting for it.
    #[error(
        "no process checkpoint: {outside} still running {gave_up}; an exec's main process is \
         outside the process tree `runc checkpoint` dumps (its parent is the shim, not the \
         container's init), so a checkpoint is only possible once it has ended"
    )]
    ExecsRunning { outside: String, gave_up: GaveUp },
    /// The job held its engine slot past `[engine] job_timeout_ms` and was aborted; `late` is
    /// how it ended within the grace it was then given, if it failed.
    #[error(
        "the checkpoint held its engine slot longer than {limit:?} ([engine] job_timeout_ms) and \
         was aborted: {aborted}{}",
        late.as_ref().map(|e| format!(" ({e})")).unwrap_or_default()
    )]
    Deadline {
        limit: Duration,
        aborted: Aborted,
        late: Option<Box<CheckpointError>>,
    },
    /// A step of a job that was aborted at its deadline (it starts nothing more).
    #[error("aborted at its deadline")]
    Aborted,
    /// The container was restored lazily and its memory had not all arrived (or never will:
    /// the page transfer failed and the container was killed).
    #[error("no process checkpoint: {0}")]
    LazyRestore(String),
    /// The inspection the job needed is gone (the container is being deleted, or it was lost).
    #[error("the container is no longer inspected")]
    NotInspected,
    /// The inspection was lost to a panic (said in full).
    #[error("{0}")]
    InspectionLost(String),
    /// A blocking task of the job died (panicked).
    #[error("{what} task: {source}")]
    Task {
        what: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
    /// An action waited for the checkpoint of earlier turns longer than the wait bound.
    #[error(
        "{action} on {container} waited {waited:?} for the checkpoint of turn(s) {turns:?}, \
         which is still not durable ([checkpoint] action_wait_timeout_ms)"
    )]
    NotDurable {
        action: super::action::Action,
        container: String,
        waited: Duration,
        turns: Vec<String>,
    },
}

impl CheckpointError {
    /// A `JoinError` of the blocking task doing `what`.
    pub fn task(what: &'static str) -> impl FnOnce(tokio::task::JoinError) -> CheckpointError {
        move |source| CheckpointError::Task { what, source }
    }
}

/// Why a job stopped waiting for the execs outside init's tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GaveUp {
    /// The next action is a kill, which would otherwise wait for the very process it ends.
    Kill { after: Duration },
    /// The action wait bound passed.
    Bound(Duration),
}

impl fmt::Display for GaveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GaveUp::Kill { after } => write!(
                f,
                "when the next action (a kill) arrived {after:?} after the checkpoint began waiting for it"
            ),
            GaveUp::Bound(bound) => write!(
                f,
                "{bound:?} after the checkpoint began waiting for it ([checkpoint] action_wait_timeout_ms)"
            ),
        }
    }
}

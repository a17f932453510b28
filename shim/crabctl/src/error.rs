//! crabctl's errors, and the one mapping from an error to the exit status a script sees.
//!
//! Every command returns a [`CtlError`]. [`CtlError::kind`] sorts it into one of three kinds
//! ([`ErrorKind`]), and [`ErrorKind::exit_code`] gives each its status:
//!
//! | status | meaning |
//! |---|---|
//! | 0 | success |
//! | 1 | failed: anything else (containerd unreachable, I/O, a corrupt store, a step that broke) |
//! | 2 | usage error: the command line does not parse (clap's status), or names a container ambiguously |
//! | 3 | not found: the container, pod, checkpoint, turn or store named does not exist |
//! | 4 | refused: the request cannot be done as asked (a failed checkpoint, a pod's container for fork/rollback/recover, a container the shim does not inspect, an untrusted image, a bad config) |

use std::path::PathBuf;

use crab_runtime_config::ConfigError;
use crab_shim::{
    checkpoint::{pages::PagesError, provenance::ProvenanceError, store::StoreError},
    engine::EngineError,
};

use crate::{image::ImageError, pod::PodError};

/// The exit status of a usage error (clap's own).
pub const EXIT_USAGE: u8 = 2;

/// The exit statuses, as `crabctl --help` and docs/crabctl.md list them.
pub const EXIT_CODES_HELP: &str = "\
Exit status:
  0  success
  1  failed: anything else (containerd unreachable, I/O, a corrupt store, a step that broke)
  2  usage error: the command line does not parse, or names a container ambiguously
     (an id prefix several containers share)
  3  not found: the container, pod, checkpoint, turn or store named does not exist
  4  refused: the request cannot be done as asked (a failed checkpoint, a pod's container for
     fork/rollback/recover, a container the shim does not inspect, an untrusted or unusable
     image, a bad config)";

/// What kind of failure an error is, for the exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Anything not below: nothing the caller named was wrong, a step failed.
    Failed,
    /// A container, pod, checkpoint, turn or store named by the caller does not exist.
    NotFound,
    /// The request is well-formed but cannot be done as asked.
    Refused,
    /// The command line names something ambiguously (clap's own usage errors exit alike).
    Usage,
}

impl ErrorKind {
    /// The exit status of this kind of failure (see the module docs).
    pub fn exit_code(self) -> u8 {
        match self {
            ErrorKind::Failed => 1,
            ErrorKind::NotFound => 3,
            ErrorKind::Refused => 4,
            ErrorKind::Usage => EXIT_USAGE,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("cannot connect to containerd at {address}: {reason} (is containerd running? --address or $CONTAINERD_ADDRESS names its socket)")]
    Connect { address: PathBuf, reason: String },
    #[error("{op}: {message} ({code:?})")]
    Grpc {
        op: String,
        code: tonic::Code,
        message: String,
    },
    #[error("no container {container} in namespace {namespace} (`ctr -n {namespace} containers ls` lists them; --namespace names another namespace)")]
    NoContainer {
        namespace: String,
        container: String,
    },
    #[error("{prefix} is ambiguous in namespace {namespace}: it begins the ids of {} (give more of the id)", .candidates.join(", "))]
    Ambiguous {
        namespace: String,
        prefix: String,
        candidates: Vec<String>,
    },
    #[error("{container} has no checkpoint store at {path} (is it run by the crab runtime, with this state_dir? --config names the config whose state_dir holds it)")]
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
    #[error("{container} has no recovery point yet (no checkpoint, or only failed ones): end a turn to take one (crabctl turn-end {container})")]
    NoRecoveryPoint { container: String },
    #[error("no turns of {container} in {}: {source} (has a turn of it ended? --config names the config whose state_dir holds them)", dir.display())]
    NoTurns {
        container: String,
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{container} has no turn {turn} (crabctl turns {container} lists them)")]
    NoTurn { container: String, turn: String },
    #[error("{container} has no checkpoint or turn {point:?} to diff; it has {available}")]
    NoDiffPoint {
        container: String,
        point: String,
        available: String,
    },
    #[error("turn answer {}: {reason}", path.display())]
    BadAnswer { path: PathBuf, reason: String },
    #[error("image {0} is not in containerd's content store (pull or import it again)")]
    NoImage(String),
    #[error("image {0}: {1}")]
    BadImage(String, String),
    #[error("{container}'s rootfs is not built on its image {image} any more (the name points elsewhere now): cannot tell its base layers (--base-image REF names the image it was built on)")]
    BaseMismatch { container: String, image: String },
    #[error("layer {digest} of checkpoint {seq} is neither in the store ({store}) nor in containerd's content store: that checkpoint cannot be exported any more (--turn T names another; crabctl checkpoints lists them)")]
    MissingLayer {
        digest: String,
        seq: u64,
        store: PathBuf,
    },
    #[error("container {0} already exists (remove it first, or give another id)")]
    Exists(String),
    /// The request cannot be done as asked (a precondition the caller can fix).
    #[error("{0}")]
    Refused(String),
    /// A step failed for a reason the caller did not cause.
    #[error("{0}")]
    Failed(String),
    /// One fork of several failed (the others were removed again).
    #[error("fork {id}: {source}")]
    Fork {
        id: String,
        #[source]
        source: Box<CtlError>,
    },
    /// A rollback's or recovery's new task did not start (its container record is kept).
    #[error("{container}'s new task did not start: {source} (its record is kept: crabctl recover {container} tries again)")]
    Restart {
        container: String,
        #[source]
        source: Box<CtlError>,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{failures} removals failed (see above): fix what they say, then run crabctl prune again"
    )]
    PruneFailures { failures: usize },
    #[error("crab config: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Pages(#[from] PagesError),
    #[error(transparent)]
    Pod(#[from] PodError),
    #[error(transparent)]
    Provenance(#[from] ProvenanceError),
    #[error(transparent)]
    Engine(#[from] EngineError),
}

pub type Result<T, E = CtlError> = std::result::Result<T, E>;

impl CtlError {
    /// The kind of this error (every variant decides: no wildcard, so a new one must too).
    pub fn kind(&self) -> ErrorKind {
        use ErrorKind::*;
        match self {
            CtlError::Grpc { code, .. } => match code {
                tonic::Code::NotFound => NotFound,
                tonic::Code::InvalidArgument
                | tonic::Code::FailedPrecondition
                | tonic::Code::AlreadyExists
                | tonic::Code::PermissionDenied
                | tonic::Code::OutOfRange => Refused,
                _ => Failed,
            },
            CtlError::NoContainer { .. }
            | CtlError::NoStore { .. }
            | CtlError::NoCheckpoint { .. }
            | CtlError::NoRecoveryPoint { .. }
            | CtlError::NoTurns { .. }
            | CtlError::NoTurn { .. }
            | CtlError::NoDiffPoint { .. } => NotFound,
            CtlError::Ambiguous { .. } => Usage,
            CtlError::FailedCheckpoint { .. }
            | CtlError::BadImage(..)
            | CtlError::BaseMismatch { .. }
            | CtlError::Exists(_)
            | CtlError::Refused(_)
            | CtlError::Config(_) => Refused,
            CtlError::Connect { .. }
            | CtlError::BadAnswer { .. }
            | CtlError::NoImage(_)
            | CtlError::MissingLayer { .. }
            | CtlError::Failed(_)
            | CtlError::Io { .. }
            | CtlError::PruneFailures { .. }
            | CtlError::Pages(_)
            | CtlError::Engine(_) => Failed,
            CtlError::Fork { source, .. } | CtlError::Restart { source, .. } => source.kind(),
            CtlError::Store(e) => match e {
                StoreError::NotFound { .. } => NotFound,
                _ => Failed,
            },
            CtlError::Image(e) => match e {
                ImageError::BadBase { .. } => Refused,
                ImageError::Io { .. }
                | ImageError::NotPlain { .. }
                | ImageError::Pages(_)
                | ImageError::Descriptor { .. } => Failed,
            },
            CtlError::Pod(e) => match e {
                PodError::NoPod { .. }
                | PodError::NoContainer { .. }
                | PodError::NoneRunning { .. } => NotFound,
                PodError::Sandbox { .. } | PodError::CriManaged { .. } => Refused,
            },
            CtlError::Provenance(e) => match e {
                ProvenanceError::Untrusted(_)
                | ProvenanceError::Altered(_)
                | ProvenanceError::Malformed(_) => Refused,
                _ => Failed,
            },
        }
    }

    /// The exit status for this error.
    pub fn exit_code(&self) -> u8 {
        self.kind().exit_code()
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn each_kind_has_its_own_documented_status() {
        let codes = [
            ErrorKind::Failed,
            ErrorKind::NotFound,
            ErrorKind::Refused,
            ErrorKind::Usage,
        ]
        .map(ErrorKind::exit_code);
        assert_eq!(codes, [1, 3, 4, EXIT_USAGE]);
        for code in codes.iter().chain([&0]) {
            assert!(
                EXIT_CODES_HELP.contains(&format!("\n  {code}  ")),
                "{code} is not documented:\n{EXIT_CODES_HELP}"
            );
        }
    }

    #[test]
    fn errors_map_to_their_kind() {
        let s = String::new;
        let not_found = [
            CtlError::NoContainer {
                namespace: s(),
                container: s(),
            },
            CtlError::NoCheckpoint {
                container: s(),
                turn: s(),
                available: s(),
            },
            CtlError::NoTurn {
                container: s(),
                turn: s(),
            },
            CtlError::NoDiffPoint {
                container: s(),
                point: s(),
                available: s(),
            },
            CtlError::NoRecoveryPoint { container: s() },
            CtlError::NoStore {
                container: s(),
                path: PathBuf::new(),
            },
            CtlError::Grpc {
                op: s(),
                code: tonic::Code::NotFound,
                message: s(),
            },
            CtlError::Store(StoreError::NotFound {
                seq: 1,
                root: PathBuf::new(),
            }),
            CtlError::Pod(PodError::NoPod {
                namespace: s(),
                pod: s(),
                pod_namespace: s(),
                pods: vec![],
            }),
        ];
        let refused = [
            CtlError::FailedCheckpoint {
                container: s(),
                seq: 1,
                turn_id: s(),
                available: s(),
            },
            CtlError::Refused(s()),
            CtlError::Exists(s()),
            CtlError::Grpc {
                op: s(),
                code: tonic::Code::FailedPrecondition,
                message: s(),
            },
            CtlError::Provenance(ProvenanceError::Untrusted(s())),
            CtlError::Pod(PodError::CriManaged {
                container: s(),
                pod: s(),
                pod_namespace: s(),
                op: s(),
            }),
        ];
        let failed = [
            CtlError::Connect {
                address: PathBuf::new(),
                reason: s(),
            },
            CtlError::Grpc {
                op: s(),
                code: tonic::Code::Internal,
                message: s(),
            },
            CtlError::Failed(s()),
            CtlError::PruneFailures { failures: 2 },
            CtlError::Store(StoreError::Corrupt {
                path: PathBuf::new(),
                reason: s(),
            }),
        ];
        for (errors, kind, code) in [
            (&not_found[..], ErrorKind::NotFound, 3),
            (&refused[..], ErrorKind::Refused, 4),
            (&failed[..], ErrorKind::Failed, 1),
        ] {
            for e in errors {
                assert_eq!((e.kind(), e.exit_code()), (kind, code), "{e:?}");
            }
        }
        // A fork's failure is of its cause's kind.
        let fork = |source| CtlError::Fork {
            id: s(),
            source: Box::new(source),
        };
        assert_eq!(fork(CtlError::Refused(s())).exit_code(), 4);
        assert_eq!(fork(CtlError::Failed(s())).exit_code(), 1);
    }
}

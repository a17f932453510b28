//! End-to-end harness for the crab shim.
//!
//! Tests drive a private containerd (started by `hack/containerd.sh`, see `make test`) two ways:
//! the `ctr` CLI ([`ctr::Ctr`]) and containerd's gRPC API ([`Harness`], built on the
//! `containerd-client` protos); Docker Engine is a third client ([`docker`]: private dockerds
//! on the same containerd, `hack/dockerd.sh`). The runtime under test comes from
//! `CRAB_RUNTIME`, so the same tests run against `io.containerd.crab.v1` and the stock
//! `io.containerd.runc.v2`.
//!
//! A missing environment skips nothing: an unreachable containerd or a missing test image is a
//! test failure with a message that says how to bring them up. The one way a test does not run
//! is [`Harness::runs_crab_only`]: tests of crab's own features (turns, checkpoints, crab's
//! config) return early when the suite runs against another runtime
//! (`CRAB_RUNTIME=io.containerd.runc.v2`, for comparison), and each says so on stderr as
//! `SKIPPED <test> under <runtime>: <why>`. Under crab (the default, and `make test`) every
//! test runs.

pub mod api;
pub mod bench;
pub mod cri;
pub mod ctr;
pub mod docker;
pub mod engine;
pub mod env;
pub mod events;
pub mod harness;
pub mod host;
pub mod ksm;
pub mod node;
pub mod registry;
pub mod replay;
pub mod sandbox;
pub mod spec;
pub mod stdio;

use std::path::PathBuf;
use std::time::Duration;

pub use env::TestEnv;
pub use events::{EventStream, TaskEvent};
pub use harness::{CleanupGuard, Harness, RunOutput, TaskStatus};
pub use spec::ProcessSpec;
pub use stdio::{Stdio, StdioOptions};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "containerd is not reachable at {address} ({reason}). The integration tests need the \
         private containerd and test images: run `make test` (or `make containerd-up images` \
         and then the tests), or point CRAB_CONTAINERD_ADDRESS at a running containerd"
    )]
    Unreachable { address: PathBuf, reason: String },
    #[error("image {image}: {reason}. Build and import the test images with `make images` (part of `make test`)")]
    Image { image: String, reason: String },
    #[error("{op}: {code:?}: {message}")]
    Grpc {
        op: String,
        code: tonic::Code,
        message: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { what: String, after: Duration },
    #[error("`{command}`: {detail}")]
    Command { command: String, detail: String },
    #[error("{0}")]
    Protocol(String),
}

impl Error {
    /// The gRPC status code, for tests that check how a call failed.
    pub fn grpc_code(&self) -> Option<tonic::Code> {
        match self {
            Error::Grpc { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub(crate) fn grpc(op: impl Into<String>, status: tonic::Status) -> Self {
        Error::Grpc {
            op: op.into(),
            code: status.code(),
            message: status.message().to_string(),
        }
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

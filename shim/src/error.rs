//! One error type for the shim core, mapped to ttrpc status codes at the edge.

use containerd_shim_protos::ttrpc::{self, Code};

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
    /// A runc invocation failed; `message` is runc's own last error line when it wrote one.
    /// Worded as containerd's runc shim words it (`OCI runtime create failed: runc create
    /// failed: ...`), since the CRI hands it on verbatim to the kubelet (a failed start's
    /// ContainerStatus.message) and tools match on it.
    #[error("OCI runtime {command} failed: {message}")]
    Runc {
        command: &'static str,
        message: String,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
}

impl Error {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }

    fn code(&self) -> Code {
        match self {
            Error::NotFound(_) => Code::NOT_FOUND,
            Error::AlreadyExists(_) => Code::ALREADY_EXISTS,
            Error::FailedPrecondition(_) => Code::FAILED_PRECONDITION,
            Error::InvalidArgument(_) | Error::Config(_) => Code::INVALID_ARGUMENT,
            Error::Unimplemented(_) => Code::UNIMPLEMENTED,
            // containerd's runc shim passes a runc failure on as an untyped error, which
            // errdefs turns into UNKNOWN; clients see the same code from crab (the CRI hands
            // it on to the kubelet, e.g. for an exec of a missing binary).
            Error::Runc { .. } => Code::UNKNOWN,
            Error::Io { .. } | Error::Other(_) => Code::INTERNAL,
        }
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> Self {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}

impl From<containerd_shim::Error> for Error {
    fn from(e: containerd_shim::Error) -> Self {
        Error::Other(e.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_follow_containerd_errdefs() {
        let status = |e: Error| match ttrpc::Error::from(e) {
            ttrpc::Error::RpcStatus(s) => (s.code(), s.message().to_string()),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(
            status(Error::NotFound("container x".into())).0,
            Code::NOT_FOUND
        );
        assert_eq!(
            status(Error::Unimplemented("Checkpoint")).0,
            Code::UNIMPLEMENTED
        );
        let (code, msg) = status(Error::Runc {
            command: "create",
            message: "no such file".into(),
        });
        assert_eq!(code, Code::UNKNOWN);
        assert_eq!(msg, "OCI runtime create failed: no such file");
    }
}

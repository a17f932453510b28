//! How crab's errors go back to containerd: each kind of [`Error`] has its status code here, and
//! only here, following containerd's errdefs (the CRI and `ctr` act on the codes); the message
//! is the error's own text.

use containerd_shim::protos::ttrpc::{self, Code};

use super::metrics::MetricsError;
use crate::{checkpoint::CheckpointError, error::Error, runc::RuncError};

/// The status code containerd expects for `e`.
pub fn code(e: &Error) -> Code {
    match e {
        Error::NotFound(_) => Code::NOT_FOUND,
        Error::AlreadyExists(_) => Code::ALREADY_EXISTS,
        // A checkpoint that cannot be restored or taken, restored processes refused before
        // they ran, what a restore needs unusable: what the image, the spec or the host holds
        // does not allow the request.
        Error::FailedPrecondition(_)
        | Error::Restore { .. }
        | Error::StartFrom { .. }
        | Error::Resume { .. }
        | Error::Restored { .. }
        | Error::Refused(_)
        | Error::Checkpoint { .. }
        | Error::Sign { .. }
        | Error::Unusable { .. } => Code::FAILED_PRECONDITION,
        // A turn's checkpoint the client can wait for or retry: not yet durable, an exec still
        // running, no slot of the host's engine, past its deadline. Any other is a failure.
        Error::Capture(source) => match source.downcast_ref::<CheckpointError>() {
            Some(
                CheckpointError::NotDurable { .. }
                | CheckpointError::ExecsRunning { .. }
                | CheckpointError::NoSlot(_)
                | CheckpointError::Deadline { .. },
            ) => Code::FAILED_PRECONDITION,
            _ => Code::INTERNAL,
        },
        Error::InvalidArgument(_) | Error::Config(_) => Code::INVALID_ARGUMENT,
        Error::Unimplemented(_) => Code::UNIMPLEMENTED,
        // containerd's runc shim passes a runc failure on as an untyped error, which errdefs
        // turns into UNKNOWN; clients see the same code from crab (the CRI hands it on to the
        // kubelet, e.g. for an exec of a missing binary).
        Error::Runc(RuncError::Failed { .. }) => Code::UNKNOWN,
        Error::Runc(RuncError::Run(_) | RuncError::Output { .. })
        | Error::Reaper(_)
        | Error::Io { .. }
        | Error::Sys { .. }
        | Error::Json { .. }
        | Error::Pid { .. }
        | Error::Mount { .. }
        | Error::Task(_)
        | Error::TimedOut(_)
        | Error::NoCgroup(_)
        | Error::Logger(_)
        | Error::Rollback { .. }
        | Error::Other(_) => Code::INTERNAL,
    }
}

/// The ttrpc status containerd receives for `e`.
pub fn to_ttrpc(e: Error) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code(&e), e.to_string()))
}

/// The ttrpc status for a `Stats` of container `id` that failed.
pub fn stats_failed(id: &str, e: MetricsError) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(
        Code::INTERNAL,
        format!("stats of {id}: {e}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(e: Error) -> (Code, String) {
        match to_ttrpc(e) {
            ttrpc::Error::RpcStatus(s) => (s.code(), s.message().to_string()),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn codes_follow_containerd_errdefs() {
        assert_eq!(
            status(Error::NotFound("container x".into())),
            (Code::NOT_FOUND, "container x not found".into())
        );
        assert_eq!(
            status(Error::Unimplemented("Checkpoint")).0,
            Code::UNIMPLEMENTED
        );
        assert_eq!(
            status(Error::InvalidArgument("resources: x".into())).0,
            Code::INVALID_ARGUMENT
        );
        let (code, msg) = status(
            RuncError::Failed {
                command: "create",
                message: "no such file".into(),
            }
            .into(),
        );
        assert_eq!(code, Code::UNKNOWN);
        assert_eq!(msg, "OCI runtime create failed: no such file");
        // runc that could not even run is the shim's own failure.
        let spawn = crate::reaper::ReaperError::Spawn {
            program: "/nonexistent/runc".into(),
            source: std::io::ErrorKind::NotFound.into(),
        };
        let (code, msg) = status(RuncError::Run(spawn).into());
        assert_eq!(code, Code::INTERNAL);
        assert!(
            msg.starts_with("cannot execute /nonexistent/runc: "),
            "{msg}"
        );
    }

    /// A turn's checkpoint error keeps its type under the core's `Capture` kind; its code
    /// follows from that type: what the client can act on is a failed precondition, a failure
    /// of the checkpoint itself is internal. The message is the capture side's own.
    #[test]
    fn a_checkpoint_error_keeps_its_kind_and_its_code_follows_from_it() {
        let e: Error = CheckpointError::Aborted.into();
        let kept = match &e {
            Error::Capture(s) => s.downcast_ref::<CheckpointError>(),
            other => panic!("not a capture error: {other:?}"),
        };
        assert!(matches!(kept, Some(CheckpointError::Aborted)), "{kept:?}");
        assert_eq!(
            status(e),
            (Code::INTERNAL, "aborted at its deadline".into())
        );
        let e: Error = CheckpointError::ExecsRunning {
            outside: "exec e1 (pid 7)".into(),
            gave_up: crate::checkpoint::error::GaveUp::Bound(std::time::Duration::from_secs(3)),
        }
        .into();
        let text = e.to_string();
        assert_eq!(status(e), (Code::FAILED_PRECONDITION, text));
        let e: Error = CheckpointError::NotInspected.into();
        assert_eq!(status(e).0, Code::INTERNAL);
    }

    /// A restore refused in the restore subsystem reaches containerd with the code and the
    /// message it had when the core flattened it into a string, and its type stays under it.
    #[test]
    fn a_refused_restore_keeps_its_kind_its_code_and_its_message() {
        use crate::restore::{
            intake::RestoreError,
            kernel::{CheckError, Refusal},
            privilege::Excess,
        };
        let excess = "process 7 (thread 7, \"sh\") has effective capabilities CAP_SYS_ADMIN \
                      the spec does not grant";
        let e = Error::Restore {
            id: "c1".into(),
            source: RestoreError::Privilege(Excess(excess.into())).into(),
        };
        let kept = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<RestoreError>());
        assert!(matches!(kept, Some(RestoreError::Privilege(_))), "{kept:?}");
        assert_eq!(
            status(e),
            (
                Code::FAILED_PRECONDITION,
                format!(
                    "cannot restore c1: checkpoint image asks for more privilege than the \
                     container's spec grants: {excess}"
                )
            )
        );
        // The kernel check's refusal at CRIU's gate, in the restore that ran.
        let refused = Error::Refused(CheckError::from(Refusal("process 9 has more".into())).into());
        let e = Error::Restored {
            id: "c1".into(),
            source: Box::new(refused),
            criu: "; CRIU: Error (criu/cr-restore.c:1): x".into(),
            log: "/b/criu-restore-work/restore.log".into(),
        };
        let Error::Restored { source, .. } = &e else {
            unreachable!()
        };
        assert!(
            matches!(&**source, Error::Refused(s) if s.downcast_ref::<CheckError>().is_some()),
            "{source:?}"
        );
        assert_eq!(
            status(e),
            (
                Code::FAILED_PRECONDITION,
                "cannot restore c1 from its checkpoint: the restored processes have more than the \
                 container's spec grants: process 9 has more; CRIU: Error (criu/cr-restore.c:1): \
                 x (log: /b/criu-restore-work/restore.log)"
                    .into()
            )
        );
        // Each kind of a checkpoint not restored, or not taken, is FAILED_PRECONDITION.
        let why = || -> crate::error::Source { "why".into() };
        for e in [
            Error::StartFrom {
                id: "c1".into(),
                from: "its image",
                source: why(),
            },
            Error::Resume {
                id: "c1".into(),
                from: "checkpoint 3 of its lineage l (store of c0)".into(),
                source: why(),
            },
            Error::Checkpoint {
                id: "c1".into(),
                source: why(),
            },
            Error::Sign {
                id: "c1".into(),
                source: why(),
            },
            Error::Unusable {
                what: "[replication]",
                source: why(),
            },
        ] {
            let (code, msg) = status(e);
            assert_eq!(code, Code::FAILED_PRECONDITION, "{msg}");
            assert!(msg.ends_with(": why"), "{msg}");
        }
    }

    #[test]
    fn a_full_disk_stays_visible_under_the_message() {
        let e = Error::io("cannot write /b/update-resources.json")(
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        let source = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .unwrap();
        assert_eq!(source.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(status(e).0, Code::INTERNAL);
    }
}

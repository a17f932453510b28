//! Kill: a signal to a container's init (runc) or to an exec's process, after the sandbox's
//! checkpoints (bounded: stopping a container always works).

use super::Containers;
use crate::{
    checkpoint::Action,
    error::{Error, Result},
    process::Status,
    runc::RuncError,
};

impl Containers {
    pub async fn kill(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let c = self.get(id)?;
        let p = c.process(exec_id)?;
        // A signal changes the sandbox too, but stopping a container must always work: after
        // the bound the kill goes ahead (said in the log). Not for a probe, nor for an exec that
        // already ended (the CRI kills every ExecSync process as it cleans up): that signal
        // changes nothing.
        let ended_exec = !exec_id.is_empty() && p.snapshot().status == Status::Stopped;
        if !p.probe && !ended_exec {
            if let Err(e) = c.sandbox.gate(Action::Kill).await {
                log::warn!("{e}; killing anyway");
            }
        }
        let snap = p.snapshot();
        if exec_id.is_empty() {
            if snap.exit.is_some() && !all {
                return Err(Error::NotFound("process already finished".into()));
            }
            return c.runtime.kill(id, signal, all).await.map_err(gone_or);
        }
        match snap.status {
            Status::Created => Err(Error::FailedPrecondition(format!(
                "exec {exec_id} is not started"
            ))),
            Status::Stopped => Err(Error::NotFound("process already finished".into())),
            Status::Running | Status::Paused => {
                let sig = nix::sys::signal::Signal::try_from(signal as i32)
                    .map_err(|_| Error::InvalidArgument(format!("signal {signal}")))?;
                match nix::sys::signal::kill(nix::unistd::Pid::from_raw(snap.pid as i32), sig) {
                    Err(nix::errno::Errno::ESRCH) => {
                        Err(Error::NotFound("process already finished".into()))
                    }
                    other => Ok(other?),
                }
            }
        }
    }
}

/// runc's failure to signal a process, as the Task API words a process already gone.
fn gone_or(e: RuncError) -> Error {
    match e.is_gone() {
        true => Error::NotFound("process already finished".into()),
        false => e.into(),
    }
}

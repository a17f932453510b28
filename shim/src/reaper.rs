//! Running helper commands (runc) under the shim's reaper.
//!
//! The shim is a subreaper and the containerd-shim framework reaps every child with
//! `waitpid(-1)` on SIGCHLD, publishing each exit on its monitor. A child started with
//! tokio's or std's own `wait` would race that reaper (and usually lose with ECHILD), so
//! commands are spawned with std, and their exit status is taken from the monitor: the
//! subscription is made *before* the spawn so the exit cannot be missed.

use std::process::{Command, Stdio};

use containerd_shim::{
    asynchronous::monitor::{monitor_subscribe, monitor_unsubscribe, Subscription},
    monitor::{Subject, Topic},
};
use std::io::Read;

/// Why a command could not be run, or its exit not learnt, through the reaper.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    /// The shim framework refused the subscription to its exit monitor.
    #[error("{0}")]
    Subscribe(#[source] containerd_shim::Error),
    #[error("exit monitor closed before pid {pid} exited")]
    MonitorClosed { pid: i32 },
    #[error("cannot execute {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = ReaperError> = std::result::Result<T, E>;

/// An exit subscription that unsubscribes itself when dropped.
pub struct ExitSubscription(Option<Subscription>);

impl ExitSubscription {
    pub async fn new() -> Result<Self> {
        Ok(Self(Some(
            monitor_subscribe(Topic::Pid)
                .await
                .map_err(ReaperError::Subscribe)?,
        )))
    }

    /// Waits for the exit of `pid`; returns its exit code (128+signal when signalled).
    pub async fn wait_for(&mut self, pid: i32) -> Result<i32> {
        let sub = self.0.as_mut().expect("subscription present until drop");
        while let Some(event) = sub.rx.recv().await {
            if let Subject::Pid(p) = event.subject {
                if p == pid {
                    return Ok(event.exit_code);
                }
            }
        }
        Err(ReaperError::MonitorClosed { pid })
    }

    pub async fn recv(&mut self) -> Option<(i32, i32)> {
        let sub = self.0.as_mut()?;
        loop {
            let event = sub.rx.recv().await?;
            if let Subject::Pid(p) = event.subject {
                return Some((p, event.exit_code));
            }
        }
    }
}

impl Drop for ExitSubscription {
    fn drop(&mut self) {
        if let Some(sub) = self.0.take() {
            let id = sub.id;
            drop(sub);
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move {
                    let _ = monitor_unsubscribe(id).await;
                });
            }
        }
    }
}

pub struct Output {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Spawns `cmd` and waits for it through the shim's reaper. When `capture` is set, stdout and
/// stderr are collected; otherwise the caller has already set the command's stdio.
pub async fn run(mut cmd: Command, capture: bool) -> Result<Output> {
    let mut exits = ExitSubscription::new().await?;
    if capture {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
    }
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd.spawn().map_err(|source| ReaperError::Spawn {
        program: program.clone(),
        source,
    })?;
    // Dropping the command closes our copies of the child's stdio, so pipes see EOF when
    // the child (and whatever it leaves behind) closes them.
    drop(cmd);
    let pid = child.id() as i32;
    let readers = [
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    ]
    .map(|r| {
        tokio::task::spawn_blocking(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    });
    let code = exits.wait_for(pid).await?;
    let [out, err] = readers;
    let stdout = out.await.unwrap_or_default();
    let stderr = err.await.unwrap_or_default();
    Ok(Output {
        code,
        stdout,
        stderr,
    })
}

//! A process of a container (its init or an exec) and its lifecycle state.

use std::{
    sync::Mutex,
    time::{Duration, SystemTime},
};

use tokio::sync::watch;

use crate::{
    error::{Error, Result},
    stdio::{ProcessIo, StdioSpec},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Created,
    Running,
    Paused,
    Stopped,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    pub pid: u32,
    pub status: u32,
    pub at: SystemTime,
}

#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    pub pid: u32,
    pub status: Status,
    pub exit: Option<ExitInfo>,
}

struct State {
    pid: u32,
    status: Status,
    exit: Option<ExitInfo>,
}

pub struct Process {
    /// The exec id, empty for the container's init.
    pub exec_id: String,
    pub stdio: StdioSpec,
    /// An exec's OCI process spec (JSON), as given to `runc exec --process`.
    pub exec_spec: Option<Vec<u8>>,
    /// An exec that is no agent action (a probe the spec names, see
    /// [`crate::turns::PROBE_COMMANDS`]): it neither waits for checkpoints nor ends turns.
    pub probe: bool,
    state: Mutex<State>,
    exited: watch::Sender<Option<ExitInfo>>,
    io: tokio::sync::Mutex<Option<ProcessIo>>,
    /// Held while the process is being started, so that its exit (which can come before
    /// `runc start`/`runc exec` even returns) is handled after its start is published.
    pub start_lock: tokio::sync::Mutex<()>,
}

impl Process {
    pub fn new(exec_id: String, stdio: StdioSpec, exec_spec: Option<Vec<u8>>) -> Self {
        Self {
            exec_id,
            stdio,
            exec_spec,
            probe: false,
            state: Mutex::new(State {
                pid: 0,
                status: Status::Created,
                exit: None,
            }),
            exited: watch::channel(None).0,
            io: tokio::sync::Mutex::new(None),
            start_lock: tokio::sync::Mutex::new(()),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        let s = self.state.lock().unwrap();
        Snapshot {
            pid: s.pid,
            status: s.status,
            exit: s.exit,
        }
    }

    pub fn pid(&self) -> u32 {
        self.state.lock().unwrap().pid
    }

    pub fn status(&self) -> Status {
        self.state.lock().unwrap().status
    }

    pub fn set_pid(&self, pid: u32) {
        self.state.lock().unwrap().pid = pid;
    }

    /// Moves from `from` to `to`, or fails naming the state it is in.
    pub fn transition(&self, from: &[Status], to: Status) -> Result<()> {
        let mut s = self.state.lock().unwrap();
        if !from.contains(&s.status) {
            return Err(Error::FailedPrecondition(format!(
                "process {} is {:?}, not {from:?}",
                self.display_id(),
                s.status
            )));
        }
        s.status = to;
        Ok(())
    }

    pub async fn set_io(&self, io: ProcessIo) {
        *self.io.lock().await = Some(io);
    }

    pub async fn with_io<T>(&self, f: impl FnOnce(&ProcessIo) -> Result<T>) -> Result<T> {
        match self.io.lock().await.as_ref() {
            Some(io) => f(io),
            None => Err(Error::FailedPrecondition(format!(
                "process {} has no stdio",
                self.display_id()
            ))),
        }
    }

    /// Waits (bounded) for the process's output to be copied out, so clients that react to
    /// its exit event find all of it.
    pub async fn drain_output(&self, bound: Duration) {
        if let Some(io) = self.io.lock().await.as_mut() {
            if let Some(holders) = io.drain(bound).await {
                let held: Vec<String> = holders
                    .iter()
                    .map(|(pid, comm)| format!("pid {pid} ({comm})"))
                    .collect();
                log::warn!(
                    "process {}: its output is still open {bound:?} after its exit, held by {}; \
                     it closes when they do or when the process is deleted",
                    self.display_id(),
                    if held.is_empty() {
                        "no other process found".to_string()
                    } else {
                        held.join(", ")
                    }
                );
            }
        }
    }

    /// Closes the process's stdio (its output copies stop; writers left behind get EPIPE).
    pub async fn close_io(&self) {
        self.io.lock().await.take();
    }

    /// Records the exit; returns false when it was already recorded.
    pub fn record_exit(&self, status: u32) -> Option<ExitInfo> {
        let mut s = self.state.lock().unwrap();
        if s.exit.is_some() {
            return None;
        }
        let info = ExitInfo {
            pid: s.pid,
            status,
            at: SystemTime::now(),
        };
        s.status = Status::Stopped;
        s.exit = Some(info);
        Some(info)
    }

    /// Makes the recorded exit visible to `wait` callers (after its event is published).
    pub fn announce_exit(&self, info: ExitInfo) {
        self.exited.send_replace(Some(info));
    }

    /// Whether its exit event was published ([`Self::announce_exit`]).
    pub fn exit_announced(&self) -> bool {
        self.exited.borrow().is_some()
    }

    pub async fn wait(&self) -> ExitInfo {
        let mut rx = self.exited.subscribe();
        loop {
            if let Some(info) = *rx.borrow_and_update() {
                return info;
            }
            if rx.changed().await.is_err() {
                // The sender lives as long as `self`; unreachable while we hold `&self`.
                std::future::pending::<()>().await;
            }
        }
    }

    pub fn display_id(&self) -> &str {
        if self.exec_id.is_empty() {
            "init"
        } else {
            &self.exec_id
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn exit_is_recorded_once_and_wakes_waiters_when_announced() {
        let p = std::sync::Arc::new(Process::new("e1".into(), StdioSpec::default(), None));
        p.set_pid(42);
        p.transition(&[Status::Created], Status::Running).unwrap();
        let waiter = tokio::spawn({
            let p = p.clone();
            async move { p.wait().await }
        });
        let info = p.record_exit(3).unwrap();
        assert!(p.record_exit(4).is_none());
        assert_eq!(p.status(), Status::Stopped);
        assert!(!waiter.is_finished());
        p.announce_exit(info);
        let got = waiter.await.unwrap();
        assert_eq!((got.pid, got.status), (42, 3));
        let err = p
            .transition(&[Status::Running], Status::Paused)
            .unwrap_err();
        assert!(err.to_string().contains("Stopped"), "{err}");
    }
}

//! The task events the core reports (a container created, a process started or exited, ...),
//! as plain values, in the order they happen. The protocol edge reads them from one channel
//! and publishes each as containerd's event, in that order: containerd and the CRI depend on
//! it (a start before its exit, an exec's exits before its init's).

use std::{path::PathBuf, time::SystemTime};

use tokio::sync::{mpsc, oneshot};

use crate::{bundle::RootfsMount, stdio::StdioSpec};

/// What happened to a task.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskEvent {
    Create {
        container_id: String,
        bundle: PathBuf,
        rootfs: Vec<RootfsMount>,
        stdio: StdioSpec,
        /// containerd's checkpoint the container starts from (empty: none).
        checkpoint: String,
        /// The init's pid (0 while a restore waits for Start).
        pid: u32,
    },
    Start {
        container_id: String,
        pid: u32,
    },
    Delete {
        container_id: String,
        pid: u32,
        exit_status: u32,
        exited_at: SystemTime,
    },
    Paused {
        container_id: String,
    },
    Resumed {
        container_id: String,
    },
    ExecAdded {
        container_id: String,
        exec_id: String,
    },
    ExecStarted {
        container_id: String,
        exec_id: String,
        pid: u32,
    },
    /// A process exited: `id` is the exec id, or the container id for its init.
    Exit {
        container_id: String,
        id: String,
        pid: u32,
        exit_status: u32,
        exited_at: SystemTime,
    },
    Oom {
        container_id: String,
    },
}

/// One event on its way to the edge, with whom to tell once it is published.
pub struct Envelope {
    pub event: TaskEvent,
    pub published: Option<oneshot::Sender<()>>,
}

/// The edge's end of the channel: events in the order they were sent.
pub type EventReceiver = mpsc::UnboundedReceiver<Envelope>;

/// The core's end of the channel.
#[derive(Clone)]
pub struct EventSender(Option<mpsc::UnboundedSender<Envelope>>);

impl EventSender {
    pub fn channel() -> (Self, EventReceiver) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self(Some(tx)), rx)
    }

    /// A sender whose events go nowhere (a core that no containerd listens to).
    pub fn discard() -> Self {
        Self(None)
    }

    /// Sends `event` and waits until the edge has handed it to containerd's publisher (or given
    /// up on it), so that what follows the event in the core (a reply, a waiter told of an
    /// exit, the shim's shutdown) follows it on its way to containerd too.
    pub async fn publish(&self, event: TaskEvent) {
        let Some(tx) = &self.0 else { return };
        let (done, published) = oneshot::channel();
        if tx
            .send(Envelope {
                event,
                published: Some(done),
            })
            .is_ok()
        {
            // An error only says the edge is gone: nothing is left to wait for.
            let _ = published.await;
        }
    }

    /// Sends `event` without waiting for it to be published (from outside the async runtime,
    /// e.g. an OOM watcher's thread); it still comes after every event sent before it.
    pub fn send(&self, event: TaskEvent) {
        if let Some(tx) = &self.0 {
            let _ = tx.send(Envelope {
                event,
                published: None,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn oom(id: &str) -> TaskEvent {
        TaskEvent::Oom {
            container_id: id.into(),
        }
    }

    #[tokio::test]
    async fn events_arrive_in_the_order_sent() {
        let (events, mut rx) = EventSender::channel();
        events.send(oom("a"));
        let edge = tokio::spawn(async move {
            let mut seen = Vec::new();
            while let Some(e) = rx.recv().await {
                seen.push(e.event);
                if let Some(done) = e.published {
                    let _ = done.send(());
                }
            }
            seen
        });
        events.publish(oom("b")).await;
        events.send(oom("c"));
        drop(events);
        assert_eq!(edge.await.unwrap(), [oom("a"), oom("b"), oom("c")]);
    }

    #[tokio::test]
    async fn publish_returns_once_the_edge_has_published() {
        let (events, mut rx) = EventSender::channel();
        let publishing = tokio::spawn(async move { events.publish(oom("a")).await });
        let envelope = rx.recv().await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!publishing.is_finished());
        envelope.published.unwrap().send(()).unwrap();
        publishing.await.unwrap();
    }

    #[tokio::test]
    async fn publishing_to_a_gone_edge_returns() {
        let (events, rx) = EventSender::channel();
        drop(rx);
        events.publish(oom("a")).await;
        // An edge that drops an event unpublished does not hold the core up either.
        let (events, mut rx) = EventSender::channel();
        let edge = tokio::spawn(async move { drop(rx.recv().await) });
        events.publish(oom("b")).await;
        edge.await.unwrap();
        EventSender::discard().publish(oom("c")).await;
    }
}

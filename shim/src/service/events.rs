//! Publishes the core's [`TaskEvent`]s to containerd: one task reads them from the channel and
//! hands each, as containerd's task event, to the shim framework's publisher (whose own queue
//! delivers them), one at a time, in the order the core sent them.

use containerd_shim::{
    protos::{events::task as ev, protobuf::MessageDyn, topics},
    publisher::RemotePublisher,
    Context,
};

use super::convert::{containerd_mount, timestamp};
use crate::events::{Envelope, EventReceiver, TaskEvent};

/// Forwards every event of `events` to containerd (namespace `namespace`) until the core's
/// senders are gone.
pub fn forward(publisher: RemotePublisher, namespace: String, mut events: EventReceiver) {
    tokio::spawn(async move {
        while let Some(Envelope { event, published }) = events.recv().await {
            let (topic, message) = to_containerd(event);
            if let Err(e) = publisher
                .publish(Context::default(), topic, &namespace, message)
                .await
            {
                log::error!("cannot publish {topic}: {e}");
            }
            if let Some(done) = published {
                let _ = done.send(());
            }
        }
    });
}

/// containerd's topic and event for `event`.
fn to_containerd(event: TaskEvent) -> (&'static str, Box<dyn MessageDyn>) {
    match event {
        TaskEvent::Create {
            container_id,
            bundle,
            rootfs,
            stdio,
            checkpoint,
            pid,
        } => (
            topics::TASK_CREATE_EVENT_TOPIC,
            Box::new(ev::TaskCreate {
                container_id,
                bundle: bundle.display().to_string(),
                rootfs: rootfs.iter().map(containerd_mount).collect(),
                io: Some(ev::TaskIO {
                    stdin: stdio.stdin,
                    stdout: stdio.stdout,
                    stderr: stdio.stderr,
                    terminal: stdio.terminal,
                    ..Default::default()
                })
                .into(),
                checkpoint,
                pid,
                ..Default::default()
            }),
        ),
        TaskEvent::Start { container_id, pid } => (
            topics::TASK_START_EVENT_TOPIC,
            Box::new(ev::TaskStart {
                container_id,
                pid,
                ..Default::default()
            }),
        ),
        TaskEvent::Delete {
            container_id,
            pid,
            exit_status,
            exited_at,
        } => (
            topics::TASK_DELETE_EVENT_TOPIC,
            Box::new(ev::TaskDelete {
                id: container_id.clone(),
                container_id,
                pid,
                exit_status,
                exited_at: Some(timestamp(exited_at)).into(),
                ..Default::default()
            }),
        ),
        TaskEvent::Paused { container_id } => (
            topics::TASK_PAUSED_EVENT_TOPIC,
            Box::new(ev::TaskPaused {
                container_id,
                ..Default::default()
            }),
        ),
        TaskEvent::Resumed { container_id } => (
            topics::TASK_RESUMED_EVENT_TOPIC,
            Box::new(ev::TaskResumed {
                container_id,
                ..Default::default()
            }),
        ),
        TaskEvent::ExecAdded {
            container_id,
            exec_id,
        } => (
            topics::TASK_EXEC_ADDED_EVENT_TOPIC,
            Box::new(ev::TaskExecAdded {
                container_id,
                exec_id,
                ..Default::default()
            }),
        ),
        TaskEvent::ExecStarted {
            container_id,
            exec_id,
            pid,
        } => (
            topics::TASK_EXEC_STARTED_EVENT_TOPIC,
            Box::new(ev::TaskExecStarted {
                container_id,
                exec_id,
                pid,
                ..Default::default()
            }),
        ),
        TaskEvent::Exit {
            container_id,
            id,
            pid,
            exit_status,
            exited_at,
        } => (
            topics::TASK_EXIT_EVENT_TOPIC,
            Box::new(ev::TaskExit {
                container_id,
                id,
                pid,
                exit_status,
                exited_at: Some(timestamp(exited_at)).into(),
                ..Default::default()
            }),
        ),
        TaskEvent::Oom { container_id } => (
            topics::TASK_OOM_EVENT_TOPIC,
            Box::new(ev::TaskOOM {
                container_id,
                ..Default::default()
            }),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::{bundle::RootfsMount, stdio::StdioSpec};

    fn downcast<T: containerd_shim::protos::protobuf::MessageFull>(m: &dyn MessageDyn) -> T {
        m.downcast_ref::<T>()
            .expect("event of the topic's type")
            .clone()
    }

    #[test]
    fn create_carries_the_rootfs_and_stdio() {
        let rootfs = vec![RootfsMount {
            kind: "overlay".into(),
            source: "overlay".into(),
            target: String::new(),
            options: vec!["lowerdir=/l".into(), "upperdir=/u".into()],
        }];
        let (topic, m) = to_containerd(TaskEvent::Create {
            container_id: "c".into(),
            bundle: "/run/b".into(),
            rootfs: rootfs.clone(),
            stdio: StdioSpec {
                stdin: "in".into(),
                stdout: "out".into(),
                stderr: "err".into(),
                terminal: true,
            },
            checkpoint: "/cp".into(),
            pid: 42,
        });
        assert_eq!(topic, "/tasks/create");
        let e: ev::TaskCreate = downcast(m.as_ref());
        assert_eq!(
            (e.container_id.as_str(), e.bundle.as_str()),
            ("c", "/run/b")
        );
        assert_eq!((e.checkpoint.as_str(), e.pid), ("/cp", 42));
        assert_eq!(e.rootfs.len(), 1);
        assert_eq!(super::super::convert::rootfs_mount(&e.rootfs[0]), rootfs[0]);
        let io = e.io.as_ref().unwrap();
        assert_eq!(
            (io.stdin.as_str(), io.stdout.as_str(), io.stderr.as_str()),
            ("in", "out", "err")
        );
        assert!(io.terminal);
    }

    #[test]
    fn exits_and_deletes_name_the_process_and_its_time() {
        let at = SystemTime::UNIX_EPOCH + Duration::new(1_700_000_000, 5);
        let (topic, m) = to_containerd(TaskEvent::Exit {
            container_id: "c".into(),
            id: "e1".into(),
            pid: 7,
            exit_status: 137,
            exited_at: at,
        });
        assert_eq!(topic, "/tasks/exit");
        let e: ev::TaskExit = downcast(m.as_ref());
        assert_eq!(
            (e.container_id.as_str(), e.id.as_str(), e.pid, e.exit_status),
            ("c", "e1", 7, 137)
        );
        let t = e.exited_at.as_ref().unwrap();
        assert_eq!((t.seconds, t.nanos), (1_700_000_000, 5));
        let (topic, m) = to_containerd(TaskEvent::Delete {
            container_id: "c".into(),
            pid: 7,
            exit_status: 0,
            exited_at: at,
        });
        assert_eq!(topic, "/tasks/delete");
        let e: ev::TaskDelete = downcast(m.as_ref());
        assert_eq!((e.container_id.as_str(), e.id.as_str()), ("c", "c"));
    }

    #[test]
    fn every_event_has_its_topic() {
        let c = || "c".to_string();
        let topics: Vec<&str> = [
            TaskEvent::Start {
                container_id: c(),
                pid: 1,
            },
            TaskEvent::Paused { container_id: c() },
            TaskEvent::Resumed { container_id: c() },
            TaskEvent::ExecAdded {
                container_id: c(),
                exec_id: "e".into(),
            },
            TaskEvent::ExecStarted {
                container_id: c(),
                exec_id: "e".into(),
                pid: 2,
            },
            TaskEvent::Oom { container_id: c() },
        ]
        .into_iter()
        .map(|e| to_containerd(e).0)
        .collect();
        assert_eq!(
            topics,
            [
                "/tasks/start",
                "/tasks/paused",
                "/tasks/resumed",
                "/tasks/exec-added",
                "/tasks/exec-started",
                "/tasks/oom"
            ]
        );
    }
}

//! containerd's event stream (Events.Subscribe) decoded into task events, for tests that check
//! what a shim publishes and in which order.

use std::time::{Duration, Instant};

use containerd_client::events::{
    TaskCheckpointed, TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskOom,
    TaskPaused, TaskResumed, TaskStart,
};
use containerd_client::services::v1::{
    events_client::EventsClient, PublishRequest, SubscribeRequest,
};
use prost::Message;
use prost_types::Any;

use crate::{Error, Harness, Result};

/// One event from containerd's exchange, decoded when it is a task event.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskEvent {
    Create(TaskCreate),
    Start(TaskStart),
    ExecAdded(TaskExecAdded),
    ExecStarted(TaskExecStarted),
    Exit(TaskExit),
    Paused(TaskPaused),
    Resumed(TaskResumed),
    Delete(TaskDelete),
    Oom(TaskOom),
    Checkpointed(TaskCheckpointed),
    /// Any other topic, or a task topic whose payload did not decode.
    Other {
        topic: String,
        type_url: String,
    },
}

impl TaskEvent {
    fn decode(topic: &str, any: Option<Any>) -> TaskEvent {
        let any = any.unwrap_or_default();
        let v = any.value.as_slice();
        let decoded = match topic {
            "/tasks/create" => TaskCreate::decode(v).map(TaskEvent::Create),
            "/tasks/start" => TaskStart::decode(v).map(TaskEvent::Start),
            "/tasks/exec-added" => TaskExecAdded::decode(v).map(TaskEvent::ExecAdded),
            "/tasks/exec-started" => TaskExecStarted::decode(v).map(TaskEvent::ExecStarted),
            "/tasks/exit" => TaskExit::decode(v).map(TaskEvent::Exit),
            "/tasks/paused" => TaskPaused::decode(v).map(TaskEvent::Paused),
            "/tasks/resumed" => TaskResumed::decode(v).map(TaskEvent::Resumed),
            "/tasks/delete" => TaskDelete::decode(v).map(TaskEvent::Delete),
            "/tasks/oom" => TaskOom::decode(v).map(TaskEvent::Oom),
            "/tasks/checkpointed" => TaskCheckpointed::decode(v).map(TaskEvent::Checkpointed),
            _ => Ok(TaskEvent::Other {
                topic: topic.to_string(),
                type_url: any.type_url.clone(),
            }),
        };
        decoded.unwrap_or(TaskEvent::Other {
            topic: topic.to_string(),
            type_url: any.type_url,
        })
    }

    /// The topic this event was published on.
    pub fn topic(&self) -> &str {
        match self {
            TaskEvent::Create(_) => "/tasks/create",
            TaskEvent::Start(_) => "/tasks/start",
            TaskEvent::ExecAdded(_) => "/tasks/exec-added",
            TaskEvent::ExecStarted(_) => "/tasks/exec-started",
            TaskEvent::Exit(_) => "/tasks/exit",
            TaskEvent::Paused(_) => "/tasks/paused",
            TaskEvent::Resumed(_) => "/tasks/resumed",
            TaskEvent::Delete(_) => "/tasks/delete",
            TaskEvent::Oom(_) => "/tasks/oom",
            TaskEvent::Checkpointed(_) => "/tasks/checkpointed",
            TaskEvent::Other { topic, .. } => topic,
        }
    }
}

/// A live subscription; events arrive in the order containerd's exchange forwarded them.
pub struct EventStream {
    rx: tokio::sync::mpsc::UnboundedReceiver<TaskEvent>,
    /// Everything received so far, in order (including events skipped by `next_matching`).
    pub seen: Vec<TaskEvent>,
}

impl EventStream {
    /// The next event, or `None` when `timeout` passes first.
    pub async fn next(&mut self, timeout: Duration) -> Result<Option<TaskEvent>> {
        match tokio::time::timeout(timeout, self.rx.recv()).await {
            Ok(Some(e)) => {
                self.seen.push(e.clone());
                Ok(Some(e))
            }
            Ok(None) => Err(Error::Protocol("event subscription ended".into())),
            Err(_) => Ok(None),
        }
    }

    /// Waits for the first event satisfying `pred`; the events before it stay in `seen`.
    pub async fn next_matching(
        &mut self,
        what: &str,
        timeout: Duration,
        mut pred: impl FnMut(&TaskEvent) -> bool,
    ) -> Result<TaskEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left).await? {
                Some(e) if pred(&e) => return Ok(e),
                Some(_) => continue,
                None => {
                    return Err(Error::Timeout {
                        what: format!("event {what} (saw: {:?})", self.topics()),
                        after: timeout,
                    })
                }
            }
        }
    }

    /// Waits for the next event on `topic`.
    pub async fn next_topic(&mut self, topic: &str, timeout: Duration) -> Result<TaskEvent> {
        self.next_matching(topic, timeout, |e| e.topic() == topic)
            .await
    }

    /// Collects whatever else arrives within `quiet`, for checks that nothing unexpected came.
    pub async fn drain(&mut self, quiet: Duration) -> Result<()> {
        while self.next(quiet).await?.is_some() {}
        Ok(())
    }

    /// Topics of `seen`, in order.
    pub fn topics(&self) -> Vec<String> {
        self.seen.iter().map(|e| e.topic().to_string()).collect()
    }
}

impl Harness {
    /// Subscribes to containerd's events with `filters` (containerd filter syntax; the list is
    /// OR'ed, commas inside one filter AND). Returns once the subscription is live, confirmed
    /// the way [`Harness::task_exits`] does it: a probe event on a private topic must come back.
    pub async fn subscribe(&self, filters: &[String]) -> Result<EventStream> {
        static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let probe_topic = format!(
            "/crab-integration/subscribe-probe/{}/{}",
            std::process::id(),
            PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let mut all = filters.to_vec();
        all.push(format!("topic==\"{probe_topic}\""));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (ready_tx, mut ready_rx) = tokio::sync::mpsc::unbounded_channel();
        let mut events = EventsClient::new(self.channel());
        let req = self.request(SubscribeRequest { filters: all });
        let probe = probe_topic.clone();
        tokio::spawn(async move {
            let resp = match events.subscribe(req).await {
                Ok(r) => r,
                Err(e) => {
                    log::error!("Events.Subscribe: {e}");
                    return;
                }
            };
            let mut stream = resp.into_inner();
            while let Ok(Some(env)) = stream.message().await {
                if env.topic == probe {
                    let _ = ready_tx.send(());
                    continue;
                }
                if tx.send(TaskEvent::decode(&env.topic, env.event)).is_err() {
                    return;
                }
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            EventsClient::new(self.channel())
                .publish(self.request(PublishRequest {
                    topic: probe_topic.clone(),
                    event: Some(containerd_client::to_any(&TaskExit::default())),
                }))
                .await
                .map_err(|s| Error::grpc("Events.Publish", s))?;
            match tokio::time::timeout(Duration::from_millis(50), ready_rx.recv()).await {
                Ok(Some(())) => {
                    return Ok(EventStream {
                        rx,
                        seen: Vec::new(),
                    })
                }
                Ok(None) => return Err(Error::Protocol("event subscription failed".into())),
                Err(_) if Instant::now() < deadline => continue,
                Err(_) => {
                    return Err(Error::Timeout {
                        what: "the event subscription to deliver a probe event".into(),
                        after: Duration::from_secs(10),
                    })
                }
            }
        }
    }

    /// Subscribes to the task events of container `id` in the test namespace, filtered by
    /// containerd on the event's `container_id` field.
    pub async fn subscribe_container(&self, id: &str) -> Result<EventStream> {
        self.subscribe(&[format!(
            "namespace==\"{}\",topic~=\"^/tasks/\",event.container_id==\"{id}\"",
            self.env.namespace
        )])
        .await
    }
}

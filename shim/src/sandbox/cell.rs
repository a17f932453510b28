//! The inspection of one container behind a cell: used by one task at a time, off the async
//! runtime, and lost for good (with the reason said) when a task panics while using it.

use std::sync::Arc;

use crate::inspector::Inspection;

/// How long an action may wait for the inspection before the wait is logged
/// (`settled`).
pub(super) const SETTLE_WARN: std::time::Duration = std::time::Duration::from_secs(5);

/// Why a container has no inspection now.
#[derive(Debug, Clone)]
pub enum NotInspected {
    /// `[checkpoint] enabled = false`, or a pod's pause container.
    Disabled,
    /// Checkpointing is starting (at Create).
    Starting,
    /// Restored from a process image at Start; inspected from then on.
    UntilStart,
    /// Checkpointing could not start.
    Failed(String),
    /// The container is being deleted.
    Deleted,
}

/// Why the inspection could not be used.
#[derive(Debug, thiserror::Error)]
pub enum InspectionUnavailable {
    #[error("container {id} is not inspected (turn ends are disabled by [checkpoint] enabled = false, or it is a pod's pause container)")]
    Disabled { id: String },
    #[error("container {id} is not inspected yet: its checkpointing is starting")]
    Starting { id: String },
    #[error("container {id} is not inspected yet: it is restored from its checkpoint at start")]
    UntilStart { id: String },
    #[error("container {id} is not inspected: its checkpointing could not start: {why}")]
    Failed { id: String, why: String },
    #[error("container {id} is being deleted")]
    Deleted { id: String },
    #[error("container {id} is no longer inspected: its inspection panicked while {during} ({panic}), so its turn ends cannot be answered any more")]
    Lost {
        id: String,
        during: &'static str,
        panic: String,
    },
}

pub(super) enum Slot<T> {
    Off(NotInspected),
    Ready(T),
    /// A task panicked while it used the inspection: what it was doing, and the panic.
    Lost {
        during: &'static str,
        panic: String,
    },
}

/// The inspection of one container, used by one task at a time, off the async runtime (it
/// reads /proc, the upperdir and process memory). A panic while it is used loses it for good
/// (its state is half-updated): it is dropped, and every later use says what happened.
pub struct InspectionCell<T = Inspection> {
    container_id: String,
    slot: Arc<tokio::sync::Mutex<Slot<T>>>,
}

impl<T: Send + 'static> InspectionCell<T> {
    pub fn new(container_id: &str, why: NotInspected) -> Self {
        InspectionCell {
            container_id: container_id.to_string(),
            slot: Arc::new(tokio::sync::Mutex::new(Slot::Off(why))),
        }
    }

    /// Starts using `inspection`.
    pub async fn set(&self, inspection: T) {
        *self.slot.lock().await = Slot::Ready(inspection);
    }

    /// Drops the inspection (once no task uses it); later uses say `why`. A lost inspection
    /// stays lost.
    pub async fn turn_off(&self, why: NotInspected) {
        let mut slot = self.slot.lock().await;
        if !matches!(*slot, Slot::Lost { .. }) {
            *slot = Slot::Off(why);
        }
    }

    /// Runs `f` on the inspection on a blocking thread, once no other task uses it.
    pub async fn run<R: Send + 'static>(
        &self,
        during: &'static str,
        f: impl FnOnce(&mut T) -> R + Send + 'static,
    ) -> Result<R, InspectionUnavailable> {
        let slot = self.slot.clone().lock_owned().await;
        Self::run_holding(self.container_id.clone(), slot, during, f).await
    }

    /// [`Self::run`] without waiting for `f`: the inspection is taken before this returns, so
    /// whoever uses it next waits until `f` is done.
    pub async fn run_in_background(
        &self,
        during: &'static str,
        f: impl FnOnce(&mut T) + Send + 'static,
    ) {
        let slot = self.slot.clone().lock_owned().await;
        let id = self.container_id.clone();
        tokio::spawn(async move {
            if let Err(e @ InspectionUnavailable::Lost { .. }) =
                Self::run_holding(id, slot, during, f).await
            {
                log::error!("{e}");
            }
        });
    }

    /// Returns once no task uses the inspection. Unbounded (what holds it is bounded: a turn
    /// end, a checkpoint job under its deadline); a wait past [`SETTLE_WARN`] is logged, so a
    /// stalled exec start says what it waits for.
    pub async fn settled(&self) {
        let lock = self.slot.lock();
        tokio::pin!(lock);
        match tokio::time::timeout(SETTLE_WARN, &mut lock).await {
            Ok(guard) => drop(guard),
            Err(_) => {
                let since = std::time::Instant::now() - SETTLE_WARN;
                log::warn!(
                    "container {}: an action has waited {SETTLE_WARN:?} for the inspection (a turn \
                     end, a base mark or a checkpoint job holds it)",
                    self.container_id
                );
                drop(lock.await);
                log::warn!(
                    "container {}: the action waited {:?} for the inspection",
                    self.container_id,
                    since.elapsed()
                );
            }
        }
    }

    async fn run_holding<R: Send + 'static>(
        id: String,
        mut slot: tokio::sync::OwnedMutexGuard<Slot<T>>,
        during: &'static str,
        f: impl FnOnce(&mut T) -> R + Send + 'static,
    ) -> Result<R, InspectionUnavailable> {
        if let Some(e) = unavailable(&id, &slot) {
            return Err(e);
        }
        let task_id = id.clone();
        let ran = tokio::task::spawn_blocking(move || {
            let Slot::Ready(inspection) = &mut *slot else {
                unreachable!("checked before");
            };
            let panic = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                f(inspection)
            })) {
                Ok(out) => return Ok(out),
                Err(payload) => panic_message(payload.as_ref()),
            };
            log::error!(
                "container {task_id}: the inspection panicked while {during}, it is dropped: {panic}"
            );
            let lost = std::mem::replace(
                &mut *slot,
                Slot::Lost {
                    during,
                    panic: panic.clone(),
                },
            );
            // Its drop unregisters the cgroup; a second panic there changes nothing more.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(lost)));
            Err(panic)
        })
        .await;
        match ran {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(panic)) => Err(InspectionUnavailable::Lost { id, during, panic }),
            // Only a runtime shutting down gets here (the panic is caught above).
            Err(e) => Err(InspectionUnavailable::Lost {
                id,
                during,
                panic: e.to_string(),
            }),
        }
    }
}

pub(super) fn unavailable<T>(id: &str, slot: &Slot<T>) -> Option<InspectionUnavailable> {
    let id = id.to_string();
    Some(match slot {
        Slot::Ready(_) => return None,
        Slot::Off(NotInspected::Disabled) => InspectionUnavailable::Disabled { id },
        Slot::Off(NotInspected::Starting) => InspectionUnavailable::Starting { id },
        Slot::Off(NotInspected::UntilStart) => InspectionUnavailable::UntilStart { id },
        Slot::Off(NotInspected::Failed(why)) => InspectionUnavailable::Failed {
            id,
            why: why.clone(),
        },
        Slot::Off(NotInspected::Deleted) => InspectionUnavailable::Deleted { id },
        Slot::Lost { during, panic } => InspectionUnavailable::Lost {
            id,
            during,
            panic: panic.clone(),
        },
    })
}

pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    match (
        payload.downcast_ref::<&str>(),
        payload.downcast_ref::<String>(),
    ) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic without a message".to_string(),
    }
}

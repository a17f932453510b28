//! Start: a created init (`runc start`, or the restore of its process image) or an added exec
//! (`runc exec`), behind the checkpoints the sandbox still holds.

use std::sync::Arc;

use super::{count_restore, Container, Containers};
use crate::{
    bundle,
    checkpoint::Action,
    error::{Error, Result},
    events::TaskEvent,
    process::{Process, Status},
    stdio::PreparedIo,
};

impl Containers {
    pub async fn start(&self, id: &str, exec_id: &str) -> Result<u32> {
        let c = self.get(id)?;
        // A probe (the kubelet's liveness check) must not wait behind a long checkpoint.
        let probe = !exec_id.is_empty() && c.process(exec_id)?.probe;
        if !probe {
            c.sandbox
                .gate(match exec_id.is_empty() {
                    true => Action::Start,
                    false => Action::ExecStart,
                })
                .await?;
        }
        if !exec_id.is_empty() && !probe {
            // Not before the base mark that Start left running in the background (nor while a
            // checkpoint job uses the inspection). A probe's effects are no turn's: it goes on.
            c.sandbox.settled().await;
        }
        match exec_id.is_empty() {
            true => self.start_init(c, id).await,
            false => self.start_exec_process(c, id, exec_id).await,
        }
    }

    /// Starts container `id`'s init: `runc start`, or the restore of its process image; then
    /// the base every turn is compared with is marked.
    async fn start_init(&self, c: Arc<Container>, id: &str) -> Result<u32> {
        let _guard = c.lifecycle.lock().await;
        let _starting = c.init.start_lock.lock().await;
        c.init.transition(&[Status::Created], Status::Created)?;
        let pending = c.pending_restore.lock().unwrap().take();
        let early_exit = match pending {
            Some(r) => {
                let engine = r.config.engine.clone();
                let restored = self.restore_init(&c, r).await;
                count_restore(&engine, restored.is_ok());
                restored?
            }
            None => {
                c.runtime.start(id).await?;
                None
            }
        };
        c.init.transition(&[Status::Created], Status::Running)?;
        let pid = c.init.pid();
        // The base every turn is compared with, taken after `runc init` has become the
        // container's own program and its start-up has settled. Start does not wait for it
        // (tens of ms, pod start time under Kubernetes): it holds the inspection, and execs
        // wait for that (`gate`), so none can change the container before the base is taken.
        c.sandbox.mark_base_in_background(pid).await;
        self.events
            .publish(TaskEvent::Start {
                container_id: id.into(),
                pid,
            })
            .await;
        if let Some(code) = early_exit {
            let this_init = c.init.clone();
            drop(_starting);
            drop(_guard);
            self.handle_exit(c, this_init, code).await;
        }
        Ok(pid)
    }

    /// Starts exec `exec_id` of container `id` (added by Exec).
    async fn start_exec_process(&self, c: Arc<Container>, id: &str, exec_id: &str) -> Result<u32> {
        let p = c.process(exec_id)?;
        if !matches!(c.init.status(), Status::Running) {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is not running"
            )));
        }
        let starting = p.start_lock.lock().await;
        p.transition(&[Status::Created], Status::Running)?;
        self.pids.lock().unwrap().begin_start();
        let started = self.start_exec(&c, &p).await;
        let early_exit = self.pids.lock().unwrap().finish_start(
            started.as_ref().ok().copied(),
            (id.to_string(), exec_id.to_string()),
        );
        let pid = match started {
            Ok(pid) => pid,
            Err(e) => {
                // The exec never ran: it is stopped, with runc's error as its story.
                if let Some(info) = p.record_exit(255) {
                    p.announce_exit(info);
                }
                return Err(e);
            }
        };
        self.events
            .publish(TaskEvent::ExecStarted {
                container_id: id.into(),
                exec_id: exec_id.into(),
                pid,
            })
            .await;
        drop(starting);
        if let Some(code) = early_exit {
            self.handle_exit(c, p, code).await;
        }
        Ok(pid)
    }

    /// `runc exec` of exec `p` in container `c`, with its io; returns its pid.
    async fn start_exec(&self, c: &Container, p: &Process) -> Result<u32> {
        let spec_file = c.bundle.join(format!("exec-{}.json", p.exec_id));
        let pid_file = c.bundle.join(format!("exec-{}.pid", p.exec_id));
        std::fs::write(&spec_file, p.exec_spec.as_deref().unwrap_or_default())
            .map_err(Error::io(format!("cannot write {}", spec_file.display())))?;
        let mut prepared =
            PreparedIo::new(&p.stdio, &p.exec_id, &self.namespace, c.runc.io_owner).await?;
        prepared.null_from_container(c.init.pid());
        let child = std::mem::replace(&mut prepared.child, crate::runc::ChildStdio::null());
        let console = prepared.console.as_ref().map(|c| c.path.clone());
        let result = c
            .runtime
            .exec(&c.id, &spec_file, &pid_file, console.as_deref(), child)
            .await;
        let _ = std::fs::remove_file(&spec_file);
        result?;
        let io = prepared.start().await?;
        let pid = bundle::read_pid(&pid_file)?;
        let _ = std::fs::remove_file(&pid_file);
        p.set_pid(pid);
        p.set_io(io).await;
        Ok(pid)
    }
}

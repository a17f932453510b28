//! The smaller verbs on a running container: pause, resume, pids, close_stdin, resize_pty,
//! and update (resources, annotations, turn ends and in-place rollbacks).

use std::collections::HashMap;

use super::Containers;
use crate::{
    checkpoint::Action,
    error::{Error, Result},
    events::TaskEvent,
    process::Status,
    turns,
};

impl Containers {
    pub async fn pause(&self, id: &str) -> Result<()> {
        let c = self.get(id)?;
        let _guard = c.lifecycle.lock().await;
        c.init.transition(&[Status::Running], Status::Running)?;
        c.runtime.pause(id).await?;
        c.init.transition(&[Status::Running], Status::Paused)?;
        self.events
            .publish(TaskEvent::Paused {
                container_id: id.into(),
            })
            .await;
        Ok(())
    }

    pub async fn resume(&self, id: &str) -> Result<()> {
        let c = self.get(id)?;
        let _guard = c.lifecycle.lock().await;
        c.init.transition(&[Status::Paused], Status::Paused)?;
        c.runtime.resume(id).await?;
        c.init.transition(&[Status::Paused], Status::Running)?;
        self.events
            .publish(TaskEvent::Resumed {
                container_id: id.into(),
            })
            .await;
        Ok(())
    }

    /// Pids of the container, each with its exec id when it is an exec's main process.
    pub async fn pids(&self, id: &str) -> Result<Vec<(u32, Option<String>)>> {
        let c = self.get(id)?;
        let pids = c.runtime.ps(id).await?;
        let execs: HashMap<u32, String> = c
            .execs
            .lock()
            .unwrap()
            .values()
            .map(|p| (p.pid(), p.exec_id.clone()))
            .filter(|(pid, _)| *pid != 0)
            .collect();
        Ok(pids
            .into_iter()
            .map(|pid| (pid as u32, execs.get(&(pid as u32)).cloned()))
            .collect())
    }

    pub async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        let p = self.get(id)?.process(exec_id)?;
        p.with_io(|io| {
            io.close_stdin();
            Ok(())
        })
        .await
    }

    pub async fn resize_pty(&self, id: &str, exec_id: &str, width: u32, height: u32) -> Result<()> {
        let p = self.get(id)?.process(exec_id)?;
        p.with_io(|io| io.resize(width, height)).await
    }

    /// Applies new resources (JSON `LinuxResources`, if any) and keeps the annotations.
    pub async fn update(
        &self,
        id: &str,
        resources: Option<Vec<u8>>,
        annotations: HashMap<String, String>,
    ) -> Result<()> {
        let c = self.get(id)?;
        let turn_end = turns::requested_turn_end(&annotations)?;
        let with_resources = resources.as_ref().is_some_and(|r| !r.is_empty());
        if let Some(seq) = turns::requested_rollback(&annotations, with_resources)? {
            let _guard = c.lifecycle.lock().await;
            if c.init.status() != Status::Running {
                return Err(Error::FailedPrecondition(format!(
                    "in-place rollback refused: container {id} is not running ({:?})",
                    c.init.status()
                )));
            }
            c.sandbox.rollback_in_place(seq, c.init.pid()).await?;
            return Ok(());
        }
        let _guard = c.lifecycle.lock().await;
        if let Some(json) = resources.filter(|r| !r.is_empty()) {
            c.sandbox.gate(Action::Update).await?;
            serde_json::from_slice::<oci_spec::runtime::LinuxResources>(&json)
                .map_err(|e| Error::InvalidArgument(format!("resources: {e}")))?;
            let file = c.bundle.join("update-resources.json");
            std::fs::write(&file, &json)
                .map_err(Error::io(format!("cannot write {}", file.display())))?;
            let result = c.runtime.update(id, &file).await;
            let _ = std::fs::remove_file(&file);
            result?;
        }
        if !annotations.is_empty() {
            log::debug!("container {id}: annotations {annotations:?}");
            c.annotations.lock().unwrap().extend(annotations);
        }
        if let Some(turn_id) = turn_end {
            c.sandbox
                .end_turn(&turn_id, || c.running_exec_pids())
                .await?;
        }
        Ok(())
    }
}

//! Exec: a process added to a running container (started by Start), probes told from agent
//! actions.

use std::sync::Arc;

use super::Containers;
use crate::{
    error::{Error, Result},
    events::TaskEvent,
    process::{Process, Status},
    stdio::StdioSpec,
    turns,
};

impl Containers {
    pub async fn add_exec(
        &self,
        id: &str,
        exec_id: &str,
        stdio: StdioSpec,
        spec: Vec<u8>,
    ) -> Result<()> {
        let c = self.get(id)?;
        if exec_id.is_empty() {
            return Err(Error::InvalidArgument("exec id must not be empty".into()));
        }
        if matches!(c.init.status(), Status::Stopped) {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is stopped"
            )));
        }
        let process = serde_json::from_slice::<oci_spec::runtime::Process>(&spec)
            .map_err(|e| Error::InvalidArgument(format!("exec {exec_id} process spec: {e}")))?;
        c.sandbox.netns().exec_added(&process);
        let probe = turns::is_probe(&c.probes, process.args().as_deref().unwrap_or_default());
        if probe {
            log::debug!("exec {exec_id} of {id} is a probe: it neither waits for nor ends turns");
        }
        {
            let mut execs = c.execs.lock().unwrap();
            if execs.contains_key(exec_id) {
                return Err(Error::AlreadyExists(format!(
                    "exec {exec_id} in container {id}"
                )));
            }
            let mut process = Process::new(exec_id.into(), stdio, Some(spec));
            process.probe = probe;
            execs.insert(exec_id.to_string(), Arc::new(process));
        }
        self.events
            .publish(TaskEvent::ExecAdded {
                container_id: id.into(),
                exec_id: exec_id.into(),
            })
            .await;
        Ok(())
    }
}
